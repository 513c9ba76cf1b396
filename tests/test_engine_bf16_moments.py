"""OffloadConfig(moments_dtype="bf16"): Adam's moments stored in bf16 with stochastic rounding
([Note: stochastic rounding] in ops/rounding.py), an opt-in inexact mode. Checked: the moments
payloads are bf16 (a third less optimizer state per param), training tracks the exact fp32
engine and torch closely, the GPU share of the optimizer computes the very bits CPU-Adam does,
NVMe state moves a third fewer bytes, checkpoints carry fp32 moments between the two modes,
and a bad value is refused."""
import pytest
import torch

import zero_offload as zo
from zero_offload.runtime.checkpoint import chunk_state
from zero_offload.runtime.store import Tier
from _engine_util import (DEVICE, Reference, config, gpt_batches, gpt_loss, micro_gpt, rel_err,
                          train_engine)
from test_engine_gpu_share import WHOLE

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


def _engine(**kw):
    return zo.initialize(micro_gpt(), optimizer=SPEC, config=config(**kw), device=DEVICE)


def _moments(engine):
    out = []
    for layout in engine.partition.chunks:
        if layout.trainable:
            st = chunk_state(engine.group, layout)
            out.append((st["exp_avg"], st["exp_avg_sq"]))
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bf16_moments_are_bf16_and_track_the_exact_engine(dtype):
    batches = gpt_batches(12)
    # Chunks big enough that 4 KiB payload alignment does not hide the smaller moments.
    exact = _engine(chunk_mb=0.25, dtype=dtype)
    lowp = _engine(chunk_mb=0.25, dtype=dtype, moments_dtype="bf16")
    try:
        cid = next(i for i, c in enumerate(lowp.partition.chunks) if c.trainable)
        for name in ("exp_avg", "exp_avg_sq"):
            assert lowp.store.payload_spec(cid, name).dtype is torch.bfloat16
            assert exact.store.payload_spec(cid, name).dtype is torch.float32
        # The moments' 8 B/param become 4.
        numel = sum(c.numel for c in lowp.partition.chunks if c.trainable)
        assert exact.plan.need[Tier.CPU] - lowp.plan.need[Tier.CPU] == pytest.approx(4 * numel, rel=0.1)  # (4 KiB alignment)
        exact_losses = train_engine(exact, batches, gpt_loss)
        lowp_losses = train_engine(lowp, batches, gpt_loss)
        if dtype == "fp32":  # the exact engine is torch (the other tests hold bf16 to its recipe)
            ref = Reference(micro_gpt(), SPEC)
            assert exact_losses == pytest.approx([ref.step(b, gpt_loss) for b in batches], rel=1e-5)
        # Inexact, but close: the loss curve within 1%, the weights within 2% of the exact run.
        assert lowp_losses == pytest.approx(exact_losses, rel=1e-2)
        assert lowp_losses != exact_losses  # the rounding is real (bf16 moments differ)
        sd_exact, sd_lowp = exact.state_dict(), lowp.state_dict()
        for name, t in sd_exact.items():
            assert rel_err(sd_lowp[name], t) <= 2e-2, name
        for (m, v), (m_ref, v_ref) in zip(_moments(lowp), _moments(exact)):
            assert m.dtype is torch.float32  # chunk_state widens
            assert torch.equal(m, m.bfloat16().float()) and torch.equal(v, v.bfloat16().float())
            assert rel_err(m, m_ref) <= 5e-2 and rel_err(v, v_ref) <= 5e-2
    finally:
        exact.close()
        lowp.close()


def test_gpu_share_rounds_the_moments_as_cpu_adam_does():
    """The device path (torch fused AdamW on widened moments, then the same stochastic rounding
    in torch) gives the CPU-Adam kernel's bits when both run on the CPU; on CUDA it stays close."""
    batches = gpt_batches(4)
    host = _engine(params="gpu", optimizer="cpu", moments_dtype="bf16")
    share = _engine(params="gpu", optimizer="auto", gpu_budget=WHOLE, moments_dtype="bf16")
    try:
        assert share.plan.count(optimizer=Tier.GPU) == len(share.plan.homes)
        train_engine(host, batches, gpt_loss)
        train_engine(share, batches, gpt_loss)
        for (m, v), (mh, vh) in zip(_moments(share), _moments(host)):
            if DEVICE == "cpu":
                assert torch.equal(m, mh) and torch.equal(v, vh)
            else:
                assert rel_err(m, mh) <= 1e-2 and rel_err(v, vh) <= 1e-2
        a, b = share.state_dict(), host.state_dict()
        for name in a:
            assert (torch.equal(a[name], b[name]) if DEVICE == "cpu"
                    else rel_err(a[name], b[name]) <= 1e-3), name
    finally:
        host.close()
        share.close()


def test_nvme_moves_a_third_fewer_optimizer_bytes(tmp_path):
    moved = {}
    for dtype in ("fp32", "bf16"):
        engine = _engine(optimizer="nvme", nvme_dir=str(tmp_path / dtype), moments_dtype=dtype,
                         cpu_budget=1 << 26, chunk_mb=0.03)
        try:
            train_engine(engine, gpt_batches(6), gpt_loss)
            engine.synchronize()  # the read-ahead issued when the last updates ended has landed
            moved[dtype] = engine.stats().bytes_moved["nvme->cpu"]
        finally:
            engine.close()
    # fp32 training: the params are the master (homed with params); the moments are what the
    # optimizer tier holds, 8 -> 4 bytes per param.
    assert moved["bf16"] == pytest.approx(moved["fp32"] / 2, rel=0.1), moved


@pytest.mark.parametrize("first,second", [("bf16", "fp32"), ("fp32", "bf16")])
def test_checkpoints_carry_moments_between_the_modes(first, second, tmp_path):
    batches = gpt_batches(6)
    a = _engine(moments_dtype=first)
    try:
        train_engine(a, batches[:3], gpt_loss)
        a.save_checkpoint(tmp_path / "ckpt")
        saved = _moments(a)
        straight = train_engine(a, batches[3:], gpt_loss)
    finally:
        a.close()
    b = _engine(moments_dtype=second)
    try:
        b.load_checkpoint(tmp_path / "ckpt")
        for (m, v), (ms, vs) in zip(_moments(b), saved):
            if second == "fp32":  # widened bf16 values load exactly
                assert torch.equal(m, ms) and torch.equal(v, vs)
            else:  # fp32 values round to nearest bf16 on load
                assert torch.equal(m, ms.bfloat16().float()) and torch.equal(v, vs.bfloat16().float())
        resumed = train_engine(b, batches[3:], gpt_loss)
        assert resumed == pytest.approx(straight, rel=1e-2)
    finally:
        b.close()


def test_a_bad_moments_dtype_is_refused():
    with pytest.raises(ValueError, match=r"OffloadConfig.moments_dtype='fp16' is invalid: expected 'fp32'"):
        zo.OffloadConfig(moments_dtype="fp16")
