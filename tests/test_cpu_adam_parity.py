"""Elementwise parity of CPUAdam / CPUAdamW / adam_step with torch.optim.Adam/AdamW(fused=True).

Every ISA path this CPU supports; sizes around the 8- and 16-lane vector widths and the
per-thread split; fp32, bf16 and fp16 grads; with and without weight decay; bf16/fp16 copy-out
bit-equal to torch's ``.to(dtype)``; loss-scale unscale. 50 steps each.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _cpu_adam_util import (MODES, assert_matches_torch, each_isa, needs_grad_dtype, torch_fused,  # noqa: F401
                            torch_one_thread)
from zero_offload.cpu_adam import CPUAdam, CPUAdamW, adam_step

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SMALL_SIZES = [0, 1, 7, 15, 16, 17, 1023, 4097]
STEPS = 50
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)


def _ours(params, *, adamw, **hyper):
    return (CPUAdamW if adamw else CPUAdam)(params, **hyper)


def _run_both(shape, *, adamw, weight_decay, steps=STEPS, seed=0, grad_dtype=torch.float32):
    """Trains one param with CPUAdam(W) and one with torch fused on the same grads."""
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(shape, generator=gen)
    ours = init.clone().requires_grad_()
    ref = init.clone().requires_grad_()
    if grad_dtype != torch.float32:
        ours.grad_dtype = None  # torch >= 2.10: allow a grad dtype other than the param's
    opt = _ours([ours], adamw=adamw, weight_decay=weight_decay, **HYPER)
    ref_opt = torch_fused([ref], adamw=adamw, weight_decay=weight_decay, **HYPER)
    for _ in range(steps):
        grad = torch.randn(shape, generator=gen).to(grad_dtype)
        ours.grad = grad.clone()
        ref.grad = grad.float()  # torch's side of a low-precision grad: grad.float()
        opt.step()
        ref_opt.step()
    return ours, ref, opt, ref_opt


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("size", SMALL_SIZES)
def test_optimizer_matches_torch_fused(each_isa, size, mode):
    adamw, weight_decay = MODES[mode]
    ours, ref, opt, ref_opt = _run_both((size,), adamw=adamw, weight_decay=weight_decay)
    assert_matches_torch(ours.detach(), ref.detach(), f"{each_isa} n={size} {mode} param")
    if size:
        for key in ("exp_avg", "exp_avg_sq"):
            assert_matches_torch(opt.state[ours][key], ref_opt.state[ref][key], f"{each_isa} {key}")
        assert float(opt.state[ours]["step"]) == STEPS


@pytest.mark.parametrize("mode", ["adam_l2", "adamw"])
def test_large_buffer_matches_torch_fused(each_isa, mode):
    adamw, weight_decay = MODES[mode]
    ours, ref, _, _ = _run_both((1_000_003,), adamw=adamw, weight_decay=weight_decay, steps=STEPS)
    assert_matches_torch(ours.detach(), ref.detach(), f"{each_isa} n=1_000_003 {mode}")


@needs_grad_dtype
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [1, 17, 4097])
def test_optimizer_low_precision_grads(each_isa, size, grad_dtype):
    ours, ref, _, _ = _run_both((size,), adamw=True, weight_decay=0.1, grad_dtype=grad_dtype)
    assert_matches_torch(ours.detach(), ref.detach(), f"{each_isa} n={size} grads {grad_dtype}")


def _flat_run(size, *, grad_dtype, out_dtype, mode, grad_scale=1.0, steps=STEPS, seed=1):
    """adam_step on flat buffers vs torch fused on grad.float() / grad_scale; checks every step."""
    adamw, weight_decay = MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(size, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(size), torch.zeros(size)
    out = None if out_dtype is None else torch.empty(size, dtype=out_dtype)
    ref = param.clone().requires_grad_()
    ref_opt = torch_fused([ref], adamw=adamw, weight_decay=weight_decay, **HYPER)
    for step in range(1, steps + 1):
        grad = (torch.randn(size, generator=gen) * grad_scale).to(grad_dtype)
        adam_step(param, grad, exp_avg, exp_avg_sq, step=step, betas=HYPER["betas"], lr=HYPER["lr"],
                  eps=HYPER["eps"], weight_decay=weight_decay, adamw=adamw, grad_scale=grad_scale,
                  out_lowp=out)
        ref.grad = grad.float() / torch.tensor(grad_scale, dtype=torch.float32)
        ref_opt.step()
        assert_matches_torch(param, ref.detach(), f"step {step} param")
        if out is not None:
            # the copy-out is the updated fp32 param rounded as torch's .to(dtype) rounds it
            expected = param.to(out_dtype)
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"step {step} out_lowp"
    assert_matches_torch(exp_avg, ref_opt.state[ref]["exp_avg"], "exp_avg")
    assert_matches_torch(exp_avg_sq, ref_opt.state[ref]["exp_avg_sq"], "exp_avg_sq")


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [7, 16, 1023])
def test_adam_step_grads_and_copy_out(each_isa, size, grad_dtype, out_dtype):
    _flat_run(size, grad_dtype=grad_dtype, out_dtype=out_dtype, mode="adamw")


@pytest.mark.parametrize("mode", ["adam", "adam_l2"])
def test_adam_step_copy_out_adam_modes(each_isa, mode):
    _flat_run(4097, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16, mode=mode)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("grad_scale", [2.0 ** 12, 3.0, 0.5])
def test_loss_scale_unscale(each_isa, grad_dtype, grad_scale):
    _flat_run(1023, grad_dtype=grad_dtype, out_dtype=torch.float16, mode="adam_l2",
              grad_scale=grad_scale, steps=20)


def test_large_buffer_bf16_offload_update():
    """The offload engine's update at scale: bf16 grads in, bf16 params out (default ISA)."""
    _flat_run(1_000_003, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16, mode="adamw", steps=5)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(0, 37), min_size=1, max_size=3),
    mode=st.sampled_from(sorted(MODES)),
    lr=st.floats(1e-4, 1e-1),
    beta1=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_and_hyperparameters(shape, mode, lr, beta1, seed):
    """Random multi-dim shapes and hyperparameters (beta1 >= 0.5 takes torch's other lerp branch)."""
    adamw, weight_decay = MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(shape, generator=gen)
    ours, ref = init.clone().requires_grad_(), init.clone().requires_grad_()
    hyper = dict(lr=lr, betas=(beta1, 0.99), eps=1e-6, weight_decay=weight_decay)
    opt, ref_opt = _ours([ours], adamw=adamw, **hyper), torch_fused([ref], adamw=adamw, **hyper)
    for _ in range(10):
        grad = torch.randn(shape, generator=gen)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    assert ours.shape == ref.shape
    assert_matches_torch(ours.detach(), ref.detach(), f"shape {shape} {mode} lr={lr} beta1={beta1}")
