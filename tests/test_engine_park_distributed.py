"""Park and resume on two ranks (gloo; [Note: parking] in runtime/parking.py): both ranks park and
resume together, with params on the device (each rank's shard homed there, replicas of the whole
chunks: dropped at the park, the fresh ones, of a frozen block, gathered again at the resume) and
with params paged from the host; the steps after equal those of ranks that never parked, bit for
bit. A refusal on one rank refuses on both, nothing changed; a failure part-way on one rank is
undone on both; either way training goes on as if nothing had been asked."""
import pytest
import torch

import zero_offload as zo
from _dist_util import run_ranks, values
from _engine_util import SMALL_CHUNK_MB, gpt_batches, micro_gpt
from zero_offload.runtime.store import Tier

WORLD = 2
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


def _engine(kw, nvme_dir):
    model = micro_gpt()
    model.blocks[0].requires_grad_(False)  # frozen chunks: their replicas stay fresh across steps
    cfg = zo.OffloadConfig(**{**dict(params="gpu", optimizer="cpu", dtype="fp32", chunk_mb=SMALL_CHUNK_MB,
                                     gpu_budget=1 << 22, cpu_budget=1 << 26, threads=1, prefetch_depth=1,
                                     nvme_dir=nvme_dir), **kw})
    return zo.initialize(model, optimizer=SPEC, config=cfg, device="cpu")


def _train(engine, rank, batches) -> list:
    losses = []
    for x, y in batches:
        sl = slice(2 * rank, 2 * rank + 2)  # this rank's half of the global batch
        loss = engine(x[sl], y[sl])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _state(engine) -> dict:
    out = dict(engine.state_dict())
    for layout in engine.partition.chunks:
        for k, v in engine.chunk_state(layout).items():
            out[f"chunk {layout.index} {k}"] = v
    return out


def _park_rank(rank, world, kw, nvme_dir, target, fault):
    """Train 2 steps, park on ``target`` (``fault``: how rank 1 fails to), resume, train 2 more;
    returns (losses, state, what was seen) of this engine and of one that never parked."""
    from zero_offload.runtime import parking
    batches = gpt_batches(4, batch=2 * world)
    plain = _engine(kw, nvme_dir and f"{nvme_dir}/plain")
    want = _train(plain, rank, batches)
    want_state = _state(plain)
    plain.close()

    engine = _engine(kw, nvme_dir and f"{nvme_dir}/parked")
    seen = {}
    got = _train(engine, rank, batches[:2])
    replicated = [c.g.cid for c in engine._chunks if c.g.replica_fresh]
    virtual_memory = parking.psutil.virtual_memory
    if fault == "refuse" and rank == 1:  # this rank's host memory cannot hold the state
        now = virtual_memory()
        parking.psutil.virtual_memory = lambda: now._replace(available=0)
    if fault in ("fail-park", "fail-resume") and rank == 1:
        store = engine.store
        real_park, real_unpark = store.park, store.unpark

        def fail(*args, **kwargs):
            raise OSError("injected on rank 1")
        if fault == "fail-park":
            store.park = fail
        else:
            store.unpark = fail
    try:
        engine.park(target)
    except (MemoryError, OSError, RuntimeError) as e:
        seen["park error"] = f"{type(e).__name__}: {e}"
    parking.psutil.virtual_memory = virtual_memory
    if fault == "fail-park" and rank == 1:
        engine.store.park = real_park
    seen["parked"] = engine.parked
    seen["device bytes parked"] = engine.store.bytes(Tier.GPU)
    seen["replicas parked"] = [c.g.cid for c in engine._chunks if c.g.replica is not None]
    if engine.parked is not None:
        try:
            engine.resume()
        except (MemoryError, OSError, RuntimeError) as e:
            seen["resume error"] = f"{type(e).__name__}: {e}"
        if fault == "fail-resume" and rank == 1:
            engine.store.unpark = real_unpark
        seen["parked after a failed resume"] = engine.parked
        if engine.parked is not None:
            engine.resume()
    seen["replicas back"] = [c.g.cid for c in engine._chunks if c.g.replica_fresh] == replicated
    seen["replicated"] = replicated
    got += _train(engine, rank, batches[2:])
    state = _state(engine)
    engine.close()
    same = got == want and state.keys() == want_state.keys() and all(
        torch.equal(state[k], want_state[k]) if isinstance(state[k], torch.Tensor) else state[k] == want_state[k]
        for k in state)
    return same, seen


@pytest.mark.parametrize("target", ["cpu", "nvme"])
@pytest.mark.parametrize("params", ["gpu", "cpu"])
def test_both_ranks_park_and_resume_and_train_on_exactly(params, target, tmp_path):
    nvme = str(tmp_path / "swap") if target == "nvme" else None
    out = values(run_ranks(_park_rank, WORLD, tmp_path, dict(params=params), nvme, target, None,
                           timeout_s=180))
    for rank, (same, seen) in enumerate(out):
        assert same, (rank, seen)
        assert "park error" not in seen and "resume error" not in seen, seen
        assert seen["parked"] == target and seen["device bytes parked"] == 0, seen
        assert seen["replicas parked"] == [], seen
        assert seen["replicas back"], seen
        if params == "gpu":
            assert seen["replicated"], seen  # the frozen block's replicas were there, and came back


@pytest.mark.parametrize("fault", ["refuse", "fail-park", "fail-resume"])
def test_one_rank_that_cannot_park_or_resume_stops_both(fault, tmp_path):
    out = values(run_ranks(_park_rank, WORLD, tmp_path, dict(), None, "cpu", fault, timeout_s=180))
    (same0, seen0), (same1, seen1) = out
    assert same0 and same1, (seen0, seen1)  # and training went on exactly
    if fault == "refuse":
        assert seen1["park error"].startswith("MemoryError: engine.park: the device holds"), seen1
        assert seen0["park error"] == ("RuntimeError: engine.park: another rank cannot park (its error says "
                                       "why); nothing was parked"), seen0
    elif fault == "fail-park":
        assert seen1["park error"] == "OSError: injected on rank 1", seen1
        assert seen0["park error"].startswith("RuntimeError: engine.park: another rank failed to park"), seen0
    else:
        assert seen1["resume error"] == "OSError: injected on rank 1", seen1
        assert seen0["resume error"].startswith("RuntimeError: engine.resume: another rank failed to "
                                                "resume"), seen0
        assert seen0["parked after a failed resume"] == seen1["parked after a failed resume"] == "cpu"
    if fault != "fail-resume":
        for seen in (seen0, seen1):
            assert seen["parked"] is None and seen["device bytes parked"] > 0, seen
