"""The step pipeline: a CPU-Adam worker thread that updates chunks as their grads land.

Engine-agnostic: it knows a ``ChunkStore``, payload names and flat element ranges, nothing about
modules or hooks. The engine (engine.py) and the optimizer-only entry point (``OffloadAdamW``)
both drive it the same way:

1. When a chunk's grads have been flushed towards host memory, ``submit_grads(GradJob(...))``
   with the flush handle. The worker waits for that move only (never the whole device), then,
   as the job asks: accumulates into an fp32 buffer (gradient accumulation), adds the sum of
   squares of the grads to the running total (global-norm clipping, fp16 overflow check), and
   optionally runs the update at once (``GradJob.then``: overlap with the rest of backward,
   used when no global quantity is needed).
2. Otherwise, once every grad is in (``wait_grads``, ``take_grad_stats``), the caller decides
   (skip on overflow, clip coefficient) and ``submit_update(UpdateJob(...))`` per chunk, in the
   order the next forward needs them, and returns: the updates overlap the next forward.
3. Before a chunk is used again, ``wait_chunk(cid)`` blocks until no job of that chunk is
   queued or running. Nothing else synchronises.

Jobs run in submission order on one thread; each ``adam_step`` call is itself multi-threaded in
the native kernel and releases the GIL, so the caller's thread keeps driving the GPU.

Optimizer state whose home is NVMe is read ahead in update order and written behind by a
``Prefetcher`` over (master, exp_avg, exp_avg_sq) -> CPU; ``begin_round()`` marks the start of
each round of updates so the prefetcher learns the order (see prefetch.py).

[Note: what an update writes] ``adam_step`` updates ``master``, ``exp_avg`` and ``exp_avg_sq``
in place in their CPU copies and, when ``lowp`` is set, writes the updated params rounded to
the working dtype into the CPU copy of ``lowp`` (the buffer the next forward fetches). Every
written copy is marked dirty in the store, so stale copies elsewhere (a GPU copy of the params,
an NVMe home) are refreshed by the next fetch or written back when the CPU copy is released.
A working copy homed off the CPU (GPU or NVMe) is flushed home right after the update and its
CPU copy dropped, so host memory holds only what the placement asks for.
"""
from __future__ import annotations

import collections
import enum
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .prefetch import Prefetcher
from .store import ChunkStore, Handle, Tier

__all__ = ["Accumulate", "AdamArgs", "GradJob", "PipelineError", "PipelinePayloads",
           "PipelineStats", "Segment", "StepPipeline", "UpdateJob"]


class PipelineError(RuntimeError):
    """A job failed on the worker thread; the original exception is the ``__cause__``."""


@dataclass(frozen=True, kw_only=True)
class PipelinePayloads:
    """Store payload names the pipeline reads and writes (one set for every chunk)."""

    grads: str = "grads"
    """Grads in the working dtype; the worker reads their CPU copy."""
    master: str = "master"
    """fp32 params updated in place (the working copy itself when ``lowp`` is None)."""
    exp_avg: str = "exp_avg"
    exp_avg_sq: str = "exp_avg_sq"
    lowp: Optional[str] = "params"
    """bf16/fp16 working copy that receives the updated params (None: fp32 training)."""
    accum: Optional[str] = None
    """fp32 CPU buffer summing grads over micro-batches (None: no accumulation)."""


class Accumulate(enum.Enum):
    """What a grad job does with the accumulation buffer."""

    NONE = "none"  # no accumulation: updates read the grads payload
    COPY = "copy"  # first micro-batch of a window: accum = grads
    ADD = "add"    # later micro-batches: accum += grads
    HOLD = "hold"  # no new grads for this chunk: use accum as it is (``ready`` is not waited on)


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of a chunk updated by one kernel call with bias-correction step
    ``step`` (1-based; params that missed steps keep their own count, as torch.optim does)."""

    start: int
    stop: int
    step: int


@dataclass(frozen=True, kw_only=True)
class AdamArgs:
    """Hyperparameters of one update, read when it is submitted (an lr scheduler may change them
    between steps)."""

    lr: float
    betas: tuple
    eps: float
    weight_decay: float
    adamw: bool
    grad_scale: float = 1.0
    """The update applies ``grad / grad_scale``: loss scale divided by the clip coefficient."""


@dataclass(frozen=True, kw_only=True)
class UpdateJob:
    cid: int
    segments: tuple
    args: AdamArgs
    source: str
    """Payload holding the grads to apply: ``payloads.grads`` or ``payloads.accum``."""


@dataclass(frozen=True, kw_only=True)
class GradJob:
    cid: int
    ready: Handle
    """The move that lands the grads in the CPU copy of ``payloads.grads``."""
    accumulate: Accumulate = Accumulate.NONE
    stats: bool = False
    """Add the sum of squares of the (accumulated) grads / ``stats_scale`` to the total."""
    stats_scale: float = 1.0
    then: Optional[UpdateJob] = None
    """Update to run right after (overlap with backward)."""


@dataclass(frozen=True)
class _RoundStart:
    """Queue marker: a new round of updates starts (prefetch order bookkeeping)."""


@dataclass
class PipelineStats:
    updates: int = 0
    elements_updated: int = 0
    adam_s: float = 0.0
    """Seconds the worker spent in adam_step."""
    busy_s: float = 0.0
    """Seconds the worker spent on jobs (waits for moves included)."""
    wait_chunk_s: float = 0.0
    """Seconds callers spent in ``wait_chunk`` (the consumer's stall on the CPU update)."""
    grad_jobs: int = 0

    def as_dict(self) -> dict:
        return dict(vars(self))


class StepPipeline:
    """One worker thread running grad and update jobs in submission order. Thread-safe.

    Args:
        store: the ChunkStore holding the payloads named in ``payloads``.
        payloads: payload names (see ``PipelinePayloads``).
        prefetch_depth: chunks of optimizer state read ahead (NVMe homes) in update order.
        threads: threads per ``adam_step`` call (None: all available cores).
        on_update_done: called on the worker thread with the chunk id after each update (e.g.
            to start copying the new params back to the GPU).
    """

    def __init__(self, store: ChunkStore, *, payloads: PipelinePayloads = PipelinePayloads(),
                 prefetch_depth: int = 2, threads: Optional[int] = None,
                 on_update_done: Optional[Callable[[int], None]] = None):
        from . import cpu_adam  # the native kernel; imported here so importing this module stays cheap

        self._adam = cpu_adam
        self.store = store
        self.payloads = payloads
        self.threads = threads
        self.on_update_done = on_update_done
        self.stats = PipelineStats()
        state_hops = [(payloads.master, Tier.CPU), (payloads.exp_avg, Tier.CPU),
                      (payloads.exp_avg_sq, Tier.CPU)]
        self.state_prefetcher = Prefetcher(store, depth=prefetch_depth, hops=state_hops)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending: collections.Counter = collections.Counter()  # cid -> jobs queued/running
        self._pending_grads = 0
        self._sumsq = 0.0
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="zero_offload-cpu-adam", daemon=True)
        self._thread.start()

    # ---- submission -----------------------------------------------------------------------

    def begin_round(self) -> None:
        """A new round of updates starts (call before its first update or grad job)."""
        self._put(_RoundStart(), cid=None)

    def submit_grads(self, job: GradJob) -> None:
        if job.accumulate is not Accumulate.NONE and self.payloads.accum is None:
            raise ValueError("GradJob asks to accumulate but the pipeline has no accum payload; "
                             "build it with PipelinePayloads(accum=...)")
        with self._cv:
            self._pending_grads += 1
        self._put(job, cid=job.cid)

    def submit_update(self, job: UpdateJob) -> None:
        self._put(job, cid=job.cid)

    def _put(self, job, *, cid) -> None:
        self._raise_if_failed()
        if self._closed:
            raise PipelineError("the step pipeline is closed")
        if cid is not None:
            with self._cv:
                self._pending[cid] += 1
        self._queue.put(job)

    # ---- waiting --------------------------------------------------------------------------

    def busy(self, cid: int) -> bool:
        """Whether a job of chunk ``cid`` is queued or running (non-blocking)."""
        with self._cv:
            return self._pending[cid] > 0

    def wait_chunk(self, cid: int) -> None:
        """Block until no job of chunk ``cid`` is queued or running."""
        with self._cv:
            if self._pending[cid] == 0:
                self._raise_if_failed()
                return
            t0 = time.perf_counter()
            self._cv.wait_for(lambda: self._pending[cid] == 0 or self._error is not None)
            self.stats.wait_chunk_s += time.perf_counter() - t0
        self._raise_if_failed()

    def wait_grads(self) -> None:
        """Block until every submitted grad job has run."""
        with self._cv:
            self._cv.wait_for(lambda: self._pending_grads == 0 or self._error is not None)
        self._raise_if_failed()

    def drain(self) -> None:
        """Block until every submitted job has run."""
        with self._cv:
            self._cv.wait_for(lambda: not any(self._pending.values()) or self._error is not None)
        self._raise_if_failed()

    def take_grad_stats(self) -> float:
        """Sum of squares of the grads of the grad jobs with ``stats=True`` since the last call
        (after ``wait_grads``); inf or NaN when any grad was. Resets the total."""
        self.wait_grads()
        with self._cv:
            total, self._sumsq = self._sumsq, 0.0
        return total

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PipelineError(f"the CPU-Adam worker failed: {self._error!r}") from self._error

    # ---- worker ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            cid = getattr(job, "cid", None)
            t0 = time.perf_counter()
            try:
                if self._error is None:
                    self._execute(job)
            except BaseException as e:  # reported to the caller by the next wait/submit
                self._error = e
            finally:
                with self._cv:
                    self.stats.busy_s += time.perf_counter() - t0
                    if cid is not None:
                        self._pending[cid] -= 1
                    if isinstance(job, GradJob):
                        self._pending_grads -= 1
                    self._cv.notify_all()

    def _execute(self, job) -> None:
        if isinstance(job, _RoundStart):
            self.state_prefetcher.start_pass()
        elif isinstance(job, GradJob):
            self._grads(job)
        elif isinstance(job, UpdateJob):
            self._update(job)
        else:  # pragma: no cover - only this module builds jobs
            raise TypeError(f"unknown pipeline job {job!r}")

    def _grads(self, job: GradJob) -> None:
        store, names = self.store, self.payloads
        if job.accumulate is Accumulate.HOLD:
            source = store.get(job.cid, names.accum, Tier.CPU)
        else:
            job.ready.wait()
            source = store.get(job.cid, names.grads, Tier.CPU)
        if job.accumulate in (Accumulate.COPY, Accumulate.ADD):
            acc = store.get(job.cid, names.accum, Tier.CPU, write=True)
            if job.accumulate is Accumulate.COPY:
                acc.copy_(source)
            else:
                acc.add_(source)
            store.mark_dirty(job.cid, names.accum, Tier.CPU)
            source = acc
        if job.stats:
            s = self._adam.grad_sumsq(source, grad_scale=job.stats_scale, threads=self.threads)
            with self._cv:
                self._sumsq += s
        self.stats.grad_jobs += 1
        if job.then is not None:
            self._update(job.then)

    def _update(self, job: UpdateJob) -> None:
        store, names, cid = self.store, self.payloads, job.cid
        state = self.state_prefetcher.use(cid)
        try:
            # use() reads; the update also writes, so wait for moves still reading these copies.
            master, exp_avg, exp_avg_sq = (store.get(cid, n, Tier.CPU, write=True)
                                           for n in (names.master, names.exp_avg, names.exp_avg_sq))
            grad = store.get(cid, job.source, Tier.CPU)
            lowp = self._lowp_buffer(cid, job) if names.lowp is not None else None
            a = job.args
            t0 = time.perf_counter()
            for seg in job.segments:
                sl = slice(seg.start, seg.stop)
                self._adam.adam_step(
                    master[sl], grad[sl], exp_avg[sl], exp_avg_sq[sl], step=seg.step, lr=a.lr,
                    betas=a.betas, eps=a.eps, weight_decay=a.weight_decay, adamw=a.adamw,
                    grad_scale=a.grad_scale, out_lowp=None if lowp is None else lowp[sl],
                    threads=self.threads)
            self.stats.adam_s += time.perf_counter() - t0
            self.stats.updates += 1
            self.stats.elements_updated += sum(s.stop - s.start for s in job.segments)
            for n in (names.master, names.exp_avg, names.exp_avg_sq):
                store.mark_dirty(cid, n, Tier.CPU)
            if lowp is not None:
                store.mark_dirty(cid, names.lowp, Tier.CPU)
        finally:
            self.state_prefetcher.release(cid)
        if lowp is not None and store.payload_spec(cid, names.lowp).home is not Tier.CPU:
            # See [Note: what an update writes]: send the new working copy home, drop the CPU one.
            store.flush(cid, names.lowp)
            store.evict(cid, names.lowp, Tier.CPU)
        if self.on_update_done is not None:
            self.on_update_done(cid)

    def _lowp_buffer(self, cid: int, job: UpdateJob) -> torch.Tensor:
        """The CPU copy of the working params, ready to be overwritten by the update."""
        store, name = self.store, self.payloads.lowp
        spec = store.payload_spec(cid, name)
        covered = sum(s.stop - s.start for s in job.segments)
        if spec.home is Tier.CPU:
            return store.get(cid, name, Tier.CPU, write=True)
        if covered == spec.numel:
            return store.allocate(cid, name, Tier.CPU)  # every element is rewritten: no read
        store.fetch(cid, name, Tier.CPU)
        return store.get(cid, name, Tier.CPU, write=True)

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued jobs and stop the worker. Idempotent; does not raise worker errors."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    @property
    def failed(self) -> bool:
        return self._error is not None

