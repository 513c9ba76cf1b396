"""CPUAdamW is a drop-in for torch.optim.AdamW on bf16/fp16 params and on params of any dense
layout (channels_last, transposed, permuted): same params and state as torch's fused CPU AdamW,
bit for bit, over several steps, and state dicts load both ways. See [Note: optimizer params of
any dense layout and dtype] in zero_offload/cpu_adam.py.

Shapes have a multiple of 16 elements: torch's fused kernel runs the last numel % 16 elements
through a scalar loop with its own rounding (see _cpu_adam_util.assert_matches_torch)."""
import pytest
import torch

from _cpu_adam_util import assert_matches_torch
from zero_offload.cpu_adam import CPUAdam, CPUAdamW

HYPER = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)

LAYOUTS = {
    "channels_last": lambda dtype: torch.randn(8, 4, 3, 2).to(dtype).to(memory_format=torch.channels_last),
    "transposed": lambda dtype: torch.randn(16, 6).to(dtype).t(),
    "permuted": lambda dtype: torch.randn(2, 4, 8).to(dtype).permute(2, 0, 1),
    "contiguous": lambda dtype: torch.randn(12, 8).to(dtype),
}


def _param(layout: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return LAYOUTS[layout](dtype).requires_grad_()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory, in memory order."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _like(p: torch.Tensor) -> torch.Tensor:
    """A copy of ``p`` with its strides (a leaf)."""
    return torch.empty_like(p).copy_(p).detach().requires_grad_()


def _grads(p: torch.Tensor, steps: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for _ in range(steps)]


def _set_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    p.grad = torch.empty_like(p).copy_(g)  # in the param's layout, as autograd gives it


def _train(opt, p, grads) -> None:
    for g in grads:
        _set_grad(p, g)
        opt.step()


def _assert_same(ours, p, ref_opt, ref) -> None:
    assert p.dtype == ref.dtype and p.stride() == ref.stride()
    assert torch.equal(p, ref), (p - ref).abs().max()
    for key in ("exp_avg", "exp_avg_sq"):
        mine, theirs = ours.state[p][key], ref_opt.state[ref][key]
        assert mine.dtype == theirs.dtype == p.dtype, key  # torch keeps state in the param's dtype
        assert mine.stride() == p.stride(), key            # and in its layout (preserve_format)
        assert torch.equal(mine, theirs), key
    assert torch.equal(ours.state[p]["step"], ref_opt.state[ref]["step"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls, ref_cls", [(CPUAdamW, torch.optim.AdamW), (CPUAdam, torch.optim.Adam)])
def test_matches_torch_fused_bit_for_bit(cls, ref_cls, dtype, layout):
    p = _param(layout, dtype)
    ref = _like(p)
    before = p.detach().clone()
    ours, theirs = cls([p], **HYPER, threads=2), ref_cls([ref], **HYPER, fused=True)
    grads = _grads(p, 5)
    _train(ours, p, grads)
    _train(theirs, ref, grads)
    assert not torch.equal(p, before)  # the update landed in the param itself
    _assert_same(ours, p, theirs, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_and_fp32_state_dicts_load_both_ways(dtype):
    """ours -> torch and torch -> ours, mid-training; both continue identically."""
    p, ref = _param("channels_last", dtype), None
    ref = _like(p)
    ours, theirs = CPUAdamW([p], **HYPER), torch.optim.AdamW([ref], **HYPER, fused=True)
    grads = _grads(p, 6)
    _train(ours, p, grads[:3])
    _train(theirs, ref, grads[:3])
    # Swap: each continues from the other's state dict.
    p2, ref2 = _like(ref), _like(p)
    ours2, theirs2 = CPUAdamW([p2], **HYPER), torch.optim.AdamW([ref2], **HYPER, fused=True)
    ours2.load_state_dict(theirs.state_dict())
    theirs2.load_state_dict(ours.state_dict())
    _train(ours2, p2, grads[3:])
    _train(theirs2, ref2, grads[3:])
    _assert_same(ours2, p2, theirs2, ref2)


def test_state_loaded_with_other_strides_is_relaid_out():
    """A state dict whose moments are contiguous (e.g. saved from a model before it went
    channels_last) updates a channels_last param correctly."""
    p = _param("channels_last", torch.float32)
    ref = _like(p)
    theirs = torch.optim.AdamW([ref], **HYPER, fused=True)
    grads = _grads(p, 4)
    _train(theirs, ref, grads[:2])
    sd = theirs.state_dict()
    # clone: a loaded tensor of the right dtype is kept as is, shared with `theirs` otherwise
    sd["state"] = {k: {n: v.contiguous().clone() for n, v in s.items()} for k, s in sd["state"].items()}
    p.data.copy_(ref.detach())
    ours = CPUAdamW([p], **HYPER)
    ours.load_state_dict(sd)
    assert ours.state[p]["exp_avg"].stride() != p.stride()
    _train(ours, p, grads[2:])
    _train(theirs, ref, grads[2:])
    _assert_same(ours, p, theirs, ref)


def test_grad_with_other_strides_or_gaps():
    """Only the param's own memory is written; the grad may have any layout."""
    p = _param("channels_last", torch.float32)
    ref = _like(p)
    ours, theirs = CPUAdamW([p], **HYPER), torch.optim.AdamW([ref], **HYPER, fused=True)
    for i, g in enumerate(_grads(p, 3)):
        wide = torch.zeros(*g.shape[:-1], 2 * g.shape[-1])
        wide[..., ::2] = g
        p.grad = [g.contiguous(), wide[..., ::2], g.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)][i]
        ref.grad = torch.empty_like(ref).copy_(g)
        ours.step()
        theirs.step()
    _assert_same(ours, p, theirs, ref)


def test_conv_model_channels_last_trains_like_torch():
    """A small conv net in channels_last: the drop-in use. Its sizes are not multiples of 16,
    so torch's scalar tail may differ by a few ulps (assert_matches_torch, in memory order)."""
    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)
                                   ).to(memory_format=torch.channels_last)
    model, ref = net(0), net(0)
    ours = CPUAdamW(model.parameters(), **HYPER)
    theirs = torch.optim.AdamW(ref.parameters(), **HYPER, fused=True)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randn(2, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
        ours.zero_grad()
        model(x).square().mean().backward()
        for a, b in zip(model.parameters(), ref.parameters()):  # the same grads (a threaded
            b.grad = a.grad.clone()                               # conv backward may vary)
        ours.step()
        theirs.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert a.stride() == b.stride()
        assert_matches_torch(_flat(a.detach()), _flat(b.detach()), "param")
