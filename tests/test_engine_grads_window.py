"""The grads window ([Note: grads window] in runtime/chunk_group.py, ``OffloadConfig.host_grads``):
grads of the chunks updated on the host pass through a bounded window of slots instead of a host
buffer per chunk. The steps equal, bit for bit, those of the persistent layout (the same update
on the same bytes), and plain torch's AdamW, in every recipe: params paged or homed on the
device, the optimizer's GPU share beside it, NVMe, bf16 / fp32 / fp16 (overflow skips),
accumulation on the host or on the device, clipping, a tied head read functionally, params read
by a parent module, a window of one slot, two ranks (gloo), checkpoints and park/resume. The
window's slots are all back after every step, and the store never holds grads per chunk."""
import time

import pytest
import torch

import zero_offload as zo
from zero_offload.runtime.placement import Measured, host_window
from zero_offload.runtime.store import Residency, Tier
from _dist_util import run_ranks
from _pipeline_util import late_read_ahead
from _engine_util import (DEVICE, Reference, assert_host_homes_match_the_plan, assert_spills_or_fails, assert_trains_alike, build_layout, assert_params_close, assert_same_state, config,
                          check_resume_across_layouts, engine_state, least_host_budget, gpt_batches, gpt_loss, micro_gpt,
                          train_engine)
import _external_util as ext

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
PARTIAL = 250_000
"""gpu_budget (bytes) giving some of the micro GPT's chunks to the device share."""

RECIPES = {
    "params-cpu": dict(params="cpu", optimizer="cpu"),
    "params-cpu-bf16": dict(params="cpu", optimizer="cpu", dtype="bf16"),
    "params-gpu-bf16": dict(params="gpu", optimizer="cpu", dtype="bf16"),
    "share-partial": dict(params="gpu", optimizer="auto", gpu_budget=PARTIAL),
    "auto-bf16": dict(params="auto", optimizer="auto", gpu_budget=PARTIAL, dtype="bf16"),
    "nvme": dict(params="nvme", optimizer="nvme"),
    "accum-every": dict(params="cpu", optimizer="cpu", grad_accum=3),
    "accum-final": dict(params="cpu", optimizer="cpu", grad_accum=3, grad_sync="final"),
    "clip": dict(params="cpu", optimizer="cpu", grad_clip=0.05),
    "clip-accum": dict(params="cpu", optimizer="cpu", grad_clip=0.05, grad_accum=2),
    "no-overlap": dict(params="cpu", optimizer="cpu", overlap=False),
    "fp16": dict(params="cpu", optimizer="cpu", dtype="fp16", initial_scale=2.0 ** 40,
                 growth_interval=2),
    "one-slot": dict(params="cpu", optimizer="cpu", grads_window=1),
    "one-slot-accum": dict(params="gpu", optimizer="cpu", grads_window=1, grad_accum=2),
}


def _build(kw, tmp_path, host_grads, model=None):
    return build_layout(kw, tmp_path, spec=SPEC, model=model, host_grads=host_grads)


def _host_chunks(engine) -> list:
    return [c for c in engine.group.chunks if c.layout.trainable and not engine.group._on_device(c)]


def _assert_window_layout(engine) -> None:
    """Grads of host-updated chunks are transient (no host buffer of their own), and between
    steps none holds a slot."""
    store = engine.store
    host = _host_chunks(engine)
    assert host, "the recipe must update some chunks on the host"
    assert engine.plan.request.host_grads == "window" and engine.plan.grads_window >= 1
    for c in host:
        assert store.windowed(c.cid, "grads")
        assert store.state(c.cid, "grads", Tier.CPU) is Residency.ABSENT
    assert store.window.taken == 0
    assert 1 <= store.window.made <= engine.plan.grads_window  # grads went through it


@pytest.mark.parametrize("name", list(RECIPES))
def test_window_equals_persistent_bit_for_bit(name, tmp_path):
    kw = RECIPES[name]
    accum = kw.get("grad_accum", 1)
    batches = gpt_batches(4 * accum)
    plain, windowed = _build(kw, tmp_path, "persistent"), _build(kw, tmp_path, "window")
    try:
        assert plain.plan.request.host_grads == "persistent" and plain.plan.grads_window == 0
        want = train_engine(plain, batches, gpt_loss, accum=accum)
        got = []
        for i in range(0, len(batches), accum):  # the window is empty after every step
            got += train_engine(windowed, batches[i:i + accum], gpt_loss, accum=accum)
            windowed.synchronize()
            _assert_window_layout(windowed)
        assert got == want
        assert_same_state(engine_state(windowed), engine_state(plain))
        if "nvme" not in kw.values():  # (NVMe: cache copies in host memory beside the homes)
            _homes_match_the_plan(plain)
            _homes_match_the_plan(windowed)
        if kw.get("dtype") == "fp16":
            assert windowed.skipped_steps >= 1  # the overflow path ran (and gave its slots back)
        if kw.get("grad_clip") is not None and accum == 1 or kw.get("overlap") is False:
            # the updates wait for the decision and read the grads: the window holds them all
            assert windowed.plan.grads_window == len([c for c in windowed.partition.chunks if c.trainable])
        elif "grads_window" in kw:
            assert windowed.plan.grads_window == kw["grads_window"]
        # host memory: the window instead of a grads buffer per host-updated chunk
        grads = sum(windowed.store.payload_spec(c.cid, "grads").nbytes for c in _host_chunks(windowed))
        assert plain.plan.need[Tier.CPU] - windowed.plan.need[Tier.CPU] >= grads - \
            windowed.plan.working[Tier.CPU] - 4096 * len(windowed.partition.chunks)
    finally:
        plain.close()
        windowed.close()


@pytest.mark.parametrize("name", ["params-cpu", "clip", "accum-every", "one-slot"])
def test_window_matches_torch(name, tmp_path):
    kw = RECIPES[name]
    accum = kw.get("grad_accum", 1)
    batches = gpt_batches(5 * accum)
    ref = Reference(micro_gpt(), SPEC, accum=accum, grad_clip=kw.get("grad_clip"))
    engine = _build(kw, tmp_path, "window")
    try:
        train_engine(engine, batches, gpt_loss, accum=accum)
        for b in batches:
            ref.step(b, gpt_loss)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()


@pytest.mark.parametrize("reads", [("tied", "function"), ("shared", "bias")], ids="+".join)
def test_params_read_outside_their_module(reads, tmp_path):
    """A tied head read functionally, a param read by its parent (``ext.ExternalReads``): the
    same steps as the persistent layout and as torch."""
    model = ext.model(reads)
    ref = Reference(model, SPEC, accum=2)
    engines = [zo.initialize(ext.model(reads), optimizer=SPEC, device=DEVICE,
                             config=config(host_grads=h, grad_accum=2, grads_window=2))
               for h in ("persistent", "window")]
    try:
        batches = ext.batches(6)
        losses = [train_engine(e, batches, ext.loss_fn, accum=2) for e in engines]
        assert losses[0] == losses[1]
        assert_same_state(engine_state(engines[1]), engine_state(engines[0]))
        for b in batches:
            ref.step(b, ext.loss_fn)
        assert_params_close(engines[1].state_dict(), ref.master_state(), rtol=1e-5)
        _assert_window_layout(engines[1])
    finally:
        for e in engines:
            e.close()


def test_checkpoint_resume_across_layouts(tmp_path):
    """A checkpoint written with the window loads into either layout; training on equals an
    engine that never stopped."""
    kw = dict(params="cpu", optimizer="cpu", dtype="bf16", grad_accum=2)
    check_resume_across_layouts(lambda layout, model=None: _build(kw, tmp_path, layout, model=model),
                                "persistent", "window", tmp_path / "ckpt")


@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_park_and_resume(target, tmp_path):
    kw = dict(params="gpu", optimizer="auto", gpu_budget=PARTIAL, dtype="bf16", nvme_dir=str(tmp_path / "s"))
    batches = gpt_batches(6)
    plain, parked = _build(kw, tmp_path, "persistent"), _build(kw, tmp_path, "window")
    try:
        want = train_engine(plain, batches, gpt_loss)
        got = train_engine(parked, batches[:3], gpt_loss)
        parked.park(target)
        parked.resume()
        got += train_engine(parked, batches[3:], gpt_loss)
        assert got == want
        assert_same_state(engine_state(parked), engine_state(plain))
        parked.synchronize()
        _assert_window_layout(parked)
    finally:
        plain.close()
        parked.close()


def test_auto_keeps_persistent_where_host_memory_does_not_bind(tmp_path):
    engine = _build(RECIPES["params-cpu"], tmp_path, "auto")
    try:
        assert engine.plan.request.host_grads == "persistent" and engine.plan.grads_window == 0
        assert not engine.store.windowed(0, "grads")
    finally:
        engine.close()


def _least_host_budget(kw, tmp_path, host_grads) -> int:
    """The smallest cpu_budget (in 4 KiB steps) at which ``host_grads``'s plan keeps every chunk's
    state in host memory."""
    probe = _build(kw, tmp_path, host_grads)
    request = probe.plan.request
    probe.close()
    return least_host_budget(request)


def test_auto_takes_the_window_where_it_keeps_state_out_of_nvme(tmp_path):
    """A host budget that holds all the state only without a grads buffer per chunk: "auto"
    takes the window (no state on NVMe), where the persistent layout spills or does not fit,
    and trains as the persistent layout does with room to spare."""
    kw = dict(params="cpu", optimizer="auto", nvme_dir=str(tmp_path / "swap"), grads_window=2)
    budget = _least_host_budget(kw, tmp_path, "window")
    assert budget < _least_host_budget(kw, tmp_path, "persistent")
    engine = _build({**kw, "cpu_budget": budget}, tmp_path, "auto")
    plain = _build(kw, tmp_path, "persistent")
    try:
        assert engine.plan.request.host_grads == "window" and engine.plan.need[Tier.NVME] == 0
        assert_spills_or_fails(engine.plan.request, host_grads="persistent")
        assert plain.plan.need[Tier.NVME] == 0
        assert_trains_alike(engine, plain, gpt_batches(3))
    finally:
        engine.close()
        plain.close()


def test_auto_never_takes_a_window_that_must_hold_every_chunk(tmp_path):
    """With clipping and no accumulation buffer every chunk's grads wait for the decision: the
    window would hold them all, so "auto" keeps the layout that never waits."""
    kw = dict(params="cpu", optimizer="auto", nvme_dir=str(tmp_path / "swap"), grad_clip=1.0)
    engine = _build({**kw, "cpu_budget": _least_host_budget(kw, tmp_path, "window") - 4096}, tmp_path, "auto")
    try:
        assert engine.plan.request.host_grads == "persistent"
    finally:
        engine.close()


@pytest.mark.parametrize("host_grads", ["persistent", "window"])
def test_grads_waiting_for_the_decision_are_dropped_whole(host_grads, tmp_path):
    """Clipping: the grads wait (in the window: holding its slots) for step()'s decision; a
    checkpoint loaded instead drops them, their slots and their sum of squares (which the next
    step's clipping norm used to include, in either layout), and training on equals the
    uninterrupted run."""
    kw = dict(params="cpu", optimizer="cpu", grad_clip=0.05)
    batches = gpt_batches(4)
    plain = _build(kw, tmp_path, host_grads)
    try:
        want = train_engine(plain, batches[:2], gpt_loss)
        plain.save_checkpoint(tmp_path / "ckpt")
        want += train_engine(plain, batches[2:], gpt_loss)
        engine = _build(kw, tmp_path, host_grads)
        try:
            got = train_engine(engine, batches[:2], gpt_loss)
            engine.backward(gpt_loss(engine, batches[3]))  # grads wait for step()
            engine.synchronize()
            if host_grads == "window":
                assert engine.store.window.taken == len(_host_chunks(engine))
            engine.load_checkpoint(tmp_path / "ckpt")
            assert engine.store.window.taken == 0
            got += train_engine(engine, batches[2:], gpt_loss)
            assert got == want
            assert_same_state(engine_state(engine), engine_state(plain))
        finally:
            engine.close()
    finally:
        plain.close()


def test_a_window_too_small_for_the_decision_raises_instead_of_hanging(tmp_path):
    """Were the plan to give fewer slots than the grads that wait for the decision, backward
    raises naming the problem (nothing would ever free a slot)."""
    engine = _build(dict(params="cpu", optimizer="cpu", grad_clip=0.05), tmp_path, "window")
    try:
        engine.store.window.slots = 1  # (what a wrong plan would give)
        with pytest.raises(RuntimeError, match=r"grads window's 1 slot\(s\) all hold grads that no queued update"):
            engine.backward(gpt_loss(engine, gpt_batches(1)[0]))
    finally:
        engine.close()


def test_backward_waits_for_a_slot_when_the_updates_fall_behind(tmp_path, monkeypatch):
    """One slot and slow host updates (each held 20 ms): backward waits for the slot (the wait is
    counted), and the steps still equal the persistent layout's."""
    from zero_offload.runtime import pipeline
    launch = pipeline.StepPipeline._launch

    def slow(self, job, run):
        time.sleep(0.02)
        return launch(self, job, run)

    kw = dict(params="cpu", optimizer="cpu", grads_window=1)
    batches = gpt_batches(3)
    plain = _build(kw, tmp_path, "persistent")
    want = train_engine(plain, batches, gpt_loss)
    monkeypatch.setattr(pipeline.StepPipeline, "_launch", slow)
    engine = _build(kw, tmp_path, "window")
    try:
        assert train_engine(engine, batches, gpt_loss) == want
        assert_same_state(engine_state(engine), engine_state(plain))
        stats = engine.stats()
        assert stats.grads_window_wait_s > 0.02 and stats.update_stall_s >= stats.grads_window_wait_s
    finally:
        engine.close()
        plain.close()


def _homes_match_the_plan(engine) -> None:
    """The store holds the plan's host homes; the working bytes are the window's."""
    assert_host_homes_match_the_plan(engine)
    assert engine.plan.working[Tier.CPU] == host_window(engine.plan.request)[1]


@pytest.mark.parametrize("fail", [False, True], ids=["grown", "fell-back"])
def test_the_share_grows_out_of_the_window(fail, tmp_path, monkeypatch):
    """The GPU share grown after a measured step (and a move that fails part-way, falling back):
    the chunks leaving the window are updated on the device, the rest keep passing through it,
    the plan's host bytes stay the store's, and the steps equal the persistent layout's."""
    kw = dict(params="auto", optimizer="auto", gpu_budget=1 << 20, activation_reserve=(1 << 20) - 140_000)
    batches = gpt_batches(4)
    engines = {h: _build(kw, tmp_path, h) for h in ("persistent", "window")}
    try:
        losses = {}
        for h, engine in engines.items():
            before = len(_host_chunks(engine))
            assert before > 2
            losses[h] = train_engine(engine, batches[:1], gpt_loss)
            _homes_match_the_plan(engine)
            real, calls = engine.store.rehome, []

            def rehome(cid, name, tier, real=real, calls=calls, **kw):
                calls.append(cid)
                if fail and len(set(calls)) == 2 and name == "exp_avg_sq":
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")
                return real(cid, name, tier, **kw)

            monkeypatch.setattr(engine.store, "rehome", rehome)
            plan = engine.grow_share(Measured(device_limit=1 << 40, device_peak=0, margin=0))
            monkeypatch.setattr(engine.store, "rehome", real)
            assert bool(plan.fell_back) == fail and len(_host_chunks(engine)) == (before - 1 if fail else 0)
            _homes_match_the_plan(engine)
            losses[h] += train_engine(engine, batches[1:], gpt_loss)
            _homes_match_the_plan(engine)
        assert losses["window"] == losses["persistent"]
        assert_same_state(engine_state(engines["window"]), engine_state(engines["persistent"]))
        if fail:
            _assert_window_layout(engines["window"])
    finally:
        for e in engines.values():
            e.close()


@pytest.mark.parametrize("host_grads", ["persistent", "window"])
def test_a_late_read_ahead_leaves_no_host_copy(host_grads, tmp_path, monkeypatch):
    """[Note: state read-ahead] in runtime/pipeline.py: the caller's read-ahead of a chunk's
    master (homed on the device, updated on the host) fetched only once that chunk's update has
    run and dropped its host copy (the caller lost the CPU meanwhile) is dropped too: between
    steps the store holds exactly the plan's host homes (test_the_share_grows_out_of_the_window
    failed so under load, one chunk's payload over), and the steps are unchanged."""
    kw = dict(params="gpu", optimizer="cpu")
    batches = gpt_batches(3)
    plain = _build(kw, tmp_path, host_grads)
    want = train_engine(plain, batches, gpt_loss)
    late = late_read_ahead(monkeypatch)
    engine = _build(kw, tmp_path, host_grads)
    try:
        got = []
        for b in batches:
            got += train_engine(engine, [b], gpt_loss)
            _homes_match_the_plan(engine)
        assert late  # the race ran: fetches after the updates they read ahead for
        assert got == want
        assert_same_state(engine_state(engine), engine_state(plain))
    finally:
        engine.close()
        plain.close()


# ---- two ranks (gloo) -------------------------------------------------------------------------

def _rank(rank, world, kw, steps, accum):
    from _engine_util import rank_engine
    out = {}
    for host_grads in ("persistent", "window"):
        engine, losses = rank_engine(SPEC, rank, world, steps=steps, accum=accum,
                                     **{"host_grads": host_grads, **kw})
        out[host_grads] = (losses, engine.state_dict(), engine.plan.grads_window, engine.store.window.taken)
        engine.close()
    return out


@pytest.mark.parametrize("kw,accum", [({}, 1), (dict(grad_accum=2), 2), (dict(grad_clip=0.05), 1),
                                      (dict(params="gpu", dtype="bf16", grads_window=1), 1)],
                         ids=["plain", "accum", "clip", "params-gpu-bf16-one-slot"])
def test_two_ranks(kw, accum, tmp_path, monkeypatch):
    kw = {k: v for k, v in kw.items() if k != "grad_accum"}
    results = run_ranks(_rank, 2, tmp_path, kw, 3, accum, timeout_s=180)
    for r in results:
        assert "error" not in r, r.get("traceback", r)
    dtype = torch.bfloat16 if kw.get("dtype") == "bf16" else torch.float32
    # each rank's half of a batch is a micro-batch of the reference (the bf16 recipe sums the
    # halves' grads in fp32; the ranks average bf16 grads: test_engine_distributed's tolerance)
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")  # the ranks compute on the CPU (gloo)
    ref = Reference(micro_gpt(), SPEC, accum=2 * accum, grad_clip=kw.get("grad_clip"), dtype=dtype)
    for x, y in gpt_batches(3 * accum, batch=4):
        for r in range(2):
            ref.step((x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]), gpt_loss)
    for r in results:
        v = r["value"]
        (lp, sdp, wp, _), (lw, sdw, ww, taken) = v["persistent"], v["window"]
        assert wp == 0 and ww >= 1 and taken == 0
        assert lp == lw
        for k in sdp:
            assert torch.equal(sdp[k], sdw[k]), k
        assert_params_close(sdw, ref.master_state(), rtol=1e-5 if dtype is torch.float32 else 1e-2)
