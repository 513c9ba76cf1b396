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
issues the look-ahead once that chunk is ready.

[Note: lock order] The store calls its eviction policy with its own lock held, and this
prefetcher calls the store with its lock held: so ``next_use`` (the policy's query) takes no
lock, else two threads (one in ``use``, one making room in the store) would deadlock. It reads
the order without the lock: a momentarily stale answer only changes which copy is evicted first,
never what is correct (the order and positions are replaced, never mutated in place, once frozen).

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
import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

from .store import BudgetError, ChunkStore, FarthestNextUsePolicy, Hop, Residency, StoreError, Tier

__all__ = ["Prefetcher", "PrefetchStats"]


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
    """

    def __init__(self, store: ChunkStore, *, depth: int, hops: Sequence = (("params", Tier.GPU),),
                 nvme_depth: "int | None" = None, evict_after_use: bool = True,
                 ready: "Callable[[int], bool] | None" = None):
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

    def chunk_ready(self, cid: int) -> None:
        """Chunk ``cid`` became ready (see ``ready``): issue the look-ahead now if it is within
        the window. Thread-safe (e.g. called on a worker thread)."""
        if self._recording:
            return
        with self._lock:
            if cid in self._upcoming(self.depth):
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

    def snapshot(self) -> PrefetchStats:
        """A copy of the stats with ``bytes_moved`` filled in from the store."""
        with self._lock:
            now = self.store.stats.bytes_moved
            return replace(self.stats, bytes_moved={h.value: now[h] - self._bytes0.get(h, 0) for h in Hop})
