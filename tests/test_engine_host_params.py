"""Params made from the master ([Note: params from the master] in runtime/placement.py,
``OffloadConfig.host_params``): a chunk whose params and fp32 master are both homed in host
memory keeps no working copy there; each fetch casts the master on the device and the CPU update
writes no copy-out. The steps equal, bit for bit, those of the copy layout (the same rounding to
nearest even on either side), and plain torch's recipe, with clipping, accumulation (on the host
and on the device), fp16 overflow skips, the grads window, automatic placement, checkpoints,
park/resume and two ranks (gloo). Where the master is not in host memory (NVMe) or the params are
the master (fp32) the copy stays and the plan says why. The plan's host bytes are the store's."""
import dataclasses

import pytest
import torch

import zero_offload as zo
from zero_offload.runtime.placement import (Budgets, ChunkNeed, FitError, PlacementRequest, plan_placement)
from zero_offload.runtime.store import Hop, Residency, Tier
from zero_offload.runtime.update_rule import AdamRule
from zero_offload.runtime.vocab import Placement
from _dist_util import run_ranks
from _engine_util import (Reference, assert_host_homes_match_the_plan, assert_spills_or_fails, assert_trains_alike, build_layout, assert_params_close, assert_same_state, engine_state,
                          check_resume_across_layouts, gpt_batches, least_host_budget, gpt_loss, micro_gpt, train_engine)

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
BF16 = dict(params="cpu", optimizer="cpu", dtype="bf16")

RECIPES = {
    "bf16": BF16,
    "clip": dict(BF16, grad_clip=0.05),
    "accum-every": dict(BF16, grad_accum=3),
    "accum-final": dict(BF16, grad_accum=3, grad_sync="final"),
    "no-overlap": dict(BF16, overlap=False),
    "fp16": dict(BF16, dtype="fp16", initial_scale=2.0 ** 40, growth_interval=2),
    "grads-window": dict(BF16, host_grads="window", grads_window=2),
    "auto": dict(params="auto", optimizer="auto", dtype="bf16", gpu_budget=150_000),
    "prefetch-0": dict(BF16, prefetch_depth=0),
}


def _build(kw, tmp_path, host_params, model=None):
    return build_layout(kw, tmp_path, spec=SPEC, model=model, host_params=host_params)


def _derived(engine) -> list:
    return [c for c in engine.group.chunks if engine.store.derived(c.cid, "params")]


def _homes_match_the_plan(engine) -> None:
    """The store holds the plan's host homes; the report counts the chunks made from the master."""
    assert_host_homes_match_the_plan(engine)
    assert engine.plan.report()["params_from_master"] == len(_derived(engine))


def _assert_from_master(engine) -> None:
    """Every chunk the plan makes from the master has no host copy of its params, ever."""
    store, derived = engine.store, _derived(engine)
    assert derived, "the recipe must home some chunks' params and master on the host"
    assert engine.plan.request.host_params == "from-master"
    for c in derived:
        h = engine.plan.homes[c.cid]
        assert h.from_master and h.params is Tier.CPU and h.optimizer is Tier.CPU
        assert store.state(c.cid, "params", Tier.CPU) is Residency.ABSENT
        assert store.payload_spec(c.cid, "params").source == "master"


def _working_params(engine) -> list:
    """Each chunk's working params as the device gets them (fetched now: after the last update)."""
    engine.synchronize()
    out = []
    for c in engine.group.chunks:
        with engine.store.use(c.cid, "params", Tier.GPU) as buf:
            out.append(buf.cpu().clone())
    return out


@pytest.mark.parametrize("name", list(RECIPES))
def test_from_master_equals_the_copy_bit_for_bit(name, tmp_path):
    kw = RECIPES[name]
    accum = kw.get("grad_accum", 1)
    batches = gpt_batches(4 * accum)
    copy, derived = _build(kw, tmp_path, "copy"), _build(kw, tmp_path, "from-master")
    try:
        assert copy.plan.request.host_params == "copy" and not _derived(copy)
        _assert_from_master(derived)
        want = train_engine(copy, batches, gpt_loss, accum=accum)
        got = train_engine(derived, batches, gpt_loss, accum=accum)
        assert got == want
        assert_same_state(engine_state(derived), engine_state(copy))
        for a, b in zip(_working_params(derived), _working_params(copy)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # the bits, not the values
        _assert_from_master(derived)
        _homes_match_the_plan(copy)
        _homes_match_the_plan(derived)
        # host memory: no working copy of the derived chunks' params (where both plans placed
        # the same homes: "auto" params fill the device less, its room holding the casts' staging)
        if [(h.params, h.optimizer) for h in copy.plan.homes] == [(h.params, h.optimizer) for h in derived.plan.homes]:
            params = sum(4096 * -(-copy.store.payload_spec(c.cid, "params").nbytes // 4096) for c in _derived(derived))
            assert copy.plan.need[Tier.CPU] - derived.plan.need[Tier.CPU] == params
        else:
            assert name == "auto"
        # PCIe: the master's 4 bytes per param go up instead of 2
        up = {e: e.store.stats.bytes_moved[Hop.CPU_TO_GPU] for e in (copy, derived)}
        assert up[derived] > up[copy]
        if kw.get("dtype") == "fp16":
            assert derived.skipped_steps >= 1  # the overflow path ran
    finally:
        copy.close()
        derived.close()


@pytest.mark.parametrize("name", ["bf16", "clip", "accum-every"])
def test_from_master_matches_torch(name, tmp_path):
    kw = RECIPES[name]
    accum = kw.get("grad_accum", 1)
    batches = gpt_batches(5 * accum)
    ref = Reference(micro_gpt(), SPEC, dtype=torch.bfloat16, accum=accum, grad_clip=kw.get("grad_clip"))
    engine = _build(kw, tmp_path, "from-master")
    try:
        _assert_from_master(engine)
        train_engine(engine, batches, gpt_loss, accum=accum)
        for b in batches:
            ref.step(b, gpt_loss)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=3e-2)
    finally:
        engine.close()


@pytest.mark.parametrize("kw,why", [(dict(params="cpu", optimizer="nvme", dtype="bf16"), "nvme"),
                                    (dict(params="cpu", optimizer="cpu", dtype="fp32"), "fp32 params are the master")],
                         ids=["master-on-nvme", "fp32"])
def test_the_copy_stays_where_the_master_is_not_in_host_memory(kw, why, tmp_path):
    """From the master needs the master in host memory and a working dtype that is not fp32:
    elsewhere the copy stays, the report says why, and the steps are the copy layout's."""
    batches = gpt_batches(3)
    copy, asked = _build(kw, tmp_path, "copy"), _build(kw, tmp_path, "from-master")
    try:
        assert not _derived(asked)
        report = asked.plan.report()
        assert report["params_from_master"] == 0 and why in report["params_copy_why"]
        assert copy.plan.report()["params_copy_why"] == ""
        assert_trains_alike(asked, copy, batches)
    finally:
        copy.close()
        asked.close()


def test_checkpoint_resume_across_layouts(tmp_path):
    """A checkpoint written from the master loads into either layout; training on equals an
    engine that never stopped."""
    kw = dict(BF16, grad_accum=2, grad_clip=0.5)

    def same_working(again, plain):
        assert [torch.equal(a, b) for a, b in zip(_working_params(again), _working_params(plain))] \
            == [True] * len(again.group.chunks)
    check_resume_across_layouts(lambda layout, model=None: _build(kw, tmp_path, layout, model=model),
                                "copy", "from-master", tmp_path / "ckpt", also=same_working)


def test_park_and_resume(tmp_path):
    """Parking drops the device copies made from the master (nothing to write back); after
    resume they are made again from the master and training goes on as without the park."""
    batches = gpt_batches(6)
    plain, parked = _build(BF16, tmp_path, "copy"), _build(BF16, tmp_path, "from-master")
    try:
        want = train_engine(plain, batches, gpt_loss)
        got = train_engine(parked, batches[:3], gpt_loss)
        parked.park("cpu")
        assert parked.store.bytes(Tier.GPU) == 0  # the casts' copies dropped, nothing written back
        parked.resume()
        got += train_engine(parked, batches[3:], gpt_loss)
        assert got == want
        assert_same_state(engine_state(parked), engine_state(plain))
        _homes_match_the_plan(parked)
    finally:
        plain.close()
        parked.close()


def test_auto_keeps_the_copy_where_host_memory_does_not_bind(tmp_path):
    engine = _build(BF16, tmp_path, "auto")
    try:
        assert engine.plan.request.host_params == "copy" and not _derived(engine)
        assert zo.OffloadConfig().host_params == "auto"  # the default: unchanged where memory is plenty
    finally:
        engine.close()


def test_auto_makes_params_from_the_master_where_it_keeps_state_out_of_nvme(tmp_path):
    """A host budget that holds all the state only without the params' copy (and with the
    persistent grads: the window is tried first and does not suffice): "auto" makes them from
    the master, keeps the state in host memory, and trains as the copy does with room to spare."""
    kw = dict(params="cpu", optimizer="auto", dtype="bf16", nvme_dir=str(tmp_path / "swap"), host_grads="persistent")
    probe = _build(kw, tmp_path, "from-master")
    request = probe.plan.request
    probe.close()
    budget = least_host_budget(request)
    assert budget < least_host_budget(dataclasses.replace(request, host_params="copy"))
    engine = _build({**kw, "cpu_budget": budget}, tmp_path, "auto")
    plain = _build(kw, tmp_path, "copy")
    try:
        assert engine.plan.request.host_params == "from-master" and engine.plan.need[Tier.NVME] == 0
        _assert_from_master(engine)
        assert_spills_or_fails(engine.plan.request, host_params="copy")
        assert_trains_alike(engine, plain, gpt_batches(3))
        _homes_match_the_plan(engine)
    finally:
        engine.close()
        plain.close()


# ---- the plan, as a pure function -------------------------------------------------------------

def _request(**kw) -> PlacementRequest:
    chunks = [ChunkNeed(numel=8192, dtype=torch.bfloat16) for _ in range(4)] + \
        [ChunkNeed(numel=8192, dtype=torch.bfloat16, trainable=False)]
    base = dict(chunks=chunks, budgets=Budgets(gpu=1 << 26, cpu=1 << 26), params=Placement.CPU,
                optimizer=Placement.CPU, rule=AdamRule(), prefetch_depth=1, host_params="from-master")
    return PlacementRequest(**{**base, **kw})


def test_plan_counts_no_host_bytes_for_params_from_the_master():
    copy = plan_placement(_request(host_params="copy"))
    derived = plan_placement(_request())
    assert [h.from_master for h in derived.homes] == [True] * 4 + [False]  # (frozen: no master)
    assert "frozen" in derived.params_why
    assert copy.need[Tier.CPU] - derived.need[Tier.CPU] == 4 * 8192 * 2
    # the device holds the fp32 staging of the casts, counted in the plan
    assert derived.need[Tier.GPU] - copy.need[Tier.GPU] == 2 * 8192 * 4
    specs = derived.payloads(0)
    assert specs["params"].source == "master" and specs["master"].home is Tier.CPU
    assert derived.payloads(4)["params"].source is None
    # the report counts host bytes of the frozen chunk's params only
    tiers = [p.report()["tiers"]["cpu"]["params"] for p in (copy, derived)]
    assert tiers == [5 * 8192 * 2, 8192 * 2]


def test_plan_auto_chooses_the_copy_first_and_raises_the_least_hungry_layouts_error():
    assert plan_placement(_request(host_params="auto")).request.host_params == "copy"
    need = plan_placement(_request()).need[Tier.CPU]
    tight = _request(host_params="auto", budgets=Budgets(gpu=1 << 26, cpu=need))
    assert plan_placement(tight).request.host_params == "from-master"
    with pytest.raises(FitError, match="cpu_budget"):
        plan_placement(dataclasses.replace(tight, budgets=Budgets(gpu=1 << 26, cpu=need - 4096)))


def test_plan_auto_params_on_the_host_from_the_master():
    """"auto" params that do not fit the device go to host memory where their state does (no
    bytes of their own there), not to NVMe, in a host budget the copies would not fit."""
    gpu = (1 + 3 + 2) * 8192 * 2 + 3 * 8192 * 2 + 2 * 8192 * 4  # working window + the casts' staging
    free = plan_placement(_request(params=Placement.AUTO, optimizer=Placement.AUTO,
                                   budgets=Budgets(gpu=gpu, cpu=1 << 26)))
    assert [h.params for h in free.homes] == [Tier.CPU] * 5 and free.need[Tier.GPU] == gpu
    staging = 2 * (8192 * 2 + 3 * 8192 * 4)  # (prefetch_depth + 1) chunks of params and state
    request = _request(params=Placement.AUTO, optimizer=Placement.AUTO, nvme_dir="/tmp",
                       budgets=Budgets(gpu=gpu, cpu=free.need[Tier.CPU] + staging, nvme=1 << 30))
    plan = plan_placement(request)
    assert [h.from_master for h in plan.homes] == [True] * 4 + [False] and plan.need[Tier.NVME] == 0
    assert all(h.params is Tier.CPU and h.optimizer in (Tier.CPU, None) for h in plan.homes)
    # the copy, with the same room for params on the device (none), spills state to NVMe
    spill = plan_placement(dataclasses.replace(request, host_params="copy", budgets=dataclasses.replace(
        request.budgets, gpu=gpu - 2 * 8192 * 4)))
    assert [h.params for h in spill.homes] == [Tier.CPU] * 5 and spill.need[Tier.NVME] > 0


def test_request_checks_host_params():
    with pytest.raises(ValueError, match="host_params must be"):
        _request(host_params="master")
    with pytest.raises(ValueError, match="pages the params"):
        _request(params=None)
    with pytest.raises(ValueError, match="host_params"):
        zo.OffloadConfig(host_params="derived")


# ---- two ranks (gloo) -------------------------------------------------------------------------

def _rank(rank, world, kw, steps, accum):
    from zero_offload.runtime.store import Tier
    from _engine_util import rank_engine
    out = {}
    for host_params in ("copy", "from-master"):
        engine, losses = rank_engine(SPEC, rank, world, steps=steps, accum=accum,
                                     **{"dtype": "bf16", "host_params": host_params, **kw})
        derived = sum(engine.store.derived(c.cid, "params") for c in engine.group.chunks)
        working = []
        for c in engine.group.chunks:
            with engine.store.use(c.cid, "params", Tier.GPU) as buf:
                working.append(buf.clone())
        plan = engine.plan
        out[host_params] = (losses, engine.state_dict(), derived, working,
                            engine.store.bytes(Tier.CPU) == plan.need[Tier.CPU] - plan.working[Tier.CPU])
        engine.close()
    return out


@pytest.mark.parametrize("kw,accum", [({}, 1), (dict(grad_accum=2), 2), (dict(grad_clip=0.05), 1)],
                         ids=["plain", "accum", "clip"])
def test_two_ranks(kw, accum, tmp_path, monkeypatch):
    """Each rank casts its shard of the master; the all-gather moves the working dtype as with
    the copy; the steps equal the copy's bit for bit and torch's recipe."""
    kw = {k: v for k, v in kw.items() if k != "grad_accum"}
    results = run_ranks(_rank, 2, tmp_path, kw, 3, accum, timeout_s=180)
    for r in results:
        assert "error" not in r, r.get("traceback", r)
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")  # the ranks compute on the CPU (gloo)
    ref = Reference(micro_gpt(), SPEC, accum=2 * accum, grad_clip=kw.get("grad_clip"), dtype=torch.bfloat16)
    for x, y in gpt_batches(3 * accum, batch=4):
        for r in range(2):
            ref.step((x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]), gpt_loss)
    for r in results:
        v = r["value"]
        (lc, sdc, dc, wc, okc), (lm, sdm, dm, wm, okm) = v["copy"], v["from-master"]
        assert dc == 0 and dm >= 1 and okc and okm
        assert lc == lm
        for k in sdc:
            assert torch.equal(sdc[k], sdm[k]), k
        for a, b in zip(wc, wm):
            assert torch.equal(a, b)
        assert_params_close(sdm, ref.master_state(), rtol=3e-2)


# ---- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kw", [dict(), dict(grad_clip=0.05), dict(grad_accum=2), dict(host_grads="window")],
                         ids=["plain", "clip", "accum", "grads-window"])
def test_cuda_from_master_equals_the_copy_and_torch(kw):
    """On CUDA (pinned master, fp32 staging and the cast on the store's H2D stream): the steps
    equal the copy layout's bit for bit, and plain torch's bf16 recipe on the same GPU; the
    device's peak stays within the budget (the staging counted)."""
    from _engine_util import reference_bf16, rel_err
    accum = kw.get("grad_accum", 1)
    model = micro_gpt(d_model=32)
    batches = gpt_batches(6 * accum)
    engines = {}
    try:
        for h in ("copy", "from-master"):
            cfg = zo.OffloadConfig(params="cpu", optimizer="cpu", dtype="bf16", chunk_mb=8192 / 2**20,
                                   gpu_budget=1 << 20, cpu_budget=1 << 28, host_params=h, **kw)
            engines[h] = zo.initialize(micro_gpt(d_model=32), optimizer=SPEC, config=cfg, device="cuda")
        _assert_from_master(engines["from-master"])
        losses = {h: train_engine(e, batches, gpt_loss, accum=accum) for h, e in engines.items()}
        assert losses["copy"] == losses["from-master"]
        assert_same_state(engine_state(engines["from-master"]), engine_state(engines["copy"]))
        for a, b in zip(*(_working_params(e) for e in engines.values())):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        _homes_match_the_plan(engines["from-master"])
        assert engines["from-master"].stats().peak_bytes["gpu"] <= 1 << 20
        if accum == 1 and "grad_clip" not in kw:
            _, masters = reference_bf16(model, SPEC, batches)
            sd = engines["from-master"].state_dict()
            assert max(rel_err(sd[n], v) for n, v in masters.items()) < 3e-2
    finally:
        for e in engines.values():
            e.close()
