"""With several ranks "auto" placement makes the same decisions on every rank, and a placement
failure on one rank raises on every rank ([Note: ranks agree on placement] in
runtime/placement.py, [Note: ranks raise together] in runtime/shards.py): ranks whose budgets
differ (explicit per rank, or "auto" from less free memory) plan from the least of them; a rank
whose plan does not fit makes the other raise at initialize, naming it; the share grows by the
tightest rank's measurement, and a move that fails on one rank falls back at the same chunk on
every rank. All trained against torch AdamW on the same global batch (2 CPU processes, gloo;
the "device" tier is host memory with its own budget, the same code path as a GPU)."""
import pytest
import torch

import zero_offload as zo
from zero_offload.runtime import placement
from zero_offload.runtime.placement import Budgets, ChunkNeed, Measured, PlacementRequest
from zero_offload.runtime.store import Tier
from zero_offload.runtime.vocab import Placement
from _dist_util import run_ranks, values
from _engine_util import Reference, assert_params_close, auto_config, gpt_batches, gpt_loss, micro_gpt

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

WORLD = 2
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
STEPS = 3
ALL = dict(gpu_budget=1 << 22)
"""A device tier that holds every chunk's params and state."""
PARTIAL = dict(gpu_budget=1 << 20, activation_reserve=(1 << 20) - 140_000)
"""A device tier whose first plan holds the params and some chunks' state (the rest on the host)."""


@pytest.fixture(autouse=True)
def _reference_on_the_cpu(monkeypatch):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")


def _homes(engine):
    """Per chunk (params home, where it is updated), from the store: what the ranks must share."""
    return [(engine.store.payload_spec(c.cid, "params").home.value,
             engine.store.payload_spec(c.cid, "grads").home.value if c.layout.trainable else None)
            for c in engine.group.chunks]


def _on_device(homes):
    return sum(1 for _, g in homes if g == "gpu")


def _train(engine, rank, batches, after_first=None):
    for x, y in batches:
        sl = slice(2 * rank, 2 * rank + 2)  # this rank's half of the global batch
        engine.backward(engine(x[sl], y[sl]))
        if engine.step() and engine.global_step == 1 and after_first is not None:
            after_first(engine)


def _reference():
    ref = Reference(micro_gpt(), SPEC)
    for b in gpt_batches(STEPS, batch=2 * WORLD):
        ref.step(b, gpt_loss)
    return ref.master_state()


def _check_trained(out):
    """Every rank equals torch on the global batch; returns the ranks' outputs but the state."""
    ref = _reference()
    for sd, *_ in out:
        assert_params_close(sd, ref, rtol=1e-5)


# ---- budgets that differ per rank -----------------------------------------------------------


def _unequal_rank(rank, world, how):
    if how == "explicit":  # per-rank config fields: rank 1 gives its device tier less
        kw = ALL if rank == 0 else PARTIAL
    else:  # "auto": rank 1 sees less free memory than rank 0
        kw = dict(gpu_budget="auto", activation_reserve=PARTIAL["activation_reserve"])
        real = placement.resolve_budgets

        def resolve(config):
            out = real(config)
            # (an "auto" tier that is not CUDA is shared by the node's ranks: halved)
            out[Tier.GPU] = (1 << 30) if rank == 0 else 2 * PARTIAL["gpu_budget"]
            return out

        placement.resolve_budgets = resolve
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**kw), device="cpu")
    first = _homes(engine)
    budgets = engine.plan.budgets
    _train(engine, rank, gpt_batches(STEPS, batch=2 * world))
    sd = engine.state_dict()
    engine.close()
    return sd, first, (budgets.gpu, budgets.cpu)


@pytest.mark.parametrize("how", ["explicit", "auto"])
def test_ranks_with_different_budgets_plan_alike(how, tmp_path):
    """Before: rank 0 (the larger device budget) homed every chunk's state on the device, rank 1
    only some: the ranks' plans differed."""
    out = values(run_ranks(_unequal_rank, WORLD, tmp_path, how, timeout_s=120))
    (_, homes0, budgets0), (_, homes1, budgets1) = out
    assert budgets0 == budgets1 and budgets0[0] == PARTIAL["gpu_budget"], (budgets0, budgets1)
    assert homes0 == homes1, (homes0, homes1)
    n = sum(1 for _, g in homes0 if g is not None)
    assert 0 < _on_device(homes0) < n, homes0  # the plan of the smaller budget: a partial share
    _check_trained(out)


# ---- a plan that fails on one rank ----------------------------------------------------------


def _fit_rank(rank, world, how):
    kw = ALL
    if how == "budget" and rank == 1:
        kw = dict(gpu_budget=1 << 12)  # not even the working window
    if how == "rank 1 only" and rank == 1:  # a plan only rank 1 cannot make
        import zero_offload.runtime.share as share_module  # where the plan is made

        def refuse(request):
            raise placement.FitError("cpu_budget=1 bytes is too small: ... Raise cpu_budget")

        share_module.plan_placement = refuse
    try:
        engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**kw), device="cpu")
    except Exception as e:  # noqa: BLE001 - what the rank saw is the result
        return "initialize", type(e).__name__, str(e)
    try:  # (before: rank 0 went on, into a collective rank 1 never calls)
        _train(engine, rank, gpt_batches(1, batch=2 * world))
        return "trained", "", ""
    except Exception as e:  # noqa: BLE001
        return "training", type(e).__name__, str(e)
    finally:
        engine.close(write_back=False)


def test_a_budget_one_rank_cannot_fit_refuses_on_every_rank(tmp_path):
    """Rank 1's device budget cannot hold the working window: every rank plans with it, so both
    raise its FitError at initialize, rank 0's naming whose budget it is. Before: rank 0 built
    its engine and went on into the first forward's all-gather (an error there much later,
    naming no budget, or a hang)."""
    results = run_ranks(_fit_rank, WORLD, tmp_path, "budget", timeout_s=60, collective_timeout_s=20)
    (where0, kind0, msg0), (where1, kind1, msg1) = values(results)
    assert (where1, kind1) == ("initialize", "FitError") and "gpu_budget=4096" in msg1, msg1
    assert (where0, kind0) == ("initialize", "FitError"), (where0, kind0, msg0)
    assert "gpu_budget=4096" in msg0 and "Raise gpu_budget" in msg0, msg0
    assert "gpu_budget 4096 bytes is rank 1's" in msg0 and "rank 1's" not in msg1, (msg0, msg1)


def test_a_plan_that_fails_on_one_rank_only_raises_on_every_rank(tmp_path):
    """Before: rank 1 raised its FitError and rank 0 went on, into the first forward."""
    results = run_ranks(_fit_rank, WORLD, tmp_path, "rank 1 only", timeout_s=60, collective_timeout_s=20)
    (where0, kind0, msg0), (where1, kind1, msg1) = values(results)
    assert (where1, kind1) == ("initialize", "FitError") and msg1.startswith("cpu_budget=1 bytes"), msg1
    assert (where0, kind0) == ("initialize", "PeerError"), (where0, kind0, msg0)
    assert "rank 1 of 2 could not place its shard (FitError: cpu_budget=1 bytes" in msg0, msg0
    assert "Raise cpu_budget" in msg0 and "\n" not in msg0, msg0


def _differ_rank(rank, world):
    if rank == 1:  # a plan that differs on rank 1 (the safety net of the exchange)
        import dataclasses
        import zero_offload.runtime.share as share_module  # where the plan is made
        real = share_module.plan_placement

        def plan(request):
            out = real(request)
            flipped = dataclasses.replace(out.homes[-1], params=Tier.CPU)
            return dataclasses.replace(out, homes=out.homes[:-1] + (flipped,))

        share_module.plan_placement = plan
    try:
        zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**ALL), device="cpu")
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "built", ""


def test_plans_that_differ_raise_on_every_rank(tmp_path):
    """Never expected ([Note: ranks agree on placement]); if it happens, both ranks refuse at
    initialize rather than hang later. Before: each rank built its engine."""
    out = values(run_ranks(_differ_rank, WORLD, tmp_path, timeout_s=60, collective_timeout_s=20))
    for kind, msg in out:
        assert kind == "RuntimeError" and "the ranks planned different homes" in msg, (kind, msg)


def _weights_rank(rank, world, missing):
    try:  # rank 1's weights path does not exist; rank 0 takes the model's own values
        zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**ALL), device="cpu",
                      weights=None if rank == 0 else missing)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "built", ""


def test_weights_missing_on_one_rank_raise_on_every_rank(tmp_path):
    """A failure before the budgets are agreed raises on both ranks. Before: rank 0 built its
    engine."""
    missing = str(tmp_path / "no-such-weights")
    (kind0, msg0), (kind1, msg1) = values(run_ranks(_weights_rank, WORLD, tmp_path / "r", missing,
                                                    timeout_s=60, collective_timeout_s=20))
    assert kind1 not in ("PeerError", "built") and "no-such-weights" in msg1, (kind1, msg1)
    assert kind0 == "PeerError" and "rank 1 of 2 could not prepare its shard" in msg0, msg0
    assert "no-such-weights" in msg0, msg0


# ---- the measured share -----------------------------------------------------------------------


def _share_delta(engine):
    """Bytes the first chunk outside the share would add to it."""
    plan = engine.plan
    i = next(i for i, (c, h) in enumerate(zip(plan.request.chunks, plan.homes))
             if c.trainable and h.optimizer is not Tier.GPU)
    return placement._share_bytes(plan.request.chunks[i], plan.request)


def _grow_rank(rank, world, fail):
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**PARTIAL), device="cpu")
    first = _homes(engine)
    seen = {}

    def grow(engine):
        if fail is None:  # rank 0 measures plenty of room, rank 1 room for one chunk
            limit = 1 << 40 if rank == 0 else _share_delta(engine)
            seen["plan"] = engine.grow_share(Measured(device_limit=limit, device_peak=0, margin=0))
            return
        real, moved = engine.store.rehome, set()

        def rehome(cid, name, tier, **kw):  # rank 1: the second chunk's move runs out of memory
            moved.add(cid)
            if rank == 1 and len(moved) == 2 and name == "exp_avg_sq":
                if fail == "oom":
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return real(cid, name, tier, **kw)

        engine.store.rehome = rehome
        try:
            seen["plan"] = engine.grow_share(Measured(device_limit=1 << 40, device_peak=0, margin=0))
        except Exception as e:  # noqa: BLE001
            seen["error"] = f"{type(e).__name__}: {e}"
        finally:
            engine.store.rehome = real

    _train(engine, rank, gpt_batches(1, batch=2 * world), after_first=grow)
    if "error" in seen:
        engine.close(write_back=False)
        return None, first, seen["error"]
    grown = _homes(engine)
    plan = seen["plan"]
    _train(engine, rank, gpt_batches(STEPS, batch=2 * world)[1:])
    sd = engine.state_dict()
    engine.close()
    return sd, first, (grown, plan.grown, plan.fell_back, plan.why)


def test_the_share_grows_by_the_tightest_rank(tmp_path):
    """Before: rank 0 grew every chunk into its share, rank 1 one chunk."""
    out = values(run_ranks(_grow_rank, WORLD, tmp_path, None, timeout_s=120))
    (_, first0, (grown0, g0, _, _)), (_, first1, (grown1, g1, _, _)) = out
    assert first0 == first1 and grown0 == grown1 and g0 == g1, (grown0, grown1)
    assert len(g0) == 1 and _on_device(grown0) == _on_device(first0) + 1, (g0, grown0)
    _check_trained(out)


def test_a_move_that_fails_on_one_rank_falls_back_on_every_rank(tmp_path):
    """Before: rank 1 fell back at its second grown chunk, rank 0 grew them all."""
    out = values(run_ranks(_grow_rank, WORLD, tmp_path, "oom", timeout_s=120))
    (_, first0, (grown0, g0, back0, why0)), (_, first1, (grown1, g1, back1, why1)) = out
    assert first0 == first1 and grown0 == grown1 and g0 == g1 and back0 == back1, (grown0, grown1)
    assert len(g0) == 1 and back0 and _on_device(grown0) == _on_device(first0) + 1
    assert "OutOfMemoryError" in why1 and "rank 1 of 2" in why0 and "OutOfMemoryError" in why0, (why0, why1)
    _check_trained(out)


def test_a_move_that_fails_otherwise_raises_on_every_rank(tmp_path):
    """A move that fails for another reason than memory: every rank raises, naming rank 1.
    Before: rank 1 raised and rank 0 went on into the next step's collectives."""
    out = values(run_ranks(_grow_rank, WORLD, tmp_path, "fatal", timeout_s=60, collective_timeout_s=20))
    (_, _, err0), (_, _, err1) = out
    assert err1.startswith("RuntimeError: CUDA error: an illegal memory access"), err1
    assert err0.startswith("PeerError: ") and "rank 1 of 2 could not move its optimizer state" in err0, err0


# ---- the pure parts ---------------------------------------------------------------------------


def test_common_budgets_and_tightest_are_the_least_of_the_ranks():
    a = Budgets(gpu=100, cpu=50, nvme=7, auto=frozenset({Tier.GPU}))
    b = Budgets(gpu=80, cpu=60, nvme=9)
    assert placement.common_budgets([a, b]) == Budgets(gpu=80, cpu=50, nvme=7, auto=frozenset({Tier.GPU}))
    assert placement.common_budgets([b]) is b
    m0 = Measured(device_limit=10 << 30, device_peak=2 << 30, margin=0)
    m1 = Measured(device_limit=8 << 30, device_peak=1 << 30, margin=0)
    assert placement.tightest([m0, m1]) is m1 and placement.tightest([m1, m0]) is m1


def test_the_plan_takes_the_largest_need_of_a_rule_sized_by_shapes():
    """Adafactor's state is sized by the params each rank holds: the plan counts, per chunk, the
    rank whose state takes the most bytes, the same on every rank."""
    rule = zo.Adafactor(lr=1e-2).rule(zo.OffloadConfig())
    request = PlacementRequest(budgets=Budgets(gpu=1 << 30, cpu=1 << 30), params=Placement.AUTO,
                               optimizer=Placement.AUTO, rule=rule)
    small = ChunkNeed(numel=4096, dtype=torch.float32, shapes=((64, 64),))
    large = ChunkNeed(numel=4096, dtype=torch.float32, shapes=((4096,),))  # 1-D: a full second moment
    assert placement.largest_need([small, large], request) is large
    assert placement.largest_need([large, small], request) is large
    assert placement.largest_need([small], request) is small
