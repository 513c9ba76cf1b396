"""The chunk-group runtime: the per-chunk step protocol both front ends (engine.py's ``Engine``,
offload_optim.py's ``OffloadAdam``) run, written once. FSDP2's ``FSDPParamGroup`` is the model:
the front ends keep the hooks (module hooks / param grad hooks) and the torch face, and call the
group's verbs; the group owns the chunk and slot records, the grads' way to the update, the
collectives (through ``Shards``), the update and where updated params go.

Ownership: a ``ChunkGroup`` owns the ``StepPipeline`` (the update worker) over a ``ChunkStore``
the front end gives it (the engine also runs a ``Prefetcher`` over that store), one
``GroupChunk`` per chunk and a ``GroupSlot`` per param in it, and the stats window over the
store's and the pipeline's counters. The verbs:

- ``expect(slot)``: a grad of the slot will come in this backward (the engine's module hooks);
- ``grad(slot, tensor)``: a grad lands; the group stages it, and once the chunk's grads of the
  pass are complete reduces them across the ranks, sends them home and submits the update (or,
  for a decision over the whole window, the grad job); the GPU share is handled inside;
- ``end_backward()``: the pass is over: what is staged goes on (``drop_backward()`` after an
  error: it is dropped); ``end_micro_batch()`` / ``end_window() -> Decision``: the window's one
  decision (clip, overflow skip) and its updates; ``drop_window()``: the window is forgotten;
- ``params(chunk, shard, ahead=)``: the chunk's whole params on the device (an all-gather, a
  replica); ``gather_updates()``: updated shards into every rank's tensors;
- ``state(chunk)`` / ``load_state(chunk, fill, steps)``: the optimizer state of whole chunks,
  each slot's part of each payload named by its span ([Note: state layout]), for checkpoints and
  ``state_dict`` of both front ends; ``read_values`` / ``write_values``: the params at full
  precision.
The update itself: segments of the slots with grads in the window, each slot's step count, the
arguments the chunk's ``UpdateRule`` makes of each slot's param group, read when the update is
queued (``_update_job``; [Note: update rules] in update_rule.py). Each chunk has one rule (the
group's, or its own: several rules in one model, by param group).

[Note: state layout] A payload laid out like the params holds slot s at ``[s.lo, s.lo + s.numel)``
of the whole chunk (every rank's shards), as the params. A payload sized by the params' shapes
(``StateSpec.spans``: Adafactor's factors) is each rank's own packing of the params it holds
(whole params: the rule is not elementwise, so shards are cut at parameter boundaries, [Note:
whole parameters] in partition.py). Its whole-chunk layout, for ``state``/``load_state``, is the
ranks' payloads side by side, each in a piece as large as the largest (``StateLayout``): every
rank knows every slot's shape and owner, so every rank computes the same layout.

[Note: chunk phases] A chunk is in one ``ChunkPhase``; ``GroupChunk.to`` raises on a move that
``_LEGAL`` does not list:
- IDLE: its params are final for now; no grad of the current accumulation window is staged.
- FILLING: grads of the current window are staged (one or more micro-batches, or some params of
  the chunk so far); the first grad of a pass enters it, after waiting for the chunk's last job
  (it reads the "grads" host copy that new grads overwrite).
- QUEUED: its update is handed to the worker and not yet waited for; ``wait`` (the front end
  needs the params: a fetch, the next grads, a sync) returns it to IDLE.
FILLING -> IDLE without an update: ``skip`` (an fp16 overflow skips the step).

[Note: grad staging] How a grad reaches the chunk's "grads" payload (``Staging``):
- DEVICE (the engine): the grads of a backward pass are summed in a device buffer covering the
  whole chunk (every rank's view: each rank has grads of every param); a chunk is complete when
  every grad ``expect``ed in the pass has landed (or at ``end_backward``). Then the buffer is
  reduced across the ranks (``Shards.reduce_scatter``: the mean, as DDP) into this rank's shard,
  the store's GPU copy of "grads", which goes home (D2H) from the comm stream. One rank with no
  device window stages straight into that GPU copy. With ``grad_accum > 1`` and no "accum"
  payload the passes' buffers are summed in an fp32 device buffer instead (``GroupChunk.total``,
  grad_sync="final") and reduced once, at the window's last micro-batch.
- DIRECT (OffloadAdam): a grad is the ranks' mean already (DDP averaged it) or this rank's own
  (FSDP2's local shards, one rank for us): the elements of it this rank holds are copied to their
  home as they come (the host copy on the store's D2H stream, ``copy_in``; the GPU copy for a
  chunk of the GPU share). Every held slot is expected in every pass. ``keep=True``: the caller
  keeps the tensor (``p.grad``), so ``end_backward`` orders its stream after the copies.
A grad of a chunk whose grads were sent on in this pass is an error (it would be lost).

[Note: grads window] With ``host_grads="window"`` (placement.py) the "grads" payload of a chunk
updated on the host is transient ([Note: transient payloads] in store.py): its device copy goes
down into a slot of the store's bounded window, and the worker gives the slot back as soon as
the grads are consumed (``StepPipeline._consumed``: after the update that reads them, or after
their sum into the accumulation payload), before the job counts as done. Before sending a
chunk's grads down, ``_window_room`` makes sure a slot is free: while all are held it waits for
the queued job of a holder (the one the worker runs first), which frees its slot; the seconds
are ``window_wait_s`` (backward held up by host updates the window did not hide). Grads that
wait for the window's decision (clipping, fp16, no accumulation payload) hold their slots until
the update, so the plan gives such a window a slot per chunk; were it smaller, no queued job
would free one and ``_window_room`` raises instead of waiting forever. Grads that end without an
update (an fp16 overflow, a dropped window or pass) give their slots back (``_release_grads``,
``_release_device_buffer``). The send is issued while the device copy is still pinned, so no
eviction on another thread writes the only copy into the window first.

[Note: GPU share] A chunk whose optimizer state is homed on the GPU (placement's "auto" GPU
share; its params are there too) never goes through the worker: its grads are the store's GPU
copy of "grads", transient (store.py, [Note: transient payloads]): device memory taken at their
staging, pinned until the update or the accumulation consumes them, then given back
(``_drop_device_grads``), so the share holds grads for the one or two chunks in flight, not for
every chunk (placement.py, [Note: share grads]); accumulation sums them
into its "accum" payload (homed on the GPU too), the sum of squares goes to a device scalar, and
its update runs on the caller's stream: the rule's ``device_step`` (Adam: torch's fused Adam(W),
``torch._fused_adamw_``) on the same segments and arguments its CPU job gets, which also rounds
the params from the master. QUEUED -> IDLE happens at once: stream order is the ordering.

[Note: one chunk behind] With several ranks, a chunk of the GPU share is handed to its update
(or accumulation) one flush late: when the next chunk's grads are complete and their
reduce-scatter is issued (``_flush``), or at the end of backward (``end_backward``), in the same
order on every rank. The caller's stream then waits for that chunk's own reduce-scatter only (an
event on the comm stream), which had the next chunk's backward to run behind. Handed on at once,
the stream would wait for the reduce-scatter just issued, with no compute queued before it to
hide it, and, NCCL running a group's collectives in order, for the all-gather issued behind the
previous chunk's update too ([Note: gathers after the update]).

[Note: gathers after the update] With several ranks and ``replicas`` (each rank keeps every
chunk's whole params on its device), a chunk updated on the device has its updated params shard
all-gathered into its replica at once, async, right behind the update on the caller's stream
(``_gather_updated``): during backward with ``overlap`` (the chunk's grads are complete, so
nothing of this backward reads its params again), or as ``end_window`` updates the chunks in
order. The next forward then finds every replica fresh and issues no collective: per step the
ranks exchange the grads' reduce-scatter and the params' all-gather, DDP's all-reduce in two
halves, both behind backward's compute, where gathering at the first use would put an
all-gather in front of each chunk's forward (measured on 4 H100s, 1.31B: the forward waited for
them; session 17). The user of the replica waits for the work device-side (``params`` hands it
over once; ``Shards.finish``); dropping or rewriting a replica waits for it first. Chunks updated
on the host keep gathering at their first use (their new shard reaches the device later).

[Note: param sinks] Where updated params go (``ParamSink``). STORE (the engine): the update
writes the store's params payload (the working copy ``lowp`` or, in fp32, the master itself),
which the engine fetches. TENSORS (OffloadAdamW): each slot's ``param`` (the user's tensor) gets
its elements after every update: on the worker from the host copy on the store's H2D stream,
after the grads copy of that update (``copy_out``: the copies are store readers, so the chunk's
next update and the eviction of an NVMe master wait for them), or on the caller's stream from
the master of a chunk updated on the device; ``wait`` orders the caller's stream after them.
With several ranks each rank writes the elements it holds, and ``gather_updates`` all-gathers
the chunks into every rank's tensors (pending after every window, ``GroupChunk.ungathered``).
The tensors belong to the user: one changed outside the optimizer (its ``_version`` moved; our
copies go through ``.data``, which does not move it) has its master re-read from it before its
next grad is staged.

[Note: the window's decision] ``overlap=True``: no window-wide quantity is needed, so each
chunk's update is queued behind its grads as soon as its window is complete (during backward).
Otherwise (clipping by the global norm, fp16 overflow checks) the grad jobs add up the grads'
sums of squares and ``end_window`` decides once, after every grad of the window: the norm is
all-reduced over the ranks (the norm of the mean grad), an overflow skips every chunk's update
(``scaler.update(found_inf=True)``), a clip divides every update's grads by its coefficient,
and the updates are queued in chunk order.

[Note: update order] The worker runs queued updates in priority order and the next forward needs
the chunks in forward order. With ``learn_order`` (OffloadAdam streaming grads in backward,
whose chunks follow param groups, not the model) the chunks of a window are given the reverse of
the order backward completed them (the last chunk handed over is the first the next forward
uses); chunks without an order go after them in chunk order (the engine's chunks are in module
order already).
"""
from __future__ import annotations

import contextlib
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from .distributed import local
from .pipeline import Accumulate, GradJob, PipelineError, PipelinePayloads, StepPipeline, UpdateJob
from .shards import Gather, Shards
from .store import ChunkStore, Handle, PayloadSpec, Residency, Tier
from .trace import StatsWindow, Trace
from .update_rule import Segment, StepBuffers, UpdateRule

__all__ = ["ChunkGroup", "ChunkPhase", "Decision", "GroupChunk", "GroupSlot", "ParamSink", "Staging",
           "update_segments"]


class ChunkPhase(enum.Enum):
    """See [Note: chunk phases]."""

    IDLE = "idle"
    FILLING = "filling"
    QUEUED = "queued"


_GATHER_UPDATED = "the all-gather of the updated params into the replica"

_LEGAL = {
    ChunkPhase.IDLE: frozenset({ChunkPhase.FILLING}),
    ChunkPhase.FILLING: frozenset({ChunkPhase.QUEUED, ChunkPhase.IDLE}),
    ChunkPhase.QUEUED: frozenset({ChunkPhase.IDLE}),
}


class Staging(enum.Enum):
    """How grads reach the chunk ([Note: grad staging])."""

    DEVICE = "device"  # a whole-chunk device buffer per pass, reduced across ranks, sent home once
    DIRECT = "direct"  # each grad's elements this rank holds, copied home as they come


class ParamSink(enum.Enum):
    """Where updated params go ([Note: param sinks])."""

    STORE = "store"      # the store's params payload (the engine fetches it)
    TENSORS = "tensors"  # each slot's ``param`` (OffloadAdamW: the user's tensors)


@dataclass(eq=False)
class GroupSlot:
    """One param in a chunk: its elements ``[lo, lo + numel)`` of the whole chunk (every rank's
    view) and, set by ``ChunkGroup.add_chunk``, the part of them this rank holds ([Note: chunk
    shards] in shards.py)."""

    lo: int
    numel: int
    end: int = -1
    """End of the whole chunk's elements its update covers (the engine's slots cover their
    alignment padding up to the next slot); -1: ``lo + numel``."""
    group: int = 0
    """Index of its param group in the hyperparameter owner's ``param_groups``."""
    name: str = ""
    """The param's name (errors)."""
    index: int = 0
    """Position in the front end's param order."""
    param: Optional[torch.Tensor] = None
    """The param's tensor where the sink writes (``ParamSink.TENSORS``; its local shard for a
    DTensor); None for the STORE sink."""
    cid: int = -1
    offset: int = 0
    """First element of this rank's shard its update covers ..."""
    stop: int = 0
    """... and the end (``offset == stop``: this rank holds none of it)."""
    start: int = 0
    """First element of the param this rank holds (0 unless a shard boundary cuts it) ..."""
    count: int = 0
    """... and how many, from ``offset`` on (fewer than ``stop - offset`` where the span covers
    padding)."""
    step: int = 0
    """Steps taken (torch.optim's ``state["step"]``; a param without a grad keeps its own)."""
    shape: Optional[tuple] = None
    """The param's shape (None: not given; a rule that is not elementwise needs it)."""
    pos: int = 0
    """Its index in its chunk's ``slots``."""
    version: int = 0
    """``param._version`` when the master last matched the param (``ParamSink.TENSORS``)."""

    @property
    def held(self) -> bool:
        return self.stop > self.offset

    @property
    def whole(self) -> bool:
        """This rank holds the whole param, exactly (``stop - offset`` elements of ``shape``): what
        a rule that is not elementwise updates ([Note: update rules])."""
        return (self.shape is not None and self.start == 0
                and self.stop - self.offset == math.prod(self.shape) == self.count)


@dataclass(frozen=True)
class StateLayout:
    """Where a payload sized by the params' shapes keeps each slot's state ([Note: state layout])."""

    piece: int
    """Elements of each rank's piece of the whole-chunk layout (the largest rank's payload)."""
    whole: tuple
    """Per slot, its ``(lo, hi)`` in the whole-chunk layout (``world * piece`` elements)."""
    mine: tuple
    """Per slot, its ``(lo, hi)`` in this rank's payload (``(0, 0)`` where it holds none)."""


@dataclass(eq=False)
class GroupChunk:
    """One chunk of the group (the bytes are in the store under ``cid``) and its grads on their
    way to the update."""

    cid: int
    slots: tuple
    numel: int
    """Elements of this rank's shard (the size of every payload laid out like the params)."""
    whole: int = 0
    """Elements of the whole chunk (every rank's shards)."""
    rule: Any = None
    """Its update rule ([Note: update rules])."""
    shaped: dict = field(default_factory=dict)
    """Payload name -> ``StateLayout`` of its rule's payloads sized by shapes ([Note: state layout])."""
    phase: ChunkPhase = ChunkPhase.IDLE
    window: set = field(default_factory=set)
    """Slots with a grad in the current accumulation window (this rank's parts)."""
    accumulating: bool = False
    """The fp32 accumulation payload holds grads of this window (``grad_accum > 1``)."""
    copied: Optional[Handle] = None
    """The copy-back of its last update (``ParamSink.TENSORS``); ``wait`` orders the caller after it."""
    version: int = 0
    """Updates queued so far: a copy of the params taken at one version is stale at the next."""
    # -- this backward pass ([Note: grad staging]) --
    expected: set = field(default_factory=set)
    """Slots whose grad is expected in this pass."""
    landed: set = field(default_factory=set)
    """Slots whose grad landed in this pass."""
    awaiting: set = field(default_factory=set)
    """``expected - landed`` (grads still to come)."""
    flushed: bool = False
    """This pass's grads were sent on (a late grad is then an error)."""
    grads: Optional[torch.Tensor] = None
    """DEVICE staging: the whole chunk's device grads of this pass (None once sent on)."""
    total: Optional[torch.Tensor] = None
    """DEVICE staging with a device window: the whole chunk's fp32 grads summed over the window."""
    total_slots: set = field(default_factory=set)
    """The slots with a grad in ``total``."""
    pinned_grads: bool = False
    """The store's GPU copy of "grads" is pinned (staged, or waiting for an update on the device)."""
    ready: Optional[Handle] = None
    """The move that lands the pass's grads in the host copy (the last ``copy_in``, DIRECT)."""
    # -- its updates --
    updated: tuple = ()
    """The slots of its last update (where the sink writes)."""
    priority: Optional[int] = None
    """Its place in the next forward ([Note: update order]); None: chunk order."""
    ungathered: bool = False
    """Several ranks, ``ParamSink.TENSORS``: updated shards not yet in every rank's tensors."""
    replica: Optional[torch.Tensor] = None
    """Several ranks with replicas: the whole chunk's params kept on the device between uses,
    gathered again only after an update (``replica_version``)."""
    replica_version: int = -1
    replica_work: Any = None
    """The all-gather into ``replica`` issued right after the chunk's update on the device, not
    waited for yet ([Note: gathers after the update]); its user's stream waits for it."""
    # -- the front end's view (the engine's; None for OffloadAdam) --
    layout: Any = None
    """The front end's layout of the chunk (the engine's ``partition.ChunkLayout``), or None."""
    buffer: Optional[torch.Tensor] = None
    """The device buffer of the whole chunk's params while the front end has them mapped (the
    engine's; [Note: parameter data] in param_guard.py), None otherwise."""
    _by_index: dict = field(default_factory=dict, repr=False)
    """``GroupSlot.index`` -> its slot (``slot``), built from ``slots``."""

    def __post_init__(self) -> None:
        self._by_index = {s.index: s for s in self.slots}

    def slot(self, index: int) -> Optional[GroupSlot]:
        """Its slot of the front end's param ``index`` (``GroupSlot.index``); None if it has none
        (a frozen param, or another chunk's)."""
        return self._by_index.get(index)

    def expects(self, index: int) -> bool:
        """The grad of the front end's param ``index`` is expected in this pass."""
        s = self._by_index.get(index)
        return s is not None and s in self.expected

    @property
    def steps(self) -> list:
        """Optimizer step count per slot, in order (torch.optim's ``state["step"]``)."""
        return [s.step for s in self.slots]

    def to(self, phase: ChunkPhase) -> None:
        if phase not in _LEGAL[self.phase]:
            raise RuntimeError(f"zero_offload internal error: chunk {self.cid} cannot go from "
                               f"{self.phase.name} to {phase.name}; please report this")
        self.phase = phase

    def expect(self, slot: GroupSlot) -> None:
        """A grad of ``slot`` will land in this pass."""
        if slot not in self.expected:
            self.expected.add(slot)
            if slot not in self.landed:
                self.awaiting.add(slot)

    def land(self, slot: GroupSlot) -> None:
        self.landed.add(slot)
        self.awaiting.discard(slot)

    def clear_pass(self) -> None:
        """Forget the expected/landed grads of the pass that ended."""
        self.expected.clear()
        self.landed.clear()
        self.awaiting.clear()
        self.flushed = False

    @property
    def replica_fresh(self) -> bool:
        """The replica holds the params of the chunk's latest update."""
        return self.replica is not None and self.replica_version == self.version


@dataclass(frozen=True)
class Decision:
    """The end of a window ([Note: the window's decision])."""

    updated: bool
    """The params were updated (or their updates queued)."""
    skipped: bool = False
    """An fp16 overflow skipped the window's updates."""
    norm: Optional[float] = None
    """The global grad norm (clipping only)."""


def _piece(slot: GroupSlot, t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` (a param or its grad; a DTensor's local shard) that this rank holds
    of ``slot``, flat (a view where ``t`` is contiguous)."""
    return local(t).detach().reshape(-1)[slot.start:slot.start + slot.count]


def _target(slot: GroupSlot) -> torch.Tensor:
    """The elements of ``slot.param`` this rank holds, as a flat view of its data (written through
    ``.data``: the param's ``_version`` does not move)."""
    return local(slot.param).data.view(-1)[slot.start:slot.start + slot.count]


def _weak(method: Callable) -> Callable:
    """``method`` called through a weak reference to its object (a no-op once it is gone): the
    worker thread does not keep the group, nor the front end it holds, alive."""
    import weakref
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


class ChunkGroup:
    """The chunks of one front end, their grads, updates and state (see the module docstring).
    Caller's-thread object (the front end serialises its calls); the worker only runs jobs and
    calls ``on_chunk_idle`` (and the TENSORS sink's copy-back).

    Args:
        store: the ChunkStore holding every payload named in ``payloads``.
        hyper: the object whose ``param_groups`` (torch optimizer style) hold each group's
            hyperparameters (the rule's ``hyper_keys``), read when an update is queued.
        rule: the update ([Note: update rules]); every chunk has its state payloads.
        payloads: the pipeline's payload names (besides the rule's).
        shards: the data-parallel group (None: one rank).
        staging: see [Note: grad staging]; sink: see [Note: param sinks].
        window: micro-batches per update; their grads are summed in ``payloads.accum`` when it
            is set, else (DEVICE staging) in an fp32 device buffer reduced at the window's end.
        overlap, clip, scaler: see [Note: the window's decision]; ``clip``: the max global grad
            norm; ``scaler``: a loss scaler (``scale``, ``update(found_inf=)``) the grads are
            scaled by. Either needs ``overlap=False``.
        replicas: several ranks: keep each chunk's gathered params between uses (``params``).
        learn_order: see [Note: update order].
        owner: the front end's name, for errors.
        prefetch_depth, threads, on_chunk_idle: the ``StepPipeline``'s.
    """

    def __init__(self, store: ChunkStore, *, hyper: Any, rule: UpdateRule,
                 payloads: PipelinePayloads,
                 shards: Optional[Shards] = None, staging: Staging = Staging.DEVICE,
                 sink: ParamSink = ParamSink.STORE, window: int = 1, overlap: bool = True,
                 clip: Optional[float] = None, scaler: Any = None, replicas: bool = False,
                 learn_order: bool = False, owner: str = "zero_offload", prefetch_depth: int = 2,
                 threads: Optional[int] = None, on_chunk_idle: Optional[Callable[[int], None]] = None):
        if overlap and (clip is not None or scaler is not None):
            raise ValueError(f"{owner}: clipping and loss scaling decide once per window: they need "
                             f"ChunkGroup(overlap=False)")
        if window > 1 and payloads.accum is None and staging is Staging.DIRECT:
            raise ValueError(f"{owner}: DIRECT staging sums a window's grads in the accumulation "
                             f"payload: give PipelinePayloads(accum=...) with window={window}")
        if not isinstance(rule, UpdateRule):
            raise TypeError(f"{owner}: rule must be an UpdateRule (runtime/update_rule.py), got "
                            f"{type(rule).__name__}")
        self.store = store
        self.shards = shards if shards is not None else Shards(owner=owner)
        self.seed = self.shards.rank  # bf16 moments: [Note: stochastic rounding] (ops/rounding.py)
        self.hyper = hyper
        self.rule = rule
        self.payloads = payloads
        self.staging = staging
        self.sink = sink
        self.window = window
        self.grad_accum = window if payloads.accum is not None else 1
        """Micro-batches whose grads are summed in the accumulation payload (1: none)."""
        self._device_window = window > 1 and payloads.accum is None and staging is Staging.DEVICE
        self._in_store = staging is Staging.DEVICE and self.shards.world == 1 and not self._device_window
        """DEVICE staging straight into the store's GPU copy of "grads" (nothing to reduce)."""
        self.overlap = overlap
        self.clip = clip
        self.scaler = scaler
        self._stats = clip is not None or scaler is not None
        self.replicas = replicas
        self.learn_order = learn_order
        self.owner = owner
        self.micro = 0
        """Micro-batches done in the current window."""
        self.chunks: list[GroupChunk] = []
        self.pipeline = StepPipeline(store, payloads=payloads, prefetch_depth=prefetch_depth,
                                     threads=threads, on_chunk_idle=on_chunk_idle, seed=self.seed,
                                     on_update_done=(_weak(self._write_back) if sink is ParamSink.TENSORS
                                                     else None))
        self._device_sumsq: Optional[torch.Tensor] = None  # [Note: GPU share]: this window's stats
        self._updated = False  # an update was queued in this window (overlap)
        self._submitted: list[GroupChunk] = []  # this window's updates in hand-over order
        self._kept = False  # a staged grad stays the caller's: end_backward orders its stream after
        self._lagged: Optional[tuple] = None  # [Note: one chunk behind]: (chunk, slots, reduced)
        self.wait_s = 0.0
        """Seconds the caller's thread waited in ``wait`` for updates (what overlap did not hide)."""
        self.window_wait_s = 0.0
        """Seconds of ``wait_s`` spent waiting for a slot of the grads window ([Note: grads
        window]): backward held up by host updates that the window did not hide."""
        self._counter_window = StatsWindow(self._sample)

    # ---- building ---------------------------------------------------------------------------

    def homes_ahead(self, specs: Sequence[Mapping[str, PayloadSpec]]):
        """Within: the host homes of the chunks about to be added (each one's ``specs``, in the
        order of the ``add_chunk`` calls) are made on a thread ahead of them ([Note: homes ahead]
        in pinned_pool.py; ``ChunkStore.homes_ahead``)."""
        return self.store.homes_ahead([n for s in specs for n in self.store.host_home_sizes(s)])

    def add_chunk(self, specs: Mapping[str, PayloadSpec], slots: Sequence[GroupSlot], *,
                  whole: Optional[int] = None, rule: Optional[UpdateRule] = None,
                  layout: Any = None) -> GroupChunk:
        """Register a chunk in the store (home copies allocated, this rank's shard of each
        payload: ``specs``) and in the group; its id is its index in ``chunks``. ``slots``: its
        params over the ``whole`` chunk (default: the shard's size), in order; each gets its
        part of this rank's shard. ``rule``: its update rule (default: the group's). A rule that
        is not elementwise needs every slot's ``shape`` and each slot whole on one rank.
        ``layout``: the front end's (``GroupChunk.layout``)."""
        rule = self.rule if rule is None else rule
        if not isinstance(rule, UpdateRule):
            raise TypeError(f"{self.owner}: rule must be an UpdateRule, got {type(rule).__name__}")
        numel = self.shards.span(whole)[2] if whole is not None else next(iter(specs.values())).numel
        whole = numel if whole is None else whole
        for i, s in enumerate(slots):
            s.end = s.lo + s.numel if s.end < 0 else s.end
            s.pos = i
            s.offset, s.stop, s.start = self.shards.cut(s.lo, s.end, whole) or (0, 0, 0)
            part = self.shards.cut(s.lo, s.lo + s.numel, whole)
            s.count = part[1] - part[0] if part is not None else 0
            if not rule.elementwise and s.held and not s.whole:
                raise ValueError(
                    f"{self.owner}: {rule.name} updates whole parameters, but {s.name or 'a parameter'} "
                    f"(elements [{s.lo}, {s.lo + s.numel}) of its chunk) is not whole on this rank (a "
                    f"data-parallel shard cuts it, or its shape was not given); lay the chunk out with "
                    f"partition.align_shards")
        shaped = {} if rule.elementwise else self._state_layouts(rule, slots, numel)
        cid = self.store.add_chunk(specs)
        if cid != len(self.chunks):
            raise RuntimeError(f"{self.owner}: the store has chunks the group does not own; give each "
                               f"ChunkGroup a store of its own")
        for s in slots:
            s.cid = cid
            if s.param is not None:
                s.version = local(s.param)._version
        chunk = GroupChunk(cid=cid, slots=tuple(slots), numel=numel, whole=whole, rule=rule, shaped=shaped,
                           layout=layout)
        self._expect_all(chunk)
        self.chunks.append(chunk)
        return chunk

    def _state_layouts(self, rule: UpdateRule, slots: Sequence[GroupSlot], numel: int) -> dict:
        """``StateLayout`` of each of ``rule``'s payloads sized by shapes ([Note: state layout]):
        every rank's payloads, from the slots' shapes and owners (slot s lies in rank
        ``s.lo // numel``'s shard)."""
        owners = [[] for _ in range(self.shards.world)]
        for s in slots:
            owners[min(s.lo // numel, self.shards.world - 1)].append(s)
        per_rank = [rule.payloads(numel, [tuple(s.shape) for s in mine]) for mine in owners]
        out = {}
        for key, spec in per_rank[self.shards.rank].items():
            if spec.spans is None:
                continue
            piece = max(1, max(p[key].numel for p in per_rank))
            whole, mine = [None] * len(slots), [(0, 0)] * len(slots)
            for r, (held, specs) in enumerate(zip(owners, per_rank)):
                for s, (lo, hi) in zip(held, specs[key].spans):
                    whole[s.pos] = (r * piece + lo, r * piece + hi)
                    if r == self.shards.rank:
                        mine[s.pos] = (lo, hi)
            out[key] = StateLayout(piece=piece, whole=tuple(whole), mine=tuple(mine))
        return out

    # ---- whole payloads (caller's thread, no job of the chunk running) ----------------------

    @property
    def state_names(self) -> dict:
        """Optimizer-state key -> payload name: "master" and the group's rule's ``state_keys``
        (Adam: "exp_avg", "exp_avg_sq"); ``names(chunk)`` for a chunk's own rule."""
        return {"master": self.payloads.master, **{k: k for k in self.rule.state_keys}}

    def names(self, chunk: GroupChunk) -> dict:
        """``state_names`` of ``chunk`` (its rule's state)."""
        return {"master": self.payloads.master, **{k: k for k in chunk.rule.state_keys}}

    def spans(self, chunk: GroupChunk, key: str) -> tuple:
        """Per slot, its ``(lo, hi)`` in the whole-chunk layout of state ``key`` ([Note: state
        layout]): its params' elements, or its part of a payload sized by shapes."""
        lay = chunk.shaped.get(key)
        return lay.whole if lay is not None else tuple((s.lo, s.lo + s.numel) for s in chunk.slots)

    def _whole_numel(self, chunk: GroupChunk, key: str) -> int:
        lay = chunk.shaped.get(key)
        return chunk.whole if lay is None else lay.piece * self.shards.world

    @contextlib.contextmanager
    def hold(self, chunk: GroupChunk, names: Sequence[str], *, write: bool = False, fresh: bool = False):
        """Host (CPU) buffers of the payloads ``names`` of ``chunk``, after its last job. ``write``:
        the caller changes them (they become the newest copies). ``fresh``: the caller writes
        every element (nothing is read; the buffers start zeroed). Copies whose home is not the
        CPU are written home when changed and dropped after the block."""
        self.wait(chunk)
        store, cid = self.store, chunk.cid
        away = [n for n in names if store.home(cid, n) is not Tier.CPU]  # (parked: [Note: parking] in store.py)
        with contextlib.ExitStack() as held:
            bufs = []
            for name in names:
                if fresh:
                    buf = store.allocate(cid, name, Tier.CPU, zero=True, pin=True)
                    held.callback(store.unpin, cid, name, Tier.CPU)
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
        """A CPU copy (clone) of this rank's shard of a payload, from wherever its newest bytes are."""
        with self.hold(chunk, [name]) as (buf,):
            return buf.clone()

    def take(self, chunk: GroupChunk, name: str) -> torch.Tensor:
        """``read``, then the chunk's memory in every tier is freed (``ChunkStore.discard``): for
        an owner that is closing and hands the values on chunk by chunk."""
        out = self.read(chunk, name)  # (after the chunk's last job: ``hold`` waits)
        self.store.discard(chunk.cid)
        return out

    def _values_name(self, chunk: GroupChunk) -> str:
        """The payload holding the chunk's params at full precision: the fp32 master, or the
        params themselves (fp32 training, frozen chunks)."""
        p = self.payloads
        return p.master if self.store.has_payload(chunk.cid, p.master) else p.lowp

    def read_values(self, chunk: GroupChunk, *, take: bool = False) -> torch.Tensor:
        """The whole chunk's params at full precision, a CPU tensor (every rank's shards:
        collective). ``take``: the chunk's memory is freed after (``take``)."""
        mine = (self.take if take else self.read)(chunk, self._values_name(chunk))
        return self.shards.gather_whole([mine], chunk.whole, what="an all-gather of a chunk's state",
                                        copy=False)[0]

    def values_back_order(self, taken: Sequence[GroupChunk]) -> list:
        """For an owner giving the chunks' values back for good (``values(take=True)`` each):
        the chunks not in ``taken`` (made, never filled: a handover that failed part-way) are
        discarded first, then ``taken`` with the chunks holding host homes first, each group in
        order. A value read of a chunk homed elsewhere passes through a host copy that needs room
        in the host budget, which the homes may fill ([Note: auto reserve] in placement.py). The
        same order on every rank: it reads the homes, which agree, not the shards' bytes (each
        chunk's read is collective)."""
        keep = {c.cid for c in taken}
        for c in self.chunks:
            if c.cid not in keep and not self.store.discarded(c.cid):
                self.wait(c)
                self.store.discard(c.cid)
        return sorted(taken, key=lambda c: not self.store.homed_in(c.cid, Tier.CPU))  # (stable)

    @contextlib.contextmanager
    def values(self, chunk: GroupChunk, *, take: bool = False):
        """``read_values`` without its copy: the whole chunk's params at full precision as a CPU
        tensor valid inside the block (one rank: the store's own buffer; read it, never write
        it). ``take``: the chunk's memory is freed after the block (``take``)."""
        with self.hold(chunk, [self._values_name(chunk)]) as (mine,):
            yield self.shards.gather_whole([mine], chunk.whole, what="an all-gather of a chunk's state",
                                           copy=False)[0]
        if take:
            self.store.discard(chunk.cid)

    def write_values(self, chunk: GroupChunk, fill: Callable[[torch.Tensor], None]) -> None:
        """Overwrite the chunk's params: ``fill`` writes the whole chunk's values at full
        precision (at whole-chunk offsets into a zeroed buffer); this rank keeps its shard, and
        the working copy is rounded from it (as the kernel writes it)."""
        self._write(chunk, self._values_name(chunk), fill)

    def state(self, chunk: GroupChunk) -> dict:
        """CPU copies of a trainable chunk's optimizer state over the whole chunk (every rank's
        shards: collective), by ``names(chunk)`` key ("master", "exp_avg", "exp_avg_sq"; fp32,
        bf16 moments widened); "spans": per key, each slot's ``(lo, hi)`` in it ([Note: state
        layout]); "steps": each slot's step count (the largest over the ranks: a slot cut by a
        shard boundary is stepped by each of its ranks)."""
        names = self.names(chunk)
        with self.hold(chunk, list(names.values())) as bufs:
            pieces = {}
            for key, buf in zip(names, bufs):
                lay = chunk.shaped.get(key)
                if lay is None:
                    pieces[key] = buf.float()
                else:  # this rank's payload in its piece of the whole layout
                    pieces[key] = torch.zeros(lay.piece, dtype=torch.float32)
                    pieces[key][:min(buf.numel(), lay.piece)].copy_(buf[:lay.piece])
            out = {}
            for size in sorted({t.numel() for t in pieces.values()}):  # one all-gather per size
                keys = [k for k in names if pieces[k].numel() == size]
                values = self.shards.gather_whole([pieces[k] for k in keys], self.shards.world * size,
                                                  what="the all-gather of the optimizer state")
                out.update(zip(keys, values))
        out = {k: out[k][:self._whole_numel(chunk, k)] for k in names}
        out["spans"] = {k: self.spans(chunk, k) for k in names}
        out["steps"] = self.shards.max_steps([s.step for s in chunk.slots])
        return out

    def load_state(self, chunk: GroupChunk, fill: Callable[[str, torch.Tensor, tuple], None],
                   steps: Optional[Sequence[int]] = None) -> None:
        """Overwrite a trainable chunk's optimizer state: ``fill(key, buf, spans)`` writes the
        values of ``key`` (as ``state`` names them) into a zeroed buffer of the whole chunk's
        layout of ``key``, slot i at ``spans[i]`` ([Note: state layout]); this rank keeps its
        shard; the working params are the master rounded. ``steps``: each slot's step count
        (None: unchanged)."""
        for key, name in self.names(chunk).items():
            spans = self.spans(chunk, key)
            self._write(chunk, name, lambda buf, key=key, spans=spans: fill(key, buf, spans),
                        whole=self._whole_numel(chunk, key))
        for s, step in zip(chunk.slots, steps if steps is not None else ()):
            s.step = int(step)
        for s in chunk.slots:
            if s.param is not None:
                s.version = local(s.param)._version  # the master matches the param again

    def _write(self, chunk: GroupChunk, name: str, fill: Callable[[torch.Tensor], None], *,
               whole: Optional[int] = None) -> None:
        """Overwrite this rank's shard of a payload from ``fill`` (whole-chunk offsets, of a
        layout of ``whole`` elements: default the chunk's); the master's working copy (``lowp``),
        where the chunk has one, is its rounding."""
        p = self.payloads
        names = [name] + ([p.lowp] if name == p.master and p.lowp is not None
                          and self.store.has_payload(chunk.cid, p.lowp)
                          and not self.store.derived(chunk.cid, p.lowp) else [])  # (derived: remade)
        self._drop_replica(chunk)
        with self.hold(chunk, names, fresh=True) as bufs:
            self.shards.fill(bufs[0], chunk.whole if whole is None else whole, fill)
            if len(bufs) > 1:
                bufs[1].copy_(bufs[0])

    # ---- grads ([Note: grad staging]) -----------------------------------------------------------

    def expect(self, slot: GroupSlot) -> None:
        """A grad of ``slot`` will land in this backward pass (DEVICE staging)."""
        self.chunks[slot.cid].expect(slot)

    def has_grad(self, slot: GroupSlot) -> bool:
        """A grad of ``slot`` landed in this pass."""
        return slot in self.chunks[slot.cid].landed

    def staged(self) -> bool:
        """Grads of a pass are staged (a backward is in progress)."""
        return any(c.landed for c in self.chunks)

    def grad(self, slot: GroupSlot, grad: torch.Tensor, *, keep: bool = False) -> None:
        """A grad of ``slot`` landed: staged, and once the chunk's grads of the pass are complete,
        reduced across the ranks, sent home and handed to the update. ``keep``: the caller keeps
        ``grad`` (DIRECT; see [Note: grad staging])."""
        chunk = self.chunks[slot.cid]
        if self.staging is Staging.DIRECT and not slot.held:
            return  # another rank's elements
        if chunk.flushed:
            raise RuntimeError(
                f"{self.owner}: parameter {slot.name!r} received a gradient after the grads of its "
                f"chunk were sent on in this backward (it was used again after every expected grad "
                f"of the chunk had landed). Use torch.utils.checkpoint with use_reentrant=False, and "
                f"call the model only through engine(...)")
        if self.staging is Staging.DIRECT:
            self._stage_direct(chunk, slot, grad, keep=keep)
        else:
            self._stage_device(chunk, slot, grad)
        if not chunk.awaiting:
            self._flush(chunk)

    def _open(self, chunk: GroupChunk) -> None:
        """The chunk's first grad of this pass: its last job (which reads the "grads" host copy)
        finishes first; the chunk is FILLING."""
        self.wait(chunk)
        if chunk.phase is ChunkPhase.IDLE:
            chunk.to(ChunkPhase.FILLING)

    def _stage_device(self, chunk: GroupChunk, slot: GroupSlot, grad: torch.Tensor) -> None:
        if not chunk.landed:
            self._open(chunk)
            if self._in_store:
                chunk.grads = self._device_buffer(chunk)
            else:  # the whole chunk's grads; each rank gets its (mean) shard when they are sent on
                spec = self.store.payload_spec(chunk.cid, self.payloads.grads)
                chunk.grads = torch.zeros(chunk.numel * self.shards.world, dtype=spec.dtype,
                                          device=self.store.device)
        dst = chunk.grads[slot.lo:slot.lo + slot.numel]
        if slot in chunk.landed:
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))
            chunk.land(slot)

    def _stage_direct(self, chunk: GroupChunk, slot: GroupSlot, grad: torch.Tensor, *, keep: bool) -> None:
        on_device = self._on_device(chunk)
        if not chunk.landed:
            self._open(chunk)
            if on_device:
                chunk.grads = self._device_buffer(chunk)
            else:  # taken for writing once; the pieces land by copy_in
                self.store.get(chunk.cid, self.payloads.grads, Tier.CPU, write=True)
        if slot.param is not None and local(slot.param)._version != slot.version:
            self._resync(chunk, slot)
        piece = _piece(slot, grad)
        if on_device:  # on the caller's stream, as the update that reads it
            chunk.grads[slot.offset:slot.offset + slot.count].copy_(piece)
        else:
            chunk.ready = self.store.copy_in(chunk.cid, self.payloads.grads, Tier.CPU, [(slot.offset, piece)])
            self._kept |= keep
        chunk.land(slot)

    def _resync(self, chunk: GroupChunk, slot: GroupSlot) -> None:
        """The param changed outside the optimizer: its master is re-read from it ([Note: param
        sinks]). Rare: synchronous."""
        with self.hold(chunk, [self.payloads.master], write=True) as (master,):
            master[slot.offset:slot.offset + slot.count].copy_(_piece(slot, slot.param))
        slot.version = local(slot.param)._version

    def _expect_all(self, chunk: GroupChunk) -> None:
        if self.staging is Staging.DIRECT:
            for s in chunk.slots:
                if s.held:
                    chunk.expect(s)

    def _flush(self, chunk: GroupChunk) -> None:
        """The chunk's staged grads of this pass go on: reduced, sent home and handed to the
        worker (or the device update)."""
        slots = [s for s in chunk.landed if s.held]
        if self.staging is Staging.DIRECT:
            ready = None
            if not self._on_device(chunk):
                self.store.mark_dirty(chunk.cid, self.payloads.grads, Tier.CPU)
                ready = chunk.ready
        else:
            full, chunk.grads = chunk.grads, None
            if self._device_window:  # only the window's last micro-batch talks
                if full is not None:
                    if chunk.total is None:
                        chunk.total = full.float()
                    else:
                        chunk.total.add_(full)
                    chunk.total_slots.update(slots)
                chunk.flushed = True
                if not self._boundary:
                    return
                full, chunk.total = chunk.total, None
                slots, chunk.total_slots = list(chunk.total_slots), set()
            ready = self._send_down(chunk) if self._in_store else self._reduce(chunk, full)
            if self.shards.world > 1 and self._on_device(chunk):
                # [Note: one chunk behind]: the reduce-scatter just issued runs while the previous
                # chunk is updated and backward goes on
                chunk.flushed = True
                lagged, self._lagged = self._lagged, (chunk, slots, self._reduced_event())
                if lagged is not None:
                    self._run_lagged(lagged)
                return
        chunk.flushed = True
        self._submit(chunk, slots, ready=ready)

    def _reduced_event(self) -> Optional["torch.cuda.Event"]:
        """An event on the comm stream after the reduce-scatter just issued (None without one)."""
        streams = self.shards.streams
        return streams.reduce.record_event() if streams is not None else None

    def _run_lagged(self, lagged: tuple) -> None:
        """The update (or accumulation) of a chunk of the GPU share whose grads were reduced one
        flush ago: the caller's stream waits for that reduce-scatter only, then goes on."""
        chunk, slots, reduced = lagged
        if reduced is not None:
            torch.cuda.current_stream(self.store.device).wait_event(reduced)
        self._submit(chunk, slots, ready=None)

    def _drain_lagged(self) -> None:
        lagged, self._lagged = self._lagged, None
        if lagged is not None:
            self._run_lagged(lagged)

    def _device_buffer(self, chunk: GroupChunk) -> torch.Tensor:
        """The store's GPU copy of the chunk's "grads", zeroed and pinned."""
        store, name = self.store, self.payloads.grads
        buf = store.allocate(chunk.cid, name, Tier.GPU, pin=True)
        chunk.pinned_grads = True
        buf.zero_()
        return buf

    def _reduce(self, chunk: GroupChunk, full: torch.Tensor) -> Optional[Handle]:
        """This rank's shard of the mean over the ranks of the whole chunk's device grads
        ``full`` into the store's GPU copy, then home ([Note: comm streams] in shards.py)."""
        shard = self._device_buffer(chunk)
        try:
            self.shards.reduce_scatter(full, shard, what="the reduce-scatter of a chunk's grads")
        except BaseException:
            self._release_device_buffer(chunk)  # the pin taken above ([Note: collective failures])
            raise
        with self.shards.after_reduce():
            handle = self._send_down(chunk)
        return handle  # (a chunk of the GPU share: its update waits for the reduce, _run_lagged)

    def _send_down(self, chunk: GroupChunk) -> Optional[Handle]:
        """The staged GPU copy of "grads" goes home (D2H, async; the returned handle) and is
        freed; a chunk of the GPU share keeps it, pinned until its update ([Note: GPU share])."""
        if self._on_device(chunk):
            return None
        return self._release_device_buffer(chunk, send=True)

    def _release_device_buffer(self, chunk: GroupChunk, *, send: bool = False) -> Optional[Handle]:
        """Unpin the GPU copy of "grads"; unless it is its home, free it (``send``: after its move
        home, issued while the copy is still pinned, so that nothing evicts it first: a windowed
        home would then be written by the evicting thread; [Note: grads window])."""
        store, name, cid = self.store, self.payloads.grads, chunk.cid
        if store.payload_spec(cid, name).home is Tier.GPU:
            self._drop_device_grads(chunk)
            return Handle.completed()
        handle = None
        if send:
            try:
                self._window_room(chunk)
            except BaseException:  # the grads are lost with the pass: their pin and copy go
                self._drop_device_grads(chunk)
                with contextlib.suppress(Exception):  # (never raising over the cause)
                    store.release(cid, name)
                raise
            handle = store.flush(cid, name, Tier.CPU)
        self._drop_device_grads(chunk)
        if not send and store.windowed(cid, name):
            store.release(cid, name)  # dead grads: no window slot for them
        else:
            store.evict(cid, name, Tier.GPU)
        return handle

    def _window_room(self, chunk: GroupChunk) -> None:
        """[Note: grads window]: before the chunk's grads go to a windowed home, a slot is free:
        while every slot holds grads, wait for the update of a chunk holding one (the first the
        worker runs) to consume them. Raises (never hangs) when no queued job would free one."""
        store, name = self.store, self.payloads.grads
        if not store.windowed(chunk.cid, name) or store.state(chunk.cid, name, Tier.CPU) is not Residency.ABSENT:
            return  # the persistent layout, or its slot is held already
        window = store.window
        while not window.available():
            holders = [c for c in self.chunks if c is not chunk and self.pipeline.busy(c.cid)
                       and store.windowed(c.cid, name)
                       and store.state(c.cid, name, Tier.CPU) is not Residency.ABSENT]
            if not holders:
                if window.available():  # a holder's update gave its slot back (the worker's
                    break               # ``_consumed``) after the check above: nothing to wait for
                raise RuntimeError(
                    f"{self.owner}: the grads window's {window.slots} slot(s) all hold grads that no queued "
                    f"update will consume (they wait for the window's decision: clipping or fp16 without "
                    f"an accumulation buffer); this is a placement bug, please report it. Work around it "
                    f"with host_grads='persistent'")
            t0 = time.perf_counter()
            self.wait(min(holders, key=self._priority))
            self.window_wait_s += time.perf_counter() - t0

    def _release_grads(self, chunk: GroupChunk) -> None:
        """The chunk's grads in a windowed home are dead (its window ends without an update):
        their slot goes back, after the chunk's jobs (which may read them)."""
        store, name = self.store, self.payloads.grads
        if self._on_device(chunk) or not store.windowed(chunk.cid, name) \
                or store.state(chunk.cid, name, Tier.CPU) is Residency.ABSENT:
            return
        if self.pipeline.busy(chunk.cid):
            self.wait(chunk)
        store.release(chunk.cid, name)

    def _drop_device_grads(self, chunk: GroupChunk) -> None:
        """Let the chunk's device grads go: unpinned, not evicted (an eviction would write the
        dead grads back to their host home; the placement budgets the copy, and the next
        staging reuses it). A chunk of the GPU share gives their device memory back ([Note:
        GPU share]: the grads are transient there)."""
        if chunk.pinned_grads:
            chunk.pinned_grads = False
            store, name = self.store, self.payloads.grads
            store.unpin(chunk.cid, name, Tier.GPU)
            spec = store.payload_spec(chunk.cid, name)
            if spec.transient and spec.home is Tier.GPU:
                store.release(chunk.cid, name)

    @property
    def _boundary(self) -> bool:
        """This micro-batch is the window's last."""
        return self.micro == self.window - 1

    def _submit(self, chunk: GroupChunk, slots: Iterable[GroupSlot], *, ready: Optional[Handle],
                hold: bool = False) -> None:
        """Hand the grads of ``slots`` on: summed into the accumulation payload (host
        accumulation), their sum of squares added up at the window's end (a decision follows),
        and with ``overlap`` the update right behind at the window's end (QUEUED)."""
        boundary = self._boundary
        update = boundary and self.overlap
        self._updated |= update
        stats = boundary and self._stats
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self._on_device(chunk):
            self._device_submit(chunk, slots, update=update, stats=stats, stats_scale=scale, hold=hold)
            return
        if update:
            self._submitted.append(chunk)
        chunk.window.update(slots)
        if self.grad_accum == 1:
            acc = Accumulate.NONE
        elif hold:
            acc = Accumulate.HOLD
        else:
            acc = Accumulate.ADD if chunk.accumulating else Accumulate.COPY
            chunk.accumulating = True
        then = None
        if update:
            chunk.updated = self._window_slots(chunk)
            then = self._update_job(chunk, 1.0)
        with self.errors():
            self.pipeline.submit_grads(GradJob(cid=chunk.cid, ready=ready or Handle.completed(),
                                               accumulate=acc, stats=stats, stats_scale=scale, then=then),
                                       priority=self._priority(chunk))

    def _priority(self, chunk: GroupChunk) -> int:
        return chunk.priority if chunk.priority is not None else len(self.chunks) + chunk.cid

    @staticmethod
    def _window_slots(chunk: GroupChunk) -> tuple:
        return tuple(s for s in chunk.slots if s in chunk.window)

    def end_backward(self) -> None:
        """The backward pass is over: grads staged but not sent on (expected grads that never
        came: unused outputs) go on now, in chunk order (the same on every rank); at the window's
        last micro-batch a chunk with grads of earlier ones only gets its stats/update from the
        accumulation payload."""
        boundary = self._boundary
        for c in self.chunks:
            if (c.landed and not c.flushed) or (boundary and c.total is not None):
                self._flush(c)
            elif boundary and c.accumulating and not c.flushed:
                self._submit(c, (), ready=Handle.completed(), hold=True)
        self._drain_lagged()
        self._end_pass()
        if self._kept:  # the caller's grads may be overwritten or freed after our copies read them
            self._kept = False
            self.store.wait_copies_in()

    def drop_backward(self) -> None:
        """After an error in backward: the grads of this pass not yet sent on are dropped (the
        pins they hold released); what went on stays in the window."""
        lagged, self._lagged = self._lagged, None
        if lagged is not None and lagged[0].pinned_grads:  # reduced, not handed on: dropped too
            self._release_device_buffer(lagged[0])
        for c in self.chunks:
            if c.grads is not None:
                if c.pinned_grads:  # staged in the store's own GPU copy
                    self._release_device_buffer(c)
                c.grads = None
        self._end_pass()

    def _end_pass(self) -> None:
        for c in self.chunks:
            c.clear_pass()
            self._expect_all(c)

    # ---- the window's end ([Note: the window's decision]) -------------------------------------

    def end_micro_batch(self) -> bool:
        """A micro-batch is done (the front end's ``step()``); True when it ended the window
        (then ``end_window``)."""
        self.micro += 1
        if self.micro < self.window:
            return False
        self.micro = 0
        return True

    def end_window(self) -> Decision:
        """The window's decision and its updates (queued in chunk order; they overlap what the
        caller does next)."""
        if self.learn_order and self._submitted:  # [Note: update order]
            last = len(self._submitted) - 1
            for c in self.chunks:
                c.priority = None
            for i, c in enumerate(self._submitted):
                c.priority = last - i
        self._submitted = []
        if self.shards.world > 1 and self.sink is ParamSink.TENSORS:
            for c in self.chunks:
                c.ungathered = True
        if self.overlap:
            updated, self._updated = self._updated, False
            return Decision(updated=updated)
        window = [c for c in self.chunks if c.window]
        if not window:
            return Decision(updated=False)
        sumsq = 0.0
        if self._stats:
            sumsq = self.pipeline.take_grad_stats() + self._take_device_stats()
            sumsq = self.shards.sum(sumsq, what="the all-reduce of the grad norm")  # the mean grad's
        scaler = self.scaler
        if scaler is not None and not math.isfinite(sumsq):
            scaler.update(found_inf=True)
            for c in window:
                self._skip(c)
            return Decision(updated=False, skipped=True)
        grad_scale = scaler.scale if scaler is not None else 1.0
        norm = None
        if self.clip is not None:
            norm = math.sqrt(sumsq)
            grad_scale /= min(1.0, self.clip / (norm + 1e-6))
        for c in window:  # chunk order: the next forward waits only for its own chunk
            self._submit_update(c, grad_scale)
        if scaler is not None:
            scaler.update(found_inf=False)
        return Decision(updated=True, norm=norm)

    def drop_window(self) -> None:
        """Forget the window: its grads (staged, summed or accumulated), their sums of squares
        (clipping, fp16: the grad jobs of the dropped passes added theirs to the total the next
        decision reads) and micro-batch count."""
        for c in self.chunks:
            self._skip(c)
            c.total = None
            c.total_slots.clear()
        if self._stats:
            self.pipeline.take_grad_stats()  # after the dropped grad jobs; the total starts at 0
            self._take_device_stats()
        self.micro = 0
        self._updated = False
        self._submitted = []

    def _submit_update(self, chunk: GroupChunk, grad_scale: float) -> None:
        """Queue the update of the chunk's window (its grads already handed over); a chunk on
        the device is updated now ([Note: GPU share])."""
        if self._on_device(chunk):
            self._update_on_device(chunk, grad_scale)
            return
        chunk.updated = self._window_slots(chunk)
        job = self._update_job(chunk, grad_scale)
        with self.errors():
            self.pipeline.submit_update(job, priority=self._priority(chunk))

    def _skip(self, chunk: GroupChunk) -> None:
        """End the chunk's window without an update (an fp16 overflow)."""
        if self._on_device(chunk):
            self._drop_device_grads(chunk)  # (its stats were taken before the step was skipped)
        else:
            self._release_grads(chunk)
        chunk.window.clear()
        chunk.accumulating = False
        if chunk.phase is ChunkPhase.FILLING:
            chunk.to(ChunkPhase.IDLE)

    # ---- the GPU share ([Note: GPU share]) ------------------------------------------------------

    def _on_device(self, chunk: GroupChunk) -> bool:
        """The chunk's optimizer state lives on the compute device (it is updated there; its
        grads are homed there too, whatever state the rule keeps)."""
        return self.store.payload_spec(chunk.cid, self.payloads.grads).home is Tier.GPU

    def _device_submit(self, chunk: GroupChunk, slots: Iterable[GroupSlot], *, update: bool,
                       grad_scale: float = 1.0, stats: bool = False, stats_scale: float = 1.0,
                       hold: bool = False) -> None:
        """``_submit`` for a chunk on the device: its grads are the store's pinned GPU copy of
        "grads"; accumulation, stats and the update run now, on the caller's stream."""
        chunk.window.update(slots)
        store, cid, p = self.store, chunk.cid, self.payloads
        src = None if hold else store.get(cid, p.grads, Tier.GPU)
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
            self._update_on_device(chunk, grad_scale)

    def rehome_payloads(self, chunk: GroupChunk, homes: Mapping[str, Tier],
                        transient: Optional[Mapping[str, bool]] = None) -> None:
        """Move where the chunk is updated (it joins the GPU share, leaves it, or its state comes
        from NVMe into host memory): each of ``homes`` (name -> tier; the homes a plan gives the
        chunk) homed there, in that order (``ChunkStore.rehome``), transient there where
        ``transient`` says so (name -> bool; else as it is), from the next window on; the "grads"
        home says where the chunk is updated (``_on_device``). All or nothing; between windows only
        (no grad staged, no job: it waits for the chunk's last one); synchronous. The STORE sink
        only (the engine's params stay where placement put them; a TENSORS front end's copy-out
        payload would have to come and go)."""
        if self.sink is not ParamSink.STORE:
            raise ValueError(f"{self.owner}: rehome serves the engine's chunks (ParamSink.STORE)")
        self.wait(chunk)
        if chunk.phase is not ChunkPhase.IDLE or chunk.window or chunk.landed or chunk.total is not None:
            raise RuntimeError(f"{self.owner}: chunk {chunk.cid} has grads of this window; rehome it "
                               f"between windows (after step())")
        store = self.store
        before = {n: store.payload_spec(chunk.cid, n) for n in homes}
        moved = []
        try:
            for name, tier in homes.items():
                flag = (transient or {}).get(name, before[name].transient)
                if before[name].home is not tier or before[name].transient != flag:
                    store.rehome(chunk.cid, name, tier, transient=flag)
                    moved.append(name)
        except BaseException:  # all or nothing: what moved goes back (never raising over the cause)
            for name in reversed(moved):
                with contextlib.suppress(Exception):
                    store.rehome(chunk.cid, name, before[name].home, transient=before[name].transient)
            raise

    def _take_device_stats(self) -> float:
        """The device share's sum of squares of this window (a host sync), then reset."""
        total, self._device_sumsq = self._device_sumsq, None
        return 0.0 if total is None else float(total.item())

    def _update_on_device(self, chunk: GroupChunk, grad_scale: float) -> None:
        chunk.updated = self._window_slots(chunk)
        self._device_update(chunk, grad_scale)
        if self.replicas and chunk.replica is not None and self.sink is ParamSink.STORE:
            self._gather_updated(chunk)
        if self.sink is ParamSink.TENSORS:  # [Note: param sinks]: on the caller's stream
            master = self.store.get(chunk.cid, self.payloads.master, Tier.GPU)
            for s in chunk.updated:
                _target(s).copy_(master[s.offset:s.offset + s.count])

    def _device_update(self, chunk: GroupChunk, grad_scale: float) -> None:
        job = self._update_job(chunk, grad_scale)
        store, cid, p = self.store, chunk.cid, self.payloads
        src = store.get(cid, job.source, Tier.GPU)
        lowp = p.lowp if p.lowp and store.has_payload(cid, p.lowp) else None  # OffloadAdam rounds itself
        names = [p.master, *job.state] + ([lowp] if lowp else [])
        bufs = dict(zip(names, (store.get(cid, n, Tier.GPU, write=True) for n in names)))
        chunk.rule.device_step(StepBuffers(cid=cid, param=bufs[p.master], grad=src, seed=self.seed,
                                          state={n: bufs[n] for n in job.state},
                                          lowp=bufs[lowp] if lowp else None), job.segments)
        for n in names:
            store.mark_dirty(cid, n, Tier.GPU)
        if job.source == p.grads:
            self._drop_device_grads(chunk)
        chunk.to(ChunkPhase.IDLE)


    def _update_job(self, chunk: GroupChunk, grad_scale: float) -> UpdateJob:
        """The update of the window's slots; advances their steps and ends the window. A rule
        that is not elementwise gets one segment per slot, each a whole param with its shape
        and its part of the payloads sized by shapes ([Note: state layout])."""
        rule, window = chunk.rule, [s for s in chunk.slots if s in chunk.window]
        if not rule.elementwise:
            for s in window:
                if not s.whole:
                    raise ValueError(
                        f"{self.owner}: {rule.name} updates whole parameters, but chunk {chunk.cid} "
                        f"has a slot [{s.offset}, {s.stop}) that is not one whole parameter (a "
                        f"data-parallel shard cut it, or its span covers padding); lay the chunk out "
                        f"with partition.align_shards ([Note: whole parameters])")
        groups = self.hyper.param_groups
        args = {g: rule.args(groups[g], grad_scale=grad_scale) for g in {s.group for s in window}}
        for s in window:
            s.step += 1
        if rule.elementwise:
            spans = update_segments((s.offset, s.stop, s.step, s.group) for s in window)
            segments = tuple(Segment(lo, hi, step, args[g]) for lo, hi, step, g in spans)
        else:
            segments = tuple(Segment(s.offset, s.stop, s.step, args[s.group], tuple(s.shape),
                                     {k: lay.mine[s.pos] for k, lay in chunk.shaped.items()} or None)
                             for s in window)
        chunk.window.clear()
        chunk.accumulating = False
        chunk.version += 1
        chunk.to(ChunkPhase.QUEUED)
        source = self.payloads.accum if self.grad_accum > 1 else self.payloads.grads
        return UpdateJob(cid=chunk.cid, segments=segments, rule=rule, source=source)

    # ---- updated params ([Note: param sinks]) -------------------------------------------------

    def _write_back(self, cid: int) -> None:
        """The pipeline's ``on_update_done`` (the worker, TENSORS sink): the updated params into
        the slots' tensors, on the store's H2D stream after the grads copy of that update."""
        chunk, p = self.chunks[cid], self.payloads
        name = p.lowp if p.lowp is not None and self.store.has_payload(cid, p.lowp) else p.master
        with self.store.use(cid, name, Tier.CPU):
            chunk.copied = self.store.copy_out(cid, name, Tier.CPU,
                                               [(s.offset, _target(s)) for s in chunk.updated],
                                               after=chunk.ready)

    def params_resident(self, cid: int) -> bool:
        """Chunk ``cid``'s whole params stay on the device whether a user maps them or not: its
        shard is homed there and is the whole (one rank), or its replica is kept (prefetch.py,
        [Note: resident chunks])."""
        if self.store.payload_spec(cid, self.payloads.lowp or self.payloads.master).home is not Tier.GPU:
            return False
        return self.shards.world == 1 or self.replicas

    def params(self, chunk: GroupChunk, shard: torch.Tensor, *, ahead: bool = False) -> Gather:
        """The chunk's whole params on the device from this rank's ``shard`` of them: the shard
        itself (one rank), an all-gather (``ahead``: issued async, ``Shards.finish`` waits for it
        where it is used), or the replica when no update has run since it was gathered (with the
        all-gather issued after the update, if it is not waited for yet: the caller finishes it)."""
        if chunk.replica_fresh:
            work, chunk.replica_work = chunk.replica_work, None
            return Gather(chunk.replica, work, _GATHER_UPDATED if work is not None else "")
        gathered = self.shards.gather(shard, what="the all-gather of a params chunk", out=chunk.replica,
                                      ahead=ahead)
        if self.replicas:
            chunk.replica, chunk.replica_version = gathered.full, chunk.version
        return gathered

    def _gather_updated(self, chunk: GroupChunk) -> None:
        """[Note: gathers after the update]: the updated params shard all-gathered into the
        chunk's replica now, async, after the caller's stream's work so far."""
        self._settle_replica(chunk)
        shard = self.store.get(chunk.cid, self.payloads.lowp or self.payloads.master, Tier.GPU)
        gathered = self.shards.gather(shard, what=_GATHER_UPDATED, out=chunk.replica, ahead=True)
        chunk.replica_work, chunk.replica_version = gathered.work, chunk.version

    def _settle_replica(self, chunk: GroupChunk) -> None:
        """The caller's stream waits for an all-gather into the replica still pending, so that
        the replica may be written again or its memory let go."""
        work, chunk.replica_work = chunk.replica_work, None
        if work is not None:
            self.shards.finish(Gather(chunk.replica, work, _GATHER_UPDATED))

    def _drop_replica(self, chunk: GroupChunk, *, quiet: bool = False) -> None:
        """The replica let go, after its pending all-gather. ``quiet`` (clean-up): a failed wait
        (a failed engine refuses it; a collective that failed) is not raised: the collective's
        own failure is the cause, and NCCL keeps the buffers it uses until the work ends."""
        try:
            self._settle_replica(chunk)
        except Exception:  # noqa: BLE001 - see above
            if not quiet:
                raise
        finally:
            chunk.replica = None

    def drop_buffers(self) -> None:
        """The device buffers kept between uses (replicas, window sums) are let go (clean-up:
        never raises over a failure that came before)."""
        for c in self.chunks:
            self._drop_replica(c, quiet=True)
            c.total = None

    def drop_replicas(self) -> list:
        """Park ([Note: parking] in parking.py): every replica is let go. Returns the chunks whose
        replica held the latest params (the same on every rank), for ``regather``."""
        fresh = [c for c in self.chunks if c.replica_fresh]
        for c in self.chunks:
            self._drop_replica(c)
        return fresh

    def regather(self, chunks: Iterable[GroupChunk]) -> None:
        """Resume: the replicas of ``chunks`` gathered again from this rank's params shards on the
        device (collective, in the given order: the same on every rank)."""
        name = self.payloads.lowp or self.payloads.master  # the working params
        for c in chunks:
            with self.store.use(c.cid, name, Tier.GPU) as shard:
                self.shards.finish(self.params(c, shard))

    def open_window(self) -> Optional[str]:
        """What of the current accumulation window is pending, in words (grads staged, summed or
        accumulated; micro-batches counted); None when no window is open."""
        if self.micro:
            return f"{self.micro} of {self.window} micro-batches of the accumulation window are done"
        if self._updated or any(c.landed or c.window or c.accumulating or c.total is not None
                                for c in self.chunks):  # (_updated: overlap updated during backward)
            return "grads of a backward are waiting for step()"
        return None

    def gather_updates(self, chunks: Optional[Iterable[GroupChunk]] = None) -> None:
        """Several ranks, TENSORS sink: every rank's updated elements of ``chunks`` (default:
        every chunk still ungathered, in chunk order; the same on every rank) into every rank's
        tensors, one chunk's all-gather overlapping the wait for the next one's update."""
        todo = [c for c in (self.chunks if chunks is None else chunks) if c.ungathered]
        for c in todo:
            c.ungathered = False
        pending = None
        for chunk in todo:
            self.wait(chunk)  # its update and its copy into this rank's tensors
            first = local(chunk.slots[0].param)
            send = torch.zeros(chunk.numel, dtype=first.dtype, device=first.device)
            for s in chunk.slots:  # this rank's elements
                send[s.offset:s.offset + s.count] = _piece(s, s.param)
            gathered = self.shards.gather(send, what="the all-gather of the updated params", ahead=True)
            if pending is not None:
                self._scatter(*pending)
            pending = (gathered, chunk)
        if pending is not None:
            self._scatter(*pending)

    def _scatter(self, gathered: Gather, chunk: GroupChunk) -> None:
        """The end of one chunk's all-gather: its params take their elements of it."""
        full = self.shards.finish(gathered)
        for s in chunk.slots:
            local(s.param).data.view(-1).copy_(full[s.lo:s.lo + s.numel])

    def pending(self) -> bool:
        """An update is queued or a gather is pending (the params are not final yet)."""
        return any(c.phase is ChunkPhase.QUEUED or c.ungathered for c in self.chunks)

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
            raise PipelineError(f"{self.owner}: {e.job or 'a job of the update worker'} failed "
                                f"({e.__cause__!r}); the optimizer state is no longer consistent with "
                                f"the model (load a checkpoint or state_dict, or rebuild it)", job=e.job) from e

    def check(self) -> None:
        """Raise the worker's failure now, if there was one."""
        if self.pipeline.failed:
            with self.errors():
                self.pipeline.drain()

    def _sample(self) -> dict:
        ps = self.pipeline.stats
        return {"adam_s": ps.adam_s, "busy_s": ps.busy_s, "wait_chunk_s": ps.wait_chunk_s,
                "wait_s": self.wait_s, "window_wait_s": self.window_wait_s, **self.store.stats.bytes_moved}

    def counters(self) -> dict:
        """The pipeline's and the store's counters since construction or ``reset_counters``."""
        return self._counter_window.read()

    def reset_counters(self) -> None:
        self._counter_window.reset()

    @property
    def trace(self) -> Optional[Trace]:
        return self.pipeline.trace

    @trace.setter
    def trace(self, trace: Optional[Trace]) -> None:
        if trace is not None and not isinstance(trace, Trace):
            raise TypeError(f"{self.owner}.trace takes a zero_offload.Trace or None, got "
                            f"{type(trace).__name__}")
        self.pipeline.trace = trace

    def synchronize(self) -> None:
        """Wait until every queued job has run and every move of the store has landed."""
        self.drain()
        self.store.synchronize()

    def close(self, *, store: bool = False, quiet: bool = False) -> None:
        """Finish the queued jobs and stop the worker (idempotent). The store is the owner's;
        ``store``: close it too, also when stopping the worker raised (an owner that built it
        for this group alone); ``quiet``: what its last moves raise is not raised (after a
        failure that is its consequence; the store frees everything either way)."""
        try:
            self.pipeline.close()
        finally:
            if store:
                with contextlib.suppress(Exception) if quiet else contextlib.nullcontext():
                    self.store.close()


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

