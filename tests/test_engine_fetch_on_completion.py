"""[Note: fetch on completion] (engine.py): when the CPU-Adam worker finishes a chunk's update and
that chunk is within the params look-ahead window, its copy to the compute device is issued then,
by the worker, without the consumer asking: the next forward finds it fetched ahead. Also the
pipeline's job choice: a grad job whose grads are still in flight does not hold the worker."""
import threading
import time

import torch

import zero_offload as zo
from _engine_util import DEVICE, config, gpt_batches, gpt_loss, micro_gpt
from zero_offload.pipeline import Accumulate, GradJob, StepPipeline
from zero_offload.store import ChunkStore, Handle, PayloadSpec, Residency, StoreConfig, Tier


def _engine(**kw):
    return zo.initialize(micro_gpt(), optimizer=zo.AdamW(lr=3e-3), config=config(**kw), device=DEVICE)


def _on_device(engine, cid):
    return engine.store.state(cid, "params", Tier.GPU) in (Residency.VALID, Residency.LOADING)


def _train_then_look(overlap: bool):
    engine = _engine(overlap=overlap, prefetch_depth=2)
    try:
        batches = gpt_batches(3)
        for b in batches[:2]:  # the first pass records the order; the second uses it
            engine.backward(gpt_loss(engine, b))
            engine.step()
        engine.pipeline.drain()  # every update done; no forward has asked for anything yet
        order = engine.prefetcher.order
        first = list(dict.fromkeys(order))[:2]
        fetched = [_on_device(engine, cid) for cid in first]
        engine.reset_stats()
        engine.backward(gpt_loss(engine, batches[2]))
        engine.step()
        st = engine.stats()
        return first, fetched, st
    finally:
        engine.close()


def test_updated_chunks_are_fetched_ahead_without_the_consumer_asking():
    for overlap in (True, False):
        first, fetched, st = _train_then_look(overlap)
        assert len(first) == 2
        # The look-ahead had stopped at these chunks while their updates were queued; the worker
        # issued their fetch once the update was done.
        assert all(fetched), (overlap, fetched)
        assert st.prefetch_ahead_rate > 0 and st.prefetch_hit_rate > 0, (overlap, st)


def test_fetch_on_completion_keeps_results_exact():
    sds = []
    for on in (True, False):
        engine = _engine(prefetch_depth=2)
        if not on:
            engine.pipeline.on_chunk_idle = None
        for b in gpt_batches(3):
            engine.backward(gpt_loss(engine, b))
            engine.step()
        sds.append(engine.state_dict())
        engine.close()
    for k in sds[0]:
        assert torch.equal(sds[0][k], sds[1][k]), k


def test_drain_waits_for_the_workers_chunk_idle_calls():
    # The worker calls on_chunk_idle (the fetch on completion) after taking the job off its
    # queue; drain used to return while such a call still ran, and Engine.close then freed the
    # chunk it was looking ahead at (a race seen in CI: "chunk 2 was discarded"). A slow call
    # makes the race certain.
    engine = _engine(prefetch_depth=2)
    calls = {"started": 0, "finished": 0}
    notify = engine.pipeline.on_chunk_idle

    def slow(cid):
        calls["started"] += 1
        time.sleep(0.05)
        notify(cid)
        calls["finished"] += 1

    engine.pipeline.on_chunk_idle = slow
    try:
        for b in gpt_batches(2):
            engine.backward(gpt_loss(engine, b))
            engine.step()
            engine.pipeline.drain()
            assert calls["started"] > 0 and calls["finished"] == calls["started"], calls
    finally:
        engine.close()


class _Gate:
    """A host-side move that completes when the test says so."""

    def __init__(self):
        self.ev = threading.Event()

    def done(self):
        return self.ev.is_set()

    def result(self):
        self.ev.wait()


def test_worker_runs_a_ready_job_before_one_whose_grads_are_in_flight():
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 20, "cpu": 1 << 24}))
    for _ in range(2):
        store.add_chunk({"grads": PayloadSpec(256, torch.float32, Tier.CPU),
                         "accum": PayloadSpec(256, torch.float32, Tier.CPU)})
    order = []
    gate = _Gate()
    pipe = StepPipeline(store, payloads=zo.pipeline.PipelinePayloads(accum="accum"), threads=1)
    try:
        orig = pipe._grads

        def grads(job):
            order.append(job.cid)
            orig(job)
        pipe._grads = grads
        with pipe._cv:  # queue both before the worker looks (a reentrant lock): chunk 0 ranks first
            pipe.submit_grads(GradJob(cid=0, ready=Handle(host=gate), accumulate=Accumulate.COPY), priority=0)
            pipe.submit_grads(GradJob(cid=1, ready=Handle.completed(), accumulate=Accumulate.COPY), priority=1)
        # chunk 1's grads are in: it runs while chunk 0's move is still in flight
        deadline = threading.Event()
        for _ in range(200):
            if order:
                break
            deadline.wait(0.01)
        gate.ev.set()
        pipe.wait_grads()
    finally:
        pipe.close()
        store.close()
    assert order == [1, 0], order
