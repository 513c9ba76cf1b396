"""Chrome-trace spans from every thread of a training step (cross-cutting: the pipeline's worker,
the kernel thread and both front ends record into one ``Trace``), and the stats window the front
ends read the lower layers' counters through."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional

import torch
from torch.profiler import record_function

__all__ = ["StatsWindow", "Trace", "profile_range"]


def profile_range(name: str):
    """A profiler range with a stable name (``zero_offload::pre_forward`` ...) while the torch
    profiler records, nothing otherwise: the hooks run a few hundred times per step and an idle
    ``record_function`` still costs microseconds each."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class Trace:
    """Timed spans from every thread of a training step (the worker's jobs and kernel calls,
    the consumer's waits, the engine's phases), written as a Chrome trace (open the file in
    https://ui.perfetto.dev or chrome://tracing). Recording costs one list append per span."""

    def __init__(self):
        self.events: list = []

    def span(self, name: str, t0: float, t1: float, *, thread: Optional[str] = None, **args) -> None:
        """A span from ``t0`` to ``t1`` (``time.perf_counter()`` seconds) on ``thread`` (default:
        the calling thread's name)."""
        self.events.append((name, thread or threading.current_thread().name, t0, t1, args))

    def clear(self) -> None:
        self.events.clear()

    def to_chrome(self) -> dict:
        origin = min((e[2] for e in self.events), default=0.0)
        threads = {name: i for i, name in enumerate(dict.fromkeys(e[1] for e in self.events))}
        out = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
               for name, tid in threads.items()]
        out += [{"name": name, "ph": "X", "pid": 0, "tid": threads[thread],
                 "ts": (t0 - origin) * 1e6, "dur": (t1 - t0) * 1e6, "args": args}
                for name, thread, t0, t1, args in self.events]
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, path) -> None:
        import json

        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)


class StatsWindow:
    """Counters since a base snapshot, for counters that belong to other objects: ``read()`` is
    ``sample() - base`` per key, ``reset()`` moves the base. The counters are never written, so
    two windows over the same objects (two front ends, a benchmark) never disturb each other."""

    def __init__(self, sample: Callable[[], dict]):
        self._sample = sample
        self._base = sample()

    def reset(self) -> None:
        self._base = self._sample()

    def read(self) -> dict:
        return {k: v - self._base.get(k, 0) for k, v in self._sample().items()}
