"""Park and resume ([Note: parking] in runtime/parking.py): ``engine.park()`` moves every byte the
engine keeps on the compute device to host memory or NVMe, ``engine.resume()`` brings it back, and
the steps after the round trip equal, bit for bit, those of an engine that never parked, for
every placement the device can hold (params paged through it, params homed there, the
optimizer's GPU share partly and wholly, "auto") in fp32, bf16 and fp16, with accumulation and
clipping; and they equal plain torch. Refusals (mid-window, inside forward, parked twice, not
parked, closed, a bad target, no room) change nothing. While parked the state reads from where
it was parked (state_dict, gathered, checkpoints saved and loaded) and close works. In CI the
"device" is the CPU (its tier is host memory: the same code path); test_engine_park_gpu.py runs
the memory checks on CUDA."""
import psutil
import pytest
import torch

import zero_offload as zo
from zero_offload.runtime import parking
from zero_offload.runtime.store import Residency, Tier
from zero_offload.runtime.vocab import round_up
from _engine_util import (DEVICE, Reference, assert_params_close, assert_same_state, config, engine_state,
                          gpt_batches, gpt_loss, micro_gpt, train_engine)

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
PARTIAL, WHOLE = 250_000, 1_000_000
"""gpu_budget (bytes) giving some of the micro GPT's chunks to the device share / all of them."""

PLACEMENTS = {
    "params-cpu": dict(params="cpu", optimizer="cpu"),
    "params-gpu": dict(params="gpu", optimizer="cpu"),
    "share-partial": dict(params="gpu", optimizer="auto", gpu_budget=PARTIAL),
    "share-whole": dict(params="gpu", optimizer="auto", gpu_budget=WHOLE),
    "auto": dict(params="auto", optimizer="auto", gpu_budget=PARTIAL),
    "nvme": dict(params="nvme", optimizer="nvme"),
}


def _build(kw, tmp_path, seed=0):
    kw = dict(kw)
    if "nvme" in kw.values() or kw.pop("nvme_dir", False):
        kw["nvme_dir"] = str(tmp_path / "swap")
    return zo.initialize(micro_gpt(seed=seed), optimizer=SPEC, config=config(**kw), device=DEVICE)


def _round_trip_equals_no_park(kw, tmp_path, *, target, accum=1, before=2, after=2, check=None):
    """Train ``before`` steps, park, resume, train ``after``: the same losses and state as an
    engine that never parked. Returns the parked engine's state (open) for more checks."""
    batches = gpt_batches((before + after) * accum)
    plain, parked = _build(kw, tmp_path / "a"), _build(kw, tmp_path / "b")
    try:
        cut = before * accum
        want = train_engine(plain, batches, gpt_loss, accum=accum)
        got = train_engine(parked, batches[:cut], gpt_loss, accum=accum)
        on_device = parked.store.gpu_home_bytes()
        report = parked.park(target)
        assert parked.parked == target == report.where
        assert parked.store.bytes(Tier.GPU) == 0  # nothing left in the device's tier
        assert report.nbytes == on_device
        if check is not None:
            check(parked)
        back = parked.resume()
        assert parked.parked is None and back.nbytes == on_device
        assert parked.store.gpu_home_bytes() == on_device
        got += train_engine(parked, batches[cut:], gpt_loss, accum=accum)
        assert got == want
        assert_same_state(engine_state(parked), engine_state(plain))
        return parked, batches
    finally:
        plain.close()


@pytest.mark.parametrize("target", ["cpu", "nvme"])
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_a_round_trip_changes_nothing(name, target, tmp_path):
    kw = {**PLACEMENTS[name], "nvme_dir": target == "nvme"}
    engine, batches = _round_trip_equals_no_park(kw, tmp_path, target=target)
    try:
        ref = Reference(micro_gpt(), SPEC)  # and it is still plain torch's AdamW
        for b in batches:
            ref.step(b, gpt_loss)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()


@pytest.mark.parametrize("kw", [
    dict(PLACEMENTS["share-partial"], dtype="bf16"),
    dict(PLACEMENTS["params-gpu"], dtype="bf16"),
    dict(PLACEMENTS["share-partial"], grad_accum=2),
    dict(PLACEMENTS["share-whole"], grad_accum=2, grad_sync="final"),
    dict(PLACEMENTS["auto"], grad_clip=0.05),
    dict(PLACEMENTS["share-partial"], dtype="fp16", initial_scale=2.0 ** 20, growth_interval=2),
], ids=["bf16-share", "bf16-params-gpu", "accum", "accum-final", "clip", "fp16"])
def test_a_round_trip_changes_nothing_in_any_recipe(kw, tmp_path):
    engine, _ = _round_trip_equals_no_park(kw, tmp_path, target="cpu", accum=kw.get("grad_accum", 1),
                                           before=3, after=3)
    engine.close()


@pytest.mark.parametrize("keep", [False, True], ids=["free", "keep-host-memory"])
def test_many_round_trips_and_the_parking_memory_goes_back(keep, tmp_path):
    """Each resume frees the host memory the park took, or, with ``keep_host_memory``, keeps it
    for the next park, which takes no new memory (the same buffers), until a resume without it."""
    kw = dict(PLACEMENTS["share-partial"], nvme_dir=True)
    plain, parked = _build(kw, tmp_path), _build(kw, tmp_path)
    store = parked.store
    try:
        budgets, buffers, clean = dict(store.budgets), None, False
        for b in gpt_batches(4):
            for e in (plain, parked):
                e.backward(gpt_loss(e, b))
                e.step()
            parked.synchronize()
            homed = [(c.cid, n) for c in parked.group.chunks for n in ("params", "grads", "master", "exp_avg",
                                                                      "exp_avg_sq")
                     if store.has_payload(c.cid, n) and store.payload_spec(c.cid, n).home is Tier.GPU]
            # A host copy of a device-homed payload (a CPU update's staging, written home behind)
            # may still be there: the park takes it as the parked copy, the resume drops it.
            cached = sum(round_up(store.payload_spec(cid, n).nbytes) for cid, n in homed
                         if store.state(cid, n, "cpu") is not Residency.ABSENT)
            host = store.bytes(Tier.CPU)
            parked.park("cpu")
            assert store.bytes(Tier.CPU) == host - cached + store.gpu_home_bytes()
            assert store.spare_bytes() <= cached  # (a kept buffer of a payload that had a host copy)
            held = sorted(store.get(cid, n, "cpu").data_ptr() for cid, n in homed if n in ("params", "master"))
            if keep and clean and not cached:
                assert held == buffers  # the kept buffers, not new ones
            buffers, clean = held, not cached
            parked.resume(keep_host_memory=keep)
            assert store.bytes(Tier.CPU) == host - cached and store.budgets == budgets
            kept = store.spare_bytes()
            assert (store.gpu_home_bytes() - cached <= kept <= store.gpu_home_bytes()) if keep else kept == 0
        assert_same_state(engine_state(parked), engine_state(plain))
        if keep:
            parked.park("nvme")  # a park elsewhere lets the kept host memory go
            assert store.spare_bytes() == 0
            parked.resume(keep_host_memory=True)
            assert store.spare_bytes() == 0  # (nothing of an NVMe park is kept)
            parked.park("cpu")
            parked.resume()
            assert store.spare_bytes() == 0
    finally:
        plain.close()
        parked.close()


def test_nvme_parking_leaves_host_memory_alone_and_removes_its_file(tmp_path):
    kw = dict(PLACEMENTS["share-whole"], nvme_dir=True)

    def check(engine):
        assert engine.store.bytes(Tier.CPU) == 0  # the share is on disk, not in host memory
        assert engine.store.bytes(Tier.NVME) == engine.store.gpu_home_bytes()
        assert any(n.startswith("zero_offload-") for n in _listing(tmp_path / "b" / "swap"))

    engine, _ = _round_trip_equals_no_park(kw, tmp_path, target="nvme", check=check)
    try:
        assert engine.store.bytes(Tier.NVME) == 0
        assert not any(n.startswith("zero_offload-") for n in _listing(tmp_path / "b" / "swap"))
    finally:
        engine.close()


def _listing(path):
    import os
    return os.listdir(path) if os.path.isdir(path) else []


# ---- where "auto" parks ---------------------------------------------------------------------


def _host_memory(monkeypatch, available):
    real = psutil.virtual_memory()
    fake = real._replace(available=available)
    monkeypatch.setattr(parking.psutil, "virtual_memory", lambda: fake)


def test_auto_parks_on_the_host_when_it_holds_the_state(tmp_path):
    engine = _build(dict(PLACEMENTS["share-whole"], nvme_dir=True), tmp_path)
    try:
        assert engine.park().where == "cpu"
        engine.resume()
    finally:
        engine.close()


def test_auto_parks_on_nvme_when_host_memory_would_not_hold_it(tmp_path, monkeypatch):
    engine = _build(dict(PLACEMENTS["share-whole"], nvme_dir=True), tmp_path)
    try:
        _host_memory(monkeypatch, engine.store.gpu_home_bytes() // 2)
        assert engine.park().where == "nvme"
        assert engine.store.bytes(Tier.NVME) == engine.store.gpu_home_bytes()
        engine.resume()
    finally:
        engine.close()


def test_auto_without_nvme_and_no_room_refuses_naming_the_numbers(tmp_path, monkeypatch):
    engine = _build(PLACEMENTS["share-whole"], tmp_path)
    try:
        _host_memory(monkeypatch, 1000)
        with pytest.raises(MemoryError, match=r"engine.park: the device holds .* and host memory has "
                                              r"1000B available .*set OffloadConfig.nvme_dir"):
            engine.park()
        assert engine.parked is None and engine.store.bytes(Tier.GPU) == engine.store.gpu_home_bytes()
        with pytest.raises(MemoryError, match="park on 'nvme'"):
            engine.park("cpu")
    finally:
        engine.close()


# ---- refusals: one line, nothing changed ----------------------------------------------------


def _untouched(engine, kw, tmp_path, batches, done):
    """The engine refused; training on gives what an engine that was never asked gives."""
    plain = _build(kw, tmp_path / "plain")
    try:
        accum = kw.get("grad_accum", 1)
        train_engine(plain, batches, gpt_loss, accum=accum)
        train_engine(engine, batches[done:], gpt_loss, accum=accum)
        assert_same_state(engine_state(engine), engine_state(plain))
    finally:
        plain.close()


def test_park_mid_window_refuses_and_changes_nothing(tmp_path):
    kw = dict(PLACEMENTS["share-partial"], grad_accum=2)
    engine = _build(kw, tmp_path)
    batches = gpt_batches(4)
    try:
        train_engine(engine, batches[:1], gpt_loss, accum=2)  # 1 of 2 micro-batches
        held = engine.store.bytes(Tier.GPU)
        with pytest.raises(RuntimeError, match=r"^engine.park: 1 of 2 micro-batches of the accumulation "
                                               r"window are done; park after the engine.step\(\) that "
                                               r"ends the window$"):
            engine.park()
        assert engine.parked is None and engine.store.bytes(Tier.GPU) == held
        _untouched(engine, kw, tmp_path, batches, 1)
    finally:
        engine.close()


def test_park_with_grads_waiting_for_step_refuses(tmp_path):
    kw = PLACEMENTS["share-partial"]
    engine = _build(kw, tmp_path)
    batches = gpt_batches(3)
    try:
        engine.backward(gpt_loss(engine, batches[0]))
        with pytest.raises(RuntimeError, match=r"^engine.park: grads of a backward are waiting for step\(\)"):
            engine.park()
        engine.step()
        _untouched(engine, kw, tmp_path, batches, 1)
    finally:
        engine.close()


def test_park_inside_forward_refuses(tmp_path):
    engine = _build(PLACEMENTS["params-gpu"], tmp_path)
    errors = []

    def hook(module, args):
        try:
            engine.park()
        except RuntimeError as e:
            errors.append(str(e))
    handle = engine.module.blocks[0].register_forward_pre_hook(hook)
    try:
        loss = gpt_loss(engine, gpt_batches(1)[0])
        assert errors == ["engine.park: called during forward; park between steps (after engine.step())"]
        engine.backward(loss)
        engine.step()
        assert engine.parked is None
    finally:
        handle.remove()
        engine.close()


def test_training_calls_while_parked_refuse_and_resume_goes_on_exactly(tmp_path):
    kw = PLACEMENTS["auto"]
    engine = _build(kw, tmp_path)
    batches = gpt_batches(3)
    try:
        train_engine(engine, batches[:1], gpt_loss)
        engine.park()
        with pytest.raises(RuntimeError, match=r"^engine.forward: the engine is parked \(engine.park\(\) moved "
                                               r"its device state to cpu\); call engine.resume\(\) first$"):
            engine(*batches[1])
        with pytest.raises(RuntimeError, match=r"^engine.step: the engine is parked"):
            engine.step()
        with pytest.raises(RuntimeError, match=r"^engine.backward: the engine is parked"):
            engine.backward(torch.ones((), requires_grad=True))
        with pytest.raises(RuntimeError, match=r"^engine.park: the engine is parked already \(on cpu\); "
                                               r"call engine.resume\(\) first$"):
            engine.park()
        name = engine.partition.slots[0].name
        with pytest.raises(RuntimeError, match=f"parameter '{name}' was read .* outside the engine"):
            engine.module.get_parameter(name).sum()  # the guard answers as between steps
        engine.resume()
        with pytest.raises(RuntimeError, match=r"^engine.resume: the engine is not parked \(call "
                                               r"engine.park\(\) first\)$"):
            engine.resume()
        _untouched(engine, kw, tmp_path, batches, 1)
    finally:
        engine.close()


def test_bad_targets_refuse(tmp_path):
    engine = _build(PLACEMENTS["params-gpu"], tmp_path)
    try:
        with pytest.raises(ValueError, match=r"engine.park\(target='gpu'\): give one of 'auto', 'cpu', 'nvme'"):
            engine.park("gpu")
        with pytest.raises(ValueError, match=r"engine.park\(target='nvme'\): this engine has no NVMe tier; "
                                             r"set OffloadConfig.nvme_dir"):
            engine.park("nvme")
        assert engine.parked is None
    finally:
        engine.close()


def test_a_closed_engine_refuses(tmp_path):
    engine = _build(PLACEMENTS["params-gpu"], tmp_path)
    engine.close()
    for call in (engine.park, engine.resume):
        with pytest.raises(RuntimeError, match="this engine is closed"):
            call()


def test_a_failure_part_way_moves_everything_back(tmp_path, monkeypatch):
    """The third copy into host memory fails: what moved comes back, the park raises that error,
    and training goes on as if it had not been asked."""
    kw = PLACEMENTS["share-whole"]
    engine = _build(kw, tmp_path)
    batches = gpt_batches(3)
    store = engine.store
    try:
        train_engine(engine, batches[:1], gpt_loss)
        held, budgets = store.bytes(Tier.GPU), dict(store.budgets)
        real, calls = type(store)._alloc_memory, []

        def failing(self, copy):
            if copy.tier is Tier.CPU:
                calls.append(copy)
                if len(calls) == 3:
                    raise MemoryError("injected: no host memory")
            return real(self, copy)
        monkeypatch.setattr(type(store), "_alloc_memory", failing)
        with pytest.raises(MemoryError, match="injected"):
            engine.park("cpu")
        monkeypatch.undo()
        assert engine.parked is None and store.bytes(Tier.GPU) == held and store.budgets == budgets
        assert store.bytes(Tier.CPU) == 0
        _untouched(engine, kw, tmp_path, batches, 1)
    finally:
        engine.close()


def test_a_failed_resume_stays_parked_and_can_resume_later(tmp_path, monkeypatch):
    kw = PLACEMENTS["share-whole"]
    engine = _build(kw, tmp_path)
    batches = gpt_batches(3)
    store = engine.store
    try:
        train_engine(engine, batches[:1], gpt_loss)
        engine.park("cpu")
        parked_host = store.bytes(Tier.CPU)
        real, calls = type(store)._alloc_memory, []

        def failing(self, copy):
            if copy.tier is Tier.GPU:
                calls.append(copy)
                if len(calls) == 4:
                    raise MemoryError("injected: device out of memory")
            return real(self, copy)
        monkeypatch.setattr(type(store), "_alloc_memory", failing)
        with pytest.raises(MemoryError, match="injected"):
            engine.resume()
        monkeypatch.undo()
        assert engine.parked == "cpu" and store.bytes(Tier.GPU) == 0 and store.bytes(Tier.CPU) == parked_host
        with pytest.raises(RuntimeError, match="engine.forward: the engine is parked"):
            engine(*batches[1])
        engine.resume()
        _untouched(engine, kw, tmp_path, batches, 1)
    finally:
        engine.close()


# ---- while parked: the state reads and writes where it was parked ---------------------------


@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_state_reads_while_parked_equal_those_before(target, tmp_path):
    kw = dict(PLACEMENTS["share-partial"], nvme_dir=True)

    def check(engine):
        state = engine.state_dict()
        assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in state)
        with engine.gathered() as model:
            for name, p in model.named_parameters():
                assert torch.equal(p, before[name])
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        files = engine.save_weights(str(tmp_path / "weights"))
        assert files
        assert engine.store.bytes(Tier.GPU) == 0  # none of it brought anything back to the device

    engine = _build(kw, tmp_path / "b")
    batches = gpt_batches(4)
    try:
        train_engine(engine, batches[:2], gpt_loss)
        before = engine.state_dict()
        engine.park(target)
        check(engine)
        engine.resume()
        train_engine(engine, batches[2:], gpt_loss)
        loaded = _build(kw, tmp_path / "c", seed=5)  # the checkpoint saved while parked resumes
        try:
            loaded.load_checkpoint(str(tmp_path / "ckpt"))
            train_engine(loaded, batches[2:], gpt_loss)
            assert_same_state(engine_state(loaded), engine_state(engine))
        finally:
            loaded.close()
    finally:
        engine.close()


@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_a_checkpoint_loaded_while_parked_is_what_resume_brings_back(target, tmp_path):
    kw = dict(PLACEMENTS["share-partial"], nvme_dir=True)
    batches = gpt_batches(5)
    source = _build(kw, tmp_path / "a")
    try:
        train_engine(source, batches[:2], gpt_loss)
        source.save_checkpoint(str(tmp_path / "ckpt"))
        train_engine(source, batches[2:], gpt_loss)
        engine = _build(kw, tmp_path / "b", seed=7)
        try:
            train_engine(engine, batches[:1], gpt_loss)  # other values, on the device
            engine.park(target)
            engine.load_checkpoint(str(tmp_path / "ckpt"))
            engine.resume()
            train_engine(engine, batches[2:], gpt_loss)
            assert_same_state(engine_state(engine), engine_state(source))
        finally:
            engine.close()
    finally:
        source.close()


@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_close_while_parked_writes_the_values_back(target, tmp_path):
    engine = _build(dict(PLACEMENTS["share-partial"], nvme_dir=True), tmp_path)
    train_engine(engine, gpt_batches(2), gpt_loss)
    want = engine.state_dict()
    engine.park(target)
    engine.close()
    model = engine.module
    for name, value in model.state_dict().items():
        assert torch.equal(value.float().cpu(), want[name]), name
    assert not any(n.startswith("zero_offload-") for n in _listing(tmp_path / "swap"))


def test_close_without_write_back_while_parked_frees_everything(tmp_path):
    engine = _build(dict(PLACEMENTS["share-whole"], nvme_dir=True), tmp_path)
    train_engine(engine, gpt_batches(1), gpt_loss)
    engine.park("nvme")
    engine.close(write_back=False)
    assert not any(n.startswith("zero_offload-") for n in _listing(tmp_path / "swap"))
