"""Shared by tests of the step pipeline's timing (runtime/pipeline.py)."""
import threading
import time

from zero_offload.runtime.pipeline import StepPipeline
from zero_offload.runtime.store import ChunkStore


def late_read_ahead(monkeypatch, *, timeout_s: float = 10.0) -> list:
    """Hold back the read-ahead the caller's thread issues when it queues a job ([Note: state
    read-ahead] in runtime/pipeline.py): before each of its fetches, until no job of that chunk is
    left (its update ran and dropped its host copies), as when a loaded machine takes the CPU
    from the caller between the queue's snapshot and the fetch. Returns the list of
    ``(cid, name)`` fetched so (filled as they are), to show that the race ran."""
    caller = threading.local()
    late = []
    read_ahead, fetch = StepPipeline._read_ahead, ChunkStore.fetch

    def held_back_read_ahead(self):
        caller.pipeline = self if threading.current_thread() is not self._thread else None
        try:
            read_ahead(self)
        finally:
            caller.pipeline = None

    def held_back_fetch(store, cid, name, tier):
        pipeline = getattr(caller, "pipeline", None)
        if pipeline is not None:
            deadline = time.monotonic() + timeout_s
            while pipeline.busy(cid) and time.monotonic() < deadline:
                time.sleep(0.001)
            if not pipeline.busy(cid):
                late.append((cid, name))
        return fetch(store, cid, name, tier)

    monkeypatch.setattr(StepPipeline, "_read_ahead", held_back_read_ahead)
    monkeypatch.setattr(ChunkStore, "fetch", held_back_fetch)
    return late
