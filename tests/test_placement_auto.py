""""auto" placement for speed (runtime/placement.py, [Note: GPU share placement] and [Note:
measured share]), as a pure function of the budgets and the measured step: optimizer state on the
device first for 1, 2 and 4 ranks (each rank its shard), then host memory; every chunk's "auto"
params on the device before any of the share; the share a prefix grown after the first step by
the measured headroom within gpu_budget; a failed move falls back to the host; the working window
of whole chunks with ranks; the report of what is where and why."""
import pytest
import torch

from zero_offload.runtime.placement import (AUTO_RESERVE_FLOOR, AUTO_RESERVE_STEPS, MARGIN_MIN, Budgets,
                                            ChunkNeed, FitError, Measured, PlacementRequest, grow_share,
                                            plan_placement, promote_state, reserve_bytes, window_bytes)
from zero_offload.runtime.placement import _staging_bytes
from zero_offload.runtime.store import Tier
from zero_offload.runtime.update_rule import AdamRule
from zero_offload.runtime.vocab import Placement

GiB = 1 << 30
MiB = 1 << 20
BF16 = torch.bfloat16
WHOLE = 32 * MiB
"""Elements of a whole chunk: 64 MiB of bf16 params (the default chunk_mb)."""
CHUNKS = 40
"""A 1.34B-element model in whole chunks: 2.5 GiB of bf16 params, 15 GiB of fp32 state, 2.5 GiB
of bf16 grads."""


def _request(ranks, *, gpu, cpu=512 * GiB, nvme=0, reserve="auto", params=Placement.AUTO, chunks=CHUNKS,
             **kw):
    """The engine's request on one of ``ranks`` ranks: each chunk's shard, "auto" everything."""
    need = tuple(ChunkNeed(numel=WHOLE // ranks, dtype=BF16) for _ in range(chunks))
    return PlacementRequest(chunks=need, budgets=Budgets(gpu=gpu, cpu=cpu, nvme=nvme), params=params,
                            optimizer=Placement.AUTO, rule=AdamRule(), prefetch_depth=2,
                            reserve=reserve, ranks=ranks, **{"gpu_optimizer": True, **kw})


def _share(plan):
    return [h.optimizer is Tier.GPU for h in plan.homes]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_a_card_that_holds_the_shards_gets_all_the_state(ranks):
    """72 GiB of an 80 GiB card (the "auto" budget), half left to the first step's activations:
    each rank's shard of the 1.34B model's state (17.5 GiB with grads on one rank) fits and goes
    on the device, params too (before the change a ranked engine planned no state there)."""
    plan = plan_placement(_request(ranks, gpu=72 * GiB))
    assert all(h.params is Tier.GPU for h in plan.homes)
    share = _share(plan)
    assert all(share), plan.why
    assert plan.need[Tier.CPU] == 0  # nothing is homed on the host
    assert plan.why == "every trainable chunk's state is on the device"
    report = plan.report()
    assert report["share"]["chunks"] == sum(share)
    assert report["share"]["elements"] == sum(share) * (WHOLE // ranks)
    gpu = report["tiers"]["gpu"]
    assert gpu["homes"] + gpu["working"] == plan.need[Tier.GPU] <= plan.budgets.gpu
    assert gpu["homes"] == gpu["params"] + gpu["optimizer"] + gpu["grads"] + gpu["other"]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_share_grows_by_what_the_first_step_leaves_free(ranks):
    """The measured step peaked at 30 GiB of the 79 GiB the allocator may reach: the share grows
    by what the peak leaves free less the margin, in chunk order, and never past it."""
    plan = plan_placement(_request(ranks, gpu=72 * GiB, chunks=4 * CHUNKS * ranks))  # not all fits
    measured = Measured(device_limit=79 * GiB, device_peak=30 * GiB)
    grown = grow_share(plan, measured)
    added = grown.need[Tier.GPU] - plan.need[Tier.GPU]
    room = min(measured.headroom, plan.budgets.gpu - plan.need[Tier.GPU])
    assert measured.headroom == 79 * GiB - 30 * GiB - max(MARGIN_MIN, int(0.04 * 79 * GiB))
    assert 0 < added <= room
    assert list(grown.grown) == [i for i, (a, b) in enumerate(zip(_share(plan), _share(grown))) if b and not a]
    share = _share(grown)
    assert share == sorted(share, reverse=True)  # still a prefix
    per_chunk = added // len(grown.grown)
    if not all(share):  # the next chunk would not have fit
        assert added + per_chunk > room
        assert ("measured headroom" if room == measured.headroom else "gpu_budget") in grown.why
    assert grown.need[Tier.CPU] < plan.need[Tier.CPU]
    assert grown.report()["measured"]["headroom"] == measured.headroom


def test_a_partial_share_is_a_prefix_of_the_chunks():
    """A 5.4B model on one rank: half of 72 GiB holds the params and the first chunks' state."""
    plan = plan_placement(_request(1, gpu=72 * GiB, chunks=4 * CHUNKS))
    share = _share(plan)
    assert 0 < sum(share) < 4 * CHUNKS and share == sorted(share, reverse=True)
    assert "until the first step is measured" in plan.why and plan.share_ended


def test_gpu_budget_still_bounds_the_grown_share():
    """A step that leaves 60 GiB free grows the share only to gpu_budget (12 GiB)."""
    plan = plan_placement(_request(1, gpu=12 * GiB))
    grown = grow_share(plan, Measured(device_limit=79 * GiB, device_peak=10 * GiB))
    assert plan.need[Tier.GPU] < grown.need[Tier.GPU] <= 12 * GiB
    assert not all(_share(grown)) and "gpu_budget" in grown.why


def test_a_step_with_no_headroom_grows_nothing():
    plan = plan_placement(_request(1, gpu=72 * GiB, chunks=4 * CHUNKS))
    grown = grow_share(plan, Measured(device_limit=79 * GiB, device_peak=78 * GiB))
    assert grown.grown == () and grown.homes == plan.homes and grown.need == plan.need
    assert grown.measured is not None


def test_a_failed_move_falls_back_to_the_host():
    """The chunks from the one whose move failed on stay on the host, the needs move back, and
    the report says so."""
    plan = plan_placement(_request(1, gpu=72 * GiB, chunks=4 * CHUNKS))
    grown = grow_share(plan, Measured(device_limit=79 * GiB, device_peak=20 * GiB))
    assert len(grown.grown) >= 3
    at = grown.grown[2]
    back = grown.fall_back(at, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert back.grown == grown.grown[:2] and back.fell_back == grown.grown[2:]
    assert [h.optimizer for h in back.homes[at:]] == [Tier.CPU] * (4 * CHUNKS - at)
    assert back.need[Tier.GPU] < grown.need[Tier.GPU] and back.need[Tier.CPU] > grown.need[Tier.CPU]
    report = back.report()
    assert report["fell_back"] == len(grown.grown) - 2 and "OutOfMemoryError" in report["why"]


STATE = 12 * WHOLE
"""A chunk's fp32 master and Adam moments."""


def _spilled(ranks=1):
    """A 5.4B-element model on one rank whose host budget holds 60 chunks' state: the first plan
    puts the share's prefix on the device, the next chunks' state on the host, the rest on NVMe."""
    return plan_placement(_request(ranks, gpu=72 * GiB, cpu=60 * STATE, nvme=1 << 50, chunks=4 * CHUNKS,
                                   nvme_dir="/swap"))


def _tiers(plan):
    return [h.optimizer for h in plan.homes]


SOME = Measured(device_limit=79 * GiB, device_peak=64 * GiB)
"""A step that leaves room for some of the host chunks' state only."""


def test_nvme_state_comes_into_the_host_memory_the_share_frees():
    """The measured step grows the share by host chunks; the host memory they free takes NVMe
    state back, in chunk order, while it fits the host budget less the plan's need."""
    plan = _spilled()
    tiers = _tiers(plan)
    assert tiers == sorted(tiers, key=lambda t: t.level) and Tier.NVME in tiers and Tier.CPU in tiers
    grown = grow_share(plan, SOME)
    assert grown.grown and set(grown.grown_from) == {Tier.CPU} and Tier.CPU in _tiers(grown)
    promoted = promote_state(grown)
    nvme = [i for i, t in enumerate(_tiers(grown)) if t is Tier.NVME]
    assert promoted.promoted and list(promoted.promoted) == nvme[:len(promoted.promoted)]
    moved = len(promoted.promoted) * STATE
    assert promoted.need[Tier.CPU] == grown.need[Tier.CPU] + moved <= plan.budgets.cpu
    assert promoted.need[Tier.NVME] == grown.need[Tier.NVME] - moved
    if Tier.NVME in _tiers(promoted):  # the next chunk's state would not have fit
        assert promoted.need[Tier.CPU] + STATE > plan.budgets.cpu and "cpu_budget" in promoted.nvme_why
    report = promoted.report()
    assert report["promoted"] == len(promoted.promoted)
    assert report["share"]["nvme_chunks"] == _tiers(promoted).count(Tier.NVME)
    assert promote_state(plan).promoted == ()  # nothing freed yet, nothing comes in


def test_the_share_grows_over_nvme_state_where_the_device_has_room():
    """A step that leaves room for more than the host chunks: the share goes on over the chunks
    whose state is on NVMe (their host bytes and disk bytes come off), so nothing is promoted."""
    plan = _spilled()
    grown = grow_share(plan, Measured(device_limit=79 * GiB, device_peak=20 * GiB))
    origin = dict(zip(grown.grown, grown.grown_from))
    assert {Tier.CPU, Tier.NVME} <= set(origin.values())
    from_disk = [i for i, t in origin.items() if t is Tier.NVME]
    assert grown.need[Tier.NVME] == plan.need[Tier.NVME] - len(from_disk) * STATE
    assert all(_tiers(grown)[i] is Tier.GPU for i in origin)
    back = grown.fall_back(from_disk[0], torch.OutOfMemoryError("CUDA out of memory."))
    assert all(back.homes[i].optimizer is Tier.NVME for i in from_disk)  # back where they came from
    assert back.need[Tier.NVME] == plan.need[Tier.NVME]
    assert back.need[Tier.GPU] == grown.need[Tier.GPU] - len(from_disk) * STATE  # (the grads are transient)
    assert back.need[Tier.CPU] > grown.need[Tier.CPU]  # their grads are homed on the host again
    assert back.grown_from == (Tier.CPU,) * len(back.grown) and back.fell_back == tuple(from_disk)


def test_the_host_memory_free_now_bounds_what_comes_in():
    grown = grow_share(_spilled(), SOME)
    promoted = promote_state(grown, host_room=2 * STATE + 1)
    assert len(promoted.promoted) == 2 and "host memory free now" in promoted.nvme_why
    assert promote_state(grown, host_room=0).promoted == ()


def test_a_failed_move_from_nvme_leaves_the_rest_there():
    grown = grow_share(_spilled(), SOME)
    promoted = promote_state(grown)
    assert len(promoted.promoted) >= 3
    at = promoted.promoted[1]
    back = promoted.stop_promotion(at, OSError(5, "Input/output error"))
    assert back.promoted == promoted.promoted[:1]
    assert all(back.homes[i].optimizer is Tier.NVME for i in promoted.promoted[1:])
    assert back.need[Tier.CPU] == grown.need[Tier.CPU] + STATE
    assert back.need[Tier.NVME] == grown.need[Tier.NVME] - STATE
    assert "Input/output error" in back.report()["nvme_why"]


def test_auto_params_are_placed_before_the_share():
    """Every chunk's "auto" params go on the device before any optimizer state: the share takes
    what the params leave, not the room of the later chunks' params."""
    chunk_params, chunk_share = 2 * WHOLE, 12 * WHOLE  # bf16 params; fp32 state (grads transient)
    # Half of it (the first step's reserve) holds every params chunk, the window and 3 chunks' state.
    gpu = 2 * (CHUNKS * chunk_params + window_bytes(_request(1, gpu=1)) + 3 * chunk_share)
    plan = plan_placement(_request(1, gpu=gpu))
    assert all(h.params is Tier.GPU for h in plan.homes)  # before: the share took the last ones' room
    assert _share(plan) == [True] * 3 + [False] * (CHUNKS - 3)


def test_the_working_window_counts_whole_chunks_with_ranks():
    """With 4 ranks a chunk in use is all-gathered whole on the device: a budget that holds the
    homes and a window of shard-sized chunks but not one of whole chunks is refused up front,
    not an out-of-memory in the first forward."""
    req = _request(4, gpu=1, params=Placement.GPU, reserve=0)
    shards, whole = window_bytes(req), window_bytes(req, whole=True)
    assert whole == 4 * shards
    homes = plan_placement(_request(4, gpu=1 << 50, params=Placement.GPU, reserve=0,
                                    gpu_optimizer=False)).need[Tier.GPU] - whole
    tight = homes + shards + (whole - shards) // 2
    with pytest.raises(FitError, match="working window"):
        plan_placement(_request(4, gpu=tight, params=Placement.GPU, reserve=0, gpu_optimizer=False))
    plan_placement(_request(4, gpu=homes + whole, params=Placement.GPU, reserve=0, gpu_optimizer=False))


def test_measured_checks_its_numbers():
    with pytest.raises(ValueError, match="device_peak"):
        Measured(device_limit=1, device_peak=-1)
    with pytest.raises(ValueError, match="margin"):
        Measured(device_limit=1, device_peak=0, margin=-5)
    m = Measured(device_limit=10 * GiB, device_peak=4 * GiB, store_peak=3 * GiB, margin=0)
    assert (m.headroom, m.activation_peak) == (6 * GiB, 1 * GiB)


def test_the_share_leaves_room_for_the_replicas():
    """params="gpu" with 2 ranks keeps a whole replica of the params on each GPU beside the
    shards: the share stops short of them (before, the share took their room and the replicas'
    check refused the plan), in the first plan and the grown one."""
    chunks = tuple(ChunkNeed(numel=WHOLE // 2, dtype=BF16) for _ in range(CHUNKS))

    def request(gpu):
        return PlacementRequest(chunks=chunks, budgets=Budgets(gpu=gpu, cpu=512 * GiB), params=Placement.GPU,
                                optimizer=Placement.AUTO, rule=AdamRule(), prefetch_depth=2, reserve=0,
                                gpu_optimizer=True, ranks=2, replicas=True)

    replicas, shards, share_chunk = CHUNKS * WHOLE * 2, CHUNKS * WHOLE, 7 * WHOLE
    gpu = replicas + shards + window_bytes(request(1), whole=True) + 3 * share_chunk
    plan = plan_placement(request(gpu))
    assert sum(_share(plan)) == 3 and _share(plan)[:3] == [True] * 3
    assert plan.need[Tier.GPU] + replicas <= gpu
    grown = grow_share(plan, Measured(device_limit=1 << 50, device_peak=0))
    assert grown.grown == () and "gpu_budget" in grown.why


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_the_measured_limit_and_auto_budget_keep_to_the_memory_fraction(fraction, monkeypatch):
    """A script that holds its process to a share of the card (set_per_process_memory_fraction)
    gets an "auto" GPU budget and a measured limit within that share, not the card's free memory:
    the allocator refuses beyond it, so a share planned past it would run out of memory."""
    from zero_offload.runtime import placement, store
    total, free, reserved = 80 * GiB, 70 * GiB, 6 * GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction,
                        raising=False)
    room, limit = store.cuda_room("cuda:0")
    measured = placement.measure_device("cuda:0")
    if fraction == 1.0:
        assert (room, limit) == (free, total) and measured.device_limit == free + reserved
    else:
        assert limit == 20 * GiB and room == 14 * GiB  # 20 GiB allowed, 6 already held
        assert measured.device_limit == 20 * GiB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = store.StoreConfig(device=torch.device("cuda:0"), budgets={Tier.GPU: "auto"})
    gpu = store.resolve_budgets(cfg)[Tier.GPU]
    assert gpu == int(room * (1 - cfg.auto_reserve_fraction))


def test_an_auto_budget_of_a_nearly_full_card_is_what_is_free_less_its_reserve(monkeypatch):
    """Before: "auto" left 10% of the TOTAL alone, so 12 GiB free of a 140 GiB card gave a GPU
    budget of 0 and the engine refused a card that trains it (12 GiB free of 80 gave 4 GiB)."""
    from zero_offload.runtime import store
    for total in (80 * GiB, 140 * GiB):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, t=total: (12 * GiB, t))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0,
                            raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        cfg = store.StoreConfig(device=torch.device("cuda:0"), budgets={Tier.GPU: "auto"})
        assert store.resolve_budgets(cfg)[Tier.GPU] == int(12 * GiB * 0.9), total
    assert store.auto_budget(0, 0.1) == 0 and store.auto_budget(100, 0.0) == 100


def _host_need(ranks, gpu, reserve):
    """Host bytes the plan with an explicit ``reserve`` needs (an unbounded host budget)."""
    return plan_placement(_request(ranks, gpu=gpu, reserve=reserve)).need[Tier.CPU]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_an_auto_reserve_is_lowered_until_the_host_holds_the_rest(ranks):
    """[Note: auto reserve] A host that cannot hold what half the card leaves it (51.82B on 4x
    H200 + 503 GiB, which ran with a reserve set by hand): the first plan leaves the activations
    the largest reserve that fits instead of refusing, within gpu / AUTO_RESERVE_STEPS of it; an
    explicit reserve is taken as asked."""
    gpu = 16 * GiB // ranks
    half = gpu // 2
    cpu = (_host_need(ranks, gpu, half) + _host_need(ranks, gpu, gpu // AUTO_RESERVE_FLOOR)) // 2
    with pytest.raises(FitError, match="cpu_budget"):
        plan_placement(_request(ranks, gpu=gpu, cpu=cpu, reserve=half))
    plan = plan_placement(_request(ranks, gpu=gpu, cpu=cpu))
    reserve = reserve_bytes(plan.request)
    assert gpu // AUTO_RESERVE_FLOOR <= reserve < half
    slack = _staging_bytes(plan.request)  # the host room the search keeps free
    assert plan.need[Tier.CPU] <= cpu - slack
    assert plan.need[Tier.GPU] <= gpu - reserve + window_bytes(plan.request, whole=True)
    with pytest.raises(FitError):  # the largest that fits, within the search's step
        plan_placement(_request(ranks, gpu=gpu, cpu=cpu - slack, reserve=reserve + gpu // AUTO_RESERVE_STEPS))
    report = plan.report()
    assert report["reserve"] == reserve and report["reserve_lowered"]
    assert "lowered from half the budget" in plan.why
    # the ranks agree: every rank plans the common request the same way
    assert plan == plan_placement(_request(ranks, gpu=gpu, cpu=cpu))


def test_half_is_kept_where_it_fits_or_where_nvme_takes_the_rest():
    """The lowering serves a plan that would not fit at all: one that fits keeps half the card,
    and so does one whose state spills to NVMe (the measured step grows the share and brings the
    NVMe state back into host memory: [Note: measured share])."""
    plan = plan_placement(_request(1, gpu=16 * GiB))
    assert reserve_bytes(plan.request) == 8 * GiB and not plan.report()["reserve_lowered"]
    spilled = _spilled()
    assert reserve_bytes(spilled.request) == 36 * GiB and Tier.NVME in _tiers(spilled)


def test_below_the_floor_the_plan_refuses_and_names_the_reserve():
    """Where only a reserve under gpu_budget / AUTO_RESERVE_FLOOR fits, "auto" does not take it
    (the step's activations are unknown): the error says so and how to ask for it; where no
    reserve fits, the error is the one of half the card."""
    gpu = 16 * GiB
    floor = gpu // AUTO_RESERVE_FLOOR
    slack = _staging_bytes(_request(1, gpu=gpu))  # the host room the lowered plan leaves
    cpu = _host_need(1, gpu, 0) + slack
    assert cpu < _host_need(1, gpu, floor) + slack
    with pytest.raises(FitError) as info:
        plan_placement(_request(1, gpu=gpu, cpu=cpu))
    text = str(info.value)
    assert "\n" not in text and "cpu_budget" in text and f"less than gpu_budget/{AUTO_RESERVE_FLOOR}" in text
    most = int(text.split("pass activation_reserve=")[1].split(";")[0])
    assert 0 <= most < floor
    plan = plan_placement(_request(1, gpu=gpu, cpu=cpu, reserve=most))  # the reserve it names fits
    assert reserve_bytes(plan.request) == most
    with pytest.raises(FitError) as info:
        plan_placement(_request(1, gpu=gpu, cpu=_host_need(1, gpu, 0) + slack - 1))
    assert "pass activation_reserve=" not in str(info.value)


def test_out_of_memory_with_a_lowered_reserve_says_the_host_is_full():
    """A first step whose activations need more than the lowered reserve: the share cannot give
    its room back to a full host, and the error says so, not "pass a larger reserve" (which
    would not fit)."""
    gpu = 16 * GiB
    cpu = (_host_need(1, gpu, gpu // 2) + _host_need(1, gpu, gpu // AUTO_RESERVE_FLOOR)) // 2
    plan = plan_placement(_request(1, gpu=gpu, cpu=cpu))
    text = str(plan.unmeasured_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")))
    assert "\n" not in text and "lowered from half of gpu_budget" in text and "host has no room" in text
    assert "Pass a larger activation_reserve" not in text and "Tried to allocate 2.00 GiB" in text
    plain = plan_placement(_request(1, gpu=gpu))
    assert "Pass a larger activation_reserve" in str(plain.unmeasured_oom(torch.OutOfMemoryError("x")))
