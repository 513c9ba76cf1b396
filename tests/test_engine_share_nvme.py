"""The measured GPU share and state on NVMe ([Note: measured share] in runtime/placement.py),
end to end on the CPU (the "device" tier is host memory with its own budget: the same code path):
a first plan whose host budget spills the last chunks' state to NVMe; after a measured step the
share grows over host chunks and the freed host memory takes NVMe state back
(``promote_state``), or, with room on the device, the share grows over the NVMe chunks
themselves. Training goes on exactly as torch AdamW's, with 1 and 2 ranks; a move from NVMe that
fails leaves that chunk and the later ones on the disk."""
import pytest

import zero_offload as zo
from zero_offload.runtime.placement import Measured
from zero_offload.runtime.store import Tier
from _dist_util import run_ranks, values
from _engine_util import (Reference, assert_host_homes_match_the_plan, assert_params_close, auto_config,
                          gpt_batches, gpt_loss, micro_gpt)

pytestmark = pytest.mark.nvme
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
STEPS = 3
SHARE = 8192
"""Device bytes one chunk of the micro GPT's share takes on one rank (its fp32 moments: the grads
are transient, [Note: share grads] in runtime/placement.py)."""
FEW = Measured(device_limit=2 * SHARE, device_peak=0, margin=0)
"""A step whose headroom takes two more chunks into the share (one rank)."""
ALL = Measured(device_limit=1 << 40, device_peak=0, margin=0)


@pytest.fixture(autouse=True)
def _reference_on_the_cpu(monkeypatch):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")


def _config(swap, world=1):
    """The share's first plan holds 4 chunks; the host budget the next 3 chunks' state (5 with
    2 ranks' half-size shards); the rest is on NVMe."""
    return auto_config(gpu_budget=1 << 20, activation_reserve=(1 << 20) - 140_000 + 6 * 4096, cpu_budget=70_000,
                       nvme_dir=str(swap))


def _homes(engine):
    """Per trainable chunk, the store's home of its state (what the update reads)."""
    return [engine.store.payload_spec(c.cid, "exp_avg").home for c in engine.group.chunks
            if c.layout.trainable]


def _train(engine, rank, world, measured, *, rehome=None):
    """STEPS steps on this rank's part of the batch, the share grown by ``measured`` after the
    first; returns (homes before, homes after, plan after the growth)."""
    before = _homes(engine)
    plan = None
    for x, y in gpt_batches(STEPS, batch=2 * world):
        sl = slice(2 * rank, 2 * rank + 2)
        engine.backward(engine(x[sl], y[sl]))
        if engine.step() and engine.global_step == 1:
            real = engine.store.rehome
            if rehome is not None:
                engine.store.rehome = rehome(real)
            try:
                plan = engine.grow_share(measured)
            finally:
                engine.store.rehome = real
            assert_host_homes_match_the_plan(engine)
    return before, _homes(engine), plan


def _reference(world=1):
    """torch AdamW on the global batch of ``world`` ranks."""
    ref = Reference(micro_gpt(), SPEC)
    for b in gpt_batches(STEPS, batch=2 * world):
        ref.step(b, gpt_loss)
    return ref


def _check_promoted(before, after, plan):
    assert Tier.NVME in before and Tier.CPU in before, before
    grown, promoted = set(plan.grown), set(plan.promoted)
    assert grown and promoted and set(plan.grown_from) == {Tier.CPU}
    for i, (b, a) in enumerate(zip(before, after)):
        want = Tier.GPU if i in grown else Tier.CPU if i in promoted else b
        assert a is want == plan.homes[i].optimizer, (i, before, after)
    assert all(before[i] is Tier.NVME for i in promoted)
    assert plan.report()["promoted"] == len(promoted)


def test_host_memory_freed_by_the_share_takes_nvme_state_back(tmp_path):
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(tmp_path / "swap"), device="cpu")
    try:
        before, after, plan = _train(engine, 0, 1, FEW)
        _check_promoted(before, after, plan)
        assert Tier.NVME in after and "does not fit" in plan.why  # the room ended both
        assert "cpu_budget" in plan.nvme_why
        assert_params_close(engine.state_dict(), _reference().master_state(), rtol=1e-5)
    finally:
        engine.close()


def test_the_share_grows_over_nvme_state_with_room_on_the_device(tmp_path):
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(tmp_path / "swap"), device="cpu")
    try:
        before, after, plan = _train(engine, 0, 1, ALL)
        assert Tier.NVME in before and after == [Tier.GPU] * len(after)
        assert Tier.NVME in plan.grown_from and plan.promoted == ()
        assert engine.store.bytes(Tier.NVME) == 0
        assert_params_close(engine.state_dict(), _reference().master_state(), rtol=1e-5)
    finally:
        engine.close()


def test_a_failed_move_from_nvme_leaves_the_rest_on_the_disk(tmp_path):
    """The second promoted chunk's last payload cannot be read: its moved payloads go back to
    NVMe, it and the later chunks stay there, the report says so, and training matches torch."""
    failed = []

    def rehome(real):
        def broken(cid, name, tier, **kw):
            if tier is Tier.CPU and engine.store.home(cid, name) is Tier.NVME:
                failed.append(cid)
                if len(set(failed)) == 2 and name == "exp_avg_sq":
                    raise OSError(5, "Input/output error")
            return real(cid, name, tier, **kw)
        return broken

    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(tmp_path / "swap"), device="cpu")
    try:
        before, after, plan = _train(engine, 0, 1, FEW, rehome=rehome)
        assert len(plan.promoted) == 1 and "Input/output error" in plan.nvme_why
        bad = failed[-1]
        for name in ("exp_avg", "exp_avg_sq"):  # (fp32: the params are the master, on the device)
            assert engine.store.payload_spec(bad, name).home is Tier.NVME
        assert after.count(Tier.NVME) == before.count(Tier.NVME) - 1
        assert_params_close(engine.state_dict(), _reference().master_state(), rtol=1e-5)
    finally:
        engine.close()


def _rank(rank, world, swap):
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(f"{swap}", world), device="cpu")
    try:
        before, after, plan = _train(engine, rank, world, Measured(device_limit=SHARE, device_peak=0, margin=0))
        return before, after, plan.grown, plan.promoted, plan.report()["promoted"], engine.state_dict()
    finally:
        engine.close()


def test_ranks_agree_on_what_comes_off_the_disk(tmp_path):
    out = values(run_ranks(_rank, 2, tmp_path, str(tmp_path / "swap"), timeout_s=120))
    ref = _reference(2)
    assert out[0][:5] == out[1][:5]  # the same homes before and after, on every rank
    before, after, grown, promoted, reported, sd = out[0]
    assert Tier.NVME in before and grown and promoted and reported == len(promoted)
    assert [after[i] for i in promoted] == [Tier.CPU] * len(promoted)
    for *_, sd in out:
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
