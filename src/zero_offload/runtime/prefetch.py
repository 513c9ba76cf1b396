"""Look-ahead over a recorded access order: keeps the next chunks in flight on each hop.

The store (store.py) moves bytes; this module decides *what* to move and *when* (policy):

- First pass: ``use(cid)`` fetches on demand and records the order chunks are asked for.
- Later passes (delimited by ``start_pass()``): before returning chunk ``i`` of the order, the
  fetches of chunks ``i+1 .. i+depth`` to their target tier are issued, and for payloads homed on
  NVMe the NVMe→CPU reads run further ahead, for chunks up to ``i+nvme_depth`` (default
  ``2*depth``), so the CPU→GPU hop finds its source already in pinned memory.
- Depth 0 fetches on demand only.
- When a chunk arrives out of the recorded order, the order is re-recorded from that point (the
  rest of this pass) and prefetching resumes at the next pass.

It also installs a ``FarthestNextUsePolicy`` on the store, so a full tier evicts the copy whose
next use in the recorded order is farthest away.

``ready`` (optional) holds the look-ahead back at the first chunk it says is not ready (e.g. its
update is still queued: fetching it would copy bytes about to change); ``chunk_ready(cid)`` then
issues the look-ahead once that chunk is ready (on the consumer's stream: ``set_stream``).

[Note: holds] Above ``use``/``release`` (pins), a consumer that maps chunks (the engine: params
pointing into a chunk's device buffer) says only ``hold(cid)`` and ``unhold(cid)``; this
prefetcher decides when a chunk is mapped (``Consumer.map``, at its first hold) and when it is let
go (``Consumer.unmap``, then ``release``), by two policies, and is the one owner of "is chunk c on
the device for its consumer" (the store keeps the bytes: [Note: residency] there).

- Parked chunks: consecutive modules mostly share a chunk; letting it go when one module's
  forward ends would page it out and in again per module (two thirds of a 350M GPT's forward,
  when measured). So a chunk nobody holds stays mapped, in a list of ``park`` chunks; the oldest
  is let go when the list overflows, and all are by ``release_idle`` (the engine: when backward
  ends and before a step queues updates, which make the device copy stale). Parked chunks stay
  pinned in the store and count in the working window (placement.py).
- Kept copies: forward and backward use every chunk once each, so dropping a chunk's copy after
  its forward use fetches the params twice per step. When the consumer will use it again
  (``Consumer.reuse``: the engine's forward with grad enabled) and each target tier holds at most
  ``keep_limit`` bytes (``placement.keep_limit``: at most half the GPU budget, never the working
  window), a chunk let go is only unpinned (``release(keep=True)``): its copy stays valid for
  backward, and a tier needing room evicts by farthest next use. Otherwise its copy is dropped,
  and ``release_idle`` drops every kept copy not in use, so none outlives the update that makes
  it stale. A budget that only fits the working window keeps nothing.

[Note: resident chunks] A chunk whose mapping costs the device nothing (``Consumer.resident``: its
params are homed on the device, or its replica is kept there) is not let go when the park list
overflows: once mapped in a pass it stays mapped until ``release_idle``. Paging it out and in
again would only cost host time (a map and an unmap per use), and so would its users' holds for
backward, which it does not need (module_hooks.py, [Note: backward hooks]). Where the host
thread's launches bound the step, that time is the step's: with both, a 1.31B GPT on 4 H200s
went from 0.166 to 0.144 s a step (session 24, one call).

A chunk nobody holds that the consumer still needs mapped (``Consumer.busy``: the engine in
backward while grads of the chunk are still to land) waits until ``settle(cid)``. Each chunk's
``Use`` moves only as ``_USES`` lists; any other move (an ``unhold`` without a hold) raises.

[Note: lock order] The store calls its eviction policy with its own lock held, and this
prefetcher calls the store with its lock held: so ``next_use`` (the policy's query) takes no
lock, else two threads (one in ``use``, one making room in the store) would deadlock. It reads
the order without the lock: a momentarily stale answer only changes which copy is evicted first,
never what is correct (the order and positions are replaced, never mutated in place, once frozen).
The holds have a lock of their own, taken before the look-ahead's and never by ``chunk_ready``:
``Consumer.map`` may wait for a worker (the engine waits for the chunk's update) whose
``chunk_ready`` needs the look-ahead's lock.

[Note: NVMe staging] A payload homed on NVMe reaches the GPU through a host copy (the store
stages NVMe -> CPU -> GPU). That copy is staging, not a cache: ``drop`` (and so ``release``)
evicts it once the chunk's use is over, unless the NVMe look-ahead (``nvme_depth``) needs the
chunk again soon. Kept, every chunk read once would stay in (pinned) host memory up to the CPU
budget, which is the memory the user moved the payload to NVMe to save: host memory for
NVMe-homed params is the look-ahead window, whatever the model's size. A copy that is the only
newest one (an update wrote it) is written home first, by the store's eviction.

[Note: wrap-around] The order is cyclic: near the end of a pass the look-ahead continues with the
start of the next pass (the first chunks of the next step are fetched during this one).
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import torch

from .store import (BudgetError, ChunkStore, FarthestNextUsePolicy, Hop, IllegalTransition, Residency,
                    StoreError, Tier)

__all__ = ["Prefetcher", "PrefetchStats", "Consumer", "Use"]


class Use(enum.Enum):
    """Where a chunk stands with the consumer's holds; see [Note: holds]."""

    # Members are singletons compared by identity: hash them by identity too (in C), not by
    # Enum's Python-level __hash__; the table lookups run twice per module call.
    __hash__ = object.__hash__

    IDLE = "idle"      # not mapped (its copies are the store's and the look-ahead's)
    HELD = "held"      # mapped, and ``holds`` users need it
    UNHELD = "unheld"  # mapped, nobody holds it, but the consumer still needs it (``busy``)
    PARKED = "parked"  # mapped, nobody holds it: let go when the park list overflows, or at idle
    KEPT = "kept"      # let go, its copies left valid (unpinned) for a use later in this pass


# Module constants: a member lookup on an Enum class costs more than the holds' own work.
_IDLE, _HELD, _UNHELD, _PARKED, _KEPT = Use.IDLE, Use.HELD, Use.UNHELD, Use.PARKED, Use.KEPT
_USES: dict[Use, frozenset[Use]] = {
    _IDLE: frozenset({_HELD}),
    _HELD: frozenset({_UNHELD, _PARKED}),
    _UNHELD: frozenset({_HELD, _PARKED, _IDLE, _KEPT}),
    _PARKED: frozenset({_HELD, _IDLE, _KEPT}),
    _KEPT: frozenset({_HELD, _IDLE}),
}


@dataclass(frozen=True, kw_only=True)
class Consumer:
    """What the holds ask of the code that maps the chunks (the engine); see [Note: holds]. Each
    is called with the holds' lock held, and may call ``use``/``release``, not the holds."""

    map: Callable[[int], None]
    """Make chunk ``cid`` usable (its first hold): take its copies with ``use`` (or adopt a
    ``use`` taken ahead) and point the consumer's views at them. If it raises, the chunk is not
    mapped and the pin it took is let go. The pin is the prefetcher's to release after ``unmap``."""
    unmap: Callable[[int], None]
    """Drop the consumer's views into chunk ``cid``'s copies (the prefetcher then unpins it)."""
    busy: Callable[[int], bool] = lambda cid: False
    """Nobody holds chunk ``cid``, but the consumer still needs it mapped; asked again at
    ``settle(cid)``."""
    reuse: Callable[[], bool] = lambda: False
    """A chunk let go now will be used again in this pass: keep its copies (within
    ``keep_limit``)."""
    resident: Callable[[int], bool] = lambda cid: False
    """Mapping chunk ``cid`` costs the device no bytes beyond those the chunk holds anyway (its
    params are homed there, or kept as a replica): once mapped it stays mapped until
    ``release_idle``, outside the park list ([Note: resident chunks]). Asked when it is mapped."""


@dataclass(eq=False)
class _Hold:
    """One chunk's state with the consumer's holds."""

    cid: int
    state: Use = _IDLE
    holds: int = 0
    resident: bool = False
    """Mapped as resident ([Note: resident chunks]): parked outside the park list."""

    def to(self, state: Use) -> None:
        if state not in _USES[self.state]:
            raise IllegalTransition(
                f"chunk {self.cid}: illegal use transition {self.state.name} -> {state.name} "
                f"(legal from {self.state.name}: {sorted(s.name for s in _USES[self.state])})")
        self.state = state


@dataclass
class PrefetchStats:
    """What the consumer saw. ``bytes_moved`` is read from the store (per hop, since this
    prefetcher was made)."""

    uses: int = 0
    hits: int = 0
    """Uses whose copies were all already valid (the prefetch had landed)."""
    ahead: int = 0
    """Uses whose copies were all valid or already on their way (fetch issued before the use).
    On CUDA the consumer waits for an in-flight copy device-side only, so this is the share that
    did not wait for a fetch to be *issued* (``hits`` counts only copies that had landed)."""
    stall_s: float = 0.0
    """Seconds ``use`` spent waiting for moves (host time)."""
    prefetches: int = 0
    """Fetches issued ahead of use."""
    budget_limited: int = 0
    """Look-aheads cut short because the target tier had no room."""
    rerecords: int = 0
    """Times the access order changed and was recorded again."""
    passes: int = 0
    bytes_moved: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 0.0

    @property
    def ahead_rate(self) -> float:
        return self.ahead / self.uses if self.uses else 0.0


class Prefetcher:
    """Records the chunk access order and keeps the next ``depth`` chunks in flight.

    Args:
        store: the ChunkStore whose chunks are used.
        depth: chunks fetched ahead on the last hop (to each target tier); 0 = on demand.
        hops: (payload name, target tier) pairs a use needs, e.g. ``[("params", "gpu")]`` for a
            forward pass or ``[("master", "cpu"), ("exp_avg", "cpu"), ("exp_avg_sq", "cpu")]``
            ahead of the optimizer.
        nvme_depth: how far ahead NVMe→CPU reads run for NVMe-homed payloads whose target is the
            GPU; default ``2 * depth``. Must be >= depth.
        evict_after_use: ``release`` drops the non-home target copy (unless the chunk is needed
            again within the look-ahead window).
        ready: ``ready(cid) -> bool``; the look-ahead stops at the first chunk that is not ready
            (None: every chunk is). Called with this prefetcher's lock held: it must not call
            back into the prefetcher.
        consumer: what ``hold``/``unhold`` map and unmap through (None: ``use``/``release``
            only). See [Note: holds].
        park: chunks nobody holds that stay mapped (the oldest is let go first).
        keep_limit: bytes each target tier may hold for a chunk let go to keep its copies.
    """

    def __init__(self, store: ChunkStore, *, depth: int, hops: Sequence = (("params", Tier.GPU),),
                 nvme_depth: "int | None" = None, evict_after_use: bool = True,
                 ready: "Callable[[int], bool] | None" = None, consumer: "Consumer | None" = None,
                 park: int = 0, keep_limit: int = 0):
        if not isinstance(store, ChunkStore):
            raise TypeError(f"Prefetcher needs a ChunkStore, got {type(store).__name__}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth must be an int >= 0 (0 = fetch on demand), got {depth!r}")
        nvme_depth = 2 * depth if nvme_depth is None else nvme_depth
        if isinstance(nvme_depth, bool) or not isinstance(nvme_depth, int) or nvme_depth < depth:
            raise ValueError(f"nvme_depth must be an int >= depth ({depth}), got {nvme_depth!r}: the NVMe "
                             f"hop has to run at least as far ahead as the CPU->GPU hop")
        try:
            hops = tuple((str(name), Tier.of(tier)) for name, tier in hops)
        except (TypeError, ValueError) as e:
            raise ValueError(f"hops must be (payload name, tier) pairs, e.g. [('params', 'gpu')]: {e}") from None
        if not hops:
            raise ValueError("hops must name at least one (payload, tier) pair")
        if Tier.NVME in (t for _, t in hops):
            raise ValueError("a hop's target tier must be 'gpu' or 'cpu' (a use reads memory, not a file)")
        if ready is not None and not callable(ready):
            raise TypeError(f"ready must be a callable cid -> bool or None, got {ready!r}")
        if consumer is not None and not isinstance(consumer, Consumer):
            raise TypeError(f"consumer must be a prefetch.Consumer or None, got {type(consumer).__name__}")
        for name, value in (("park", park), ("keep_limit", keep_limit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.store = store
        self.depth = depth
        self.nvme_depth = nvme_depth
        self.hops = hops
        self.evict_after_use = evict_after_use
        self._ready = ready
        self.stats = PrefetchStats()
        self._lock = threading.RLock()
        self._order: list[int] = []
        self._recording = True
        self._pos = 0
        self._positions: dict[int, list[int]] = {}  # cid -> positions in the order (derived index)
        self._bytes0 = dict(store.stats.bytes_moved)
        self._stream = None  # the consumer's CUDA stream (set_stream)
        # [Note: holds]
        self._consumer = consumer
        self.park = park
        self.keep_limit = keep_limit
        self._targets = tuple(dict.fromkeys(t for _, t in hops))
        self._hold_lock = threading.RLock()  # before self._lock: see [Note: lock order]
        self._holds: dict[int, _Hold] = {}  # cid -> its record (made at its first hold)
        self._parked: list[int] = []  # the PARKED chunks, oldest first (derived index)
        store.set_policy(FarthestNextUsePolicy(self.next_use))

    # ---- order --------------------------------------------------------------------------

    @property
    def order(self) -> list[int]:
        """The recorded access order (a copy)."""
        with self._lock:
            return list(self._order)

    @property
    def recording(self) -> bool:
        return self._recording

    def start_pass(self) -> None:
        """Mark the start of a pass (e.g. a training step). The first call after a recording
        pass freezes the order; prefetching starts with the pass that follows."""
        with self._lock:
            if self._recording and self._order:
                self._recording = False
                self._positions = {}
                for i, cid in enumerate(self._order):
                    self._positions.setdefault(cid, []).append(i)
            self._pos = 0
            self.stats.passes += 1

    def next_use(self, cid: int) -> "int | None":
        """Uses until ``cid`` is needed again (cyclic over the order); None when unknown.
        Lock-free: see [Note: lock order]."""
        positions = None if self._recording else self._positions.get(cid)
        if not positions:
            return None
        n, pos = len(self._order), self._pos
        return min((p - pos) % n for p in positions)

    def _advance(self, cid: int) -> None:
        if self._recording:
            self._order.append(cid)
            self._pos = len(self._order)
            return
        if self._pos >= len(self._order):
            self._pos = 0  # [Note: wrap-around] a pass without start_pass()
        if self._order[self._pos] == cid:
            self._pos += 1
            return
        # The order changed: keep what matched, record the rest of this pass anew.
        self.stats.rerecords += 1
        self._order = self._order[:self._pos] + [cid]
        self._pos = len(self._order)
        self._positions = {}
        self._recording = True

    def peek(self, count: int) -> list[int]:
        """The next ``count`` chunk ids of the recorded order after the current position, within
        this pass (no wrap-around, readiness not asked): what a consumer that must decide the same
        way on every rank (a collective issued ahead) may rely on. [] while recording."""
        with self._lock:
            if self._recording:
                return []
            return self._order[self._pos:self._pos + max(0, count)]

    def _upcoming(self, count: int) -> list[int]:
        """The next ``count`` chunk ids after the current position ([Note: wrap-around]), up to
        the first one ``ready`` says is not ready."""
        if self._recording or not self._order or count <= 0:
            return []
        n = len(self._order)
        out = [self._order[(self._pos + k) % n] for k in range(min(count, n))]
        return out if self._ready is None else list(itertools.takewhile(self._ready, out))

    # ---- use ----------------------------------------------------------------------------

    def use(self, cid: int) -> dict:
        """The target copies of chunk ``cid`` (payload name -> tensor), ready for the caller
        (on CUDA: ready on the current stream). Pins them until ``release(cid)``. Issues the
        look-ahead fetches first, so they overlap with the caller's compute."""
        store = self.store
        with self._lock:
            self._advance(cid)
            states = [store.state(cid, name, tier) for name, tier in self.hops]
            hit = all(st is Residency.VALID for st in states)
            ahead = all(st in (Residency.VALID, Residency.LOADING, Residency.FLUSHING) for st in states)
            for name, tier in self.hops:  # on demand (no-op when prefetched)
                store.fetch(cid, name, tier)
                store.pin(cid, name, tier)
            self._issue_lookahead()
        t0 = time.perf_counter()
        try:
            out = {name: store.get(cid, name, tier) for name, tier in self.hops}
        except BaseException:
            for name, tier in self.hops:
                store.unpin(cid, name, tier)
            raise
        waited = time.perf_counter() - t0
        with self._lock:
            self.stats.uses += 1
            self.stats.hits += hit
            self.stats.ahead += ahead
            if not hit:
                self.stats.stall_s += waited
        return out

    def release(self, cid: int, *, keep: bool = False) -> None:
        """The caller is done with chunk ``cid``: unpin, and drop non-home target copies that
        the look-ahead window does not need again. ``keep=True`` only unpins: the copies stay
        resident (evictable by the store's policy when a tier needs room) until ``drop(cid)``
        or a later ``release``."""
        with self._lock:
            for name, tier in self.hops:
                self.store.unpin(cid, name, tier)
            if self.evict_after_use and not keep:
                self.drop([cid])

    def drop(self, cids) -> None:
        """Drop the non-home target copies of the unpinned chunks ``cids`` that were kept by
        ``release(cid, keep=True)``, except those the look-ahead window needs soon, and the
        host staging copies of NVMe-homed ones ([Note: NVMe staging]). The caller must not hold
        (``use``) any of them."""
        store = self.store
        with self._lock:
            soon = set(self._upcoming(self.depth))
            staged_soon = set(self._upcoming(self.nvme_depth))
            for cid in cids:
                for name, tier in self.hops:
                    home = store.payload_spec(cid, name).home
                    if home is not tier and cid not in soon:
                        store.evict(cid, name, tier)
                    if home is Tier.NVME and tier is Tier.GPU and cid not in staged_soon:
                        self._drop_staging(cid, name)

    def _drop_staging(self, cid: int, name: str) -> None:
        """See [Note: NVMe staging]: the host copy an NVMe -> GPU fetch staged through, unless
        something else uses it now (pinned, e.g. a CPU update) or a move into it is in flight."""
        if self.store.state(cid, name, Tier.CPU) is Residency.VALID:
            with contextlib.suppress(StoreError):  # pinned: its user keeps it; evicted at a later drop
                self.store.evict(cid, name, Tier.CPU)

    @contextlib.contextmanager
    def chunk(self, cid: int) -> Iterator[dict]:
        """``with prefetcher.chunk(cid) as tensors:`` = ``use`` ... ``release``."""
        tensors = self.use(cid)
        try:
            yield tensors
        finally:
            self.release(cid)

    def set_stream(self, stream: "torch.cuda.Stream | None") -> None:
        """The CUDA stream the consumer computes on (the engine: captured at each forward):
        look-ahead that ``chunk_ready`` issues from another thread is queued on it, behind what
        the consumer has issued. None: the calling thread's current stream."""
        self._stream = stream

    def chunk_ready(self, cid: int) -> None:
        """Chunk ``cid`` became ready (see ``ready``): issue the look-ahead now if it is within
        the window. Thread-safe (e.g. called on a worker thread)."""
        if self._recording:
            return
        stream = self._stream
        with (torch.cuda.device(stream.device) if stream is not None else contextlib.nullcontext()), \
                (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()), \
                self._lock:
            if cid in self._upcoming(self.depth):
                self._issue_lookahead()

    def lookahead(self) -> None:
        """Issue the look-ahead from the current position now, on the consumer's stream: after
        the device came back from a park ([Note: parking] in parking.py), the next pass finds its
        first chunks fetched, as it would without the park."""
        stream = self._stream
        with (torch.cuda.device(stream.device) if stream is not None else contextlib.nullcontext()), \
                (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()), \
                self._lock:
            self._issue_lookahead()

    def _issue_lookahead(self) -> None:
        store = self.store
        ahead = self._upcoming(max(self.depth, self.nvme_depth))
        try:
            for k, nxt in enumerate(ahead):
                for name, tier in self.hops:
                    home = store.payload_spec(nxt, name).home
                    if k < self.depth:
                        target = tier
                    elif home is Tier.NVME and tier is Tier.GPU:
                        target = Tier.CPU  # the NVMe hop runs ahead of the CPU->GPU hop
                    else:
                        continue
                    if store.state(nxt, name, target) is Residency.VALID:
                        continue
                    store.fetch(nxt, name, target)
                    self.stats.prefetches += 1
        except BudgetError:
            # The tier is full of copies in use or needed sooner: stop looking ahead for now;
            # the use itself fetches on demand (and raises there if it truly cannot fit).
            self.stats.budget_limited += 1

    # ---- holds ([Note: holds]) --------------------------------------------------------------

    def hold(self, cid: int) -> bool:
        """A user needs chunk ``cid`` mapped: the consumer maps it unless it is, and the hold
        counts until ``unhold``. Returns True when this call mapped it."""
        with self._hold_lock:
            h = self._holds.get(cid) or self._new_hold(cid)
            state = h.state
            if state is _HELD:
                h.holds += 1
                return False
            mapping = state is _IDLE or state is _KEPT
            if mapping:
                self._consumer.map(cid)  # raises: nothing changed (the map let its pin go)
                h.resident = self._consumer.resident(cid)
            elif state is _PARKED and not h.resident:
                self._parked.remove(cid)
            h.to(_HELD)
            h.holds = 1
            return mapping

    def unhold(self, cid: int) -> None:
        """One user of chunk ``cid`` is done. After the last, the chunk is parked, or waits while
        the consumer says it is ``busy``."""
        with self._hold_lock:
            h = self._holds.get(cid)
            if h is None or h.state is not _HELD:
                raise IllegalTransition(f"unhold: chunk {cid} is {h.state.name if h else 'IDLE'}, "
                                        f"not held (an unhold without a matching hold)")
            h.holds -= 1
            if not h.holds:
                self._settle(h)

    def settle(self, cid: int) -> None:
        """The consumer may no longer need chunk ``cid`` (e.g. its last grad landed): park it if
        nobody holds it and it is not ``busy``. No-op otherwise."""
        with self._hold_lock:
            h = self._holds.get(cid)
            if h is not None and h.state is _UNHELD:
                self._settle(h)

    def release_idle(self) -> None:
        """Let go of every mapped chunk nobody holds (parked ones included, in chunk order), and
        drop the copies kept for later: at the end of a pass, and before the copies' bytes may
        change."""
        with self._hold_lock:
            for cid in sorted(c for c, h in self._holds.items() if h.state is _UNHELD or h.state is _PARKED):
                self._let_go(self._holds[cid])
            kept = [c for c, h in self._holds.items() if h.state is _KEPT]
            if kept:
                self.drop(kept)
                for c in kept:
                    self._holds[c].to(_IDLE)

    def forget_holds(self) -> None:
        """After an error in the consumer's pass: nobody holds any chunk now (``release_idle``
        lets them go)."""
        with self._hold_lock:
            for h in self._holds.values():
                if h.state is _HELD:
                    h.holds = 0
                    h.to(_UNHELD)

    def resident(self, cid: int) -> bool:
        """Chunk ``cid`` is mapped as resident: it stays mapped until ``release_idle``
        ([Note: resident chunks])."""
        h = self._holds.get(cid)
        return h is not None and h.resident  # (set when mapped, cleared when let go)

    def status(self, cid: int) -> Use:
        """Chunk ``cid``'s state with the holds."""
        h = self._holds.get(cid)
        return h.state if h is not None else _IDLE

    def _new_hold(self, cid: int) -> _Hold:
        if self._consumer is None:
            raise TypeError("hold/unhold need Prefetcher(consumer=...): what maps and unmaps a "
                            "held chunk; without one, use use()/release()")
        self._holds[cid] = h = _Hold(cid)
        return h

    def _settle(self, h: _Hold) -> None:
        if self._consumer.busy(h.cid):
            if h.state is not _UNHELD:
                h.to(_UNHELD)
            return
        h.to(_PARKED)
        if h.resident:
            return  # mapped until release_idle ([Note: resident chunks])
        parked = self._parked
        parked.append(h.cid)
        while len(parked) > self.park:
            self._let_go(self._holds[parked[0]])

    def _let_go(self, h: _Hold) -> None:
        """Unmap ``h``'s chunk and unpin it: its copies kept when the consumer uses it again soon
        and the target tiers have room, else dropped."""
        self._consumer.unmap(h.cid)
        keep = self._consumer.reuse() and all(self.store.bytes(t) <= self.keep_limit for t in self._targets)
        if h.state is _PARKED and not h.resident:
            self._parked.remove(h.cid)
        h.resident = False
        h.to(_KEPT if keep else _IDLE)
        self.release(h.cid, keep=keep)

    def snapshot(self) -> PrefetchStats:
        """A copy of the stats with ``bytes_moved`` filled in from the store."""
        with self._lock:
            now = self.store.stats.bytes_moved
            return replace(self.stats, bytes_moved={h.value: now[h] - self._bytes0.get(h, 0) for h in Hop})
