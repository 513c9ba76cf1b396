"""Tiered chunk store: where each payload of each chunk lives (GPU / pinned CPU / NVMe), the
budgets of the tiers, and the asynchronous moves between them.

Ownership (outer to inner): ``ChunkStore`` owns ``_Chunk`` records, a chunk owns one ``_Payload``
record per named payload ("params", "grads", "master", ...), a payload owns one ``_Copy`` record
per tier (buffer or file slot, residency state, the move writing into it, the moves reading it).
Nothing is written onto tensors, and no table is keyed by id beside the records.

Policy (which copy to evict when a tier is full) lives in ``EvictionPolicy`` classes; the store
is the mechanism that moves bytes. The prefetcher (prefetch.py) installs a policy that knows the
recorded access order.

[Note: residency] Each copy is in one ``Residency`` state; ``_LEGAL`` lists the moves between
states and ``_Copy.to`` raises ``IllegalTransition`` on any other. ``VALID`` copies all hold the
newest bytes; a write (``mark_dirty`` / ``allocate``) makes every other copy ``STALE``.

[Note: hazards] A copy has at most one move writing into it (``pending``) and any number of
moves reading it (``readers``).
- RAW: a read of a copy (``get``, or a move out of it) first waits on ``pending`` (device-side
  for CUDA consumers, host-side otherwise).
- WAR: a move into a copy first waits on its ``readers``; ``get(..., write=True)`` does the same
  for the caller, and an evicted copy whose readers are still running stays ``EVICTING`` (its
  buffer is not reused) until they finish.
- WAW: a move into a copy is issued only once the previous one has settled (``pending`` is
  waited on first), so writes into one copy land in issue order.

[Note: lazy settling] Moves finish on other threads or streams and never touch the records; a
copy whose ``pending`` handle is done is moved ``LOADING``/``FLUSHING`` → ``VALID`` the next time
the store looks at it (under the lock), so the records are only ever changed by callers' threads.

[Note: accounting] ``bytes(tier)`` is the sum of the sizes of the copies that hold memory in that
tier (any state but ``ABSENT``), kept as a set of records updated only inside ``_Copy.to``. The
peak is taken there too. Budgets are checked before a buffer is taken.

[Note: parking] ``park(to)`` empties the GPU tier for a while (the device is lent to another
user between training steps: an inference engine generating rollouts between RL updates).
Every non-home copy there is evicted (written home first when it holds the only newest bytes),
and every payload homed on the GPU is *re-homed* to ``to`` (``_Payload.away``): the CPU (an
exact-size buffer of its own, pinned when the store pins) or NVMe (a slot of a parking swap
space made for the park in ``nvme_dir``, staged through host memory ``_PARK_BATCH`` payloads at
a time); its bytes are copied there and its GPU copy is freed. ``payload_spec`` keeps the plan's
home; ``home(cid, name)`` says where the authoritative bytes are now. The budget of ``to`` grows
by what it takes in (and the CPU's by the staging, for NVMe) until ``unpark``. While parked,
every call naming the GPU tier raises; the other tiers work as before, so the state can be read
(a checkpoint) or overwritten (a load) meanwhile: a write lands in the parked home. ``unpark()``
copies each re-homed payload into a new GPU buffer, homes it there again and frees its parking
copy, the parking space and the lent budget; ``unpark(keep=True)`` keeps each host buffer of a
park on the CPU as its copy's ``spare`` instead, which the next park takes back (no fresh pinned
memory: registering it is most of a park's time), until ``release_spares``. A failure part-way
through either moves back what was moved, then raises (the store is as before the call).

[Note: transient payloads] A payload whose bytes live only between a write and their one use
(the grads of a chunk between their device-to-host copy and the update that consumes them) need
not hold host memory of its own for the store's life. ``PayloadSpec(transient=True)`` homed on
the CPU has a home copy that is ABSENT until written (a move into it, or ``allocate``); it then
takes a slot of the store's window (``StoreConfig.window_slots`` slots, each as large as the
largest transient payload: ``SlotWindow`` in pinned_pool.py, pinned when the store pins) and
gives it back at ``release(cid, name)``, the owner's word that the bytes are consumed: every
copy is freed and the payload holds no bytes until written again (reading it then raises).
The window is bounded: a write needing a slot when all are taken raises ``StoreError`` before
any change, never waits (the owner knows which of its jobs frees one: chunk_group.py, [Note:
grads window]). Home copies are never evicted, so a slot is only ever freed by ``release``,
``discard`` or ``close``. The accounting counts a held slot as its payload's bytes (like any
copy); budgets are not checked for slots (the plan counts the window). Homed on the GPU (the
grads of a chunk of the optimizer's GPU share, from their staging to the update on the device)
a transient payload is ABSENT until written too, and its home copy then takes device memory
from the caching allocator, within the GPU budget, until ``release``: no window (the allocator
reuses the blocks in the caller's stream order), so the share's grads hold memory for one or two
chunks at a time, not for every chunk of the share. ``rehome`` of a transient payload moves no
bytes (between uses they are dead): its new home holds none until written; ``rehome(...,
transient=)`` also changes whether it is transient there (a chunk leaving the GPU share for a
store without a window gets an ordinary host home, zeroed), and moves no bytes either way.

[Note: derived payloads] A payload whose bytes are another payload's of the same chunk cast to
its dtype (the bf16 working params of a chunk whose fp32 master is in host memory) need not be
kept in host memory at all: ``PayloadSpec(source="master")`` holds no home bytes (its home copy,
in the source's home tier, the CPU, stays ABSENT), and its GPU copy is made from the source's
CPU copy by one move: the fp32 bytes go up into a staging buffer on the device (the H2D stream;
4 bytes per element over PCIe instead of 2) and one cast kernel writes the GPU copy, on the same
stream (round to nearest even, as the CPU kernels round: torch's ``copy_`` between dtypes). On a
store whose device is the CPU the cast is a host copy. A write to any copy of the source
(``mark_dirty``, ``allocate``) makes every copy of its derived payloads STALE, so the next fetch
casts the new bytes; the move is a reader of the source's CPU copy, so a write into it waits for
the move first ([Note: hazards]). A derived payload is read-only and lives on the GPU tier only:
writing it (``allocate``, ``get(write=True)``, ``mark_dirty``), reading it in another tier,
``flush`` and ``rehome`` (of it or of its source) raise; evicting its GPU copy writes nothing
back (the source has the bytes). The source must be homed on the CPU, not transient, of the
same size, and not derived itself; it is checked when the chunk is added.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import functools
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple, Protocol, Sequence

import psutil
import torch

from .pinned_pool import HomesAhead, PinnedPool, PoolBuffer, SlotWindow
from .swap_io import aligned_empty
from .vocab import ALIGNMENT, round_up

__all__ = [
    "Tier", "Residency", "Hop", "PayloadSpec", "StoreConfig", "ChunkStore", "Handle", "StoreStats",
    "EvictionPolicy", "EvictionCandidate", "LRUPolicy", "FarthestNextUsePolicy",
    "BudgetError", "IllegalTransition", "StoreError", "resolve_budgets",
]


class Tier(enum.Enum):
    """Where a copy lives. Ordered fastest first; moves go between neighbours (NVMe↔GPU stages
    through the CPU)."""

    GPU = "gpu"    # the compute device: CUDA, or the CPU with its own budget when no CUDA
    CPU = "cpu"    # host memory, pinned when CUDA is present
    NVME = "nvme"  # a slot of a SwapSpace file

    @property
    def level(self) -> int:
        return list(Tier).index(self)

    @classmethod
    def of(cls, value: "Tier | str") -> "Tier":
        if isinstance(value, Tier):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"unknown tier {value!r}; use one of 'gpu', 'cpu', 'nvme' "
                             f"(or zero_offload.store.Tier)") from None


class Residency(enum.Enum):
    """State of one copy (one payload in one tier). See [Note: residency]."""

    ABSENT = "absent"      # no buffer or slot
    LOADING = "loading"    # a fetch into this copy is in flight (`pending`); reads wait on it
    FLUSHING = "flushing"  # a write-behind into this copy is in flight (`pending`)
    VALID = "valid"        # holds the newest bytes
    STALE = "stale"        # buffer or slot kept, bytes outdated by a newer copy elsewhere
    EVICTING = "evicting"  # dropped; moves still reading it run, then its memory is freed


_R = Residency
_LEGAL: dict[Residency, frozenset[Residency]] = {
    _R.ABSENT: frozenset({_R.LOADING, _R.FLUSHING, _R.VALID}),  # VALID: allocate / home zeros
    _R.LOADING: frozenset({_R.VALID, _R.ABSENT}),               # ABSENT: the move failed
    _R.FLUSHING: frozenset({_R.VALID, _R.ABSENT}),
    _R.VALID: frozenset({_R.STALE, _R.EVICTING, _R.ABSENT}),
    _R.STALE: frozenset({_R.LOADING, _R.FLUSHING, _R.VALID, _R.EVICTING, _R.ABSENT}),
    _R.EVICTING: frozenset({_R.ABSENT}),
}
_IN_FLIGHT = frozenset({_R.LOADING, _R.FLUSHING})


class Hop(enum.Enum):
    """A move between neighbouring tiers; the unit of the byte statistics."""

    NVME_TO_CPU = "nvme->cpu"
    CPU_TO_GPU = "cpu->gpu"
    GPU_TO_CPU = "gpu->cpu"
    CPU_TO_NVME = "cpu->nvme"

    @classmethod
    def between(cls, src: Tier, dst: Tier) -> "Hop":
        return cls(f"{src.value}->{dst.value}")


class StoreError(RuntimeError):
    """Misuse of the store (wrong state for the call); the message says what to do instead."""


class IllegalTransition(StoreError):
    """A copy was asked to move between residency states that ``_LEGAL`` does not connect."""


class BudgetError(MemoryError):
    """A tier cannot make room for a copy within its budget."""


# --------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class PayloadSpec:
    """One payload of a chunk: a flat buffer of ``numel`` elements of ``dtype``, whose
    authoritative copy lives in ``home``."""

    numel: int
    dtype: torch.dtype
    home: Tier
    transient: bool = False
    """Its bytes live only from a write until the owner's ``ChunkStore.release``: homed on the
    CPU, its home copy takes a slot of the store's window instead of memory of its own; homed
    on the GPU, device memory while it holds bytes ([Note: transient payloads]). Not on NVMe."""
    source: "str | None" = None
    """The payload of the same chunk this one is made from, cast to ``dtype`` ([Note: derived
    payloads]): no home bytes of its own, read-only, a GPU copy only. None: an ordinary payload."""

    def __post_init__(self):
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel <= 0:
            raise ValueError(f"PayloadSpec.numel must be a positive int, got {self.numel!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"PayloadSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "home", Tier.of(self.home))
        if not isinstance(self.transient, bool):
            raise TypeError(f"PayloadSpec.transient must be True or False, got {self.transient!r}")
        if self.source is not None and (not isinstance(self.source, str) or not self.source):
            raise TypeError(f"PayloadSpec.source must be a payload name or None, got {self.source!r}")
        if self.source is not None and self.transient:
            raise ValueError("PayloadSpec: a derived payload (source=...) holds no bytes of its own; it "
                             "cannot also be transient")
        if self.transient and self.home is Tier.NVME:
            raise ValueError("PayloadSpec: a transient payload lives in memory (gpu or cpu), not on nvme")

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """How a ``ChunkStore`` is built. Frozen; every field is checked in ``__post_init__``."""

    device: "str | torch.device | None" = None
    """The compute device behind ``Tier.GPU``: a CUDA device, or "cpu" (the 'gpu' tier is then
    ordinary host memory with its own budget). None = "cuda" when available, else "cpu"."""

    budgets: "Mapping[Tier | str, int | str]" = field(default_factory=dict)
    """Byte budget per tier, or "auto" (GPU: free CUDA memory, CPU: psutil available memory,
    each less ``auto_reserve_fraction`` of itself: ``auto_budget``; NVMe: ``swap_io.auto_nvme_budget``, free
    disk space less a small reserve). Tiers left out are "auto". The swap file is preallocated
    to the NVMe budget when the first NVMe copy is made, so a store used directly caps NVMe
    "auto" at 64 GiB; set the budget (``set_budget``) to what you need before that, as the
    engine does."""

    nvme_dir: "str | os.PathLike | None" = None
    """Directory for the NVMe tier's swap files; None = no NVMe tier (a payload homed on NVMe
    is then an error)."""

    io_threads: int = 4
    """Native I/O threads of the NVMe tier."""

    io_block_size: int = 1 << 20
    """Bytes per native I/O request (a multiple of 4096)."""

    io_queue_depth: int = 16
    """Native I/O requests in flight at once, engine-wide (``AioEngine(queue_depth=)``)."""

    copy_threads: int = 2
    """Host threads that run host-side copies and moves waiting on host-side dependencies."""

    pin_memory: "bool | None" = None
    """Register CPU-tier memory with CUDA (needed for asynchronous H2D/D2H); None = when the
    device is CUDA."""

    pool_bytes: int = 0
    """Bytes of the pinned pool slab taken up front for non-home CPU copies (staging of NVMe
    payloads, caches). 0 = start empty and grow by exact-size slabs on first use."""

    auto_reserve_fraction: float = 0.1
    """Share of the GPU's and host memory's free memory that an "auto" budget leaves alone (not
    NVMe's: see ``budgets``; ``auto_budget``)."""

    window_slots: int = 0
    """Host slots the home copies of transient payloads take while they hold bytes ([Note:
    transient payloads]); each as large as the largest transient payload. 0: no window (a
    transient payload homed on the CPU is then an error)."""

    def __post_init__(self):
        device = self.device
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"StoreConfig.device={self.device!r} is not a torch device; "
                             f"use 'cuda', 'cuda:N' or 'cpu'") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("StoreConfig.device is CUDA but torch.cuda.is_available() is False; "
                                 "use device='cpu' (the 'gpu' tier is then host memory)")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise ValueError(f"StoreConfig.device={device} is not supported; use a CUDA device or 'cpu'")
        object.__setattr__(self, "device", device)

        if not isinstance(self.budgets, Mapping):
            raise TypeError(f"StoreConfig.budgets must be a mapping tier -> bytes|'auto', got {self.budgets!r}")
        budgets: dict[Tier, int | str] = {t: "auto" for t in Tier}
        for key, value in self.budgets.items():
            tier = Tier.of(key)
            if value == "auto":
                budgets[tier] = "auto"
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StoreConfig.budgets[{tier.value!r}]={value!r}: give bytes as an int >= 0, "
                                 f"or 'auto'")
            else:
                budgets[tier] = value
        object.__setattr__(self, "budgets", budgets)

        for name, least in (("io_threads", 1), ("io_queue_depth", 1), ("copy_threads", 1), ("pool_bytes", 0),
                            ("window_slots", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"StoreConfig.{name} must be an int >= {least}, got {value!r}")
        if not isinstance(self.io_block_size, int) or self.io_block_size <= 0 or self.io_block_size % ALIGNMENT:
            raise ValueError(f"StoreConfig.io_block_size must be a positive multiple of {ALIGNMENT}, "
                             f"got {self.io_block_size!r}")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise TypeError(f"StoreConfig.pin_memory must be True, False or None, got {self.pin_memory!r}")
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("StoreConfig.pin_memory=True needs CUDA; leave it None (pin when CUDA is used)")
        if not (0.0 <= self.auto_reserve_fraction < 1.0):
            raise ValueError(f"StoreConfig.auto_reserve_fraction must be in [0, 1), got {self.auto_reserve_fraction!r}")
        if self.nvme_dir is not None and not isinstance(self.nvme_dir, (str, os.PathLike)):
            raise TypeError(f"StoreConfig.nvme_dir must be a path or None, got {self.nvme_dir!r}")

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def pin(self) -> bool:
        return self.cuda if self.pin_memory is None else self.pin_memory


_NVME_AUTO_CAP = 64 << 30

_PARK_BATCH = 8
"""Payloads a park to NVMe (or its unpark) stages through host memory at once ([Note: parking])."""


def cuda_room(device) -> tuple[int, int]:
    """(bytes this process may still take on ``device``, the most it may hold there): the device's
    free and total memory, held to ``torch.cuda.set_per_process_memory_fraction`` where the script
    set one (the allocator refuses beyond it, so "auto" budgets and the measured share must not
    plan past it)."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _d: 1.0)(device)
    if fraction < 1.0:
        total = int(fraction * total)
        free = max(0, min(free, total - torch.cuda.memory_reserved(device)))
    return int(free), int(total)


def _home_made_at_add(spec: PayloadSpec) -> bool:
    """``add_chunk`` gives the payload's home memory (or an NVMe slot) at once: not a derived
    payload ([Note: derived payloads]: none of its own) nor a transient one (ABSENT until
    written: [Note: transient payloads]). ``host_home_sizes`` lists the host ones from this."""
    return spec.source is None and not spec.transient


def _check_derived(name: str, spec: PayloadSpec, payloads: Mapping) -> None:
    """A derived payload's source: in the chunk, ordinary, homed on the CPU with it, as large
    ([Note: derived payloads])."""
    src = payloads.get(spec.source)
    why = ("the chunk has no such payload" if src is None else
           "it is derived itself" if src.source is not None else
           "it is transient" if src.transient else
           f"it is homed on {src.home.value!r}, not the CPU" if src.home is not Tier.CPU else
           f"the derived payload is homed on {spec.home.value!r}, not with it" if spec.home is not src.home else
           f"it has {src.numel} elements, not {spec.numel}" if src.numel != spec.numel else "")
    if why:
        raise StoreError(f"add_chunk: payload {name!r} is made from {spec.source!r}, but {why}; a derived "
                         f"payload's source is an ordinary payload of the same chunk and size homed on "
                         f"the CPU ([Note: derived payloads])")


def auto_budget(free: int, fraction: float) -> int:
    """An "auto" GPU or host budget: ``free`` bytes less ``fraction`` of them.

    The fraction is of what is free, not of the total: it is headroom for what the plan does not
    count before the first step measures it (the allocator's rounding, a library's workspace), and
    that headroom belongs to this process. Of the total it cost nothing on an idle card but took
    everything on a shared one: with 12 GiB free of an H200's 140, 10% of the total left a budget
    of 0 and the engine refused a card that trains it (session 19's first 4x H200 call; an H100
    with the same 12 GiB free trained)."""
    return max(0, int(free * (1.0 - fraction)))


def resolve_budgets(config: StoreConfig) -> dict[Tier, int]:
    """Bytes per tier of ``config.budgets``, "auto" resolved as ``StoreConfig.budgets`` says (what
    a store built from ``config`` now would get)."""
    reserve = config.auto_reserve_fraction
    out: dict[Tier, int] = {}
    for tier, value in config.budgets.items():
        if value != "auto":
            out[tier] = value
        elif tier is Tier.GPU and config.cuda:
            out[tier] = auto_budget(cuda_room(config.device)[0], reserve)
        elif tier in (Tier.GPU, Tier.CPU):
            out[tier] = auto_budget(psutil.virtual_memory().available, reserve)
        elif config.nvme_dir is None:
            out[tier] = 0
        else:
            from .swap_io import auto_nvme_budget
            out[tier] = min(_NVME_AUTO_CAP, auto_nvme_budget(config.nvme_dir))
    return out


# --------------------------------------------------------------------------------------------
# Handles


_DONE = concurrent.futures.Future()  # a host-side waitable that is already complete
_DONE.set_result(None)


class _IoWait:
    """Adapts a swap_io ``IoHandle`` (wait/done) to the future protocol (result/done)."""

    def __init__(self, io):
        self._io = io

    def done(self) -> bool:
        return self._io.done()

    def result(self):
        self._io.wait()
        return None


class Handle:
    """A move in flight. ``wait()`` blocks the host until it is complete; ``wait_stream(s)``
    makes CUDA stream ``s`` wait for it (blocking the host only for a host-side part, e.g. an
    NVMe read the copy depends on); ``done()`` polls.

    A move has a host part (a future or I/O request: NVMe I/O, host copies, or the enqueueing of
    a CUDA copy that had to wait for one) and, for CUDA copies, an event recorded after the copy
    on its stream. The host part resolves to that event when the event is created late.
    """

    __slots__ = ("_host", "_event")

    def __init__(self, *, host=None, event: "torch.cuda.Event | None" = None):
        self._host = host if host is not None else _DONE
        self._event = event

    @classmethod
    def completed(cls) -> "Handle":
        return cls()

    def _event_after_host(self):
        """Block for the host part (re-raising the move's error), then return the CUDA event."""
        ev = self._host.result()
        if self._event is None and ev is not None:
            self._event = ev
        return self._event

    def done(self) -> bool:
        """Whether the move is complete; raises the move's error if it failed."""
        if not self._host.done():
            return False
        ev = self._event_after_host()
        return ev is None or ev.query()

    def finished(self) -> bool:
        """Like ``done`` but a failed move counts as finished (no exception)."""
        try:
            return self.done()
        except Exception:
            return True

    def host_done(self) -> bool:
        """The host part is complete (a CUDA event, if any, may still be pending on its stream)."""
        return self._host.done()

    def wait(self) -> None:
        """Block the host until the move is complete; raises the move's error if it failed."""
        ev = self._event_after_host()
        if ev is not None:
            ev.synchronize()

    def wait_stream(self, stream) -> None:
        """Make CUDA ``stream`` wait for the move (device-side); the host blocks only for a
        host-side part. Without an event (host moves) this is ``wait()``."""
        ev = self._event_after_host()
        if ev is not None:
            stream.wait_event(ev)


class _Streams(NamedTuple):
    """The store's CUDA streams (one object, so every stream the store uses is listed here)."""

    h2d: "torch.cuda.Stream"  # pinned CPU → GPU copies (fetches)
    d2h: "torch.cuda.Stream"  # GPU → pinned CPU copies (flushes, write-behind of grads)


# --------------------------------------------------------------------------------------------
# Records


@dataclass(eq=False)
class _Copy:
    """One payload in one tier."""

    payload: "_Payload"
    tier: Tier
    state: Residency = Residency.ABSENT
    buffer: "torch.Tensor | None" = None
    """Flat typed tensor (GPU and CPU tiers)."""
    pool_buffer: "PoolBuffer | None" = None
    """The pool extent behind ``buffer`` (non-home CPU copies), returned when dropped."""
    slot: object = None
    """The SwapSpace slot (NVMe tier)."""
    space: object = None
    """The SwapSpace ``slot`` belongs to: the store's, or a park's ([Note: parking])."""
    spare: "torch.Tensor | None" = None
    """A host buffer a park used for this copy and ``unpark(keep=True)`` kept for the next park
    ([Note: parking]); not counted in ``bytes`` (``spare_bytes``)."""
    pending: "Handle | None" = None
    """The move writing into this copy (LOADING / FLUSHING)."""
    readers: list = field(default_factory=list)
    """Moves reading this copy that may still be running."""
    pins: int = 0
    """Users holding this copy (``use`` / ``pin``): a pinned copy is never evicted."""
    counted: int = 0
    """Bytes this copy adds to its tier's ``ChunkStore._held_bytes`` while held."""
    evict_at_unpin: bool = False
    """``evict(defer=True)`` found it pinned: the last ``unpin`` evicts it."""
    last_use: int = 0
    """Store clock at the last fetch/get/allocate (LRU)."""
    zero: bool = False
    """The buffer holds zeros and was never handed out since ``add_chunk`` made it (fresh memory):
    ``allocate(zero=True)`` needs no fill."""

    @property
    def nbytes(self) -> int:
        """Memory this copy holds when present: the payload rounded up to 4 KiB."""
        return round_up(self.payload.spec.nbytes, ALIGNMENT)

    @property
    def is_home(self) -> bool:
        return self.tier is self.payload.home

    @property
    def windowed(self) -> bool:
        """The CPU home of a transient payload: memory from the window, only while it holds bytes
        ([Note: transient payloads])."""
        spec = self.payload.spec
        return spec.transient and self.tier is Tier.CPU and spec.home is Tier.CPU

    def where(self) -> str:
        return f"chunk {self.payload.cid} payload {self.payload.name!r} in tier {self.tier.value!r}"

    def to(self, state: Residency, store: "ChunkStore") -> None:
        """Move to ``state``; raises IllegalTransition on a move ``_LEGAL`` does not list."""
        if state not in _LEGAL[self.state]:
            raise IllegalTransition(
                f"{self.where()}: illegal residency transition {self.state.name} -> {state.name} "
                f"(legal from {self.state.name}: {sorted(s.name for s in _LEGAL[self.state])})")
        held_before = self.state is not Residency.ABSENT
        if self.state is Residency.EVICTING:
            store._evicting[self.tier].discard(self)
        self.state = state
        held_after = state is not Residency.ABSENT
        if state is Residency.EVICTING:
            store._evicting[self.tier].add(self)
        # Running totals, not sums over the held copies: the prefetcher asks for a tier's bytes
        # each time it lets a chunk go (a sum there cost 25 ms a step at 50 chunks x 5 payloads).
        if held_after and not held_before:
            self.counted = self.nbytes
            store._held[self.tier].add(self)
            store._held_bytes[self.tier] += self.counted
            store._note_peak(self.tier)
        elif held_before and not held_after:
            store._held[self.tier].discard(self)
            store._held_bytes[self.tier] -= self.counted
            self.counted = 0


@dataclass(eq=False)
class _Payload:
    cid: int
    name: str
    spec: PayloadSpec
    copies: dict = field(default_factory=dict)
    """Tier -> _Copy, one record per tier (all three always exist)."""
    away: "Tier | None" = None
    """Where the bytes of a GPU-homed payload are while the store is parked ([Note: parking])."""
    source: "_Payload | None" = None
    """The payload this one is made from ([Note: derived payloads]); None: an ordinary one."""
    derived: list = field(default_factory=list)
    """The payloads made from this one (their copies go STALE when it is written)."""

    @property
    def home(self) -> Tier:
        """The tier of the authoritative copy now: the spec's home, unless parked away."""
        return self.spec.home if self.away is None else self.away

    def valid(self) -> list[_Copy]:
        return [c for c in self.copies.values() if c.state is Residency.VALID]


@dataclass(eq=False)
class _Chunk:
    cid: int
    payloads: dict = field(default_factory=dict)
    """name -> _Payload."""
    discarded: bool = False
    """``discard`` freed every copy; the chunk can no longer be used."""


@dataclass(eq=False)
class _Parking:
    """One park of the GPU tier ([Note: parking])."""

    tier: Tier
    """Where the GPU-homed payloads went."""
    payloads: list
    """The re-homed ``_Payload``s, in chunk order."""
    lent: dict
    """Tier -> bytes added to its budget for the park."""
    space: object = None
    """The parking SwapSpace (NVMe), closed at ``unpark``."""
    engine: object = None
    """Its AioEngine."""


# --------------------------------------------------------------------------------------------
# Policy


class EvictionCandidate(NamedTuple):
    cid: int
    name: str
    tier: Tier
    nbytes: int
    last_use: int
    stale: bool
    """True when the copy holds outdated bytes (dropping it costs no write-back)."""


class EvictionPolicy(Protocol):
    """Orders eviction candidates: the store evicts from the front until the new copy fits."""

    def order(self, candidates: Sequence[EvictionCandidate]) -> list[EvictionCandidate]:
        ...


class LRUPolicy:
    """Stale copies first, then least recently used."""

    def order(self, candidates):
        return sorted(candidates, key=lambda c: (not c.stale, c.last_use))


class FarthestNextUsePolicy:
    """Stale copies first, then the copy whose chunk is used farthest in the future (Belady),
    from ``next_use(cid) -> distance | None`` (None: unknown, treated as farthest, LRU among
    those)."""

    def __init__(self, next_use: Callable[[int], "int | None"]):
        self.next_use = next_use

    def order(self, candidates):
        def key(c):
            d = self.next_use(c.cid)
            return (not c.stale, -(float("inf") if d is None else d), c.last_use)
        return sorted(candidates, key=key)


# --------------------------------------------------------------------------------------------
# Statistics


@dataclass
class StoreStats:
    """Flow counters (moves, waits). Bytes *held* are not here: see ``ChunkStore.bytes``."""

    bytes_moved: dict = field(default_factory=lambda: {h: 0 for h in Hop})
    """Hop -> bytes issued on that hop."""
    moves: dict = field(default_factory=lambda: {h: 0 for h in Hop})
    by_payload: dict = field(default_factory=dict)
    """(hop, payload name) -> bytes issued on that hop for payloads of that name ("grads",
    "master", ...): ``bytes_moved`` split by what moved."""
    stall_s: float = 0.0
    """Host seconds spent in ``get`` waiting for moves."""
    hits: int = 0
    """``get`` calls whose copy was ready without waiting."""
    misses: int = 0
    evictions: int = 0

    def moved(self, hop: Hop, name: str, nbytes: int) -> None:
        """Count one move of ``nbytes`` of payload ``name`` on ``hop``."""
        self.bytes_moved[hop] += nbytes
        self.moves[hop] += 1
        self.by_payload[hop, name] = self.by_payload.get((hop, name), 0) + nbytes

    def as_dict(self) -> dict:
        return {"bytes_moved": {h.value: n for h, n in self.bytes_moved.items()},
                "by_payload": {f"{h.value} {name}": n for (h, name), n in self.by_payload.items()},
                "moves": {h.value: n for h, n in self.moves.items()},
                "stall_s": self.stall_s, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions}


# --------------------------------------------------------------------------------------------
# The store


class ChunkStore:
    """Chunks of named payloads spread over GPU / CPU / NVMe tiers. Thread-safe.

    See the module notes for the state machine, hazards, and accounting.
    """

    def __init__(self, config: "StoreConfig | None" = None):
        config = config if config is not None else StoreConfig()
        if not isinstance(config, StoreConfig):
            raise TypeError(f"ChunkStore(config) needs a StoreConfig, got {type(config).__name__}")
        self.config = config
        self.device = config.device
        self.budgets: dict[Tier, int] = resolve_budgets(config)
        self.policy: EvictionPolicy = LRUPolicy()
        self.stats = StoreStats()
        self._lock = threading.RLock()
        self._chunks: list[_Chunk] = []
        self._held: dict[Tier, set] = {t: set() for t in Tier}
        self._held_bytes: dict[Tier, int] = {t: 0 for t in Tier}  # of the held copies (_Copy.to)
        self._evicting: dict[Tier, set] = {t: set() for t in Tier}  # held copies in EVICTING
        self._peak: dict[Tier, int] = {t: 0 for t in Tier}
        self._clock = 0
        self._closed = False
        self._pool = PinnedPool(config.pool_bytes, pin=config.pin)
        self._window = SlotWindow(config.window_slots, pin=config.pin)  # [Note: transient payloads]
        self._homes_ahead: "HomesAhead | None" = None  # [Note: homes ahead] (initialize only)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.copy_threads, thread_name_prefix="zero_offload-store")
        self._streams = None
        if config.cuda:
            with torch.cuda.device(self.device):
                self._streams = _Streams(h2d=torch.cuda.Stream(), d2h=torch.cuda.Stream())
        self._swap = None
        self._zeros: "torch.Tensor | None" = None  # read-only zero buffer for NVMe home init
        self._parking: "_Parking | None" = None  # [Note: parking]

    # ---- public API --------------------------------------------------------------------

    @staticmethod
    def host_home_sizes(payloads: "Mapping[str, PayloadSpec]") -> list:
        """Bytes of each host-memory home ``add_chunk(payloads)`` allocates, in its order (what
        ``homes_ahead`` is told to make)."""
        return [spec.nbytes for spec in payloads.values() if _home_made_at_add(spec) and spec.home is Tier.CPU]

    @contextlib.contextmanager
    def homes_ahead(self, sizes: "Sequence[int]"):
        """Within: the host homes ``add_chunk`` allocates come from a thread that makes them ahead,
        in the order ``sizes`` gives (``host_home_sizes`` of each chunk to add): [Note: homes
        ahead] in pinned_pool.py. A home of another size is allocated as ever. Yields the
        ``HomesAhead`` (its ``taken`` and ``ended`` say how it went)."""
        ahead = HomesAhead(sizes, pin=self.config.pin)
        self._homes_ahead = ahead
        try:
            yield ahead
        finally:
            self._homes_ahead = None
            ahead.close()

    def add_chunk(self, payloads: "Mapping[str, PayloadSpec]") -> int:
        """Register a chunk; each payload's home copy is allocated (zeros) in its home tier."""
        self._check_open()
        if not isinstance(payloads, Mapping) or not payloads:
            raise ValueError("add_chunk needs a non-empty mapping name -> PayloadSpec")
        for name, spec in payloads.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"payload names must be non-empty strings, got {name!r}")
            if not isinstance(spec, PayloadSpec):
                raise TypeError(f"payload {name!r}: expected a PayloadSpec, got {type(spec).__name__}")
        with self._lock:
            if self._parking is not None and any(spec.home is Tier.GPU for spec in payloads.values()):
                raise StoreError("add_chunk: the GPU tier is parked (ChunkStore.park); unpark() first")
            for name, spec in payloads.items():
                if spec.source is not None:
                    _check_derived(name, spec, payloads)
            # Check the whole chunk fits before taking anything (no half-added chunk).
            need = {t: 0 for t in Tier}
            for name, spec in payloads.items():
                if spec.transient and spec.home is Tier.CPU and not self.config.window_slots:
                    raise StoreError(f"add_chunk: payload {name!r} is transient, but this store has no "
                                     f"window; set StoreConfig.window_slots ([Note: transient payloads])")
                if _home_made_at_add(spec):
                    need[spec.home] += round_up(spec.nbytes, ALIGNMENT)
            for tier, nbytes in need.items():
                if nbytes:
                    if tier is Tier.NVME:
                        self._check_nvme()
                    self._make_room(tier, nbytes, for_what="the home copies of a new chunk")
            chunk = _Chunk(cid=len(self._chunks))
            for name, spec in payloads.items():
                p = _Payload(cid=chunk.cid, name=name, spec=spec)
                p.copies = {t: _Copy(payload=p, tier=t) for t in Tier}
                chunk.payloads[name] = p
            self._chunks.append(chunk)
            for p in chunk.payloads.values():
                if p.spec.source is not None:
                    p.source = chunk.payloads[p.spec.source]
                    p.source.derived.append(p)
            for p in chunk.payloads.values():
                home = p.copies[p.spec.home]
                if home.windowed:
                    self._window.grow_to(p.spec.nbytes)
                if not _home_made_at_add(p.spec):
                    continue  # ABSENT: derived (for good) or transient (until written)
                self._alloc_memory(home)
                if home.tier is Tier.NVME:
                    if home.space.claim_zero(home.slot):  # a never-written extent reads as zeros
                        home.to(Residency.VALID, self)
                        continue
                    home.to(Residency.FLUSHING, self)
                    home.pending = Handle(host=self._io_after((), functools.partial(
                        home.space.write, home.slot, self._zero_source(p.spec.nbytes))))
                else:
                    if home.tier is Tier.GPU and self.device.type != "cpu":  # (fresh memory: zeros)
                        home.buffer.zero_()
                    home.zero = True
                    home.to(Residency.VALID, self)
            return chunk.cid

    def fetch(self, cid: int, name: str, tier: "Tier | str") -> Handle:
        """Make a valid copy resident in ``tier``, asynchronously, from the nearest valid copy.

        Idempotent: returns the pending handle while a move into that copy is in flight, or a
        completed handle when it is already valid. May evict other copies by policy to fit the
        budget; raises BudgetError when nothing can be evicted."""
        with self._lock:
            return self._ensure(self._copy(cid, name, tier), Residency.LOADING)

    def flush(self, cid: int, name: str, tier: "Tier | str | None" = None) -> Handle:
        """Write the newest bytes to ``tier`` (default: the payload's home), asynchronously
        (write-behind). GPU → CPU runs on the D2H stream."""
        with self._lock:
            tier = self._payload(cid, name).home if tier is None else tier
            copy = self._copy(cid, name, tier)
            self._refuse_derived(copy, "flush")
            return self._ensure(copy, Residency.FLUSHING)

    def allocate(self, cid: int, name: str, tier: "Tier | str", *, zero: bool = False,
                 pin: bool = False) -> torch.Tensor:
        """A buffer in ``tier`` for the caller to write, without reading anything into it; it
        becomes the newest copy (every other copy turns stale). Waits for moves still reading
        or writing that copy (WAR / WAW), device-side on CUDA. ``zero``: its elements are zeros
        (filled unless it is the fresh memory ``add_chunk`` made). ``pin``: pinned too (``unpin``
        after), under the same lock: a copy that is not home is evictable the moment it is
        VALID, and a concurrent ``fetch`` making room could evict it before a separate ``pin``."""
        tier = Tier.of(tier)
        if tier is Tier.NVME:
            raise StoreError("allocate() gives a buffer to write into; NVMe has none. Allocate in "
                             "'cpu', write, then flush(cid, name, 'nvme')")
        with self._lock:
            copy = self._copy(cid, name, tier)
            self._refuse_derived(copy, "allocate")
            self._await_quiet(copy)
            if copy.state is Residency.ABSENT:
                self._take_memory(copy)
            self._wait_readers(copy, device_side=True)
            if copy.state is not Residency.VALID:
                copy.to(Residency.VALID, self)
            self._others_stale(copy)
            copy.last_use = self._tick()
            if zero and not copy.zero:
                copy.buffer.zero_()
            copy.zero = False
            if pin:
                copy.pins += 1
            return copy.buffer

    def get(self, cid: int, name: str, tier: "Tier | str", *, write: bool = False) -> torch.Tensor:
        """The flat buffer of the copy in ``tier``, after the move into it (if any) is complete
        for the caller: on CUDA the *current stream* waits on the move's event (no host sync).
        ``write=True`` also waits for moves still reading the copy, so the caller may overwrite
        it (then call ``mark_dirty``). Raises if the copy is not resident: ``fetch`` it first."""
        tier = Tier.of(tier)
        if tier is Tier.NVME:
            raise StoreError("get() returns a memory buffer; an NVMe copy has none. fetch(cid, name, 'cpu') "
                             "then get it from 'cpu'")
        with self._lock:
            copy = self._copy(cid, name, tier)
            if write:
                self._refuse_derived(copy, "get(write=True)")
            self._settle(copy)
            if copy.state not in (Residency.VALID, Residency.LOADING, Residency.FLUSHING):
                raise StoreError(f"get: {copy.where()} is {copy.state.name}, not resident; call "
                                 f"fetch(cid, name, {tier.value!r}) first (or allocate() to write a new one)")
            copy.last_use = self._tick()
            copy.zero = False
            pending = copy.pending
            copy.pins += 1  # keep it from being evicted while we wait outside the lock
        try:
            t0 = time.perf_counter()
            ready = pending is None or pending.done()
            if not ready:
                if tier is Tier.GPU and self._streams is not None:
                    pending.wait_stream(torch.cuda.current_stream(self.device))
                else:
                    pending.wait()
            waited = time.perf_counter() - t0
        finally:
            with self._lock:
                copy.pins -= 1
        with self._lock:
            if ready:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                self.stats.stall_s += waited
            if copy.pending is pending and pending is not None:
                # For a CUDA consumer the bytes are ready *on its stream*: later users go through
                # that stream or events recorded on it after this point.
                self._settle(copy, force=True)
            if write:
                self._wait_readers(copy, device_side=True)
            return copy.buffer

    def mark_dirty(self, cid: int, name: str, tier: "Tier | str") -> None:
        """The caller changed the copy in ``tier``: it is now the only newest copy."""
        with self._lock:
            copy = self._copy(cid, name, tier)
            self._refuse_derived(copy, "mark_dirty")
            self._settle(copy)
            if copy.state is not Residency.VALID:
                raise StoreError(f"mark_dirty: {copy.where()} is {copy.state.name}; only a VALID copy can "
                                 f"be written. Call get() (which waits for a move into it) or allocate() "
                                 f"before writing")
            self._others_stale(copy)

    def evict(self, cid: int, name: str, tier: "Tier | str", *, defer: bool = False) -> None:
        """Drop a non-home copy, writing it back home first when it is the only newest copy.
        No-op when the copy is absent. Raises for the home copy, and for a copy in use unless
        ``defer``: then its last ``unpin`` evicts it (a reader still holds it until then)."""
        with self._lock:
            copy = self._copy(cid, name, tier)
            if defer and copy.pins and not copy.is_home:
                copy.evict_at_unpin = True
                return
            self._evict(copy)  # raises for the home copy, and for a pinned one

    def discard(self, cid: int) -> None:
        """Free every copy of the chunk, home copies included (pinned memory unregistered and
        unmapped, swap slots returned), once the moves writing or reading them finish. For an
        owner done with the chunk for good: ``Engine.close`` hands each chunk's values back to
        the model and discards it, so host memory falls as the model's own copies grow. Any later
        use of the chunk raises."""
        with self._lock:
            chunk = self._chunk(cid)
            copies = self._copies([chunk])
            for c in copies:
                if c.pins:
                    raise StoreError(f"discard: {c.where()} is in use ({c.pins} pin(s)); leave the "
                                     f"`use` block or unpin it first")
            for c in copies:
                self._await_quiet(c)
                for r in c.readers:
                    r.wait()
                c.readers = []
            for c in copies:
                c.spare = None
                self._free(c)
            chunk.discarded = True

    def rehome(self, cid: int, name: str, tier: "Tier | str", *, transient: "bool | None" = None) -> None:
        """Make ``tier`` the payload's home: its newest bytes copied into a home buffer there
        (within the tier's budget, evicting by policy), or a slot of the swap file for NVMe, and
        the old home's memory or slot freed; GPU <-> NVMe goes through a home in host memory
        (host room for the payload needed on the way). For an owner changing placement while
        nothing uses the payload (no pin, no job); waits for moves still touching it.
        Synchronous, rare: the GPU share grown after the first step, and NVMe state brought into
        the host memory it freed (placement.py, [Note: measured share]). Raises before any change when the room, the memory or the transfer
        fails (``BudgetError``, a CUDA out-of-memory error, an I/O error); of two hops, a failed
        second one moves the payload back to where it was. ``transient``: whether the payload is
        transient in its new home (None: as it is); a payload that is, or becomes, transient moves
        no bytes ([Note: transient payloads]: the owner's word that they are dead)."""
        tier = Tier.of(tier)
        with self._lock:
            p = self._payload(cid, name)
            if p.source is not None or p.derived:
                raise StoreError(f"rehome: payload {name!r} of chunk {cid} is derived or the source of a "
                                 f"derived payload ([Note: derived payloads]); their homes are fixed")
            old = p.copies[p.spec.home]
            flag = p.spec.transient if transient is None else bool(transient)
            if old.tier is tier and flag == p.spec.transient:
                return
            for c in p.copies.values():
                if c.pins:
                    raise StoreError(f"rehome: {c.where()} is in use ({c.pins} pin(s)); finish its "
                                     f"jobs and let it go first")
            for c in p.copies.values():
                self._await_quiet(c)
                for r in c.readers:
                    r.wait()
                c.readers = []
            if abs(old.tier.level - tier.level) == 2:  # GPU <-> NVMe: through host memory
                self.rehome(cid, name, Tier.CPU)
                try:
                    self.rehome(cid, name, tier)
                except BaseException:
                    with contextlib.suppress(Exception):  # (never raising over the cause)
                        self.rehome(cid, name, old.tier)
                    raise
                return
            if Tier.NVME in (old.tier, tier):
                if p.spec.transient or flag:
                    raise StoreError(f"rehome: payload {name!r} of chunk {cid} is transient; it lives in "
                                     f"memory ([Note: transient payloads])")
                self._rehome_disk(p, tier)
                return
            if p.spec.transient or flag:
                self._rehome_transient(p, tier, flag)
                return
            if old.state is not Residency.VALID:  # the newest bytes home first (a cache copy's)
                self._ensure(old, Residency.FLUSHING).wait()
                self._settle(old, force=True)
            target = p.copies[tier]
            self._evict(target)  # a cache copy there: the home is valid, nothing is written back
            self._await_quiet(target)
            self._make_room(tier, old.nbytes, for_what=f"the new home of {target.where()}")
            spec = p.spec
            p.spec = replace(spec, home=tier)
            try:
                buf = (torch.empty(spec.numel, dtype=spec.dtype, device=self.device) if tier is Tier.GPU
                       else aligned_empty(spec.nbytes, dtype=spec.dtype, pin=self.config.pin))
            except BaseException:
                p.spec = spec  # nothing changed
                raise
            buf.copy_(old.buffer)
            if self._streams is not None:
                torch.cuda.current_stream(self.device).synchronize()  # every stream sees the bytes
            self._free(old)  # the old home is an ordinary copy now: freed
            for c in p.copies.values():
                if c.state is Residency.VALID:
                    c.to(Residency.STALE, self)  # (none is newer than the new home)
            target.buffer = buf
            target.to(Residency.VALID, self)
            target.last_use = self._tick()

    def _rehome_disk(self, p: _Payload, tier: Tier) -> None:
        """``rehome`` between host memory and NVMe (quiet, unpinned, not derived). The newest bytes
        are written home first; then they go into the new home (from a valid host copy, or read
        from the slot) before anything changes, so a failed transfer leaves the old home whole."""
        old, target = p.copies[p.spec.home], p.copies[tier]
        if old.state is not Residency.VALID:  # the newest bytes home first (a cache copy's)
            self._ensure(old, Residency.FLUSHING).wait()
            self._settle(old, force=True)
        spec = p.spec
        if tier is Tier.CPU:  # NVMe -> host memory
            self._make_room(tier, old.nbytes, for_what=f"the new home of {target.where()}")
            cache = target if target.state is Residency.VALID else None  # (the home's bytes)
            buf = aligned_empty(spec.nbytes, dtype=spec.dtype, pin=self.config.pin)
            if cache is not None:
                buf.copy_(cache.buffer)
            else:
                old.space.read(old.slot, _padded(buf)).wait()
                self.stats.moved(Hop.NVME_TO_CPU, p.name, spec.nbytes)
            self._evict(target)  # the cache copy, if any: the home is valid, nothing is written back
            self._await_quiet(target)
        else:  # host memory -> a slot of the swap file
            self._check_nvme()
            self._make_room(tier, target.nbytes, for_what=f"the new home of {target.where()}")
            self._evict(target)
            self._await_quiet(target)
            space = self._swap_space()
            slot = space.alloc(target.nbytes)
            try:
                space.write(slot, self._raw(old)).wait()
            except BaseException:
                space.free(slot)
                raise
            self.stats.moved(Hop.CPU_TO_NVME, p.name, spec.nbytes)
        p.spec = replace(spec, home=tier)
        self._free(old)  # the old home's memory or slot: freed
        for c in p.copies.values():
            if c.state is Residency.VALID:
                c.to(Residency.STALE, self)  # (none is newer than the new home)
        if tier is Tier.CPU:
            target.buffer = buf
        else:
            target.slot, target.space = slot, space
        target.to(Residency.VALID, self)
        target.last_use = self._tick()

    def _rehome_transient(self, p: _Payload, tier: Tier, transient: bool) -> None:
        """``rehome`` of a payload that is or becomes transient (quiet, unpinned): no bytes move
        (between its uses they are dead: [Note: transient payloads]). Transient in its new home, it
        holds nothing there until written (a window slot, or device memory); an ordinary home
        starts zeroed. The new memory is taken before the old is freed."""
        spec = p.spec
        new = replace(spec, home=tier, transient=transient)
        target = p.copies[tier]
        if transient and tier is Tier.CPU and not self.config.window_slots:
            raise StoreError(f"rehome: payload {p.name!r} of chunk {p.cid} is transient and this store has "
                             f"no window for it; set StoreConfig.window_slots")
        buf = None
        if not transient:
            self._make_room(tier, target.nbytes, for_what=f"the new home of {target.where()}")
            buf = (torch.zeros(spec.numel, dtype=spec.dtype, device=self.device) if tier is Tier.GPU
                   else aligned_empty(spec.nbytes, dtype=spec.dtype, pin=self.config.pin).zero_())
        for c in p.copies.values():
            self._free(c)
        p.spec = new
        if buf is not None:
            target.buffer = buf
            target.to(Residency.VALID, self)
            target.last_use = self._tick()
        elif tier is Tier.CPU:
            self._window.grow_to(spec.nbytes)

    def windowed(self, cid: int, name: str) -> bool:
        """The payload is transient and homed on the CPU: its bytes take a window slot from a
        write until ``release`` ([Note: transient payloads])."""
        with self._lock:
            return self._payload(cid, name).copies[Tier.CPU].windowed

    def release(self, cid: int, name: str) -> None:
        """The owner is done with the bytes of a transient payload (they were consumed): every
        copy is freed (homed on the CPU: its window slot given back; on the GPU: its device
        memory), once the moves touching them finish; the payload holds no bytes until it is
        written again. Raises for a payload that is not transient and for a copy in use. See
        [Note: transient payloads]."""
        with self._lock:
            p = self._payload(cid, name)
            if not p.spec.transient:
                raise StoreError(f"release: chunk {cid} payload {name!r} is not a transient payload "
                                 f"(PayloadSpec.transient); its memory is kept for the store's life")
            for c in p.copies.values():
                if c.pins:
                    raise StoreError(f"release: {c.where()} is in use ({c.pins} pin(s)); let it go first")
            for c in p.copies.values():
                self._await_quiet(c)
                for r in c.readers:
                    r.wait()
                c.readers = []
                self._free(c)

    @property
    def window(self) -> SlotWindow:
        """The slots transient payloads pass through (read its ``slots``, ``taken``,
        ``reserved_bytes``; the store takes and gives them)."""
        return self._window

    def pin(self, cid: int, name: str, tier: "Tier | str") -> None:
        """Keep the copy in ``tier`` from being evicted until ``unpin``."""
        with self._lock:
            copy = self._copy(cid, name, tier)
            self._settle(copy)
            if copy.state in (Residency.ABSENT, Residency.EVICTING):
                # (an EVICTING copy's memory goes as soon as its readers finish)
                raise StoreError(f"pin: {copy.where()} is {copy.state.name}; fetch or allocate it first "
                                 f"(allocate(..., pin=True) takes both at once)")
            copy.pins += 1

    def unpin(self, cid: int, name: str, tier: "Tier | str") -> None:
        with self._lock:
            copy = self._copy(cid, name, tier)
            if copy.pins <= 0:
                raise StoreError(f"unpin: {copy.where()} is not pinned (unpin without a matching pin)")
            copy.pins -= 1
            if not copy.pins and copy.evict_at_unpin:
                copy.evict_at_unpin = False
                self._evict(copy)

    def copy_in(self, cid: int, name: str, tier: "Tier | str",
                pieces: "Sequence[tuple[int, torch.Tensor]]") -> Handle:
        """Copy caller tensors (e.g. grads on the GPU) into the valid CPU copy at the given
        element offsets: on CUDA asynchronously on the D2H stream, after the work the caller's
        current stream has issued (the sources are recorded on that stream). The caller has
        taken the copy for writing (``get(..., write=True)`` or ``allocate``) and calls
        ``mark_dirty`` once every piece is in; the returned handle completes when these pieces
        (and every earlier ``copy_in``) have landed."""
        return self._copy_pieces(cid, name, tier, pieces, into=True, after=None)

    def wait_copies_in(self) -> None:
        """The caller's current CUDA stream waits for every ``copy_in`` issued so far: their
        sources may then be overwritten or freed by its later work (no-op without CUDA)."""
        if self._streams is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._streams.d2h)

    def copy_out(self, cid: int, name: str, tier: "Tier | str",
                 pieces: "Sequence[tuple[int, torch.Tensor]]", *, after: "Handle | None" = None) -> Handle:
        """Copy slices of the valid CPU copy (at the given element offsets) into caller tensors
        (e.g. a model's params): on CUDA asynchronously on the H2D stream, after ``after``. The
        copies are readers of the store's copy (see [Note: hazards]): a later write into it
        (``get(..., write=True)``, ``allocate``, a move) waits for them, and an evicted copy
        keeps its memory until they finish. The caller holds the copy (``use`` or ``pin``)."""
        return self._copy_pieces(cid, name, tier, pieces, into=False, after=after)

    def _copy_pieces(self, cid, name, tier, pieces, *, into: bool, after) -> Handle:
        with self._lock:
            copy = self._copy(cid, name, tier)
            self._settle(copy)
            if copy.tier is not Tier.CPU or copy.state is not Residency.VALID:
                raise StoreError(f"copy_{'in' if into else 'out'}: {copy.where()} is {copy.state.name}; "
                                 f"it needs a valid CPU copy: get(), use() or allocate() it first")
            buf = copy.buffer
            hop = Hop.GPU_TO_CPU if into else Hop.CPU_TO_GPU
            nbytes = sum(t.numel() * buf.element_size() for _, t in pieces)
            self.stats.moved(hop, copy.payload.name, nbytes)
            if self._streams is None:
                if after is not None:
                    after.wait()
                for offset, t in pieces:
                    if into:
                        buf[offset:offset + t.numel()].copy_(t.reshape(-1))
                    else:
                        t.view(-1).copy_(buf[offset:offset + t.numel()])
                return Handle.completed()
            stream = self._streams.d2h if into else self._streams.h2d
            if into:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if after is not None:
                    after.wait_stream(stream)
                for offset, t in pieces:
                    if into:
                        buf[offset:offset + t.numel()].copy_(t.reshape(-1), non_blocking=True)
                        t.record_stream(stream)
                    else:
                        t.view(-1).copy_(buf[offset:offset + t.numel()], non_blocking=True)
                handle = Handle(event=stream.record_event())
            if not into:
                copy.readers.append(handle)
            return handle

    @contextlib.contextmanager
    def use(self, cid: int, name: str, tier: "Tier | str", *, write: bool = False) -> Iterator[torch.Tensor]:
        """Fetch (if needed), pin and ``get`` the copy; unpin on exit."""
        with self._lock:
            self.fetch(cid, name, tier)
            self.pin(cid, name, tier)
        try:
            yield self.get(cid, name, tier, write=write)
        finally:
            self.unpin(cid, name, tier)

    def state(self, cid: int, name: str, tier: "Tier | str") -> Residency:
        """Residency of one copy (settled first)."""
        with self._lock:
            copy = self._copy(cid, name, tier)
            self._settle(copy)
            return copy.state

    def bytes(self, tier: "Tier | str", *, cids: "Iterable[int] | None" = None) -> int:
        """Bytes the tier holds now, summed over the copy records (of the chunks ``cids`` only,
        when given: e.g. what a model's frozen chunks cost in host memory)."""
        tier = Tier.of(tier)
        with self._lock:
            for c in list(self._evicting[tier]):
                self._settle(c)  # memory whose last reader finished is free again
            if cids is None:
                return self._held_bytes[tier]
            wanted = {self._chunk(cid).cid for cid in cids}  # (an unknown id raises)
            return sum(c.nbytes for c in self._held[tier] if c.payload.cid in wanted)

    def set_budget(self, tier: "Tier | str", nbytes: int) -> None:
        """Change ``tier``'s budget (e.g. to what a placement plan needs). Refused below the bytes
        the tier holds now, and for NVMe once its swap space exists (its files are sized)."""
        tier = Tier.of(tier)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"set_budget({tier.value!r}, {nbytes!r}): give bytes as an int >= 0")
        with self._lock:
            held = self.bytes(tier)
            if nbytes < held:
                raise BudgetError(f"set_budget({tier.value!r}, {nbytes}): the tier holds {held} bytes "
                                  f"now; evict copies first or give at least {held}")
            if tier is Tier.NVME and self._swap is not None:
                raise StoreError("set_budget('nvme', ...): the swap space is already created with "
                                 f"{self.budgets[Tier.NVME]} bytes; set the budget before the first NVMe copy")
            self.budgets[tier] = nbytes

    def peak_bytes(self, tier: "Tier | str") -> int:
        with self._lock:
            return self._peak[Tier.of(tier)]

    def reset_peak(self) -> None:
        with self._lock:
            for t in Tier:
                self._peak[t] = self.bytes(t)

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    @property
    def pool(self) -> PinnedPool:
        return self._pool

    def payload_spec(self, cid: int, name: str) -> PayloadSpec:
        with self._lock:
            return self._payload(cid, name).spec

    def discarded(self, cid: int) -> bool:
        """Whether ``discard`` freed the chunk."""
        with self._lock:
            self._check_open()
            return self._chunks[cid].discarded

    def homed_in(self, cid: int, tier: "Tier | str") -> bool:
        """Whether any of the chunk's payloads has its home in ``tier`` (``discard`` frees memory
        there; derived payloads have none). Ranks whose homes agree get the same answer, whatever
        their shards' sizes."""
        tier = Tier.of(tier)
        with self._lock:
            return any(p.home is tier and p.source is None for p in self._chunk(cid).payloads.values())

    def has_payload(self, cid: int, name: str) -> bool:
        """Whether chunk ``cid`` has a payload called ``name`` (chunks may differ)."""
        with self._lock:
            return name in self._chunk(cid).payloads

    def derived(self, cid: int, name: str) -> bool:
        """Whether the payload is made from another one ([Note: derived payloads]): read-only,
        no host bytes of its own; its writers write the source instead."""
        with self._lock:
            return self._payload(cid, name).source is not None

    def set_policy(self, policy: EvictionPolicy) -> None:
        if not callable(getattr(policy, "order", None)):
            raise TypeError("an eviction policy needs an order(candidates) method")
        with self._lock:
            self.policy = policy

    # ---- parking ([Note: parking]) -----------------------------------------------------

    def home(self, cid: int, name: str) -> Tier:
        """Where the payload's authoritative copy is now: its spec's home, or, while the store is
        parked, where a GPU-homed payload's bytes were parked."""
        with self._lock:
            return self._payload(cid, name).home

    @property
    def parked(self) -> "Tier | None":
        """Where ``park`` put the GPU tier's home copies; None when not parked."""
        parking = self._parking
        return parking.tier if parking is not None else None

    def gpu_home_bytes(self) -> int:
        """Bytes of the payloads the plan homes on the GPU tier (each rounded to 4 KiB as it is
        held): what ``park`` moves off it (its other copies are dropped, written home first when
        newest) and ``unpark`` back."""
        with self._lock:
            return sum(p.copies[Tier.GPU].nbytes for p in self._gpu_homed())

    def park(self, to: "Tier | str") -> int:
        """Empty the GPU tier: see [Note: parking]. ``to``: "cpu" or "nvme" (needs ``nvme_dir``).
        Every GPU copy must be unpinned. Returns the bytes moved (``gpu_home_bytes``)."""
        to = Tier.of(to)
        if to is Tier.GPU:
            raise ValueError("park(to=...) takes 'cpu' or 'nvme': where the GPU tier's bytes go")
        with self._lock:
            self._check_open()
            if self._parking is not None:
                raise StoreError(f"park: the GPU tier is parked on {self._parking.tier.value} already; "
                                 f"unpark() first")
            if to is Tier.NVME:
                self._check_nvme()
            self.synchronize()
            if to is Tier.NVME:
                self.release_spares()  # host memory kept for a park on the host is not what this one uses
            gpu = list(self._held[Tier.GPU])
            for c in gpu:
                if c.pins:
                    raise StoreError(f"park: {c.where()} is in use ({c.pins} pin(s)); unpin every GPU "
                                     f"copy first")
            payloads = self._gpu_homed()
            nbytes = sum(p.copies[Tier.GPU].nbytes for p in payloads)
            lent = {to: nbytes}
            parking = _Parking(tier=to, payloads=payloads, lent=lent)
            if to is Tier.NVME and payloads:  # the space first: a full disk raises before anything moves
                parking.space, parking.engine = self._parking_space(nbytes)
                lent[Tier.CPU] = _PARK_BATCH * max(p.copies[Tier.CPU].nbytes for p in payloads)
            self._parking = parking
            for tier, n in lent.items():
                self.budgets[tier] += n
            try:
                for c in gpu:
                    if not c.is_home:
                        self._evict(c)  # a cache: dropped (written home first when newest)
                    elif c.payload.spec.transient:  # dead bytes between uses: freed
                        self._free(c)
                self._move_away(payloads, to)
            except BaseException as e:
                self._undo(e, self._end_park, parking)
                raise
            return nbytes

    def unpark(self, *, keep: bool = False) -> int:
        """Bring the parked payloads back into GPU buffers, homed there again, and free the
        parking copies: see [Note: parking]. ``keep``: the host buffers of a park on the CPU stay
        with their copies for the next park (which then takes no fresh pinned memory: pinning is
        most of a park's time), until ``release_spares`` or an ``unpark`` without it. Returns the
        bytes moved back."""
        with self._lock:
            self._check_open()
            parking = self._parking
            if parking is None:
                raise StoreError("unpark: the store is not parked")
            if not keep:
                self.release_spares()
            try:
                self._move_back(parking.payloads, keep=keep)
            except BaseException as e:
                self._undo(e, self._repark, parking)
                raise
            self._end_park(parking)
            return sum(p.copies[Tier.GPU].nbytes for p in parking.payloads)

    def _gpu_homed(self) -> list:
        """GPU-homed payloads with bytes to keep: not the transient ones (dead between uses)."""
        return [p for chunk in self._chunks if not chunk.discarded
                for p in chunk.payloads.values() if p.spec.home is Tier.GPU and not p.spec.transient]

    def _move_away(self, payloads: list, to: Tier) -> None:
        """Re-home ``payloads`` (GPU-homed, their GPU copies unpinned) to ``to``: their bytes
        are copied there (NVMe: staged through host memory, ``_PARK_BATCH`` payloads at a time)
        and their GPU copies freed."""
        step = _PARK_BATCH if to is Tier.NVME else max(1, len(payloads))
        for i in range(0, len(payloads), step):
            part = payloads[i:i + step]
            for p in part:  # issued together: the copies overlap
                p.away = to
                self._ensure(p.copies[to], Residency.FLUSHING)
            for p in part:
                self._await_quiet(p.copies[to])
                for tier in (Tier.GPU, Tier.CPU) if to is Tier.NVME else (Tier.GPU,):
                    self._evict(p.copies[tier])  # not home now; valid at home: nothing written

    def release_spares(self) -> int:
        """Free the host buffers ``unpark(keep=True)`` kept; returns their bytes."""
        with self._lock:
            freed = 0
            for p in self._gpu_homed():
                c = p.copies[Tier.CPU]
                if c.spare is not None:
                    freed += c.nbytes
                    c.spare = None
            return freed

    def spare_bytes(self) -> int:
        """Host bytes of the buffers ``unpark(keep=True)`` kept for the next park."""
        with self._lock:
            return sum(p.copies[Tier.CPU].nbytes for p in self._gpu_homed() if p.copies[Tier.CPU].spare is not None)

    def _move_back(self, payloads: list, *, keep: bool = False) -> None:
        """Copy parked ``payloads`` into GPU buffers, home them there again and free their other
        copies (the parking ones included; ``keep``: a parking host buffer stays as the copy's
        ``spare``)."""
        step = _PARK_BATCH if any(p.away is Tier.NVME for p in payloads) else max(1, len(payloads))
        for i in range(0, len(payloads), step):
            part = [p for p in payloads[i:i + step] if p.away is not None]
            for p in part:
                self._ensure(p.copies[Tier.GPU], Residency.LOADING)
            for p in part:
                self._await_quiet(p.copies[Tier.GPU])
                home, p.away = p.away, None
                cpu = p.copies[Tier.CPU]
                spare = cpu.buffer if keep and home is Tier.CPU and cpu.pool_buffer is None else None
                for tier in (Tier.CPU, Tier.NVME):
                    self._drop_copy(p.copies[tier])  # valid on the GPU now: nothing written
                if spare is not None and cpu.state is Residency.ABSENT:
                    cpu.spare = spare

    def _repark(self, parking: _Parking) -> None:
        """After a failed unpark: what came back goes to the park again, and the GPU copies still
        arriving are dropped."""
        for p in parking.payloads:
            if p.away is not None:
                self._drop_copy(p.copies[Tier.GPU])
        self._move_away([p for p in parking.payloads if p.away is None], parking.tier)

    def _drop_copy(self, copy: _Copy) -> None:
        """Evict a non-home copy; one whose move into it failed is dropped by settling it."""
        try:
            self._evict(copy)
        except Exception:
            if copy.state is not Residency.ABSENT:
                raise

    def _end_park(self, parking: _Parking) -> None:
        """Every payload is home on the GPU again: give back the lent budget and the space."""
        self._move_back(parking.payloads)  # (after a failed park: what moved comes back)
        for tier, n in parking.lent.items():
            self.budgets[tier] -= n
        self._parking = None
        self._close_parking_space(parking)

    def _undo(self, error: BaseException, undo: Callable, *args) -> None:
        """After ``error`` part-way through a park or unpark: ``undo(*args)`` moves back what
        moved. A failure of that is noted on ``error`` (raised by the caller), never raised
        over it; the store is then in an unknown state and takes no further calls."""
        try:
            undo(*args)
        except BaseException as again:  # noqa: BLE001 - noted on the cause
            error.add_note(f"zero_offload: moving the parked bytes back failed too ({type(again).__name__}: "
                           f"{again}); this store is closed")
            with contextlib.suppress(Exception):
                self.close()

    def _parking_space(self, nbytes: int) -> tuple:
        from .swap_io import AioEngine, SwapSpace
        engine = AioEngine(threads=self.config.io_threads, block_size=self.config.io_block_size,
                           queue_depth=self.config.io_queue_depth)
        try:
            return SwapSpace(self.config.nvme_dir, capacity_bytes=nbytes, engine=engine), engine
        except BaseException:
            engine.close()
            raise

    @staticmethod
    def _close_parking_space(parking: _Parking) -> None:
        if parking.space is not None:
            parking.space.close()
            parking.engine.close()
            parking.space = parking.engine = None

    def synchronize(self) -> None:
        """Wait (host) for every move in flight (``copy_in`` / ``copy_out`` too) and settle all
        records."""
        with self._lock:
            if self._streams is not None:
                self._streams.d2h.synchronize()
                self._streams.h2d.synchronize()
            for c in self._copies(self._chunks):
                if c.pending is not None:
                    c.pending.wait()
                for r in c.readers:
                    r.wait()
                self._settle(c, force=True)

    def close(self) -> None:
        """Finish moves in flight, free every buffer and the swap files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self.synchronize()
            finally:
                self._closed = True
                self._executor.shutdown(wait=True)
                for c in self._copies(self._chunks):
                    c.buffer = c.spare = None
                    c.pool_buffer = None
                    c.slot = None
                self._chunks.clear()
                self._window.clear()
                for t in Tier:
                    self._held[t].clear()
                    self._evicting[t].clear()
                    self._held_bytes[t] = 0
                if self._swap is not None:
                    self._swap.close()
                    self._swap = None
                if self._parking is not None:
                    parking, self._parking = self._parking, None
                    self._close_parking_space(parking)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- lookup -------------------------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise StoreError("this ChunkStore is closed; build a new one")

    def _chunk(self, cid: int):
        self._check_open()
        if isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid < len(self._chunks):
            raise KeyError(f"no chunk {cid!r}: this store has chunks 0..{len(self._chunks) - 1} "
                           f"(ids come from add_chunk)")
        chunk = self._chunks[cid]
        if chunk.discarded:
            raise StoreError(f"chunk {cid} was discarded: its bytes are gone (discard frees a chunk "
                             f"for good)")
        return chunk

    def _payload(self, cid: int, name: str) -> _Payload:
        chunk = self._chunk(cid)
        try:
            return chunk.payloads[name]
        except KeyError:
            raise KeyError(f"chunk {cid} has no payload {name!r}; it has {sorted(chunk.payloads)}") from None

    def _copy(self, cid: int, name: str, tier: "Tier | str") -> _Copy:
        copy = self._payload(cid, name).copies[Tier.of(tier)]
        if copy.tier is Tier.NVME:
            self._check_nvme()
        elif copy.tier is Tier.GPU and self._parking is not None:
            raise StoreError(f"{copy.where()}: the GPU tier is parked on {self._parking.tier.value} "
                             f"(ChunkStore.park); call unpark() before using it")
        return copy

    def _check_nvme(self) -> None:
        if self.config.nvme_dir is None:
            raise StoreError("this store has no NVMe tier: set StoreConfig.nvme_dir to a directory on a "
                             "fast disk to use 'nvme'")

    @staticmethod
    def _copies(chunks) -> list[_Copy]:
        return [c for chunk in chunks for p in chunk.payloads.values() for c in p.copies.values()]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _note_peak(self, tier: Tier) -> None:
        now = self._held_bytes[tier]
        if now > self._peak[tier]:
            self._peak[tier] = now

    # ---- settling and waiting -----------------------------------------------------------

    def _settle(self, copy: _Copy, *, force: bool = False) -> None:
        """See [Note: lazy settling]. ``force``: the caller has already waited for ``pending``."""
        copy.readers = [r for r in copy.readers if not r.finished()]
        if copy.state in _IN_FLIGHT and copy.pending is not None:
            try:
                ready = force or copy.pending.done()
            except BaseException:
                # The move into this copy failed: its bytes are garbage, drop it and report.
                copy.pending = None
                self._drop_memory(copy)
                copy.to(Residency.ABSENT, self)
                raise
            if ready:
                copy.pending = None
                copy.to(Residency.VALID, self)
        if copy.state is Residency.EVICTING and not copy.readers:
            self._drop_memory(copy)
            copy.to(Residency.ABSENT, self)

    def _await_quiet(self, copy: _Copy) -> None:
        """Wait (host) until no move writes into ``copy`` and, if it is EVICTING, until its
        readers finish; then settle it."""
        if copy.pending is not None:
            copy.pending.wait()
            self._settle(copy, force=True)
        if copy.state is Residency.EVICTING:
            for r in copy.readers:
                with contextlib.suppress(Exception):  # a failed read is reported by its destination
                    r.wait()
            copy.readers = []
        self._settle(copy)

    def _wait_readers(self, copy: _Copy, *, device_side: bool) -> None:
        """WAR: the caller is about to overwrite ``copy``; order it after moves reading it."""
        cuda_gpu = device_side and copy.tier is Tier.GPU and self._streams is not None
        for r in copy.readers:
            if cuda_gpu:
                r.wait_stream(torch.cuda.current_stream(self.device))
            else:
                r.wait()
        copy.readers = [] if not cuda_gpu else [r for r in copy.readers if not r.done()]

    def _others_stale(self, newest: _Copy) -> None:
        others = [c for c in newest.payload.copies.values() if c is not newest]
        # what is made from this payload is outdated too ([Note: derived payloads])
        others += [c for d in newest.payload.derived for c in d.copies.values()]
        for c in others:
            if c.state in _IN_FLIGHT:
                # A move into it was issued before this write; let it land, then outdate it.
                c.pending.wait()
                self._settle(c, force=True)
            if c.state is Residency.VALID:
                c.to(Residency.STALE, self)

    def _refuse_derived(self, copy: _Copy, what: str) -> None:
        p = copy.payload
        if p.source is not None:
            raise StoreError(f"{what}: payload {p.name!r} of chunk {p.cid} is made from {p.source.name!r} "
                             f"([Note: derived payloads]) and read-only; write {p.source.name!r} instead "
                             f"(its derived copies are then remade)")

    # ---- memory -------------------------------------------------------------------------

    def _alloc_memory(self, copy: _Copy) -> None:
        """Give an ABSENT copy its buffer or slot (budget already checked)."""
        spec = copy.payload.spec
        if copy.tier is Tier.GPU:
            if copy.is_home and self.device.type == "cpu":  # (no GPU: fresh zero pages, as a CPU home)
                copy.buffer = aligned_empty(spec.nbytes, dtype=spec.dtype)
            else:
                copy.buffer = torch.empty(spec.numel, dtype=spec.dtype, device=self.device)
        elif copy.windowed:  # [Note: transient payloads]
            copy.pool_buffer = self._window.acquire(spec.nbytes)
            copy.buffer = copy.pool_buffer.view(spec.dtype, spec.numel)
        elif copy.tier is Tier.CPU:
            if copy.spare is not None and copy.is_home:  # the next park takes back its kept buffer
                copy.buffer, copy.spare = copy.spare, None  # ([Note: parking]; staging uses the pool)
            elif copy.is_home:
                # Home copies live as long as the store: their own exact-size aligned allocation
                # (made ahead on another thread during initialize: [Note: homes ahead]).
                ahead = self._homes_ahead.take(spec.nbytes) if self._homes_ahead is not None else None
                copy.buffer = (ahead.view(spec.dtype) if ahead is not None
                               else aligned_empty(spec.nbytes, dtype=spec.dtype, pin=self.config.pin))
            else:
                copy.pool_buffer = self._pool.acquire(spec.nbytes)
                copy.buffer = copy.pool_buffer.view(spec.dtype, spec.numel)
        else:  # a payload parked on NVMe takes a slot of the park's space ([Note: parking])
            space = self._parking.space if copy.payload.away is Tier.NVME else self._swap_space()
            copy.slot = space.alloc(copy.nbytes)
            copy.space = space

    def _take_memory(self, copy: _Copy) -> None:
        """Memory for an ABSENT copy: room made within its tier's budget (a window slot for a
        transient home, which raises when every slot is taken: [Note: transient payloads])."""
        if copy.windowed:
            if not self._window.available():
                raise StoreError(
                    f"{copy.where()}: the window's {self._window.slots} slot(s) all hold bytes of transient "
                    f"payloads; release(cid, name) one (its bytes consumed) before writing another "
                    f"([Note: transient payloads])")
        else:
            self._make_room(copy.tier, copy.nbytes, for_what=copy.where())
        self._alloc_memory(copy)

    def _free(self, copy: _Copy) -> None:
        """Any copy, a home too, holds nothing from here on (its memory or slot given back);
        the caller has waited for what touches it."""
        if copy.state is not Residency.ABSENT:
            self._drop_memory(copy, home=True)
            copy.to(Residency.ABSENT, self)

    def _drop_memory(self, copy: _Copy, *, home: bool = False) -> None:
        if copy.is_home and not home:
            return  # home memory is kept for the store's life (or until ``discard`` / ``release``)
        if copy.pool_buffer is not None:
            (self._window if copy.windowed else self._pool).release(copy.pool_buffer)
            copy.pool_buffer = None
        if copy.slot is not None:
            copy.space.free(copy.slot)
            copy.slot = copy.space = None
        copy.buffer = None
        copy.zero = False

    def _swap_space(self):
        if self._swap is None:
            from .swap_io import AioEngine, SwapSpace
            engine = AioEngine(threads=self.config.io_threads, block_size=self.config.io_block_size,
                               queue_depth=self.config.io_queue_depth)
            self._swap = SwapSpace(self.config.nvme_dir, capacity_bytes=self.budgets[Tier.NVME], engine=engine)
        return self._swap

    def _zero_source(self, nbytes: int) -> torch.Tensor:
        need = round_up(nbytes, ALIGNMENT)
        if self._zeros is None or self._zeros.numel() < need:
            self._zeros = aligned_empty(need, pin=False)
        return self._zeros[:need]

    def _make_room(self, tier: Tier, nbytes: int, *, for_what: str) -> None:
        """Evict by policy until ``nbytes`` more fit in ``tier``'s budget, or raise BudgetError."""
        budget = self.budgets[tier]
        if nbytes > budget:
            raise BudgetError(
                f"{for_what}: needs {nbytes} bytes in tier {tier.value!r}, more than its whole budget of "
                f"{budget} bytes; raise StoreConfig.budgets[{tier.value!r}] or use smaller chunks")
        for _ in range(3):
            if self.bytes(tier) + nbytes <= budget:
                return
            candidates = {}
            for c in list(self._held[tier]):
                self._settle(c)
                if c.is_home or c.pins or c.state not in (Residency.VALID, Residency.STALE):
                    continue
                candidates[EvictionCandidate(c.payload.cid, c.payload.name, tier, c.nbytes,
                                             c.last_use, c.state is Residency.STALE)] = c
            for e in self.policy.order(list(candidates)):
                if self.bytes(tier) + nbytes <= budget:
                    return
                self._evict(candidates[e])
            # Copies still EVICTING free their memory once their readers finish.
            for c in [c for c in self._held[tier] if c.state is Residency.EVICTING]:
                self._await_quiet(c)
            if self.bytes(tier) + nbytes <= budget:
                return
            # Copies still arriving (e.g. a prefetch nobody holds yet) become evictable once
            # they land: wait for them, then try the policy again.
            arriving = [c for c in self._held[tier] if c.state in _IN_FLIGHT and not c.is_home and not c.pins]
            if not arriving:
                break
            for c in arriving:
                self._await_quiet(c)
        if self.bytes(tier) + nbytes > budget:
            busy = [c for c in self._held[tier] if not c.is_home]
            raise BudgetError(
                f"{for_what}: needs {nbytes} bytes in tier {tier.value!r}; {self.bytes(tier)} of its budget "
                f"of {budget} bytes are held and nothing more can be evicted ({len(busy)} non-home copies "
                f"are in use or in flight, the rest are home copies); raise StoreConfig.budgets"
                f"[{tier.value!r}], lower the prefetch depth, or release copies (unpin/evict) sooner")

    # ---- eviction -----------------------------------------------------------------------

    def _evict(self, copy: _Copy) -> None:
        self._settle(copy)
        if copy.state is Residency.ABSENT or copy.state is Residency.EVICTING:
            return
        if copy.is_home:
            raise StoreError(f"evict: {copy.where()} is the home copy and cannot be evicted; evict "
                             f"non-home copies only")
        if copy.pins:
            raise StoreError(f"evict: {copy.where()} is in use ({copy.pins} pin(s)); leave the `use` "
                             f"block or unpin it first, or evict(..., defer=True)")
        if copy.state in _IN_FLIGHT:
            self._await_quiet(copy)
        p = copy.payload
        if p.source is None and copy.state is Residency.VALID and p.valid() == [copy] and \
                not any(c.state in _IN_FLIGHT for c in p.copies.values()):
            self._ensure(p.copies[p.home], Residency.FLUSHING)  # write it back home first
        self.stats.evictions += 1
        if copy.tier is Tier.GPU and self._streams is not None:
            # The caching allocator must not hand this memory out again before the copy streams
            # finish reading it: record_stream was called when each move was issued.
            copy.readers = []
        copy.to(Residency.EVICTING, self)
        self._settle(copy)

    # ---- moves --------------------------------------------------------------------------

    def _ensure(self, copy: _Copy, how: Residency) -> Handle:
        """Make ``copy`` valid: nothing to do, or the handle of the move in flight, or a new move
        (LOADING for fetches, FLUSHING for write-behind) from the nearest valid copy."""
        p = copy.payload
        self._settle(copy)
        copy.last_use = self._tick()
        if copy.state is Residency.VALID:
            return Handle.completed()
        if copy.state in _IN_FLIGHT:
            return copy.pending
        if copy.state is Residency.EVICTING:
            self._await_quiet(copy)
        if p.source is not None:
            return self._derive(copy)
        src = self._source_for(copy)
        if src is None:
            if p.spec.transient:
                raise StoreError(f"{copy.where()}: this transient payload holds no bytes (released, or "
                                 f"never written); write it (allocate) before reading it ([Note: "
                                 f"transient payloads])")
            raise StoreError(f"{copy.where()}: no copy of this payload holds valid bytes (all stale "
                             f"or absent); this is a store bug, please report it")
        if abs(src.tier.level - copy.tier.level) == 2:
            # NVMe <-> GPU: stage through a CPU copy (pinned), which stays as a cache copy.
            src = p.copies[Tier.CPU]
            self._ensure(src, how)
        handle = self._fill(copy, src, how)
        hop = Hop.between(src.tier, copy.tier)
        self.stats.moved(hop, p.name, p.spec.nbytes)
        return handle

    def _fill(self, copy: _Copy, src: _Copy, how: Residency) -> Handle:
        """Issue the copy of ``src`` into ``copy`` (its memory taken first if it has none), ``copy``
        in state ``how`` until it lands; on a failed issue the memory is dropped and ``copy`` is
        absent again."""
        if copy.state is Residency.ABSENT:
            self._take_memory(copy)
        copy.to(how, self)
        try:
            handle = self._issue(src, copy)
        except BaseException:
            self._drop_memory(copy)
            copy.to(Residency.ABSENT, self)
            raise
        copy.pending = handle
        src.readers.append(handle)
        return handle

    def _derive(self, copy: _Copy) -> Handle:
        """``_ensure`` of a derived payload's GPU copy: its source's CPU copy (made valid first)
        cast into it ([Note: derived payloads])."""
        p = copy.payload
        if copy.tier is not Tier.GPU:
            raise StoreError(f"{copy.where()}: payload {p.name!r} is made from {p.source.name!r} on the "
                             f"way to the device and has no copy in tier {copy.tier.value!r} ([Note: "
                             f"derived payloads]); read {p.source.name!r} there instead")
        src = p.source.copies[Tier.CPU]
        self._ensure(src, Residency.LOADING)  # (valid already unless a copy elsewhere was written)
        handle = self._fill(copy, src, Residency.LOADING)
        self.stats.moved(Hop.CPU_TO_GPU, p.name, p.source.spec.nbytes)  # the source's bytes go up
        return handle

    def _source_for(self, copy: _Copy) -> "_Copy | None":
        """The nearest copy that is valid or becoming valid."""
        others = [c for c in copy.payload.copies.values()
                  if c is not copy and (c.state is Residency.VALID or c.state in _IN_FLIGHT)]
        if not others:
            return None
        # nearest tier first; ties (GPU and NVMe for a CPU target) go to the faster tier
        return min(others, key=lambda c: (abs(c.tier.level - copy.tier.level), c.tier.level))

    def _issue(self, src: _Copy, dst: _Copy) -> Handle:
        """Start moving src's bytes into dst (neighbouring tiers). Dependencies: src's pending
        move (RAW), dst's readers (WAR). See [Note: hazards]."""
        dst.zero = False
        deps = [h for h in ([src.pending] + dst.readers) if h is not None and not h.finished()]
        if Tier.NVME in (src.tier, dst.tier):
            io = (functools.partial(dst.space.write, dst.slot, self._raw(src)) if dst.tier is Tier.NVME
                  else functools.partial(src.space.read, src.slot, self._raw(dst)))
            return Handle(host=self._io_after(deps, io))
        if self._streams is None:
            def host_copy():
                for d in deps:
                    d.wait()
                dst.buffer.copy_(src.buffer)
            return Handle(host=self._executor.submit(host_copy))
        return self._issue_cuda(src, dst, deps)

    def _issue_cuda(self, src: _Copy, dst: _Copy, deps) -> Handle:
        stream = self._streams.h2d if dst.tier is Tier.GPU else self._streams.d2h
        # Handoff: the copy stream starts after what the caller's stream has issued so far
        # (the kernels that wrote a GPU source, or last used a reused GPU destination).
        after = torch.cuda.current_stream(self.device).record_event()
        gpu_buf = dst.buffer if dst.tier is Tier.GPU else src.buffer
        gpu_buf.record_stream(stream)  # see [Note: hazards]: freeing waits for this stream

        def enqueue():
            for d in deps:
                d.wait_stream(stream)  # host-side parts block here (we are off the hot path then)
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_event(after)
                if dst.buffer.dtype is src.buffer.dtype:
                    dst.buffer.copy_(src.buffer, non_blocking=True)
                else:  # [Note: derived payloads]: the source's bytes up, one cast kernel
                    # (allocated on this stream and used only on it: the allocator reuses it
                    # for the next move only after this one's kernels, in stream order)
                    staging = torch.empty(src.buffer.numel(), dtype=src.buffer.dtype, device=self.device)
                    staging.copy_(src.buffer, non_blocking=True)
                    dst.buffer.copy_(staging)
                return stream.record_event()

        if all(d.host_done() for d in deps):
            return Handle(event=enqueue())
        return Handle(host=self._executor.submit(enqueue))

    def _io_after(self, deps, submit) -> object:
        """Submit the I/O now when nothing must finish first; otherwise on the executor, once
        every handle in ``deps`` is done (the hazard order of [Note]s above)."""
        if not deps:
            return _IoWait(submit())

        def task():
            for d in deps:
                d.wait()
            submit().wait()
        return self._executor.submit(task)

    @staticmethod
    def _raw(copy: _Copy) -> torch.Tensor:
        """The 4 KiB-rounded uint8 view of a CPU copy's memory (what O_DIRECT moves)."""
        if copy.pool_buffer is not None:
            return copy.pool_buffer.raw
        return _padded(copy.buffer)


def _padded(buf: torch.Tensor) -> torch.Tensor:
    """The 4 KiB-rounded uint8 view of an ``aligned_empty`` buffer (its memory runs to the 4 KiB
    boundary): the extent O_DIRECT moves."""
    n = round_up(buf.numel() * buf.element_size(), ALIGNMENT)
    return torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage(), buf.storage_offset() * buf.element_size(), (n,))
