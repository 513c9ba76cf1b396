"""The step pipeline: a worker thread that updates chunks as their grads land (each chunk by its
update rule: CPU-Adam, SGD, Lion, Adafactor, Muon).

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
   (skip on overflow, clip coefficient) and ``submit_update(UpdateJob(...))`` per chunk and
   returns: the updates overlap the next forward.
3. Before a chunk is used again, ``wait_chunk(cid)`` blocks until no job of that chunk is
   queued or running. Nothing else synchronises.

[Note: job order] Jobs of one chunk run in submission order. Among chunks, the worker runs next
the queued job with the smallest ``priority`` (the caller passes the chunk's position in the next
forward; default: submission order). So during backward it updates whatever has landed, and
once backward is over it goes through the rest in the order the next forward needs them: the
forward starts as soon as its first chunk is updated and then runs behind the updates instead
of waiting for all of them. One exception: a grad job whose grads are still in flight (the device
has not reached the copy yet) does not hold the worker while another job could start at once;
that one goes first (``_pick``), so the worker never idles on a move with work at hand.

[Note: two jobs in flight] The worker does not run the kernels itself: the rule's ``cpu_job``
queues them on the native kernel thread (CPU-Adam: ``cpu_adam.adam_step_async``), and while a
job's kernels run the worker completes the previous job (waits for its kernels, marks what they
wrote, releases its buffers, writes back, calls ``on_update_done``/``on_chunk_idle``) and starts
the next one (waits for its grads, pins its buffers, queues its kernels behind the running
ones). So the cores go from one chunk's update to the next without waiting for Python, and the
worker's bookkeeping and its re-takes of the GIL (up to the interpreter's switch interval each,
while the main thread runs Python) are hidden behind the kernels. Measured on the H100 host
before this: ~0.5-0.7 ms of bookkeeping per chunk outside the kernels, ~10% of a 1.3B step. A
job still counts as queued (``busy``, ``wait_chunk``) until it is complete. The worker never
blocks on a grad move while a job is in flight: it completes that one first
(``_pick(can_defer=True)``).

[Note: jobs in flight] How many jobs start after one before the worker completes it is its
rule's ``lag`` (default 1: the two jobs above). A rule whose job runs in stages that need time
between them sets more: Muon's (``MuonRule.lag`` = 2; [Note: Muon's pipeline] in rules.py)
queues its apply passes when the job two after it starts, so a job completes after two more
have started. The worker completes the oldest job in flight whenever it has no job to start
(as above), so nothing waits on a job that no later start would advance: at the end of a step
the last jobs complete one after the other (each job's last ticket runs its remaining stages),
and a caller waiting for a chunk, or backward waiting for a grads-window slot a job in flight
holds, is never left behind a job that waits for work that cannot come.

[Note: state read-ahead] Optimizer state homed off the CPU (NVMe) is read into host memory for
the next ``prefetch_depth`` queued updates, in the order of [Note: job order] (the queue is the
schedule, so no recorded order is needed), and written back home right after each update, its
host copy dropped (write-behind: the store keeps the copy until the write has read it).
A read-ahead runs on the worker (``_begin``), where the jobs it reads for cannot end meanwhile,
and on the caller's thread (``_put``), where they can: the caller may lose the CPU between taking
the queue's snapshot and fetching, and the update then runs and drops its host copies before
the fetch makes one again, which nothing would drop (host memory holding more than the plan's
homes between steps, by one chunk's payload, depending on timing). So the fetch is followed by a
check, under the queue's lock, for a job of the chunk that has not yet dropped its copies (a job
is marked ``behind`` under that lock before it drops them, and leaves the queue after); with
none left, the read-ahead drops what it fetched itself. Either the check comes first, and that
job drops the copy, or the mark does, and the read-ahead drops it.

[Note: what an update writes] The job's rule (``UpdateJob.rule``, runtime/update_rule.py)
updates ``master`` and its state payloads in place in their CPU copies and, when ``lowp`` is
set, writes the updated params rounded to the working dtype into the CPU copy of ``lowp`` (the
buffer the next forward fetches), unless that working copy is made from the master on the way to
the device ([Note: derived payloads] in store.py): then the update writes no copy-out. Every
written copy is marked dirty in the store, so stale copies elsewhere (a GPU copy of the params,
an NVMe home) are refreshed by the next fetch or written back. A working copy homed off the CPU
(GPU or NVMe) is flushed home right after the update and its CPU copy dropped, so host memory
holds only what the placement asks for.

[Note: workers stop before the interpreter finalizes] A script that ends (normally, by an
exception, ``sys.exit``, Ctrl-C) without ``close()`` leaves the worker running with updates in
flight. The worker is a daemon thread, so CPython would let it run into finalization, where a
daemon thread that re-takes the GIL is ended with ``pthread_exit``. If it was inside a call that
released the GIL from C++ (``kernel_wait``, ``grad_sumsq``, torch ops, a CUDA event wait: all
release it through pybind11's ``gil_scoped_release``), the forced unwind of ``pthread_exit``
meets that object's noexcept destructor and the process aborts with "terminate called without
an active exception" (status 134) instead of the script's own status. So every live pipeline is
registered (weakly) with one exit hook that closes it, i.e. finishes its queued jobs and joins
its worker, before finalization. The hook runs from ``threading``'s exit hooks, ahead of
``concurrent.futures``' (registered later, run first), so a draining job can still use the
store's executor; only pipelines of the process that built them are closed (a forked child
inherits the list, not the threads). The native threads need no such step: see [Note: native
threads at exit] in csrc/kernel_queue.h.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import enum
import itertools
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .store import BudgetError, ChunkStore, Handle, Tier
from .trace import Trace
from .update_rule import Segment, StepBuffers, UpdateRule

__all__ = ["Accumulate", "GradJob", "PipelineError", "PipelinePayloads", "PipelineStats", "Segment",
           "StepPipeline", "UpdateJob"]


class PipelineError(RuntimeError):
    """A job failed on the worker thread; the original exception is the ``__cause__``, and
    ``job`` says which (e.g. "the Muon update of chunk 3"; None: not a job's failure)."""

    def __init__(self, message: str, *, job: Optional[str] = None):
        super().__init__(message)
        self.job = job


@dataclass(frozen=True, kw_only=True)
class PipelinePayloads:
    """Store payload names the pipeline reads and writes (one set for every chunk) beside the
    rule's own state payloads (``UpdateRule.state_keys``)."""

    grads: str = "grads"
    """Grads in the working dtype; the worker reads their CPU copy."""
    master: str = "master"
    """fp32 params updated in place (the working copy itself when ``lowp`` is None)."""
    lowp: Optional[str] = "params"
    """bf16/fp16 working copy that receives the updated params (None: fp32 training). Used for
    the chunks that have a payload of this name; a chunk without one updates ``master`` only."""
    accum: Optional[str] = None
    """fp32 CPU buffer summing grads over micro-batches (None: no accumulation)."""


class Accumulate(enum.Enum):
    """What a grad job does with the accumulation buffer."""

    NONE = "none"  # no accumulation: updates read the grads payload
    COPY = "copy"  # first micro-batch of a window: accum = grads
    ADD = "add"    # later micro-batches: accum += grads
    HOLD = "hold"  # no new grads for this chunk: use accum as it is (``ready`` is not waited on)


@dataclass(frozen=True, kw_only=True)
class UpdateJob:
    cid: int
    segments: tuple
    """``Segment``s of the chunk to update, each with its step count and the rule's arguments."""
    rule: UpdateRule
    """What the update does: its state payloads and its CPU job ([Note: update rules])."""
    source: str
    """Payload holding the grads to apply: ``payloads.grads`` or ``payloads.accum``."""

    @property
    def state(self) -> tuple:
        """The payloads the update reads and writes besides the grads (and ``lowp``)."""
        return self.rule.state_keys


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


@dataclass(eq=False)
class _Queued:
    """A submitted job waiting for the worker; see [Note: job order]."""

    job: object
    cid: int
    priority: int
    seq: int
    running: bool = False
    behind: bool = False
    """Its update is dropping its host copies of the state (the write-behind's last part): those
    fetched before, none fetched after ([Note: state read-ahead])."""

    @property
    def key(self) -> tuple:
        return (self.priority, self.seq)

    @property
    def update(self) -> Optional["UpdateJob"]:
        """The update the job runs (an UpdateJob, or a GradJob's ``then``), or None."""
        return self.job if isinstance(self.job, UpdateJob) else self.job.then

    @property
    def updates(self) -> bool:
        """Whether the job runs an update."""
        return self.update is not None


@dataclass(eq=False)
class _Running:
    """A job the worker has started: see [Note: two jobs in flight]."""

    q: _Queued
    t0: float = field(default_factory=time.perf_counter)
    held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    """Pins of the update's buffers, released (after its kernels) when the job completes."""
    update: Optional[UpdateJob] = None
    written: tuple = ()
    """Payloads the update writes in their CPU copies: see [Note: what an update writes]."""
    tickets: list = field(default_factory=list)


def _lag(run: "_Running") -> int:
    """Jobs to start after ``run`` before completing it ([Note: jobs in flight])."""
    rule = run.update.rule if run.update is not None else None
    return max(1, int(getattr(rule, "lag", 1)))


def _describe(update: "UpdateJob") -> str:
    """An update job in messages: "the Muon update of chunk 3"."""
    return f"the {getattr(update.rule, 'name', type(update.rule).__name__)} update of chunk {update.cid}"


def _wait_quietly(tickets) -> None:
    """Wait for kernels that may still use buffers about to be released (errors are reported
    by ``_complete``, which waits first)."""
    for t in tickets:
        try:
            t.wait()
        except BaseException:
            pass


@dataclass
class PipelineStats:
    updates: int = 0
    adam_s: float = 0.0
    """Seconds the update kernels ran (the rules' CPU jobs: CPU-Adam on the native kernel thread)."""
    busy_s: float = 0.0
    """Seconds the worker thread spent on jobs: bookkeeping, waits for moves and for kernels
    (the time it waited for new jobs excluded)."""
    wait_chunk_s: float = 0.0
    """Seconds callers spent in ``wait_chunk`` (the consumer's stall on the CPU update)."""


class StepPipeline:
    """One worker thread running grad and update jobs; see [Note: job order]. Thread-safe.

    Args:
        store: the ChunkStore holding the payloads named in ``payloads``.
        payloads: payload names (see ``PipelinePayloads``).
        prefetch_depth: queued updates whose optimizer state is read ahead (NVMe homes).
        threads: threads per kernel call of a rule's CPU job (None: all available cores).
        on_update_done: called on the worker thread with the chunk id after each update (e.g.
            to start copying the new params back to the GPU).
        on_chunk_idle: called on the worker thread, with no pipeline lock held, with the chunk
            id once a job that updated the chunk has finished and no other job of that chunk is
            queued (``busy(cid)`` is False then): the chunk's params are final for now, so a
            consumer may start fetching them. See [Note: fetch on completion] in engine.py.
        seed: base of the stochastic-rounding seeds of bf16 moments ([Note: stochastic
            rounding] in ops/rounding.py); unused with fp32 moments.
    """

    def __init__(self, store: ChunkStore, *, payloads: PipelinePayloads = PipelinePayloads(),
                 prefetch_depth: int = 2, threads: Optional[int] = None,
                 on_update_done: Optional[Callable[[int], None]] = None,
                 on_chunk_idle: Optional[Callable[[int], None]] = None, seed: int = 0):
        from ..ops import cpu_adam  # grad_sumsq; imported here so importing this module stays cheap

        self._adam = cpu_adam
        self.store = store
        self.payloads = payloads
        self.prefetch_depth = prefetch_depth
        self.threads = threads
        self.on_update_done = on_update_done
        self.on_chunk_idle = on_chunk_idle
        self.seed = seed
        self.stats = PipelineStats()
        self.trace: Optional[Trace] = None  # set to a Trace to record spans
        self._cv = threading.Condition()
        self._queue: list[_Queued] = []  # submitted, not finished (the running one included)
        self._seq = itertools.count()
        self._pending_grads = 0
        self._notifying = 0  # ``on_chunk_idle`` calls running on the worker (``drain`` waits for them)
        self._sumsq = 0.0
        self._error: Optional[BaseException] = None
        self._failed_job: Optional[str] = None  # what ``_error`` broke, for messages
        self._closed = False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="zero_offload-cpu-adam", daemon=True)
        self._thread.start()
        _close_at_exit(self)

    # ---- submission -----------------------------------------------------------------------

    def submit_grads(self, job: GradJob, *, priority: Optional[int] = None) -> None:
        """Queue a grad job. ``priority``: see [Note: job order] (None: submission order)."""
        if job.accumulate is not Accumulate.NONE and self.payloads.accum is None:
            raise ValueError("GradJob asks to accumulate but the pipeline has no accum payload; "
                             "build it with PipelinePayloads(accum=...)")
        self._put(job, priority)

    def submit_update(self, job: UpdateJob, *, priority: Optional[int] = None) -> None:
        """Queue an update. ``priority``: see [Note: job order] (None: submission order)."""
        self._put(job, priority)

    def _put(self, job, priority) -> None:
        self._raise_if_failed()
        if self._closed:
            raise PipelineError("the step pipeline is closed")
        with self._cv:
            seq = next(self._seq)
            self._queue.append(_Queued(job=job, cid=job.cid, priority=seq if priority is None else priority,
                                       seq=seq))
            self._pending_grads += isinstance(job, GradJob)
            self._cv.notify_all()
        self._read_ahead()

    # ---- waiting --------------------------------------------------------------------------

    def busy(self, cid: int) -> bool:
        """Whether a job of chunk ``cid`` is queued or running (non-blocking)."""
        with self._cv:
            return any(q.cid == cid for q in self._queue)

    def wait_chunk(self, cid: int) -> None:
        """Block until no job of chunk ``cid`` is queued or running."""
        with self._cv:
            if self.busy(cid) and self._error is None:
                t0 = time.perf_counter()
                self._cv.wait_for(lambda: self._error is not None or not self.busy(cid))
                t1 = time.perf_counter()
                self.stats.wait_chunk_s += t1 - t0
                if self.trace is not None:
                    self.trace.span("wait_chunk", t0, t1, cid=cid)
        self._raise_if_failed()

    def wait_grads(self) -> None:
        """Block until every submitted grad job has run."""
        with self._cv:
            self._cv.wait_for(lambda: self._pending_grads == 0 or self._error is not None)
        self._raise_if_failed()

    def drain(self) -> None:
        """Block until every submitted job has run, its ``on_chunk_idle`` call included (a caller
        that frees chunks next, as ``Engine.close`` does, must not race a prefetch it issues)."""
        with self._cv:
            self._cv.wait_for(lambda: (not self._queue and not self._notifying) or self._error is not None)
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
            raise PipelineError(f"the update worker failed in {self._failed_job}: {self._error!r}",
                                job=self._failed_job) from self._error

    def _fail(self, error: BaseException, job: str) -> None:
        self._error, self._failed_job = error, job

    # ---- scheduling ([Note: job order]) ---------------------------------------------------

    def _runnable(self) -> list:
        """Queued jobs that are the first of their chunk and not running, best first (lock held)."""
        first: dict = {}
        blocked = set()
        for q in sorted(self._queue, key=lambda q: q.seq):
            if q.running:
                blocked.add(q.cid)
            elif q.cid not in blocked and q.cid not in first:
                first[q.cid] = q
        return sorted((q for c, q in first.items() if c not in blocked), key=lambda q: q.key)

    @staticmethod
    def _startable(q: _Queued) -> bool:
        """Whether a job can start without waiting for its grads' move (non-blocking poll)."""
        job = q.job
        if not isinstance(job, GradJob) or job.accumulate is Accumulate.HOLD:
            return True
        return job.ready.host_done() and job.ready.finished()

    def _pick(self, *, can_defer: bool = False) -> Optional[_Queued]:
        """The job to run next (lock held). [Note: job order], except that a grad job whose
        grads are still in flight does not hold the worker while another job could run now: the
        best job that can start at once goes first; when none can, the grad job submitted first
        (its move was issued first, and moves of one stream land in issue order), so the worker
        waits for the move that lands soonest — unless ``can_defer`` (a job is in flight): then
        None, so the worker completes that one before it blocks on a move. None also when no job
        is runnable."""
        runnable = self._runnable()
        for q in runnable:
            if self._startable(q):
                return q
        if can_defer or not runnable:
            return None
        return min(runnable, key=lambda q: q.seq)

    def _read_ahead(self) -> None:
        """[Note: state read-ahead] for the next ``prefetch_depth`` queued updates."""
        if self.prefetch_depth <= 0:
            return
        with self._cv:
            # Jobs already started hold their state (pinned); re-reading a chunk whose update just
            # ended would fetch back what its write-behind is sending home.
            upcoming = {q.cid: q.update for q in sorted(self._queue, key=lambda q: q.key)
                        if not q.running and q.updates}
        try:
            for cid, job in list(upcoming.items())[:self.prefetch_depth]:
                names = [n for n in (self.payloads.master, *job.state)
                         if self.store.payload_spec(cid, n).home is not Tier.CPU]
                for name in names:
                    self.store.fetch(cid, name, Tier.CPU)
                if names and not self._drops_later(cid):  # its update ended meanwhile: ours to drop
                    for name in names:
                        self.store.evict(cid, name, Tier.CPU, defer=True)
        except BudgetError:
            pass  # host memory is full of copies in use: the update fetches on demand

    def _drops_later(self, cid: int) -> bool:
        """A job of chunk ``cid`` will drop its host copies of the state after this call
        ([Note: state read-ahead])."""
        with self._cv:
            return any(q.cid == cid and q.updates and not q.behind for q in self._queue)

    # ---- worker ([Note: two jobs in flight]) -------------------------------------------------

    def _run(self) -> None:
        inflight: collections.deque = collections.deque()  # started, not completed; oldest first
        while True:
            with self._cv:
                if not inflight:
                    self._cv.wait_for(lambda: self._closed or (self._queue and self._runnable()))
                    if self._closed and not self._queue:
                        return
                q = self._pick(can_defer=bool(inflight))
                if q is not None:
                    q.running = True
            if q is None:  # nothing to start now: complete the oldest job in flight first
                self._finish(inflight.popleft())
                continue
            inflight.append(self._begin(q))
            while len(inflight) > _lag(inflight[0]):  # its lag of jobs started after it: [Note: jobs in flight]
                self._finish(inflight.popleft())

    def _begin(self, q: _Queued) -> "_Running":
        """Start a job: wait for its grads, accumulate / add up stats, and queue its update's
        kernels on the native kernel thread. Errors are kept for ``_finish`` to report."""
        run = _Running(q=q)
        t0 = time.perf_counter()
        what = "reading optimizer state ahead"
        try:
            if self._error is None:
                self._read_ahead()
                job = q.job
                what = f"the grads of chunk {q.cid}"
                update = self._grads(job) if isinstance(job, GradJob) else job
                if update is not None:
                    what = _describe(update)
                    self._launch(update, run)
        except BaseException as e:
            self._fail(e, what)
        self.stats.busy_s += time.perf_counter() - t0
        return run

    def _finish(self, run: "_Running") -> None:
        """Complete a started job: wait for its kernels, record what it wrote, release its
        buffers, write back / notify; then take it off the queue."""
        q = run.q
        t0 = time.perf_counter()
        try:
            if run.update is not None:
                self._complete(run)
        except BaseException as e:
            self._fail(e, _describe(run.update))
        finally:
            run.held.close()
            with self._cv:
                self.stats.busy_s += time.perf_counter() - t0
                self._queue.remove(q)
                self._pending_grads -= isinstance(q.job, GradJob)
                idle = (self.on_chunk_idle is not None and self._error is None and q.updates
                        and not self.busy(q.cid))
                self._notifying += idle
                self._cv.notify_all()
        if idle:
            try:
                self.on_chunk_idle(q.cid)  # outside the lock: see [Note: lock order] (engine.py)
            except BaseException as e:
                self._fail(e, f"the chunk-idle callback of chunk {q.cid}")
            finally:
                with self._cv:
                    self._notifying -= 1
                    self._cv.notify_all()
        if self.trace is not None:
            self.trace.span(type(q.job).__name__, run.t0, time.perf_counter(), cid=q.cid)

    def _grads(self, job: GradJob) -> Optional[UpdateJob]:
        """The grad part of a job; returns the update to run after it (``job.then``)."""
        store, names = self.store, self.payloads
        if job.accumulate is Accumulate.HOLD:
            source = store.get(job.cid, names.accum, Tier.CPU)
        else:
            t0 = time.perf_counter()
            job.ready.wait()
            if self.trace is not None:
                self.trace.span("grads_ready", t0, time.perf_counter(), cid=job.cid)
            source = store.get(job.cid, names.grads, Tier.CPU)
        if job.accumulate in (Accumulate.COPY, Accumulate.ADD):
            acc = store.get(job.cid, names.accum, Tier.CPU, write=True)
            if job.accumulate is Accumulate.COPY:
                acc.copy_(source)
            else:
                acc.add_(source)
            store.mark_dirty(job.cid, names.accum, Tier.CPU)
            self._consumed(job.cid, names.grads)
            source = acc
        if job.stats:
            s = self._adam.grad_sumsq(source, grad_scale=job.stats_scale, threads=self.threads)
            with self._cv:
                self._sumsq += s
        return job.then

    def _launch(self, job: UpdateJob, run: "_Running") -> None:
        """Pin the update's buffers (held until ``_finish``) and start the rule's CPU job."""
        store, names, cid = self.store, self.payloads, job.cid
        held = run.held
        # use(): fetch (a no-op when home on the CPU or read ahead) and pin atomically, so a
        # concurrent fetch making room cannot evict a copy between the two.
        written = (names.master, *job.state)
        master, *state = (held.enter_context(store.use(cid, n, Tier.CPU, write=True)) for n in written)
        grad = held.enter_context(store.use(cid, job.source, Tier.CPU))
        lowp = (self._lowp_buffer(cid, job, held) if names.lowp is not None and store.has_payload(cid, names.lowp)
                and not store.derived(cid, names.lowp) else None)  # (derived: remade from the master)
        run.update = job
        run.written = written + (() if lowp is None else (names.lowp,))
        bufs = StepBuffers(cid=cid, param=master, grad=grad, state=dict(zip(job.state, state)),
                           lowp=lowp, seed=self.seed, device=store.device if store.config.cuda else None)
        # Waited for before the buffers are released, whatever happens (ExitStack is LIFO).
        held.callback(_wait_quietly, run.tickets)
        run.tickets.extend(job.rule.cpu_job(bufs, job.segments, threads=self.threads))

    def _complete(self, run: "_Running") -> None:
        store, job = self.store, run.update
        cid = job.cid
        for ticket in run.tickets:
            seconds = ticket.wait()
            self.stats.adam_s += seconds
            if self.trace is not None:
                self.trace.span("adam", ticket.start, ticket.start + seconds, cid=cid,
                                thread="zero_offload-kernels")
        self.stats.updates += 1
        for n in run.written:
            store.mark_dirty(cid, n, Tier.CPU)
        run.held.close()  # unpin before the write-behind may evict
        if job.source == self.payloads.grads:
            self._consumed(cid, job.source)
        # See [Note: state read-ahead] and [Note: what an update writes]: write-behind.
        behind = [n for n in run.written if store.payload_spec(cid, n).home is not Tier.CPU]
        for n in behind:
            store.flush(cid, n)
        if self.on_update_done is not None:
            self.on_update_done(cid)  # may pin a host copy to read it on: its eviction waits for that
        with self._cv:
            run.q.behind = True  # a read-ahead fetching from here on drops its copies itself
        for n in behind:
            store.evict(cid, n, Tier.CPU, defer=True)

    def _consumed(self, cid: int, name: str) -> None:
        """The grads in ``name`` were used up (summed into the accumulation payload, or applied):
        a transient payload's window slot goes back now ([Note: transient payloads] in store.py),
        before the job counts as done, so a caller waiting for the chunk finds the slot free."""
        if self.store.windowed(cid, name):
            self.store.release(cid, name)

    def _lowp_buffer(self, cid: int, job: UpdateJob, held: contextlib.ExitStack) -> torch.Tensor:
        """The CPU copy of the working params, pinned in ``held``, ready to be overwritten."""
        store, name = self.store, self.payloads.lowp
        spec = store.payload_spec(cid, name)
        covered = sum(s.stop - s.start for s in job.segments)
        if spec.home is not Tier.CPU and covered == spec.numel:
            # Every element is rewritten: take a buffer without reading the old bytes (pinned at
            # once: a concurrent fetch making room could evict it before a separate pin).
            buf = store.allocate(cid, name, Tier.CPU, pin=True)
            held.callback(store.unpin, cid, name, Tier.CPU)
            return buf
        return held.enter_context(store.use(cid, name, Tier.CPU, write=True))

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued jobs and stop the worker. Idempotent; does not raise worker errors."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    @property
    def failed(self) -> bool:
        return self._error is not None


# ---- exit ([Note: workers stop before the interpreter finalizes]) -------------------------------

_live_pipelines: "weakref.WeakSet[StepPipeline]" = weakref.WeakSet()
_exit_hook_lock = threading.Lock()
_exit_hook_registered = False


def _close_at_exit(pipeline: StepPipeline) -> None:
    """Close ``pipeline`` at interpreter exit unless it is closed (or gone) before."""
    global _exit_hook_registered
    with _exit_hook_lock:
        if not _exit_hook_registered:
            # concurrent.futures registers its own hook (joining executor threads, refusing new
            # work) on import; registering after it makes ours run first.
            import concurrent.futures.thread  # noqa: F401
            register = getattr(threading, "_register_atexit", atexit.register)
            try:
                register(_close_live_pipelines)
            except RuntimeError:  # threading is already shutting down: fall back to atexit
                atexit.register(_close_live_pipelines)
            _exit_hook_registered = True
        _live_pipelines.add(pipeline)


def _close_live_pipelines() -> None:
    for pipeline in list(_live_pipelines):
        if pipeline._pid != os.getpid() or pipeline._closed:
            continue
        try:
            pipeline.close()
        except BaseException as e:  # the interpreter is exiting: say so in one line, go on
            print(f"zero_offload: stopping the update worker at exit failed: {e!r}", file=sys.stderr)
