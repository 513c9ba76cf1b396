"""The GPU share gives its room back in a step before the first measurement ([Note: unmeasured
share] in runtime/placement.py): before backward when the forward's reach says the device lacks
room (one and two ranks, the ranks evicting alike), and by running a forward that ran out of
memory again with the whole share on the host (one process); the measured step grows it back.
Trained against torch AdamW. The allocator is scripted (``FakeMemory``): on the CPU the "device"
tier is host memory with its own budget, the same code path as a GPU."""
import dataclasses
import weakref

import pytest
import torch

import zero_offload as zo
from zero_offload.runtime import placement
from zero_offload.runtime.placement import MARGIN_MIN, Measured
from zero_offload.runtime.store import Tier
from _dist_util import run_ranks, values
from _engine_util import Reference, assert_params_close, auto_config, gpt_batches, gpt_loss, micro_gpt

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
STEPS = 3
ALL = dict(gpu_budget=1 << 22)
"""A device tier whose first plan holds every chunk's params and state."""


@pytest.fixture(autouse=True)
def _reference_on_the_cpu(monkeypatch):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")


class FakeMemory:
    """The allocator as the engine reads it: the store's device tier is what is allocated, the
    forward reaches ``forward`` bytes above its start, and the limit leaves the backward ``short``
    bytes less than it needs (the margin is ``MARGIN_MIN`` at these sizes). ``measure`` gives
    room for every chunk and records the floor it was given."""

    def __init__(self, engine, *, short: int, forward: int = 1 << 20):
        self.engine, self.forward = engine, forward
        self.fixed_limit = engine.store.bytes(Tier.GPU) + MARGIN_MIN + forward - short
        self.released, self.restarts, self.floors = 0, 0, []

    def allocated(self):
        return self.engine.store.bytes(Tier.GPU)

    def peak_allocated(self):
        return self.allocated() + self.forward

    def peak_reserved(self):
        return self.peak_allocated()

    def limit(self):
        return self.fixed_limit

    def release(self):
        self.released += 1

    def restart_peaks(self):
        self.restarts += 1

    def measure(self, *, store_peak=0, floor=0):
        self.floors.append(floor)
        return Measured(device_limit=1 << 40, device_peak=floor, margin=0)


def _share(engine):
    """Chunk indices whose state is on the device, from the store."""
    return [i for i, c in enumerate(engine.group.chunks)
            if c.layout.trainable and engine.store.payload_spec(c.cid, "grads").home is Tier.GPU]


def _last_chunks_for(plan, nbytes):
    """The share's chunks, the last first, whose device bytes first reach ``nbytes``."""
    out, freed = [], 0
    share = [i for i, (c, h) in enumerate(zip(plan.request.chunks, plan.homes))
             if c.trainable and h.optimizer is Tier.GPU]
    for i in reversed(share):
        if freed >= nbytes:
            break
        out.append(i)
        freed += placement._share_bytes(plan.request.chunks[i], plan.request)
    return out


def _reference(batches):
    ref = Reference(micro_gpt(), SPEC)
    losses = [ref.step(b, gpt_loss) for b in batches]
    return ref.master_state(), losses


def test_backward_gets_the_room_the_forward_says_it_lacks_and_the_share_grows_back():
    batches = gpt_batches(STEPS, batch=2)
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**ALL), device="cpu")
    try:
        first = _share(engine)
        assert len(first) > 3, first
        short = placement._share_bytes(engine.plan.request.chunks[first[-1]], engine.plan.request) + 1
        expect = _last_chunks_for(engine.plan, short)
        assert len(expect) == 2, expect
        fake = engine._share.memory = FakeMemory(engine, short=short)
        peak_before = fake.peak_reserved()
        engine.backward(gpt_loss(engine, batches[0]))
        assert list(engine.plan.evicted) == expect and _share(engine) == sorted(set(first) - set(expect))
        assert fake.released == 1 and fake.restarts == 1 and "moved to host memory for the first step" in engine.plan.why
        left = placement.share_bytes(engine.plan, expect)
        engine.step()  # measured: every chunk back
        assert fake.floors == [peak_before - left], (fake.floors, peak_before, left)
        assert _share(engine) == first and sorted(engine.plan.grown) == sorted(expect)
        assert engine.stats().placement["evicted"] == 2
        for b in batches[1:]:
            engine.backward(gpt_loss(engine, b))
            engine.step()
        ref, _ = _reference(batches)
        assert_params_close(engine.state_dict(), ref, rtol=1e-5)
    finally:
        engine.close()


def test_backward_with_room_leaves_the_share_alone():
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**ALL), device="cpu")
    try:
        first = _share(engine)
        fake = engine._share.memory = FakeMemory(engine, short=-1)
        engine.backward(gpt_loss(engine, gpt_batches(1, batch=2)[0]))
        assert engine.plan.evicted == () and _share(engine) == first and fake.released == 0
        engine.step()
        assert fake.floors == [0]
    finally:
        engine.close()


def _oom_once(engine, alive=None):
    """The first forward runs out of memory in block 1, after block 0 drew a random number;
    returns the draws of block 0, one per forward. ``alive``: a list that gets, at each forward
    after the first, whether a tensor of the failed forward's frames is still held."""
    draws, calls, held = [], [], []

    def draw(module, args):
        draws.append(torch.rand(()).item())
        if held and alive is not None:
            alive.append(held[0]() is not None)

    def oom(module, args):
        calls.append(1)
        if len(calls) == 1:
            activation = torch.empty(1 << 10)  # (a local of the failing frame, as activations are)
            held.append(weakref.ref(activation))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine.module.blocks[0].register_forward_pre_hook(draw)
    engine.module.blocks[1].register_forward_pre_hook(oom)
    return draws


def test_a_forward_out_of_memory_runs_again_with_the_share_on_the_host():
    batches = gpt_batches(STEPS, batch=2)
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**ALL), device="cpu")
    try:
        first = _share(engine)
        fake = engine._share.memory = FakeMemory(engine, short=-1)
        alive = []
        draws = _oom_once(engine, alive)
        torch.manual_seed(7)
        with pytest.warns(UserWarning, match="the first forward ran out of CUDA memory"):
            loss = gpt_loss(engine, batches[0])
        assert len(draws) == 2 and draws[0] == draws[1], draws  # the retry drew what the first did
        assert alive == [False]  # the failed forward's tensors were let go before it ran again
        assert sorted(engine.plan.evicted) == first and _share(engine) == [] and fake.released == 1
        engine.backward(loss)
        engine.step()
        assert fake.floors == [0] and _share(engine) == first
        losses = [loss.item()]
        for b in batches[1:]:
            loss = gpt_loss(engine, b)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        ref, ref_losses = _reference(batches)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert_params_close(engine.state_dict(), ref, rtol=1e-5)
    finally:
        engine.close()


def test_a_forward_out_of_memory_the_host_cannot_help_raises_naming_the_reserve():
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**ALL), device="cpu")
    try:
        engine._share.memory = FakeMemory(engine, short=-1)
        plan = engine.plan  # a host budget with no room for any chunk's state
        budgets = dataclasses.replace(plan.budgets, cpu=plan.need[Tier.CPU])
        engine.plan = dataclasses.replace(plan, request=dataclasses.replace(plan.request, budgets=budgets))
        _oom_once(engine)
        with pytest.raises(torch.OutOfMemoryError, match="before the first was measured.*activation_reserve"):
            gpt_loss(engine, gpt_batches(1, batch=2)[0])
        assert engine.plan.evicted == ()
    finally:
        engine.close()


def test_shrink_share_stops_at_the_host_budget_and_grow_share_undoes_it():
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**ALL), device="cpu")
    try:
        plan = engine.plan
        one = placement.shrink_share(plan, 1)
        assert len(one.evicted) == 1 and one.homes[one.evicted[0]].optimizer is Tier.CPU
        assert placement.shrink_share(plan, 1 << 40, limit=3).evicted == tuple(_last_chunks_for(plan, 1 << 40)[:3])
        budgets = dataclasses.replace(plan.budgets, cpu=one.need[Tier.CPU])  # room for one chunk
        tight = dataclasses.replace(plan, request=dataclasses.replace(plan.request, budgets=budgets))
        got = placement.shrink_share(tight, 1 << 40)
        assert got.evicted == one.evicted and "does not fit the host budget" in got.why, got.why
        everything = placement.shrink_share(plan, 1 << 40)
        back = placement.grow_share(everything, Measured(device_limit=1 << 40, device_peak=0, margin=0))
        assert back.homes == plan.homes and back.need == plan.need
        assert sorted(back.grown) == sorted(everything.evicted)
    finally:
        engine.close()


def _rank(rank, world):
    """Rank 1's backward lacks one chunk's bytes, rank 0's nothing: both evict that chunk."""
    batches = gpt_batches(STEPS, batch=2 * world)
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**ALL), device="cpu")
    first = _share(engine)
    last = placement._share_bytes(engine.plan.request.chunks[first[-1]], engine.plan.request)
    fake = engine._share.memory = FakeMemory(engine, short=last if rank == 1 else -(1 << 30))
    for k, (x, y) in enumerate(batches):
        sl = slice(2 * rank, 2 * rank + 2)
        engine.backward(engine(x[sl], y[sl]))
        if k == 0:
            evicted, share = engine.plan.evicted, _share(engine)
        engine.step()
    out = (engine.state_dict(), first, evicted, share, _share(engine), fake.released)
    engine.close()
    return out


def test_two_ranks_evict_alike_for_the_larger_shortfall(tmp_path):
    out = values(run_ranks(_rank, 2, tmp_path, timeout_s=120))
    (sd0, first0, ev0, share0, after0, rel0), (sd1, first1, ev1, share1, after1, rel1) = out
    assert first0 == first1 and ev0 == ev1 == (first0[-1],) and share0 == share1 == first0[:-1]
    assert after0 == after1 == first0 and rel0 == rel1 == 1
    ref = Reference(micro_gpt(), SPEC)
    for b in gpt_batches(STEPS, batch=4):
        ref.step(b, gpt_loss)
    for sd in (sd0, sd1):
        assert_params_close(sd, ref.master_state(), rtol=1e-5)


def test_only_the_first_micro_batch_of_the_first_window_gives_room():
    """With grad_accum=2 the later micro-batches of the first window hold accumulated grads that
    a move would carry: the share gives room before the first backward only; then it is measured
    once, at the window's end, and grown back. Trained against torch with accumulation."""
    batches = gpt_batches(2 * STEPS, batch=2)
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=auto_config(**ALL, grad_accum=2), device="cpu")
    try:
        first = _share(engine)
        last = placement._share_bytes(engine.plan.request.chunks[first[-1]], engine.plan.request)
        fake = engine._share.memory = FakeMemory(engine, short=last)
        seen = []
        for b in batches:
            engine.backward(gpt_loss(engine, b) / 2)
            seen.append((len(engine.plan.evicted), fake.released, fake.restarts))
            engine.step()
        assert seen[:3] == [(1, 1, 1), (1, 1, 1), (1, 1, 1)], seen  # micro 1 and the next window: nothing
        assert len(fake.floors) == 1 and _share(engine) == first
        ref = Reference(micro_gpt(), SPEC, accum=2)
        for b in batches:
            ref.step(b, gpt_loss)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()
