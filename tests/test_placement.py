"""The neutral placement (runtime/placement.py): a PlacementRequest in, a PlacementPlan out, for
the requests both front ends make (the engine pages its params through the device; OffloadAdam
keeps them in the user's tensors), with no model, config or store; and ``rank_budgets``, the one
place an "auto" budget becomes this rank's share of the node."""
import collections
import dataclasses

import pytest
import torch

from zero_offload.runtime.placement import (PARKED_CHUNKS, Budgets, ChunkNeed, FitError, PlacementRequest,
                                            keep_limit, local_ranks, plan_placement, rank_budgets,
                                            window_bytes)
from zero_offload.runtime.store import PayloadSpec, Tier
from zero_offload.runtime.update_rule import AdamRule, StateSpec
from zero_offload.runtime.vocab import Placement

N = 1 << 14
"""Elements per chunk: 64 KiB in fp32, 32 KiB in bf16 (multiples of 4 KiB: no rounding)."""
BIG = 1 << 40
F32, BF16 = torch.float32, torch.bfloat16


def _chunks(n, *, numel=N, dtype=F32, trainable=True):
    return tuple(ChunkNeed(numel=numel, dtype=dtype, trainable=trainable) for _ in range(n))


def _engine(chunks, *, gpu=BIG, cpu=BIG, nvme=0, **kw):
    """A request as the engine makes it (params paged by the store)."""
    kw = {"params": Placement.CPU, "optimizer": Placement.CPU, "prefetch_depth": 1, "rule": AdamRule(), **kw}
    return PlacementRequest(chunks=chunks, budgets=Budgets(gpu=gpu, cpu=cpu, nvme=nvme), **kw)


def _adam(chunks, *, gpu=0, cpu=BIG, nvme=0, **kw):
    """A request as OffloadAdam makes it (the user's tensors keep the params)."""
    kw = {"optimizer": Placement.AUTO, "prefetch_depth": 1, "rule": AdamRule(), **kw}
    return PlacementRequest(chunks=chunks, budgets=Budgets(gpu=gpu, cpu=cpu, nvme=nvme), params=None,
                            gpu_optimizer=True, owner="OffloadAdamW", state_option="state", **kw)


def _specs(plan, i):
    return {name: (spec.dtype, spec.home) for name, spec in plan.payloads(i).items()}


# ---- the engine's requests ----------------------------------------------------------------


def test_engine_homes_and_payloads_follow_the_table(tmp_path):
    """bf16 params on the host, state on NVMe: each trainable chunk has params and grads in bf16,
    an fp32 master and moments on NVMe; a frozen chunk carries params only. The needs are the
    homes plus the device's working window and the host's NVMe staging."""
    chunks = _chunks(2, dtype=BF16) + _chunks(1, dtype=BF16, trainable=False)
    req = _engine(chunks, optimizer=Placement.NVME, nvme_dir=str(tmp_path), nvme=BIG)
    plan = plan_placement(req)
    assert [(h.params, h.optimizer) for h in plan.homes] == [(Tier.CPU, Tier.NVME)] * 2 + [(Tier.CPU, None)]
    assert _specs(plan, 0) == {"params": (BF16, Tier.CPU), "grads": (BF16, Tier.CPU),
                               "master": (F32, Tier.NVME), "exp_avg": (F32, Tier.NVME),
                               "exp_avg_sq": (F32, Tier.NVME)}
    assert _specs(plan, 2) == {"params": (BF16, Tier.CPU)}
    assert all(isinstance(s, PayloadSpec) and s.numel == N for s in plan.payloads(0).values())
    state, half = 12 * N, 2 * N
    staging = (req.prefetch_depth + 1) * (half + state)  # params + state of the largest chunk
    assert plan.need[Tier.NVME] == 2 * state
    assert plan.need[Tier.CPU] == 3 * half + 2 * half + staging  # params, grads, staging
    assert plan.need[Tier.GPU] == window_bytes(req) == (1 + 3 + PARKED_CHUNKS) * half + 3 * half
    assert plan.working == {Tier.GPU: window_bytes(req), Tier.CPU: staging, Tier.NVME: 0}


def test_fp32_params_are_the_master_and_accum_lives_where_the_update_runs():
    plan = plan_placement(_engine(_chunks(1), accum=True, rule=AdamRule(moments_dtype=BF16)))
    assert _specs(plan, 0) == {"params": (F32, Tier.CPU), "grads": (F32, Tier.CPU),
                               "exp_avg": (BF16, Tier.CPU), "exp_avg_sq": (BF16, Tier.CPU),
                               "accum": (F32, Tier.CPU)}


def test_engine_auto_params_fill_the_device_then_host_then_nvme(tmp_path):
    """Within gpu_budget less the reserve, after the window; then host memory while it has room
    beside the NVMe staging; then NVMe."""
    chunks = _chunks(6)
    probe = _engine(chunks, params=Placement.AUTO, optimizer=Placement.NVME, nvme_dir=str(tmp_path), nvme=BIG)
    window, p, state = window_bytes(probe), 4 * N, 8 * N  # fp32: moments only
    grads_host = 6 * p
    staging = 2 * (p + state)
    req = dataclasses.replace(probe, budgets=Budgets(gpu=2 * (window + 2 * p), cpu=grads_host + staging + 2 * p,
                                                     nvme=BIG), reserve="auto")
    plan = plan_placement(req)
    assert [h.params for h in plan.homes] == [Tier.GPU] * 2 + [Tier.CPU] * 2 + [Tier.NVME] * 2
    assert plan.need[Tier.GPU] == window + 2 * p <= req.budgets.gpu // 2


def test_gpu_share_is_a_prefix_for_both_front_ends():
    """"auto" state takes the device in chunk order, with the chunk's accum (its grads are
    transient there: [Note: share grads]); once a chunk does not fit, no later one is put there,
    even a smaller one that would fit."""
    chunks = _chunks(3) + _chunks(1, numel=N // 4)
    share = 12 * N  # fp32 engine chunk (no master): 8N of moments + 4N of accum
    eng = _engine(chunks, params=Placement.GPU, optimizer=Placement.AUTO, gpu_optimizer=True, accum=True)
    base = window_bytes(eng) + 4 * (3 * N + N // 4)  # the window (its grads chunks) and the params homes
    plan = plan_placement(dataclasses.replace(eng, budgets=Budgets(gpu=base + 2 * share + share // 2, cpu=BIG)))
    assert [h.optimizer for h in plan.homes] == [Tier.GPU] * 2 + [Tier.CPU] * 2 and plan.share_ended
    assert _specs(plan, 0)["grads"] == (F32, Tier.GPU) and _specs(plan, 0)["accum"] == (F32, Tier.GPU)
    assert plan.payloads(0)["grads"].transient and not plan.payloads(0)["accum"].transient
    assert _specs(plan, 3)["grads"] == (F32, Tier.CPU) and not plan.payloads(3)["grads"].transient
    assert plan.need[Tier.GPU] == base + 2 * share
    assert plan.need[Tier.CPU] == (8 + 4 + 4) * N + (8 + 4 + 4) * N // 4  # chunks 2 and 3 only
    # Grads waiting for the window's decision (clipping, no accum) are all held at once: counted
    held = dataclasses.replace(eng, accum=False, grads_wait=True, budgets=Budgets(gpu=base + 2 * share, cpu=BIG))
    plan = plan_placement(held)  # 8N of moments + 4N of grads
    assert [h.optimizer for h in plan.homes] == [Tier.GPU] * 2 + [Tier.CPU] * 2
    assert plan.need[Tier.GPU] == base + 2 * share

    share = 16 * N  # fp32: 12N state + 4N grads on the device, counted per chunk ([Note: share grads])
    adam = _adam(chunks, gpu=2 * share + share // 2)
    plan = plan_placement(adam)
    assert [h.optimizer for h in plan.homes] == [Tier.GPU] * 2 + [Tier.CPU] * 2
    assert all(h.params is None for h in plan.homes) and plan.payloads(0)["grads"].transient
    assert plan.need[Tier.GPU] == 2 * share  # no working window: nothing is paged


def test_offload_adam_payloads_keep_no_params_but_the_host_updates_copy_out():
    """The user's tensors are the params: fp32 chunks have none in the store; bf16 chunks
    updated on the host have the rounded copy in host memory, and none on the GPU share."""
    chunks = _chunks(1, dtype=BF16) + _chunks(1) + _chunks(1, dtype=BF16)
    plan = plan_placement(_adam(chunks, gpu=(12 + 2) * N))
    assert [h.optimizer for h in plan.homes] == [Tier.GPU, Tier.CPU, Tier.CPU]
    state = {"master": (F32, Tier.GPU), "exp_avg": (F32, Tier.GPU), "exp_avg_sq": (F32, Tier.GPU)}
    assert _specs(plan, 0) == {"grads": (BF16, Tier.GPU), **state}
    assert _specs(plan, 1) == {"grads": (F32, Tier.CPU), **{k: (F32, Tier.CPU) for k in state}}
    assert _specs(plan, 2) == {"grads": (BF16, Tier.CPU), **{k: (F32, Tier.CPU) for k in state},
                               "params": (BF16, Tier.CPU)}
    assert plan.need[Tier.CPU] == (4 + 12) * N + (2 + 12 + 2) * N


def test_offload_adam_spills_to_nvme_past_the_host_room_and_rest_carries_on(tmp_path):
    """State fills host memory while the host buffers of every chunk and the NVMe staging still
    fit, then NVMe; ``rest()`` is the budgets less the homes (staging is counted again by a later
    plan), with no GPU share once it ended."""
    chunks = _chunks(4)
    grads, state = 4 * N, 12 * N
    staging = 2 * state
    cpu = 4 * grads + staging + 2 * state + grads  # (room for a later chunk's grads)
    req = _adam(chunks, gpu=0, cpu=cpu, nvme=BIG, nvme_dir=str(tmp_path))
    plan = plan_placement(req)
    assert [h.optimizer for h in plan.homes] == [Tier.CPU] * 2 + [Tier.NVME] * 2
    assert plan.need == {Tier.GPU: 0, Tier.CPU: cpu - grads, Tier.NVME: 2 * state}
    rest = plan.rest()
    assert (rest.gpu, rest.cpu, rest.nvme) == (0, staging + grads, BIG - 2 * state)
    later = plan_placement(dataclasses.replace(req, chunks=_chunks(1), budgets=rest))
    assert later.homes[0].optimizer is Tier.NVME  # its grads fit beside the staging, its state does not
    with pytest.raises(FitError, match="cpu_budget"):  # and a chunk more has no room for its grads
        plan_placement(dataclasses.replace(req, chunks=_chunks(1), budgets=later.rest()))


def test_the_share_ends_for_later_plans():
    plan = plan_placement(_adam(_chunks(2), gpu=20 * N))
    assert [h.optimizer for h in plan.homes] == [Tier.GPU, Tier.CPU]
    assert plan.rest().gpu == 0
    whole = plan_placement(_adam(_chunks(2), gpu=40 * N))
    assert whole.rest().gpu == 8 * N and not whole.share_ended


def test_explicit_state_is_taken_as_asked(tmp_path):
    plan = plan_placement(_adam(_chunks(2), gpu=BIG, optimizer=Placement.NVME, nvme=BIG, nvme_dir=str(tmp_path)))
    assert [h.optimizer for h in plan.homes] == [Tier.NVME] * 2


# ---- what does not fit --------------------------------------------------------------------


def test_fit_errors_name_the_budget_the_numbers_and_the_fix(tmp_path):
    with pytest.raises(FitError, match=r"^gpu_budget=4096 bytes cannot hold the working set.*Raise "
                                       r"gpu_budget to at least \d+, or lower chunk_mb or prefetch_depth"):
        plan_placement(_engine(_chunks(2), gpu=4096))
    with pytest.raises(FitError, match=r"^cpu_budget=4096 bytes is too small.*optimizer='nvme'\) or "
                                       r"params \(params='nvme'\)"):
        plan_placement(_engine(_chunks(2), cpu=4096))
    with pytest.raises(FitError, match=r"^OffloadAdamW: cpu_budget=4096 bytes is too small: the host-memory "
                                       r"homes \(grads, optimizer state placed on 'cpu'\).*\(state='nvme'\) on NVMe"):
        plan_placement(_adam(_chunks(2), cpu=4096))
    with pytest.raises(FitError, match=r"NVMe directory .* is too small: the state placed there needs "
                                       r"\d+ bytes .*\(nvme_budget=4096\).*raise nvme_budget"):
        plan_placement(_engine(_chunks(2), optimizer=Placement.NVME, nvme=4096, nvme_dir=str(tmp_path)))
    auto = Budgets(gpu=0, cpu=BIG, nvme=4096, auto=frozenset({Tier.NVME}))
    on_nvme = _adam(_chunks(2), optimizer=Placement.NVME, nvme_dir=str(tmp_path))
    with pytest.raises(FitError, match=r"^OffloadAdamW: the NVMe directory .* \('auto': free space less a "
                                       r"reserve .*or keep more state in host memory \(state='cpu' or 'auto'\)"):
        plan_placement(dataclasses.replace(on_nvme, budgets=auto))
    # the grad_sync="final" window and the replicas of params="gpu" with several ranks
    with pytest.raises(FitError, match=r"\d+ bytes of fp32 grads window \(grad_sync='final'"):
        plan_placement(_engine(_chunks(2), gpu=4 * 2 * N + 4096, fp32_grads_window=True))
    replicated = _engine(_chunks(2), params=Placement.GPU, ranks=2, replicas=True)
    need = plan_placement(dataclasses.replace(replicated, budgets=Budgets(gpu=BIG, cpu=BIG))).need[Tier.GPU]
    replicas = sum(c.numel * 2 * c.dtype.itemsize for c in replicated.chunks)
    with pytest.raises(FitError, match=r"params='gpu' with 2 ranks keeps a full replica"):
        plan_placement(dataclasses.replace(replicated, budgets=Budgets(gpu=need + replicas - 1, cpu=BIG)))
    assert plan_placement(dataclasses.replace(replicated, budgets=Budgets(gpu=need + replicas, cpu=BIG)))


def test_auto_replicas_only_where_the_whole_state_fits_beside_them():
    """[Note: replicas when all fits]: several ranks, "auto" replicas are kept where every chunk's
    params and state stay on the device with them; a budget that holds the whole state but not the
    replicas too goes without them (the share is worth more); one rank or host params: none."""
    chunks = _chunks(12)
    auto = _engine(chunks, params=Placement.AUTO, optimizer=Placement.AUTO, gpu_optimizer=True, ranks=2,
                   replicas="auto")
    plan = plan_placement(auto)
    assert plan.request.replicas is True
    assert all(h.params is Tier.GPU and h.optimizer is Tier.GPU for h in plan.homes)
    # a chunk in use is its replica: the working window holds no whole params chunk
    assert window_bytes(plan.request, whole=True) == 3 * 4 * N * 2 < window_bytes(
        dataclasses.replace(plan.request, replicas=False), whole=True)
    replicas = 12 * 2 * 4 * N
    with_replicas = plan.need[Tier.GPU] + replicas
    bare = plan_placement(dataclasses.replace(auto, replicas=False))
    assert all(h.optimizer is Tier.GPU for h in bare.homes) and bare.need[Tier.GPU] < with_replicas
    tight = dataclasses.replace(auto, budgets=Budgets(gpu=with_replicas - 1, cpu=BIG))
    plan = plan_placement(tight)
    assert plan.request.replicas is False and all(h.optimizer is Tier.GPU for h in plan.homes)
    roomy = dataclasses.replace(auto, budgets=Budgets(gpu=with_replicas, cpu=BIG))
    assert plan_placement(roomy).request.replicas is True
    for other in (dataclasses.replace(auto, ranks=1), dataclasses.replace(auto, params=Placement.CPU)):
        assert plan_placement(other).request.replicas is False
    # the state spilling to the host: no replicas, whatever room they would find
    spill = dataclasses.replace(auto, budgets=Budgets(gpu=bare.need[Tier.GPU] - 1, cpu=BIG))
    plan = plan_placement(spill)
    assert plan.request.replicas is False and plan.homes[-1].optimizer is Tier.CPU
    assert plan.request.replicas_later and not plan_placement(dataclasses.replace(auto, ranks=1)).request.replicas_later


def test_the_measured_step_adds_the_replicas_where_it_leaves_room():
    """[Note: replicas when all fits]: a first plan whose reserve left no room for the replicas
    beside the whole state gets them from ``grow_share`` once the share is whole and the measured
    headroom holds them too; not with less headroom, nor with a chunk's state left on the host, nor
    after a fall-back."""
    from zero_offload.runtime.placement import Measured, grow_share
    chunks = _chunks(12)
    replicas = 12 * 2 * 4 * N
    auto = _engine(chunks, params=Placement.AUTO, optimizer=Placement.AUTO, gpu_optimizer=True, ranks=2,
                   replicas="auto")
    bare = plan_placement(dataclasses.replace(auto, replicas=False)).need[Tier.GPU]
    with_replicas = plan_placement(auto).need[Tier.GPU] + replicas
    # a reserve that leaves the whole state its room but not the replicas
    first = plan_placement(dataclasses.replace(auto, budgets=Budgets(gpu=4 * bare, cpu=BIG),
                                               reserve=4 * bare - with_replicas + 1))
    assert first.request.replicas is False and first.request.replicas_later and _all_gpu(first)
    assert first.report()["replicas"] is False
    limit = 4 * bare
    roomy = grow_share(first, Measured(device_limit=limit, device_peak=0, margin=0))
    assert roomy.replicas_added and roomy.request.replicas is True and not roomy.request.replicas_later
    assert roomy.report()["replicas"] is True and roomy.report()["replicas_bytes"] == replicas
    short = grow_share(first, Measured(device_limit=limit, device_peak=limit - replicas + 1, margin=0))
    assert not short.replicas_added and short.request.replicas is False and short.request.replicas_later
    # the share not whole (the reserve kept a chunk's state on the host) and the headroom too small
    # for it: no replicas either
    partial = plan_placement(dataclasses.replace(auto, budgets=Budgets(gpu=bare, cpu=BIG), reserve=4 * N * 4))
    assert any(h.optimizer is Tier.CPU for h in partial.homes)
    grown = grow_share(partial, Measured(device_limit=bare, device_peak=bare, margin=0))
    assert not grown.replicas_added and grown.request.replicas is False
    back = roomy.fall_back(0, MemoryError("x")) if roomy.grown else dataclasses.replace(
        roomy, grown=(11,), grown_from=(Tier.CPU,)).fall_back(11, MemoryError("x"))
    assert not back.replicas_added and back.request.replicas is False and back.request.replicas_later


def _all_gpu(plan):
    return all(h.params is Tier.GPU and h.optimizer is Tier.GPU for h in plan.homes)


def test_requests_are_checked():
    with pytest.raises(ValueError, match=r"OffloadAdamW: placing state on NVMe needs a swap directory"):
        _adam(_chunks(1), optimizer=Placement.NVME)
    with pytest.raises(TypeError, match="Budgets"):
        PlacementRequest(budgets={Tier.CPU: 1}, params=None, optimizer=Placement.CPU, rule=AdamRule())
    with pytest.raises(TypeError, match="Placement"):
        PlacementRequest(budgets=Budgets(gpu=0, cpu=0), params="cpu", optimizer=Placement.CPU, rule=AdamRule())
    with pytest.raises(TypeError, match="PlacementRequest.rule must be an UpdateRule"):
        _engine((), rule=object())
    with pytest.raises(ValueError, match="reserve"):
        _engine((), reserve=-1)
    with pytest.raises(ValueError, match="Budgets.cpu"):
        Budgets(gpu=0, cpu="auto")
    assert plan_placement(_adam(())).homes == ()  # a group with nothing to train


def test_keep_limit_leaves_the_window_of_whole_chunks():
    """The engine keeps params copies up to half the budget, never into the working window of
    whole (all-gathered) chunks."""
    one = _engine(_chunks(3), gpu=BIG)
    assert keep_limit(one) == BIG // 2
    tight = dataclasses.replace(one, budgets=Budgets(gpu=window_bytes(one) + 4096, cpu=BIG))
    assert keep_limit(tight) == 4096
    two = dataclasses.replace(tight, ranks=2)
    assert window_bytes(two, whole=True) == 2 * window_bytes(two) and keep_limit(two) == 0


# ---- this rank's share of the node --------------------------------------------------------


@pytest.fixture
def node(monkeypatch):
    """The node has 100 MiB available of 200 MiB (an "auto" host budget: 90 MiB, the available
    less 10% of itself) and a disk with 1 PiB free."""
    import psutil
    import shutil
    vm = collections.namedtuple("vm", "total available percent")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: vm(200 << 20, 100 << 20, 50.0))
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 51, 1 << 50, 1 << 50))
    return int((100 << 20) * 0.9)


def test_rank_budgets_share_the_nodes_auto_budgets(node, tmp_path):
    asked = {Tier.GPU: "auto", Tier.CPU: "auto", Tier.NVME: "auto"}
    alone = rank_budgets(asked, device="cpu", nvme_dir=tmp_path)
    assert (alone.gpu, alone.cpu, alone.nvme) == (node, node, (1 << 50) - (4 << 30))  # NVMe: no 64 GiB cap
    assert alone.auto == frozenset(Tier)
    two = rank_budgets(asked, device="cpu", nvme_dir=tmp_path, local_ranks=2, freed_host=1000)
    assert (two.gpu, two.cpu, two.nvme) == (node // 2, node // 2 + 1000, ((1 << 50) - (4 << 30)) // 2)
    given = rank_budgets({Tier.GPU: 5, Tier.CPU: 7, Tier.NVME: 9}, nvme_dir=tmp_path, local_ranks=2,
                         freed_host=1000)
    assert (given.gpu, given.cpu, given.nvme, given.auto) == (5, 7, 9, frozenset())  # bytes are this rank's
    assert rank_budgets({Tier.CPU: "auto", Tier.NVME: "auto"}).nvme == 0  # no swap directory
    assert rank_budgets({Tier.CPU: 1}).gpu == 0  # a tier left out has nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device is each rank's own")
def test_a_cuda_devices_auto_budget_is_not_divided(node):
    free, total = torch.cuda.mem_get_info()
    got = rank_budgets({Tier.GPU: "auto"}, device="cuda", local_ranks=4).gpu
    assert got > 0.9 * free / 2


def test_local_ranks_reads_the_launchers_count(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_ranks() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_ranks() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='four' is not a number of processes"):
        local_ranks()


# ---- the update rule declares the state ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _FactoredRule:
    """A rule that is not elementwise, with Adafactor-like state: one fp32 factor of
    rows + columns per parameter (a vector's: its length), laid end to end, and a bf16 step
    buffer the size of the chunk. Placement only sees ``payloads``."""

    name = "Factored"
    elementwise = False
    state_keys = ("factors", "delta")
    hyper_keys = ("lr",)
    log: list = dataclasses.field(default_factory=list, compare=False)

    def payloads(self, numel, shapes=()):
        self.log.append((numel, tuple(shapes)))
        factors = sum(s[0] + s[1] if len(s) == 2 else s[0] for s in shapes)
        return {"factors": StateSpec(factors, F32), "delta": StateSpec(numel, BF16)}

    def args(self, group, *, grad_scale=1.0):
        return None

    def cpu_job(self, bufs, segments, *, threads=None):
        return []

    def device_step(self, bufs, segments):
        pass


def test_the_rule_names_sizes_and_types_the_state_for_both_front_ends(tmp_path):
    """No exp_avg in sight: the rule's payloads (sized by the chunk's param shapes) are homed
    with the master, counted in the plan's bytes (the GPU share, host, NVMe and its staging) and
    given to the store with their own sizes; frozen chunks carry none."""
    rule = _FactoredRule()
    shapes = ((64, 128), (256,))  # 8192 + 256 elements: factors 64 + 128 + 256 = 448
    numel = 8192 + 256
    chunks = (ChunkNeed(numel=numel, dtype=BF16, shapes=shapes), ChunkNeed(numel=numel, dtype=BF16, trainable=False))
    req = _engine(chunks, optimizer=Placement.NVME, nvme_dir=str(tmp_path), nvme=BIG, rule=rule)
    plan = plan_placement(req)
    specs = plan.payloads(0)
    assert set(specs) == {"params", "grads", "master", "factors", "delta"}
    assert (specs["factors"].numel, specs["factors"].dtype, specs["factors"].home) == (448, F32, Tier.NVME)
    assert (specs["delta"].numel, specs["delta"].dtype, specs["delta"].home) == (numel, BF16, Tier.NVME)
    assert specs["master"].numel == numel and specs["master"].home is Tier.NVME
    assert set(plan.payloads(1)) == {"params"}
    assert (numel, shapes) in rule.log
    page = 4096
    state = -(-4 * numel // page) * page + page + -(-2 * numel // page) * page  # master, factors, delta
    assert plan.need[Tier.NVME] == state
    # OffloadAdam's kind of request: the same state on the GPU share, then host memory
    grads = -(-2 * numel // page) * page
    adam = _adam(chunks[:1] * 2, gpu=state + grads, rule=rule)
    plan = plan_placement(adam)
    assert [h.optimizer for h in plan.homes] == [Tier.GPU, Tier.CPU]
    assert plan.payloads(0)["factors"].home is Tier.GPU and plan.payloads(1)["factors"].home is Tier.CPU
    assert plan.need[Tier.GPU] == state + grads
    assert plan.need[Tier.CPU] == state + grads + grads  # + the host update's rounded params


class _Stateless(_FactoredRule):
    name = "Stateless"
    state_keys = ()

    def payloads(self, numel, shapes=()):
        return {}


class _Clashing(_FactoredRule):
    def payloads(self, numel, shapes=()):
        return {"factors": StateSpec(1, F32), "master": StateSpec(numel, F32)}


def test_a_stateless_rule_and_rules_that_break_the_contract():
    """fp32 params the store pages are the master: a rule with no state gets no optimizer
    payloads at all. A rule that is not elementwise must be told the shapes; a rule's payloads
    must be its state_keys and must not take a runtime payload's name."""
    whole = (ChunkNeed(numel=N, dtype=F32, shapes=((N,),)),)
    plan = plan_placement(_engine(whole, rule=_Stateless()))
    assert set(plan.payloads(0)) == {"params", "grads"} and plan.homes[0].optimizer is Tier.CPU
    with pytest.raises(ValueError, match=r"Factored is not elementwise: .*must carry their shapes"):
        _engine(_chunks(1), rule=_FactoredRule())
    with pytest.raises(ValueError, match=r"update rule Factored: its payloads \['factors', 'master'\] must be "
                                         r"its state_keys \['factors', 'delta'\].*fix the rule's payloads"):
        plan_placement(_engine(whole, rule=_Clashing()))
