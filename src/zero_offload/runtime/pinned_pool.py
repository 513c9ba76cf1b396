"""A fixed pool of aligned, pinned host buffers carved out of one registered slab.

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every block
up to a power of two, so a 33 MiB chunk costs 64 MiB of locked host memory, and it frees blocks
back only when asked. Here the pool takes its memory once, in one ``aligned_empty(pin=True)``
slab (one ``cudaHostRegister`` call, exact size), and hands out 4096-aligned extents of it:
exact sizes (rounded up to 4 KiB for O_DIRECT), reused, never freed on the hot path.

[Note: pool growth] When a request fits in no free extent of any slab, the pool grows by one
new slab of exactly that size (counted in ``stats.grows``), unless it was built with
``growable=False``, in which case it raises. Grown slabs are kept and reused like the first one;
``trim()`` gives fully idle grown slabs back; nothing calls it on the hot path (the store does
not call it at all yet: size ``StoreConfig.pool_bytes`` for the staging window instead).

Without CUDA (or ``pin=False``) the slab is plain aligned memory: every code path but the
registration runs on a CPU-only machine.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .swap_io import aligned_empty, give_extent, take_extent
from .vocab import round_up

__all__ = ["HomesAhead", "PinnedPool", "PoolBuffer", "PoolStats", "SlotWindow"]


@dataclass(eq=False)
class _Slab:
    """One aligned allocation and the extents of it that are free."""

    memory: torch.Tensor
    """uint8 view of the whole slab (4096-aligned, pinned when the pool pins)."""
    grown: bool
    """True for a slab added after construction (see [Note: pool growth])."""
    free: list[tuple[int, int]] = field(default_factory=list)
    """Sorted, non-adjacent (offset, nbytes) extents that no buffer holds (swap_io.take_extent)."""

    @property
    def nbytes(self) -> int:
        return self.memory.numel()


@dataclass(eq=False)
class PoolBuffer:
    """One extent handed out by the pool; give it back with ``PinnedPool.release``."""

    raw: torch.Tensor
    """uint8 view of the extent: 4096-aligned, ``nbytes`` long (a multiple of 4096)."""
    slab: "_Slab | None"
    """The slab it is carved from (None: a ``SlotWindow`` slot, memory of its own)."""
    offset: int
    released: bool = False

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the extent as a flat ``dtype`` tensor."""
        return self.raw[: numel * dtype.itemsize].view(dtype)


@dataclass
class PoolStats:
    """Counters of pool events (not of bytes held: those are derived from the slabs)."""

    grows: int = 0
    """Slabs added because a request fit nowhere (see [Note: pool growth])."""


class PinnedPool:
    """Exact-size aligned host buffers, pinned when CUDA is present, reused forever.

    Args:
        capacity_bytes: size of the slab taken up front (rounded up to 4096; 0 = none yet).
        pin: register the memory with CUDA; None (default) = when CUDA is available.
        growable: whether a request that fits nowhere adds a slab (else it raises).

    Thread-safe. ``reserved_bytes`` (memory held) and ``in_use_bytes`` are derived from the slabs.
    """

    def __init__(self, capacity_bytes: int = 0, *, pin: bool | None = None, growable: bool = True):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self.growable = growable
        self.stats = PoolStats()
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        if capacity_bytes:
            self._slabs.append(self._new_slab(round_up(capacity_bytes), grown=False))

    def _new_slab(self, nbytes: int, *, grown: bool) -> _Slab:
        memory = aligned_empty(nbytes, pin=self.pin)
        # Touch every page now: the pool's memory is resident from the start (RSS follows the
        # formula, and no page faults land on the hot path). Pinning touches them anyway.
        memory.zero_()
        return _Slab(memory=memory, grown=grown, free=[(0, nbytes)])

    @property
    def reserved_bytes(self) -> int:
        """Host bytes the pool holds (all slabs)."""
        with self._lock:
            return sum(s.nbytes for s in self._slabs)

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the slabs handed out and not yet released."""
        with self._lock:
            return sum(s.nbytes - sum(n for _, n in s.free) for s in self._slabs)

    def acquire(self, nbytes: int) -> PoolBuffer:
        """A buffer of ``round_up(nbytes, 4096)`` bytes, carved first-fit from the slabs."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        size = round_up(nbytes)
        with self._lock:
            for slab in self._slabs:
                off = take_extent(slab.free, size)
                if off is not None:
                    return PoolBuffer(raw=slab.memory[off:off + size], slab=slab, offset=off)
            if not self.growable:
                free = max((n for s in self._slabs for _, n in s.free), default=0)
                raise MemoryError(
                    f"pinned pool exhausted: need {size} bytes, largest free extent is {free} bytes "
                    f"of {sum(s.nbytes for s in self._slabs)} reserved; build the pool with a larger "
                    f"capacity_bytes, or growable=True")
            slab = self._new_slab(size, grown=True)
            slab.free.clear()  # the whole new slab is this buffer
            self._slabs.append(slab)
            self.stats.grows += 1
            return PoolBuffer(raw=slab.memory, slab=slab, offset=0)

    def release(self, buf: PoolBuffer) -> None:
        """Give a buffer back for reuse. The caller must not touch ``buf`` afterwards."""
        with self._lock:
            if buf.released:
                raise RuntimeError("pinned pool: buffer released twice")
            buf.released = True
            give_extent(buf.slab.free, buf.offset, buf.nbytes, owner="pinned pool")

    def trim(self) -> int:
        """Free grown slabs that hold no buffer; returns the bytes given back."""
        with self._lock:
            idle = [s for s in self._slabs if s.grown and s.free == [(0, s.nbytes)]]
            self._slabs = [s for s in self._slabs if s not in idle]
            return sum(s.nbytes for s in idle)


class SlotWindow:
    """At most ``slots`` host buffers (pinned when ``pin``), made on first use and reused:
    the bounded window that transient payloads pass through (store.py, [Note: transient
    payloads]). A slot is as large as the largest request it was made for (``grow_to`` before
    the first request: every slot then serves every request); a free slot too small for a
    request is replaced by one large enough. ``acquire`` never waits: it raises when every slot
    is taken (the owner makes room first; the store's caller decides how)."""

    def __init__(self, slots: int, *, pin: bool = False):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ValueError(f"SlotWindow: slots must be an int >= 0, got {slots!r}")
        self.slots = slots
        self.pin = pin
        self.slot_bytes = 0
        """Size new slots are made with (4 KiB-rounded; ``grow_to``)."""
        self._lock = threading.Lock()
        self._free: list[PoolBuffer] = []
        self._taken = 0
        self._taken_bytes = 0

    def grow_to(self, nbytes: int) -> None:
        """Slots made from now on hold at least ``nbytes``."""
        with self._lock:
            self.slot_bytes = max(self.slot_bytes, round_up(nbytes))

    @property
    def made(self) -> int:
        """Slots that exist (free or taken)."""
        with self._lock:
            return self._taken + len(self._free)

    @property
    def taken(self) -> int:
        with self._lock:
            return self._taken

    def available(self) -> int:
        """Slots a request could take now (free ones and ones still to be made)."""
        with self._lock:
            return self.slots - self._taken

    @property
    def reserved_bytes(self) -> int:
        """Host bytes the slots made so far hold."""
        with self._lock:
            return sum(b.nbytes for b in self._free) + self._taken_bytes

    def acquire(self, nbytes: int) -> PoolBuffer:
        """A free slot of at least ``nbytes``; raises ``MemoryError`` when all ``slots`` are taken."""
        size = round_up(nbytes)
        with self._lock:
            if self._taken >= self.slots:
                raise MemoryError(f"the window's {self.slots} slot(s) are all taken; release one first")
            fit = [b for b in self._free if b.nbytes >= size]
            if fit:
                buf = fit[0]
                self._free.remove(buf)
            else:
                if self._free:  # a free slot too small for this request: replace it
                    self._free.pop()
                memory = aligned_empty(max(size, self.slot_bytes), pin=self.pin)
                memory.zero_()  # resident from the start, as the pool's slabs
                buf = PoolBuffer(raw=memory, slab=None, offset=0)
            buf.released = False
            self._taken += 1
            self._taken_bytes += buf.nbytes
            return buf

    def release(self, buf: PoolBuffer) -> None:
        with self._lock:
            if buf.released:
                raise RuntimeError("slot window: slot released twice")
            buf.released = True
            self._taken -= 1
            self._taken_bytes -= buf.nbytes
            self._free.append(buf)

    def clear(self) -> None:
        """Free the slots that are not taken."""
        with self._lock:
            self._free.clear()


class HomesAhead:
    """[Note: homes ahead] The host homes of a model's chunks, made on a background thread in
    the order ``initialize`` will ask for them, while its own thread fills the chunks before.

    Making a home is ``aligned_empty(nbytes, pin=pin)``: fresh pages brought in ([Note: fault
    in] in swap_io.py), then registered with CUDA. That is the kernel's work (a VM backs each new
    page too): 3.9 GiB/s on one H200 VM (session 21's pin probe), so at 14B it takes longer than
    drawing the first values (26 s and 17 s of 71 GiB of homes). Made here, it overlaps them.
    ``take(nbytes)`` hands out the next buffer when its size is the one expected, waiting for it
    if needed; anything else (another size, a failure on the thread, ``close``) ends the
    look-ahead and the caller allocates for itself, as it would without one: the bytes, their
    alignment and their pinning are the same either way. ``ahead`` buffers at most wait made
    (None: all of them; running ahead costs no memory: the buffers made and those taken never
    add up to more than the homes asked for, as ``close()``, on an early end too, frees those not
    taken before the caller allocates its own). The default stays 8: with every home made ahead
    at 14B on one H200 (session 21, fair harness) the thread's pages came in beside the 16
    threads drawing the GPU-homed chunks' values, and its 71 GiB took 39 s (call 3), against
    23.5 s with 8 ahead (call 4), where the chunks homed on the GPU come first and the host
    homes mostly after them. Two calls: not yet compared in one. With CUDA the thread
    makes the caller's device current before it registers anything (its registration belongs
    there)."""

    def __init__(self, sizes: Sequence[int], *, pin: Optional[bool], ahead: Optional[int] = 8):
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1):
            raise ValueError(f"HomesAhead: ahead must be an int >= 1 or None (all), got {ahead!r}")
        self._sizes = [int(n) for n in sizes]
        self._next = 0  # index in _sizes of the next take
        self._pin = pin
        self._ready: "queue.Queue" = queue.Queue(maxsize=ahead or 0)  # (0: unbounded)
        self._stop = threading.Event()
        self.taken = 0
        """Buffers handed out."""
        self.ended: Optional[str] = None
        """Why the look-ahead ended early (None: it did not)."""
        self.clock: dict = {"touch": 0.0, "pin": 0.0}
        """Seconds the thread spent bringing pages in and pinning them (``aligned_empty``'s clock)."""
        device = None
        if (pin or pin is None) and torch.cuda.is_available():
            device = torch.cuda.current_device()
        self._thread = threading.Thread(target=self._run, args=(device,), name="zero_offload-homes", daemon=True)
        self._thread.start()

    def _run(self, device) -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            for n in self._sizes:
                buf = aligned_empty(n, pin=self._pin, clock=self.clock)
                while not self._stop.is_set():
                    try:
                        self._ready.put(buf, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # the caller allocates for itself (and meets the error there)
            self._ready.put(e)

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """The next home (uint8, ``nbytes`` long) when ``nbytes`` is the size expected next; else
        None, and the look-ahead ends."""
        if self.ended is not None:
            return None
        if self._next >= len(self._sizes) or self._sizes[self._next] != nbytes:
            self._end(f"asked for {nbytes} bytes, expected "
                      f"{self._sizes[self._next] if self._next < len(self._sizes) else 'nothing more'}")
            return None
        got = self._ready.get()
        if isinstance(got, BaseException):
            self._end(f"the thread failed: {type(got).__name__}: {got}")
            return None
        self._next += 1
        self.taken += 1
        return got

    def _end(self, why: str) -> None:
        self.ended = why
        self.close()

    def close(self) -> None:
        """Stop the thread; the buffers made and not taken are freed."""
        if self.ended is None:
            self.ended = "closed"
        self._stop.set()
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                if not self._thread.is_alive():
                    break
                self._thread.join(timeout=0.1)
