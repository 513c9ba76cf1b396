"""Chrome-trace spans from every thread of a training step (cross-cutting: the pipeline's worker,
the kernel thread and both front ends record into one ``Trace``)."""
from __future__ import annotations

import threading
from typing import Optional

__all__ = ["Trace"]


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
