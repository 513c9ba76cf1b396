"""The chunk-group runtime: what both front ends (engine.py's ``Engine``, offload_optim.py's
``OffloadAdam``) do with a chunk between its grads and its updated params, written once. FSDP2's
``FSDPParamGroup`` is the model: the front ends keep the hooks (module hooks / param grad hooks)
and the torch face, the group owns the chunk records and the update.

Ownership: a ``ChunkGroup`` owns the ``StepPipeline`` (the update worker) over a ``ChunkStore``
the front end gives it (the engine also runs a ``Prefetcher`` over that store), one
``GroupChunk`` per chunk and a ``GroupSlot`` per param span in it, and the stats window over the
store's and the pipeline's counters. Per chunk it does:

- grad staging: ``open_grads`` (the first grad of a window), ``stage`` (device grads copied into
  the host "grads" copy by the store) or the front end's own device buffer flushed by the store
  (``device_grads`` / ``flush_grads``), then ``submit`` (grad job, accumulation, norm stats, and
  the update right behind it when asked);
- the update: segments of the slots with grads in the window, each slot's step count, the
  arguments the group's ``UpdateRule`` makes of each slot's param group, read when the update
  is queued (``_update_job``; [Note: update rules] in update_rule.py);
- copy-back of the updated params into caller tensors (``copy_back``, OffloadAdam), through
  the store, which orders the chunk's next update and the eviction of the source after it;
- state I/O for checkpoints and ``state_dict``: ``hold`` (host buffers of whole payloads),
  ``read`` and ``state_names``.

[Note: chunk phases] A chunk is in one ``ChunkPhase``; ``GroupChunk.to`` raises on a move that
``_LEGAL`` does not list:
- IDLE: its params are final for now; no grad of the current accumulation window is staged.
- FILLING: grads of the current window are staged (one or more micro-batches, or some params of
  the chunk so far); ``open_grads`` enters it, after waiting for the chunk's last job (it reads
  the "grads" host copy that new grads overwrite).
- QUEUED: its update is handed to the worker and not yet waited for; ``wait`` (the front end
  needs the params: a fetch, the next grads, a sync) returns it to IDLE.
FILLING -> IDLE without an update: ``skip`` (an fp16 overflow skips the step).

[Note: GPU share] A chunk whose optimizer state is homed on the GPU (placement's "auto" GPU
share; its params are there too) never goes through the worker: ``device_submit`` takes its
device grads (the store's GPU copy of "grads", kept pinned until the update when the update
waits for ``step``), sums them into its "accum" payload (homed on the GPU too) and adds their
sum of squares to a device scalar, and its update runs on the caller's stream: the rule's
``device_step`` (Adam: torch's fused Adam(W), ``torch._fused_adamw_``) on the same segments and
arguments its CPU job gets, which also rounds the params from the master. QUEUED -> IDLE happens
at once: stream order is the ordering.
"""
from __future__ import annotations

import contextlib
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from .pipeline import Accumulate, GradJob, PipelineError, PipelinePayloads, StepPipeline, UpdateJob
from .store import ChunkStore, Handle, PayloadSpec, Tier
from .trace import StatsWindow, Trace
from .update_rule import Segment, StepBuffers, UpdateRule

__all__ = ["ChunkGroup", "ChunkPhase", "GroupChunk", "GroupSlot", "update_segments"]


class ChunkPhase(enum.Enum):
    """See [Note: chunk phases]."""

    IDLE = "idle"
    FILLING = "filling"
    QUEUED = "queued"


_LEGAL = {
    ChunkPhase.IDLE: frozenset({ChunkPhase.FILLING}),
    ChunkPhase.FILLING: frozenset({ChunkPhase.QUEUED, ChunkPhase.IDLE}),
    ChunkPhase.QUEUED: frozenset({ChunkPhase.IDLE}),
}


@dataclass(eq=False)
class GroupSlot:
    """One param's span in a chunk's flat payloads. Front ends may subclass it to keep their own
    per-param fields beside it."""

    offset: int
    stop: int
    """End of the elements its update covers (the engine's slots cover their alignment padding)."""
    group: int = 0
    """Index of its param group in the hyperparameter owner's ``param_groups``."""
    step: int = 0
    """Steps taken (torch.optim's ``state["step"]``; a param without a grad keeps its own)."""
    shape: Optional[tuple] = None
    """The param's shape when the slot holds the whole param, exactly (``stop - offset`` elements):
    what a rule that is not elementwise needs ([Note: update rules]); None otherwise."""


@dataclass(eq=False)
class GroupChunk:
    """One chunk of the group (the bytes are in the store under ``cid``)."""

    cid: int
    slots: tuple
    numel: int
    phase: ChunkPhase = ChunkPhase.IDLE
    window: set = field(default_factory=set)
    """Slots with a grad in the current accumulation window."""
    accumulating: bool = False
    """The fp32 accumulation payload holds grads of this window (``grad_accum > 1``)."""
    copied: Optional[Handle] = None
    """The copy-back of its last update (``copy_back``); ``wait`` orders the caller after it."""
    version: int = 0
    """Updates queued so far: a copy of the params taken at one version is stale at the next."""

    def to(self, phase: ChunkPhase) -> None:
        if phase not in _LEGAL[self.phase]:
            raise RuntimeError(f"zero_offload internal error: chunk {self.cid} cannot go from "
                               f"{self.phase.name} to {phase.name}; please report this")
        self.phase = phase


class ChunkGroup:
    """The chunks of one front end, their updates and their state. Caller's-thread object: the
    worker only runs jobs and calls ``on_update_done`` / ``on_chunk_idle``.

    Args:
        store: the ChunkStore holding every payload named in ``payloads``.
        hyper: the object whose ``param_groups`` (torch optimizer style) hold each group's
            hyperparameters (the rule's ``hyper_keys``), read when an update is queued.
        rule: the update ([Note: update rules]); every chunk has its state payloads.
        payloads: the pipeline's payload names (besides the rule's).
        grad_accum: micro-batches per update whose grads the group sums in ``payloads.accum``
            (1: the front end accumulates itself, or not at all).
        owner: the front end's name, for errors.
        prefetch_depth, threads, on_update_done, on_chunk_idle: the ``StepPipeline``'s.
    """

    def __init__(self, store: ChunkStore, *, hyper: Any, rule: UpdateRule, payloads: PipelinePayloads,
                 grad_accum: int = 1, owner: str = "zero_offload", prefetch_depth: int = 2,
                 threads: Optional[int] = None,
                 on_update_done: Optional[Callable[[int], None]] = None,
                 on_chunk_idle: Optional[Callable[[int], None]] = None, seed: int = 0):
        self.store = store
        self.seed = seed  # bf16 moments: [Note: stochastic rounding] (ops/rounding.py)
        if not isinstance(rule, UpdateRule):
            raise TypeError(f"{owner}: rule must be an UpdateRule (runtime/update_rule.py), got "
                            f"{type(rule).__name__}")
        self.hyper = hyper
        self.rule = rule
        self.payloads = payloads
        self.grad_accum = grad_accum
        self.owner = owner
        self.chunks: list[GroupChunk] = []
        self.pipeline = StepPipeline(store, payloads=payloads, prefetch_depth=prefetch_depth,
                                     threads=threads, on_update_done=on_update_done,
                                     on_chunk_idle=on_chunk_idle, seed=seed)
        self._device_sumsq: Optional[torch.Tensor] = None  # [Note: GPU share]: this window's stats
        self._held_grads: set = set()  # cids whose device grads wait for their update
        self.wait_s = 0.0
        """Seconds the caller's thread waited in ``wait`` for updates (what overlap did not hide)."""
        self._window = StatsWindow(self._sample)

    # ---- building ---------------------------------------------------------------------------

    def add_chunk(self, specs: Mapping[str, PayloadSpec], slots: Sequence[GroupSlot]) -> GroupChunk:
        """Register a chunk in the store (home copies allocated) and in the group; its id is its
        index in ``chunks``."""
        cid = self.store.add_chunk(specs)
        if cid != len(self.chunks):
            raise RuntimeError(f"{self.owner}: the store has chunks the group does not own; give each "
                               f"ChunkGroup a store of its own")
        chunk = GroupChunk(cid=cid, slots=tuple(slots), numel=next(iter(specs.values())).numel)
        self.chunks.append(chunk)
        return chunk

    # ---- whole payloads (caller's thread, no job of the chunk running) ----------------------

    @property
    def state_names(self) -> dict:
        """Optimizer-state key -> payload name: "master" and the rule's ``state_keys`` (Adam:
        "exp_avg", "exp_avg_sq")."""
        return {"master": self.payloads.master, **{k: k for k in self.rule.state_keys}}

    @contextlib.contextmanager
    def hold(self, chunk: GroupChunk, names: Sequence[str], *, write: bool = False, fresh: bool = False):
        """Host (CPU) buffers of the payloads ``names`` of ``chunk``, after its last job. ``write``:
        the caller changes them (they become the newest copies). ``fresh``: the caller writes
        every element (nothing is read; the buffers start zeroed). Copies whose home is not the
        CPU are written home when changed and dropped after the block."""
        self.wait(chunk)
        store, cid = self.store, chunk.cid
        away = [n for n in names if store.payload_spec(cid, n).home is not Tier.CPU]
        with contextlib.ExitStack() as held:
            bufs = []
            for name in names:
                if fresh:
                    buf = store.allocate(cid, name, Tier.CPU)
                    store.pin(cid, name, Tier.CPU)
                    held.callback(store.unpin, cid, name, Tier.CPU)
                    buf.zero_()
                else:
                    buf = held.enter_context(store.use(cid, name, Tier.CPU, write=write))
                bufs.append(buf)
            yield bufs
            if write or fresh:
                for name in names:
                    store.mark_dirty(cid, name, Tier.CPU)
        for name in away:
            store.evict(cid, name, Tier.CPU, defer=True)  # written home first when newest

    def read(self, chunk: GroupChunk, name: str) -> torch.Tensor:
        """A CPU copy (clone) of a whole payload, from wherever its newest bytes are."""
        with self.hold(chunk, [name]) as (buf,):
            return buf.clone()

    def take(self, chunk: GroupChunk, name: str) -> torch.Tensor:
        """``read``, then the chunk's memory in every tier is freed (``ChunkStore.discard``): for
        an owner that is closing and hands the values on chunk by chunk."""
        out = self.read(chunk, name)  # (after the chunk's last job: ``hold`` waits)
        self.store.discard(chunk.cid)
        return out

    # ---- grads ------------------------------------------------------------------------------

    def open_grads(self, chunk: GroupChunk, *, host: bool = False) -> None:
        """A grad of ``chunk`` is about to be staged: the chunk's last job (which reads the
        "grads" host copy) finishes first; the chunk is FILLING. ``host``: the grads will be
        ``stage``d straight into the host copy, which is taken for writing here, once."""
        self.wait(chunk)
        if chunk.phase is ChunkPhase.IDLE:
            chunk.to(ChunkPhase.FILLING)
        if host:
            self.store.get(chunk.cid, self.payloads.grads, Tier.CPU, write=True)

    def stage(self, chunk: GroupChunk, pieces: Sequence[tuple[int, torch.Tensor]]) -> Handle:
        """Copy device tensors (grads) into the chunk's "grads" host copy at the given element
        offsets, on the store's D2H stream after the caller's current stream; the returned
        handle (and every later one) says they have landed. Call ``open_grads(host=True)`` at
        the window's first grad."""
        return self.store.copy_in(chunk.cid, self.payloads.grads, Tier.CPU, pieces)

    def device_grads(self, chunk: GroupChunk) -> torch.Tensor:
        """A zeroed device buffer (pinned in the store) for the chunk's grads of this pass;
        ``flush_grads`` sends it down. Call ``open_grads`` first."""
        store, name = self.store, self.payloads.grads
        buf = store.allocate(chunk.cid, name, Tier.GPU)
        buf.zero_()
        store.pin(chunk.cid, name, Tier.GPU)
        return buf

    def flush_grads(self, chunk: GroupChunk, *, drop: bool = False) -> Handle:
        """The device grads buffer of ``device_grads`` goes to its host copy (D2H, async) and is
        freed; returns the move's handle. ``drop``: freed without copying (after an error). A
        chunk of the GPU share keeps its grads on the device (their home): only unpinned."""
        store, name = self.store, self.payloads.grads
        store.unpin(chunk.cid, name, Tier.GPU)
        if store.payload_spec(chunk.cid, name).home is Tier.GPU:
            self._held_grads.discard(chunk.cid)
            return Handle.completed()
        handle = None if drop else store.flush(chunk.cid, name, Tier.CPU)
        store.evict(chunk.cid, name, Tier.GPU)
        return handle

    def submit(self, chunk: GroupChunk, slots: Iterable[GroupSlot], *, ready: Handle,
               update: bool, grad_scale: float = 1.0, stats: bool = False,
               stats_scale: float = 1.0, priority: Optional[int] = None, hold: bool = False) -> None:
        """Hand the grads of ``slots`` (landed in the host "grads" copy once ``ready`` is done)
        to the worker: summed into the accumulation payload when ``grad_accum > 1``, their sum
        of squares added up when ``stats``, and, when ``update``, the chunk's update right
        behind (the window ends; QUEUED). ``hold``: no new grads, the job works on the
        accumulation payload as it is."""
        chunk.window.update(slots)
        if self.grad_accum == 1:
            acc = Accumulate.NONE
        elif hold:
            acc = Accumulate.HOLD
        else:
            acc = Accumulate.ADD if chunk.accumulating else Accumulate.COPY
            chunk.accumulating = True
        then = self._update_job(chunk, grad_scale) if update else None
        with self.errors():
            self.pipeline.submit_grads(GradJob(cid=chunk.cid, ready=ready, accumulate=acc, stats=stats,
                                               stats_scale=stats_scale, then=then),
                                       priority=chunk.cid if priority is None else priority)

    # ---- the GPU share ([Note: GPU share]) ------------------------------------------------------

    def on_device(self, chunk: GroupChunk) -> bool:
        """The chunk's optimizer state lives on the compute device (it is updated there; its
        grads are homed there too, whatever state the rule keeps)."""
        return self.store.payload_spec(chunk.cid, self.payloads.grads).home is Tier.GPU

    def device_submit(self, chunk: GroupChunk, slots: Iterable[GroupSlot], *, update: bool,
                      grad_scale: float = 1.0, stats: bool = False, stats_scale: float = 1.0,
                      hold: bool = False) -> None:
        """``submit`` for a chunk on the device: its grads are the store's pinned GPU copy of
        "grads" (``device_grads``); accumulation, stats and the update run now, on the caller's
        stream."""
        chunk.window.update(slots)
        store, cid, p = self.store, chunk.cid, self.payloads
        src = None if hold else store.get(cid, p.grads, Tier.GPU)
        if src is not None:
            self._held_grads.add(cid)  # pinned by device_grads until consumed
        if self.grad_accum > 1:
            acc = store.get(cid, p.accum, Tier.GPU, write=True)
            if src is not None:
                if chunk.accumulating:
                    acc.add_(src)
                else:
                    acc.copy_(src)
                store.mark_dirty(cid, p.accum, Tier.GPU)
                self._drop_device_grads(chunk)
            chunk.accumulating = True
            src = acc
        if stats:
            norm = torch.linalg.vector_norm(src, dtype=torch.float32).double() / stats_scale
            sq = norm * norm
            self._device_sumsq = sq if self._device_sumsq is None else self._device_sumsq + sq
        if update:
            self._device_update(chunk, grad_scale)

    def take_device_stats(self) -> float:
        """The device share's sum of squares of this window (a host sync), then reset."""
        total, self._device_sumsq = self._device_sumsq, None
        return 0.0 if total is None else float(total.item())

    def _drop_device_grads(self, chunk: GroupChunk) -> None:
        """Let the chunk's device grads go: unpinned, not evicted (an eviction would write the
        dead grads back to their host home; the placement budgets the copy, and the next
        ``device_grads`` reuses it)."""
        if chunk.cid in self._held_grads:
            self._held_grads.discard(chunk.cid)
            self.store.unpin(chunk.cid, self.payloads.grads, Tier.GPU)

    def _device_update(self, chunk: GroupChunk, grad_scale: float) -> None:
        job = self._update_job(chunk, grad_scale)
        store, cid, p = self.store, chunk.cid, self.payloads
        src = store.get(cid, job.source, Tier.GPU)
        lowp = p.lowp if p.lowp and store.has_payload(cid, p.lowp) else None  # OffloadAdam rounds itself
        names = [p.master, *job.state] + ([lowp] if lowp else [])
        bufs = dict(zip(names, (store.get(cid, n, Tier.GPU, write=True) for n in names)))
        self.rule.device_step(StepBuffers(cid=cid, param=bufs[p.master], grad=src, seed=self.seed,
                                          state={n: bufs[n] for n in job.state},
                                          lowp=bufs[lowp] if lowp else None), job.segments)
        for n in names:
            store.mark_dirty(cid, n, Tier.GPU)
        if job.source == p.grads:
            self._drop_device_grads(chunk)
        chunk.to(ChunkPhase.IDLE)

    def submit_update(self, chunk: GroupChunk, *, grad_scale: float = 1.0,
                      priority: Optional[int] = None) -> None:
        """Queue the update of the chunk's window (its grads already handed over); a chunk on
        the device is updated now ([Note: GPU share])."""
        if self.on_device(chunk):
            self._device_update(chunk, grad_scale)
            return
        job = self._update_job(chunk, grad_scale)
        with self.errors():
            self.pipeline.submit_update(job, priority=chunk.cid if priority is None else priority)

    def skip(self, chunk: GroupChunk) -> None:
        """End the chunk's window without an update (an fp16 overflow)."""
        if self.on_device(chunk):
            self._drop_device_grads(chunk)  # (its stats were taken before the step was skipped)
        chunk.window.clear()
        chunk.accumulating = False
        if chunk.phase is ChunkPhase.FILLING:
            chunk.to(ChunkPhase.IDLE)

    def _update_job(self, chunk: GroupChunk, grad_scale: float) -> UpdateJob:
        """The update of the window's slots; advances their steps and ends the window. A rule
        that is not elementwise gets one segment per slot, each a whole param with its shape."""
        rule, window = self.rule, [s for s in chunk.slots if s in chunk.window]
        if not rule.elementwise:
            for s in window:
                if s.shape is None or math.prod(s.shape) != s.stop - s.offset:
                    raise ValueError(
                        f"{self.owner}: {rule.name} updates whole parameters, but chunk {chunk.cid} "
                        f"has a slot [{s.offset}, {s.stop}) that is not one whole parameter (a "
                        f"data-parallel shard cut it, or its span covers padding); cut shards at "
                        f"parameter boundaries (partition.shard_spans(align_to_params=True))")
        groups = self.hyper.param_groups
        args = {g: rule.args(groups[g], grad_scale=grad_scale) for g in {s.group for s in window}}
        for s in window:
            s.step += 1
        if rule.elementwise:
            spans = update_segments((s.offset, s.stop, s.step, s.group) for s in window)
            segments = tuple(Segment(lo, hi, step, args[g]) for lo, hi, step, g in spans)
        else:
            segments = tuple(Segment(s.offset, s.stop, s.step, args[s.group], tuple(s.shape))
                             for s in window)
        chunk.window.clear()
        chunk.accumulating = False
        chunk.version += 1
        chunk.to(ChunkPhase.QUEUED)
        source = self.payloads.accum if self.grad_accum > 1 else self.payloads.grads
        return UpdateJob(cid=chunk.cid, segments=segments, rule=rule, source=source)

    # ---- updated params ---------------------------------------------------------------------

    def copy_back(self, chunk: GroupChunk, name: str, pieces: Sequence[tuple[int, torch.Tensor]], *,
                  after: Optional[Handle] = None) -> None:
        """On the worker, after an update: copy the payload's host copy at the given offsets into
        the caller's tensors (the model's params), on the store's H2D stream after ``after``.
        The store keeps the source readable until the copies are done (its next update and its
        eviction wait); ``wait`` orders the caller's stream after them."""
        with self.store.use(chunk.cid, name, Tier.CPU):
            chunk.copied = self.store.copy_out(chunk.cid, name, Tier.CPU, pieces, after=after)

    def wait(self, chunk: GroupChunk) -> None:
        """Until no job of the chunk is queued or running; the caller's current CUDA stream waits
        for its copy-back. QUEUED -> IDLE."""
        t0 = time.perf_counter()
        with self.errors():
            self.pipeline.wait_chunk(chunk.cid)  # raises the worker's failure, if any
        self.wait_s += time.perf_counter() - t0
        if chunk.phase is ChunkPhase.QUEUED:
            chunk.to(ChunkPhase.IDLE)
        copied, chunk.copied = chunk.copied, None
        if copied is not None and self.store.config.cuda:
            copied.wait_stream(torch.cuda.current_stream(self.store.device))

    def drain(self) -> None:
        """Every queued job done, every chunk waited for (the caller's stream after its copies)."""
        with self.errors():
            self.pipeline.drain()
        for c in self.chunks:
            self.wait(c)

    def busy(self, cid: int) -> bool:
        return self.pipeline.busy(cid)

    # ---- errors, stats, trace, lifetime -----------------------------------------------------

    @contextlib.contextmanager
    def errors(self):
        """A worker failure raised as one error naming the owner and the way out."""
        try:
            yield
        except PipelineError as e:
            raise PipelineError(f"{self.owner}: a CPU-Adam job failed ({e.__cause__!r}); the optimizer "
                                f"state is no longer consistent with the model (load a checkpoint or "
                                f"state_dict, or rebuild it)") from e

    def check(self) -> None:
        """Raise the worker's failure now, if there was one."""
        if self.pipeline.failed:
            with self.errors():
                self.pipeline.drain()

    def _sample(self) -> dict:
        ps = self.pipeline.stats
        return {"adam_s": ps.adam_s, "busy_s": ps.busy_s, "wait_chunk_s": ps.wait_chunk_s,
                "wait_s": self.wait_s, **self.store.stats.bytes_moved}

    def counters(self) -> dict:
        """The pipeline's and the store's counters since construction or ``reset_counters``."""
        return self._window.read()

    def reset_counters(self) -> None:
        self._window.reset()

    @property
    def trace(self) -> Optional[Trace]:
        return self.pipeline.trace

    @trace.setter
    def trace(self, trace: Optional[Trace]) -> None:
        if trace is not None and not isinstance(trace, Trace):
            raise TypeError(f"{self.owner}.trace takes a zero_offload.Trace or None, got "
                            f"{type(trace).__name__}")
        self.pipeline.trace = trace

    def close(self) -> None:
        """Finish the queued jobs and stop the worker (idempotent; the store is the owner's)."""
        self.pipeline.close()


def update_segments(spans: Iterable[tuple[int, int, int, Any]]) -> list[tuple[int, int, int, Any]]:
    """Maximal runs ``(lo, hi, step, key)`` of the element ranges ``(lo, hi, step, key)`` of the
    slots one update covers (in offset order): touching ranges with the same step count (after
    this update) and the same ``key`` (e.g. the param group) merge, so each run is one CPU-Adam
    call (normally one per chunk)."""
    out: list[list] = []
    for lo, hi, step, key in spans:
        last = out[-1] if out else None
        if last is not None and last[1] == lo and last[2] == step and last[3] == key:
            last[1] = hi
        else:
            out.append([lo, hi, step, key])
    return [tuple(r) for r in out]

