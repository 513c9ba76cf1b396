"""OffloadAdam/OffloadAdamW train exactly as torch.optim.Adam/AdamW (CPU as the device)."""
import copy

import pytest
import torch

from _offload_optim_util import assert_moved, batches, make_model, max_rel_diff, train
from zero_offload.offload_optim import OffloadAdam, OffloadAdamW

CHUNK_MB = 0.02  # ~5k fp32 params per chunk: the tiny GPT (28k params) spans several chunks
# threads=1 everywhere: on 2 shared cores, CPU-Adam threads on the worker compete with torch's
# own threads running backward, and these models are too small to gain from more.


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("ours, ref", [(OffloadAdamW, torch.optim.AdamW), (OffloadAdam, torch.optim.Adam)])
def test_fp32_parity_20_steps(ours, ref, overlap):
    model, reference = make_model(), make_model()
    start = copy.deepcopy(reference)
    hp = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    opt = ours(model.parameters(), **hp, chunk_mb=CHUNK_MB, threads=1, overlap=overlap)
    assert len(opt._chunks) > 3
    data = batches(20)
    losses = train(model, opt, data)
    ref_losses = train(reference, ref(reference.parameters(), **hp), data)
    assert max_rel_diff(model, reference) < 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_moved(reference, start)
    # Same formula and operation order as torch's fused CPU Adam: bit for bit.
    fused = make_model()
    train(fused, ref(fused.parameters(), **hp, fused=True), data)
    assert max_rel_diff(model, fused) == 0.0
    if overlap:  # grads were consumed during backward (see [Note: overlap semantics])
        assert all(p.grad is None for p in model.parameters())
    assert opt.stats.steps == 20
    opt.close()


def test_param_groups_with_own_lr_and_decay_and_a_frozen_param():
    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in m.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.2},
                {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2}]

    model, reference = make_model(), make_model()
    for m in (model, reference):
        m.wpe.weight.requires_grad_(False)
    opt = OffloadAdamW(groups(model), lr=2e-3, chunk_mb=CHUNK_MB, threads=1)
    data = batches(12)
    train(model, opt, data)
    train(reference, torch.optim.AdamW(groups(reference), lr=2e-3), data)
    assert max_rel_diff(model, reference) < 1e-5
    assert torch.equal(model.wpe.weight, make_model().wpe.weight)  # frozen: untouched
    assert [g["lr"] for g in opt.param_groups] == [2e-3, 1e-2]
    opt.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_lr_scheduler(overlap):
    def sched(o):
        return torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step))

    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=5e-3, chunk_mb=CHUNK_MB, threads=1, overlap=overlap)
    ref = torch.optim.AdamW(reference.parameters(), lr=5e-3)
    data = batches(10)
    train(model, opt, data, sched=sched(opt))
    train(reference, ref, data, sched=sched(ref))
    assert max_rel_diff(model, reference) < 1e-5
    assert opt.param_groups[0]["lr"] == pytest.approx(ref.param_groups[0]["lr"])
    # the lr really changed the trajectory: a constant lr gives another model
    constant = make_model()
    train(constant, torch.optim.AdamW(constant.parameters(), lr=5e-3), data)
    assert max_rel_diff(constant, reference) > 1e-3
    opt.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_grad_accumulation(overlap):
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, chunk_mb=CHUNK_MB, threads=1, overlap=overlap, grad_accum=2)
    data = batches(12)
    train(model, opt, data, accum=2)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3), data, accum=2)
    assert max_rel_diff(model, reference) < 1e-5
    opt.close()


def test_overlap_refuses_an_extra_backward_before_step():
    model = make_model()
    opt = OffloadAdamW(model.parameters(), chunk_mb=CHUNK_MB, threads=1)
    (x, y), = batches(1)
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="grad_accum=1 before step"):
        model(x, y).backward()


def test_clipping_with_overlap_off_matches_torch():
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, chunk_mb=CHUNK_MB, threads=1, overlap=False)
    ref = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    norms = []
    for (x, y) in batches(8):
        for m, o in ((model, opt), (reference, ref)):
            m(x, y).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05).item())
            o.step()
            o.zero_grad()
    assert max(norms) > 0.05  # clipping was active
    assert max_rel_diff(model, reference) < 1e-5
    opt.close()


def test_params_changed_outside_the_optimizer_are_picked_up():
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, chunk_mb=CHUNK_MB, threads=1)
    ref = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    data = batches(6)
    train(model, opt, data[:3])
    train(reference, ref, data[:3])
    with torch.no_grad():  # e.g. loading weights into the model mid-run
        for m in (model, reference):
            m.ln_f.weight.mul_(0.5)
            m.blocks[0].attn.qkv.weight.add_(0.01)
    train(model, opt, data[3:])
    train(reference, ref, data[3:])
    assert max_rel_diff(model, reference) < 1e-5
    opt.close()


def test_bf16_params_keep_an_fp32_master():
    """Low-precision params: the update runs on the fp32 master, the param is its bf16 rounding
    (torch.optim.AdamW on an fp32 copy fed the same bf16 grads is the reference)."""
    torch.manual_seed(0)
    w32 = torch.randn(300, 40)
    p = torch.nn.Parameter(w32.bfloat16())
    master = torch.nn.Parameter(p.detach().float())
    opt = OffloadAdamW([p], lr=1e-3, weight_decay=0.1, overlap=False, chunk_mb=0.01, threads=1)
    ref = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.1)
    for _ in range(10):
        g = torch.randn(300, 40).bfloat16()
        p.grad, master.grad = g, g.float()
        opt.step()
        ref.step()
    st = opt.state_dict()["state"][0]
    assert torch.allclose(st["master"], master.detach(), rtol=1e-5, atol=1e-7)
    assert torch.equal(p.detach(), master.detach().bfloat16())
    # the master holds what bf16 cannot: updating bf16 in place would have lost it
    assert (st["master"] != st["master"].bfloat16().float()).any()
    opt.close()


def test_unused_params_are_skipped_like_torch():
    """A param without a grad in a step is not stepped (torch skips p.grad is None)."""
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, chunk_mb=CHUNK_MB, threads=1)
    ref = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    for i, (x, y) in enumerate(batches(6)):
        for m, o in ((model, opt), (reference, ref)):
            loss = m(x, y)
            if i % 2:  # every other step the last block gets no grad
                m.blocks[-1].requires_grad_(False)
                loss = m(x, y)
                m.blocks[-1].requires_grad_(True)
            loss.backward()
            o.step()
            o.zero_grad()
    assert max_rel_diff(model, reference) < 1e-5
    steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
    assert steps == {3, 6}
    opt.close()


@pytest.mark.parametrize("state", ["cpu", "nvme"])
def test_bf16_moments_opt_in_tracks_torch_and_saves_state(state, tmp_path):
    """moments_dtype="bf16" (inexact): moments stored as bf16 (stochastically rounded), 8 instead
    of 12 bytes of state per param; training stays close to torch.optim.AdamW; state_dict gives
    fp32 moments (on bf16 values); a bad value is refused."""
    model, reference = make_model(), make_model()
    hp = dict(lr=3e-3, weight_decay=0.1)
    extra = dict(state="nvme", nvme_dir=str(tmp_path)) if state == "nvme" else {}
    opt = OffloadAdamW(model.parameters(), **hp, chunk_mb=CHUNK_MB, threads=1, moments_dtype="bf16", **extra)
    cid = opt._chunks[0].cid
    assert opt._store.payload_spec(cid, "exp_avg").dtype is torch.bfloat16
    assert opt._store.payload_spec(cid, "master").dtype is torch.float32
    data = batches(10)
    losses = train(model, opt, data)
    ref_losses = train(reference, torch.optim.AdamW(reference.parameters(), **hp), data)
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    assert 0 < max_rel_diff(model, reference) < 2e-2
    sd = opt.state_dict()
    for entry in sd["state"].values():
        for k in ("exp_avg", "exp_avg_sq"):
            assert entry[k].dtype is torch.float32 and torch.equal(entry[k], entry[k].bfloat16().float())
    opt.close()
    with pytest.raises(ValueError, match=r"moments_dtype='fp16' is invalid: use 'fp32'"):
        OffloadAdamW(make_model().parameters(), moments_dtype="fp16")
