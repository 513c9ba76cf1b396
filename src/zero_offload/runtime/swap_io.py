"""NVMe swap I/O in three layers, each usable alone: ``aligned_empty`` (host buffers fit for
O_DIRECT), ``AioEngine`` / ``IoHandle`` (the native I/O threads) and ``SwapSpace`` (a private
directory holding a preallocated file, with a slot allocator, blocking-handle and asyncio fronts).

Swap directories: ``prepare_swap_dir`` checks (and creates 0700) a directory meant to hold swap
spaces; ``find_spaces`` / ``remove_stale_spaces`` find the spaces other processes left there and
remove those whose owner died (see [Note: owner file]); ``find_all_spaces`` /
``remove_dead_spaces`` do so for a whole swap location (see [Note: swap locations]);
``temp_swap_dir`` makes a run's temporary swap directory; ``auto_nvme_budget`` sizes an "auto"
NVMe budget and ``disk_holders`` names our spaces on a disk that is short of space.
"""
from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import enum
import errno
import functools
import json
import mmap
import os
import re
import shlex
import shutil
import socket
import stat
import tempfile
import threading
import time
import warnings
import weakref

import psutil
import torch

from .vocab import ALIGNMENT, human_bytes, round_up


def _check_int(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


HUGE_PAGES = False
"""``aligned_empty`` asks the kernel for transparent huge pages on buffers of 2 MiB or more
([Note: huge pages]). Off: on the 4x H100 host (THP "madvise", 64 threads, 8 GiB) the touch ran
4.28 GiB/s with the advice against 4.32 without, and cudaHostRegister 13.5 against 21.3 GiB/s
(benchmarks/results/init_pin_probe_nvidia-h100-x4_2026-11-27_s16.json)."""
_HUGE_PAGE = 2 << 20


def _advise_huge(owner: mmap.mmap, nbytes: int) -> None:
    """[Note: huge pages] The host homes of a large model are hundreds of GiB of fresh anonymous
    memory, touched once (zeroed) and pinned once at initialize. In 4 KiB pages that is a page
    fault per 4 KiB and a page-table entry per 4 KiB for ``cudaHostRegister`` to walk; with
    ``madvise(MADV_HUGEPAGE)`` the kernel backs the mapping with 2 MiB pages where it can
    (transparent huge pages in "madvise" mode, the common default), 512x fewer faults and
    entries, and falls back to small pages where it cannot: the bytes, the alignment and the
    contents are the same either way. Kernels without THP refuse the advice: ignored."""
    if HUGE_PAGES and nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            owner.madvise(mmap.MADV_HUGEPAGE)


POPULATE_THREADS = 4
"""Threads ``fault_in`` splits a fresh buffer's pages over ([Note: fault in]); 0: torch fills it."""
_POPULATE_MIN = 4 << 20  # smaller buffers are filled: a thread pool costs more than it saves
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14; Python's mmap module lacks it before 3.14
_populate_ok: bool | None = None  # None: not tried yet; False: this kernel refused it
_NO_PAGES = {errno.ENOMEM, errno.EFAULT, getattr(errno, "EHWPOISON", errno.ENOMEM)}


@functools.lru_cache(maxsize=None)
def _madvise():
    """libc's ``madvise`` through ctypes (it releases the GIL for the call), or None; looked up
    once per process."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _populate_range(madvise, ptr: int, nbytes: int) -> int:
    """``madvise(MADV_POPULATE_WRITE)`` over one range, again where a signal cut it short;
    0 or the errno."""
    while True:
        if madvise(ptr, nbytes, _MADV_POPULATE_WRITE) == 0:
            return 0
        err = ctypes.get_errno()
        if err not in (errno.EINTR, errno.EAGAIN):
            return err


def fault_in(buffer: torch.Tensor, *, threads: int | None = None) -> str:
    """Bring every page of ``buffer`` (fresh anonymous memory, as ``aligned_empty`` maps it) in,
    as zeros; returns the way it took, "populate" or "fill". ``threads``: default
    ``POPULATE_THREADS`` (0: fill).

    [Note: fault in] A pinned home must have its pages before ``cudaHostRegister`` locks them
    ([Note: touch before pinning]). Filling the buffer from user space takes a page fault per
    4 KiB page, each a trap into the kernel that allocates and zeroes one page;
    ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14) does the same allocation and zeroing inside
    the kernel in one call, without a trap per page, and its ranges go to ``threads`` threads
    (``POPULATE_THREADS``) at once. The pages and their contents (zeros) are the same either way.
    Where the kernel refuses the advice (EINVAL: older than 5.14, or no libc ``madvise``) the
    buffer is filled by torch, as before, and the refusal is remembered for the process. A
    populate that finds no memory (ENOMEM) raises, where a fill would have met the OOM killer."""
    global _populate_ok
    nbytes = buffer.numel() * buffer.element_size()
    threads = POPULATE_THREADS if threads is None else int(threads)
    ptr = buffer.data_ptr()
    whole_pages = not (ptr % mmap.PAGESIZE or nbytes % mmap.PAGESIZE)
    if threads >= 1 and whole_pages and nbytes >= _POPULATE_MIN and _populate_ok is not False:
        madvise = _madvise()
        if madvise is not None:
            n = max(1, min(threads, nbytes // _POPULATE_MIN))
            piece = round_up(-(-nbytes // n), _HUGE_PAGE)
            ranges = [(ptr + o, min(piece, nbytes - o)) for o in range(0, nbytes, piece)]
            if len(ranges) == 1:
                errs = [_populate_range(madvise, *ranges[0])]
            else:
                with concurrent.futures.ThreadPoolExecutor(len(ranges), thread_name_prefix="zero_offload-fault") as ex:
                    errs = list(ex.map(lambda r: _populate_range(madvise, *r), ranges))
            bad = next((e for e in errs if e), 0)
            if not bad:
                _populate_ok = True
                return "populate"
            if bad in _NO_PAGES:
                raise MemoryError(f"the host could not give {human_bytes(nbytes)} of pages to a pinned buffer "
                                  f"({os.strerror(bad)}); free host memory, or lower the host budget "
                                  f"(OffloadConfig.cpu_budget) so that the rest goes to NVMe")
            _populate_ok = False  # EINVAL (an older kernel), EPERM, ...: fill from here on
    buffer.zero_()
    return "fill"


def _cuda_unregister(ptr: int, owner) -> None:
    # [Note: pinned lifetime] `owner` (the mmap) is an argument of this finalizer, so it is
    # still mapped while we unregister; it is unmapped only after this returns.
    del owner
    torch.cuda.cudart().cudaHostUnregister(ptr)


def aligned_empty(nbytes: int, *, dtype: torch.dtype = torch.uint8, pin: bool | None = False,
                  clock: dict | None = None) -> torch.Tensor:
    """A 1-D CPU tensor of ``nbytes // dtype.itemsize`` elements, ready for O_DIRECT.

    Its data pointer is 4096-aligned and the memory it owns runs to ``round_up(nbytes, 4096)``
    bytes (at least 4096), so a transfer of the padded size stays inside it. The contents are
    zero (fresh anonymous pages, touched lazily).

    pin: ``True`` registers the memory with CUDA (``cudaHostRegister``: exact size, not the
    power-of-two caching host allocator) and unregisters it when the memory is freed; raises
    RuntimeError without CUDA. ``None`` pins exactly when CUDA is available. ``False`` (the
    default) leaves it pageable.

    clock: a dict whose "touch" and "pin" entries get the seconds spent bringing the pages in
    and registering them (added to what they hold).
    """
    _check_int("nbytes", nbytes, minimum=0)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    itemsize = dtype.itemsize
    if nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a multiple of {dtype}'s item size {itemsize}; "
                         f"pass a whole number of elements")
    if pin is None:
        pin = torch.cuda.is_available()
    elif not isinstance(pin, bool):
        raise TypeError(f"pin must be True, False or None (None = pin when CUDA exists), got {pin!r}")
    elif pin and not torch.cuda.is_available():
        raise RuntimeError("aligned_empty(pin=True) needs CUDA, but torch.cuda.is_available() is False; "
                           "pass pin=False, or pin=None to pin only when CUDA exists")
    padded = max(round_up(nbytes), ALIGNMENT)
    # [Note: aligned memory] An anonymous mmap is page-aligned and zero-filled. torch.frombuffer
    # keeps a reference to the memoryview for as long as the storage lives, and the memoryview
    # keeps the mmap mapped, so every view of the tensor keeps the memory alive.
    owner = mmap.mmap(-1, padded)
    _advise_huge(owner, padded)  # before the first touch
    view = memoryview(owner)
    base = torch.frombuffer(view, dtype=torch.uint8)
    ptr = base.data_ptr()
    if ptr % ALIGNMENT:
        raise RuntimeError(f"mmap returned an address {ptr:#x} that is not 4096-aligned; "
                           f"this platform's page size is unsupported")
    if pin:
        # [Note: touch before pinning] Pinning faults every page in first, one page at a time
        # on the calling thread; brought in here ([Note: fault in]) on several threads, the
        # pages are in when cudaHostRegister runs, which then only locks them. (Unpinned
        # memory is left untouched: its pages come on first use, as zeros.)
        t0 = time.perf_counter()
        fault_in(base)
        t1 = time.perf_counter()
        err = torch.cuda.cudart().cudaHostRegister(ptr, padded, 0)
        if clock is not None:
            clock["touch"] = clock.get("touch", 0.0) + t1 - t0
            clock["pin"] = clock.get("pin", 0.0) + time.perf_counter() - t1
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister({padded} bytes) failed with CUDA error {int(err)}; "
                               f"the host may be out of lockable memory (see ulimit -l), "
                               f"or pass pin=False")
        # At interpreter exit the registration is left to the driver: unregistering (and
        # unmapping) every buffer then would cost seconds per hundred GiB and buy nothing, as
        # the process's memory goes with it.
        weakref.finalize(view, _cuda_unregister, ptr, owner).atexit = False
    return base[:nbytes].view(dtype)


# ---------------------------------------------------------------------------------------------
# Engine


def _native():
    from .. import _C  # deferred: importing swap_io for aligned_empty needs no build
    return _C


def _check_aligned(name: str, value: int) -> None:
    if value % ALIGNMENT:
        raise ValueError(f"{name}={value} is not a multiple of 4096: O_DIRECT I/O needs 4096-aligned "
                         f"buffer addresses, file offsets and sizes (aligned_empty() makes such buffers)")


def _check_buffer(tensor, nbytes: int) -> None:
    """Raise unless ``tensor`` may take part in a transfer of ``nbytes`` (a multiple of 4096).

    [Note: buffer rule] A buffer is a contiguous CPU tensor of any dtype whose data pointer is
    4096-aligned and whose storage runs at least ``nbytes`` past that pointer. The tensor's own
    nbytes may be smaller than ``nbytes`` by the padding to 4096 (``aligned_empty`` owns it).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"buffer must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"buffer must be a CPU tensor, got one on {tensor.device}; "
                         f"copy it to a pinned aligned_empty() buffer first")
    if not tensor.is_contiguous():
        raise ValueError("buffer must be contiguous; use an aligned_empty() buffer")
    _check_aligned("buffer data_ptr()", tensor.data_ptr())
    storage = tensor.untyped_storage()
    owned = storage.data_ptr() + storage.nbytes() - tensor.data_ptr()
    if round_up(tensor.nbytes) < nbytes or owned < nbytes:
        raise ValueError(f"buffer holds {tensor.nbytes} bytes ({owned} to the end of its storage) but the "
                         f"transfer moves {nbytes} bytes; pass a buffer of at least {nbytes} bytes, e.g. "
                         f"aligned_empty({nbytes})")


class IoHandle:
    """One transfer in flight. ``wait()`` blocks without the GIL and raises OSError naming the
    file, offset and size if the transfer failed; ``done()`` polls. Made by AioEngine/SwapSpace;
    keeps the buffer alive until the transfer ends."""

    __slots__ = ("_request", "_buffer")

    def __init__(self, request, buffer: torch.Tensor):
        self._request = request
        self._buffer = buffer

    def wait(self) -> None:
        self._request.wait()
        self._buffer = None  # [Note: buffer lifetime] no longer needed by the engine

    def done(self) -> bool:
        if self._request.done():
            self._buffer = None
            return True
        return False

    @property
    def nbytes(self) -> int:
        return self._request.nbytes

    @property
    def offset(self) -> int:
        return self._request.offset

    @property
    def path(self) -> str:
        return self._request.path

    def __repr__(self):
        state = "done" if self.done() else "in flight"
        return (f"IoHandle({self._request.op.name.lower()} {self.nbytes} bytes at offset {self.offset} "
                f"of {self.path}, {state})")


class AioEngine:
    """Native pool of I/O threads doing pread/pwrite (O_DIRECT when the file was opened so).

    Each request is cut into ``block_size`` pieces spread over ``threads`` threads, at most
    ``queue_depth`` pieces in flight engine-wide (so the disk sees ``min(threads, queue_depth)``
    concurrent requests: each thread has one in flight). Thread-safe. ``close()`` (or leaving a
    ``with`` block) waits for every transfer, then stops the threads.
    """

    def __init__(self, *, threads: int = 4, block_size: int = 1 << 20, queue_depth: int = 16):
        _check_int("threads", threads, minimum=1)
        if threads > 256:
            raise ValueError(f"threads must be <= 256, got {threads}")
        _check_int("block_size", block_size, minimum=ALIGNMENT)
        _check_aligned("block_size", block_size)
        _check_int("queue_depth", queue_depth, minimum=1)
        self._native_engine = _native().IoEngine(threads=threads, block_size=block_size, queue_depth=queue_depth)
        self.threads, self.block_size, self.queue_depth = threads, block_size, queue_depth
        self._lock = threading.Lock()
        # [Note: buffer lifetime] handles of unfinished transfers, so their buffers stay alive
        # even if the caller drops the handle; pruned on every submit.
        self._in_flight: set[IoHandle] = set()

    def read(self, fd: int, buffer: torch.Tensor, *, offset: int, nbytes: int | None = None,
             path: str | None = None, after: IoHandle | None = None, notify_fd: int = -1) -> IoHandle:
        """Read ``nbytes`` (default: ``buffer.nbytes`` rounded up to 4096) at ``offset`` of ``fd``
        into ``buffer``. ``after``: start only once that handle's transfer ends (and fail if it
        failed). ``notify_fd``: an eventfd/pipe written once on completion. ``path`` names the file
        in error messages."""
        return self._submit(_native().IoOp.READ, fd, buffer, offset, nbytes, path, _after(after), notify_fd)

    def write(self, fd: int, buffer: torch.Tensor, *, offset: int, nbytes: int | None = None,
              path: str | None = None, after: IoHandle | None = None, notify_fd: int = -1) -> IoHandle:
        """Write ``buffer`` to ``fd`` at ``offset``; arguments as for :meth:`read`."""
        return self._submit(_native().IoOp.WRITE, fd, buffer, offset, nbytes, path, _after(after), notify_fd)

    def _submit(self, op, fd, buffer, offset, nbytes, path, after, notify_fd) -> IoHandle:
        _check_int("fd", fd, minimum=0)
        _check_int("offset", offset, minimum=0)
        _check_aligned("offset", offset)
        if nbytes is None:
            if not isinstance(buffer, torch.Tensor):
                raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
            nbytes = max(round_up(buffer.nbytes), ALIGNMENT)
        _check_int("nbytes", nbytes, minimum=1)
        _check_aligned("nbytes", nbytes)
        _check_buffer(buffer, nbytes)
        with self._lock:
            if self._native_engine is None:
                raise ValueError("AioEngine is closed; create a new one")
            request = self._native_engine.submit(
                op=op, fd=fd, path=path if path is not None else f"<fd {fd}>", addr=buffer.data_ptr(),
                nbytes=nbytes, offset=offset, notify_fd=notify_fd,
                after=after)
            handle = IoHandle(request, buffer)
            self._in_flight = {h for h in self._in_flight if not h.done()}
            self._in_flight.add(handle)
        return handle

    def close(self) -> None:
        """Wait for every transfer (errors stay with their handles), then stop the threads."""
        with self._lock:
            engine, self._native_engine = self._native_engine, None
            pending, self._in_flight = self._in_flight, set()
        for handle in pending:
            _wait_quietly(handle)
        del engine  # joins the threads (the native destructor finishes any queued piece first)

    @property
    def closed(self) -> bool:
        return self._native_engine is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"AioEngine(threads={self.threads}, block_size={self.block_size}, "
                f"queue_depth={self.queue_depth}{', closed' if self.closed else ''})")


def _after(handle: IoHandle | None):
    if handle is not None and not isinstance(handle, IoHandle):
        raise TypeError(f"after must be an IoHandle or None, got {type(handle).__name__}")
    return handle._request if handle is not None else None


def _wait_quietly(handle) -> None:
    try:
        handle.wait()
    except OSError:
        pass  # reported to whoever waits on the handle


# ---------------------------------------------------------------------------------------------
# Free extents: first fit over sorted (offset, nbytes) pairs (SwapSpace's file, PinnedPool's slabs)


def take_extent(free: list, nbytes: int) -> int | None:
    """First fit: carve ``nbytes`` out of ``free`` (sorted, non-adjacent ``(offset, nbytes)``
    extents) and return its offset, or None when no extent is large enough."""
    for i, (off, size) in enumerate(free):
        if size >= nbytes:
            if size == nbytes:
                del free[i]
            else:
                free[i] = (off + nbytes, size - nbytes)
            return off
    return None


def give_extent(free: list, off: int, nbytes: int, *, owner: str) -> None:
    """Return an extent to ``free``, merging it with free neighbours; ``owner`` names the memory
    in the error raised for an extent that is free already."""
    i = bisect.bisect_left(free, (off, 0))
    if i < len(free) and free[i][0] < off + nbytes or i > 0 and sum(free[i - 1]) > off:
        raise RuntimeError(f"{owner}: extent at {off} ({nbytes} bytes) returned twice")
    if i < len(free) and free[i][0] == off + nbytes:
        nbytes += free.pop(i)[1]
    if i > 0 and sum(free[i - 1]) == off:
        i -= 1
        off, nbytes = free[i][0], free.pop(i)[1] + nbytes
    free.insert(i, (off, nbytes))


# ---------------------------------------------------------------------------------------------
# Swap space


class IoMode(enum.Enum):
    """How a SwapSpace reaches its file."""

    DIRECT = "direct"
    """O_DIRECT: bypasses the page cache (host RAM stays free; speed is the disk's)."""
    BUFFERED = "buffered"
    """Through the page cache: the fallback where the file system refuses O_DIRECT."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slot:
    """A region of a SwapSpace's file holding one payload."""

    offset: int
    """Byte offset in the swap file (a multiple of 4096)."""
    nbytes: int
    """Bytes asked for in ``alloc``."""

    @property
    def padded_nbytes(self) -> int:
        """Bytes every transfer of this slot moves: ``nbytes`` rounded up to 4096."""
        return max(round_up(self.nbytes), ALIGNMENT)


@dataclasses.dataclass(kw_only=True)
class _SlotRecord:
    slot: Slot
    last: object = None
    """The native request of the latest transfer on this slot (no buffer: nothing kept alive);
    the next transfer is ordered after it."""
    written: bool = False
    """A write was submitted since alloc, or ``claim_zero`` found it never written: reads are
    allowed."""


@dataclasses.dataclass(kw_only=True)
class _Files:
    """What a SwapSpace created, shared with its finalizer (which must not hold the space)."""

    directory: str
    path: str
    fd: int
    in_flight: set
    lock: threading.Lock

    def remove(self) -> None:
        # [Note: cleanup] wait for our transfers before closing the fd: a native thread must never
        # write to a descriptor number that the process has reused.
        with self.lock:
            pending, fd = list(self.in_flight), self.fd
            self.in_flight.clear()
            self.fd = -1
        for handle in pending:
            _wait_quietly(handle)
        if fd >= 0:
            os.close(fd)
        _remove_created(self.path, self.directory)


def _remove_created(path: str, directory: str) -> None:
    """Remove the swap file ``path`` and its private ``directory`` with its owner file, unless the
    directory holds something else (then the owner file stays, so the space is still known)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        rest = os.listdir(directory)
    except FileNotFoundError:
        return
    if set(rest) <= {OWNER_FILE}:  # never removes what someone else put there
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, OWNER_FILE))
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _probe_direct(path: str) -> int | None:
    """Open ``path`` with O_DIRECT and write one aligned block; the fd, or None if refused."""
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        with mmap.mmap(-1, ALIGNMENT) as probe:  # page-aligned
            os.pwrite(fd, probe, 0)
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        if e.errno == errno.EINVAL:
            return None
        raise
    return fd


# ---------------------------------------------------------------------------------------------
# Swap directories: checks, creation, and the owners of the spaces in them

SPACE_PREFIX = "zero_offload-"
"""Name prefix of every SwapSpace's private subdirectory: ``zero_offload-<pid>-<random>``."""
OWNER_FILE = "owner.json"
"""The owner file in a SwapSpace's private subdirectory; see [Note: owner file]."""
SWAP_FILE = "swap.bin"
"""The swap file in a SwapSpace's private subdirectory."""
_OWNER_FORMAT = "zero_offload swap space"
_OWNER_VERSION = 1
_START_TIME_SLACK = 1.0
"""Seconds two readings of one process's start time may differ by (psutil derives it from the
boot time, which the kernel reports to the second)."""

# [Note: owner file] Every SwapSpace writes OWNER_FILE into its private directory before the swap
# file exists: one JSON object {"format": "zero_offload swap space", "version": 1, "pid",
# "hostname", "pid_namespace" (inode of /proc/self/ns/pid, or null), "start_time" (the process's
# start, psutil create_time, seconds since the epoch), "created" (seconds since the epoch),
# "uid"}. It is what proves a directory is ours: only a directory named SPACE_PREFIX* that holds a
# well-formed owner file is ever removed, and then only SWAP_FILE and OWNER_FILE in it (the
# directory goes only if that empties it). Its owner is dead when the space was made on this host
# and PID namespace and no process has that pid with that start time (pid reuse cannot fool it)
# or that process is a zombie. Spaces of another host or PID namespace cannot be judged and are
# never removed. A directory without an owner file (being set up, or made by someone else) is
# not a space.


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


class OwnerState(enum.Enum):
    """Whether the process that created a swap space still runs."""

    ALIVE = "alive"
    DEAD = "dead"
    """On this host and PID namespace, and gone (or a zombie, or its pid reused): the space is stale."""
    UNKNOWN = "unknown"
    """Another host or PID namespace (a shared disk): cannot tell; never removed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpaceOwner:
    """What a swap space's owner file records (see [Note: owner file])."""

    pid: int
    hostname: str
    pid_namespace: int | None
    start_time: float
    """The process's start, seconds since the epoch: with ``pid`` it names one process."""
    created: float
    """When the space was created, seconds since the epoch."""
    uid: int

    @classmethod
    def of_this_process(cls) -> "SpaceOwner":
        return cls(pid=os.getpid(), hostname=socket.gethostname(), pid_namespace=_pid_namespace(),
                   start_time=psutil.Process().create_time(), created=time.time(), uid=os.geteuid())

    def to_json(self) -> str:
        return json.dumps({"format": _OWNER_FORMAT, "version": _OWNER_VERSION, **dataclasses.asdict(self)})

    @classmethod
    def read(cls, path: str) -> "SpaceOwner | None":
        """The owner recorded in the owner file ``path``; None unless it is one of ours."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = json.loads(os.read(fd, 1 << 16))
            if data.pop("format") != _OWNER_FORMAT or data.pop("version") != _OWNER_VERSION:
                return None
            owner = cls(**data)
            types = [(owner.pid, int), (owner.hostname, str), (owner.start_time, (int, float)),
                     (owner.created, (int, float)), (owner.uid, int), (owner.pid_namespace, (int, type(None)))]
            return owner if all(isinstance(v, t) and not isinstance(v, bool) for v, t in types) else None
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        finally:
            os.close(fd)

    def state(self) -> OwnerState:
        if self.hostname != socket.gethostname() or self.pid_namespace != _pid_namespace():
            return OwnerState.UNKNOWN
        try:
            process = psutil.Process(self.pid)
            if abs(process.create_time() - self.start_time) > _START_TIME_SLACK:
                return OwnerState.DEAD  # the pid now names another process
            if process.status() == psutil.STATUS_ZOMBIE:
                return OwnerState.DEAD
        except psutil.NoSuchProcess:
            return OwnerState.DEAD
        except psutil.Error:
            return OwnerState.ALIVE  # access denied: assume it runs
        return OwnerState.ALIVE


def _write_owner(directory: str) -> None:
    """Write this process's owner file into ``directory`` (new: O_EXCL)."""
    fd = os.open(os.path.join(directory, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, SpaceOwner.of_this_process().to_json().encode())
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FoundSpace:
    """A swap space found in a swap directory (``find_spaces``), or a run's temporary swap
    directory (``temp_dir``; only ``remove_dead_spaces`` reports those)."""

    path: str
    """Its private subdirectory."""
    owner: SpaceOwner
    state: OwnerState
    nbytes: int
    """Bytes of the files in it."""
    temp_dir: bool = False
    """A run's temporary swap directory (``temp_swap_dir``) rather than a space."""

    @property
    def stale(self) -> bool:
        """Its owner is dead: nothing will use or remove it."""
        return self.state is OwnerState.DEAD


def find_spaces(directory) -> list[FoundSpace]:
    """Every swap space (a ``zero_offload-*`` subdirectory with an owner file) in ``directory``,
    alive or not, sorted by path. Creates nothing; [] if ``directory`` does not exist."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        if not entry.name.startswith(SPACE_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        owner = SpaceOwner.read(os.path.join(entry.path, OWNER_FILE))
        if owner is None:
            continue
        nbytes = 0
        with contextlib.suppress(OSError):
            for f in os.scandir(entry.path):
                if f.is_file(follow_symlinks=False):
                    nbytes += f.stat(follow_symlinks=False).st_size
        found.append(FoundSpace(path=entry.path, owner=owner, state=owner.state(), nbytes=nbytes))
    return sorted(found, key=lambda f: f.path)


def remove_stale_spaces(directory, *, dry_run: bool = False) -> list[tuple[FoundSpace, str | None]]:
    """Remove the stale swap spaces in ``directory`` (owner dead, see [Note: owner file]).

    Returns each stale space with None where it was removed (or would be, with ``dry_run``), or
    the reason it was kept (it holds files zero_offload did not write, or removal failed). Only
    the swap file and the owner file are removed; live spaces, spaces of other hosts and anything
    without an owner file are never touched.
    """
    results = []
    for space in find_spaces(directory):
        if not space.stale:
            continue
        if not dry_run:
            try:
                _remove_created(os.path.join(space.path, SWAP_FILE), space.path)
            except OSError as e:
                results.append((space, f"removing it failed: {e.strerror or e}; remove it by hand"))
                continue
        foreign = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            foreign = sorted(set(os.listdir(space.path)) - {SWAP_FILE, OWNER_FILE})
        if foreign:
            results.append((space, f"its directory holds files zero_offload did not write "
                                   f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}), so only "
                                   f"its swap file {'would go' if dry_run else 'was removed'}; remove the rest by hand"))
        else:
            results.append((space, None))
    return results


# [Note: swap locations] A swap location is a directory runs are given (``--nvme-dir``,
# ``OffloadConfig.nvme_dir``) or, without one, the default temporary location
# (tempfile.gettempdir(), i.e. $TMPDIR). Spaces of one location live in: the directory itself;
# its ``rank<r>`` subdirectories (the engine's, one per rank under torchrun); and its temporary
# swap directories ``zero_offload_swap_*`` (a run given no swap directory makes one:
# ``temp_swap_dir``) and their ``rank<r>`` subdirectories. A temporary swap directory holds an
# owner file like a space's, so one whose owner died is ours to remove once the spaces in it are
# gone: only its owner file and empty ``rank<r>`` subdirectories go with it, and it is kept if
# anything else is left. ``rank<r>`` subdirectories of a directory the user named are left alone
# (empty; the next run reuses them). A ``zero_offload_swap_*`` directory without an owner file
# (made before owner files, or being set up) is searched for spaces but never removed; one of
# another user is not even searched.

TEMP_DIR_PREFIX = "zero_offload_swap_"
"""Name prefix of a run's temporary swap directory (``temp_swap_dir``), in the default location."""
_RANK_DIR = re.compile(r"rank[0-9]+")


def default_swap_location() -> str:
    """Where runs given no swap directory put their temporary swap directories: $TMPDIR."""
    return tempfile.gettempdir()


@contextlib.contextmanager
def temp_swap_dir():
    """A new temporary swap directory ``$TMPDIR/zero_offload_swap_*`` (0700) with an owner file,
    removed with everything in it on exit. If the process is killed instead, ``remove_dead_spaces``
    (``zero-offload clean``, the next run's start) removes it; see [Note: swap locations]."""
    path = tempfile.mkdtemp(prefix=TEMP_DIR_PREFIX, dir=default_swap_location())
    try:
        _write_owner(path)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # clean-up never raises over the cause


def _subdirs(directory: str, match) -> list[str]:
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    return sorted(e.path for e in entries if match(e.name) and e.is_dir(follow_symlinks=False))


def _temp_dirs(directory: str) -> list[str]:
    """The temporary swap directories in ``directory`` that this user owns (another user's, 0700
    in a shared $TMPDIR, can be neither read nor judged)."""
    uid = os.geteuid()

    def ours(path: str) -> bool:
        try:
            return os.lstat(path).st_uid == uid
        except OSError:
            return False
    return [d for d in _subdirs(directory, lambda name: name.startswith(TEMP_DIR_PREFIX)) if ours(d)]


def _with_ranks(directory: str) -> list[str]:
    return [directory] + _subdirs(directory, _RANK_DIR.fullmatch)


def find_all_spaces(directory=None) -> list[FoundSpace]:
    """Every swap space of a swap location (default: the default temporary location), alive or
    not, sorted by path: in ``directory``, its ``rank<r>`` subdirectories and its temporary swap
    directories (see [Note: swap locations]). Creates nothing."""
    directory = os.path.abspath(os.fspath(default_swap_location() if directory is None else directory))
    roots = _with_ranks(directory) + [d for t in _temp_dirs(directory) for d in _with_ranks(t)]
    return sorted((f for root in roots for f in find_spaces(root)), key=lambda f: f.path)


def remove_dead_spaces(directory=None, *, dry_run: bool = False) -> list[tuple[FoundSpace, str | None]]:
    """``remove_stale_spaces`` over a whole swap location (default: the default temporary
    location), then the temporary swap directories whose owner died (see [Note: swap
    locations]). Returns what ``remove_stale_spaces`` does, plus one entry (``temp_dir`` True)
    per dead temporary swap directory: None where it was removed (or would be), else why kept."""
    directory = os.path.abspath(os.fspath(default_swap_location() if directory is None else directory))
    results = [r for root in _with_ranks(directory) for r in remove_stale_spaces(root, dry_run=dry_run)]
    for temp in _temp_dirs(directory):
        removed = []
        for root in _with_ranks(temp):
            done = remove_stale_spaces(root, dry_run=dry_run)
            results += done
            removed += [space.path for space, kept in done if kept is None]
        owner = SpaceOwner.read(os.path.join(temp, OWNER_FILE))
        if owner is None or owner.state() is not OwnerState.DEAD:
            continue
        left = _left_in_temp_dir(temp, set(removed))
        found = FoundSpace(path=temp, owner=owner, state=OwnerState.DEAD, nbytes=0, temp_dir=True)
        if left:
            results.append((found, f"it holds what zero_offload did not write "
                                   f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}); remove it by hand"))
            continue
        if not dry_run:
            for rank in _subdirs(temp, _RANK_DIR.fullmatch):
                with contextlib.suppress(OSError):
                    os.rmdir(rank)  # empty but for spaces removed above
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(temp, OWNER_FILE))
            with contextlib.suppress(OSError):
                os.rmdir(temp)
            if os.path.lexists(temp):
                results.append((found, "removing it failed; remove it by hand"))
                continue
        results.append((found, None))
    return results


def _left_in_temp_dir(temp: str, removed: set) -> list[str]:
    """What the temporary swap directory ``temp`` holds beside its owner file, its ``rank<r>``
    subdirectories and the spaces in ``removed``: paths relative to ``temp``."""
    ranks = _subdirs(temp, _RANK_DIR.fullmatch)
    left = []
    for root in [temp, *ranks]:
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            continue
        for name in names:
            path = os.path.join(root, name)
            if path in removed or path in ranks or (root == temp and name == OWNER_FILE):
                continue
            left.append(os.path.relpath(path, temp))
    return sorted(left)


def auto_nvme_budget(directory) -> int:
    """Bytes an "auto" NVMe budget gives swap files in ``directory``: its file system's free
    space less a reserve of ``NVME_AUTO_RESERVE`` or 5% of the free space, whichever is smaller
    (the disk's size plays no part: a big disk with little free space still gets most of it)."""
    free = shutil.disk_usage(directory).free
    return max(0, free - min(NVME_AUTO_RESERVE, free // 20))


NVME_AUTO_RESERVE = 4 << 30
"""Most free disk space an "auto" NVMe budget leaves to others (logs, checkpoints)."""


def disk_holders(directory, *, limit: int = 5) -> str:
    """"; zero_offload swap spaces on this disk: ..." naming our spaces on the file system of
    ``directory`` (in its swap location and in the default temporary one) by path, size, owner
    pid and whether it runs, then the command that removes the dead ones; "" when there are none.
    For the messages of a disk short of space."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return ""
    found, seen = [], set()
    for location in (_location_of(directory), os.path.abspath(default_swap_location())):
        for f in find_all_spaces(location):
            with contextlib.suppress(OSError):
                if f.path not in seen and os.stat(f.path).st_dev == dev:
                    seen.add(f.path)
                    found.append(f)
    if not found:
        return ""
    found.sort(key=lambda f: -f.nbytes)
    state = {OwnerState.ALIVE: "running", OwnerState.DEAD: "dead",
             OwnerState.UNKNOWN: "another host: cannot tell"}
    listed = ", ".join(f"{f.path} ({human_bytes(f.nbytes)}, pid {f.owner.pid} {state[f.state]})"
                       for f in found[:limit])
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    dead = [f for f in found if f.stale]
    fix = ""
    if dead:
        where = sorted({clean_location(f.path) for f in dead}, key=lambda w: w or "")
        cmds = " and ".join("zero-offload clean" + (f" --nvme-dir {shlex.quote(w)}" if w else "") for w in where)
        fix = f"; {human_bytes(sum(f.nbytes for f in dead))} of them are dead runs': free it with {cmds}"
    return f"; zero_offload swap spaces on this disk: {listed}{more}{fix}"


def clean_location(space_path: str) -> str | None:
    """The swap location whose ``zero-offload clean`` removes the space at ``space_path``: the
    directory to pass as --nvme-dir, or None for the default temporary location."""
    location = _location_of(os.path.dirname(os.path.abspath(space_path)))
    return None if location == os.path.abspath(default_swap_location()) else location


def _location_of(directory: str) -> str:
    """The swap location ``directory`` belongs to: itself, or the one above a ``rank<r>``
    subdirectory and a temporary swap directory (see [Note: swap locations])."""
    if _RANK_DIR.fullmatch(os.path.basename(directory)):
        directory = os.path.dirname(directory)
    if os.path.basename(directory).startswith(TEMP_DIR_PREFIX):
        directory = os.path.dirname(directory)
    return directory


def free_stale_spaces(directory, *, stacklevel: int = 2) -> list[FoundSpace]:
    """``remove_stale_spaces(directory)`` as a swap space's start does it: returns the spaces
    removed; a RuntimeWarning names each one it had to keep, and why."""
    removed = []
    for space, kept in remove_stale_spaces(directory):
        if kept is None:
            removed.append(space)
        else:
            warnings.warn(f"stale swap space {space.path} (pid {space.owner.pid}, dead) was kept: {kept}",
                          RuntimeWarning, stacklevel=stacklevel)
    return removed


def swap_dir_problem(directory) -> str | None:
    """Why ``directory`` can never hold swap spaces, as a phrase ("is a regular file, not a
    directory"), or None. Only looks: creates nothing (a missing directory is no problem)."""
    path = os.path.abspath(os.fspath(directory))
    probe = path
    while True:
        try:
            st = os.stat(probe)
            break
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(probe)
            if parent == probe:
                return None
            probe = parent
        except OSError:
            return None  # e.g. a parent we may not search: prepare_swap_dir reports it
    if stat.S_ISDIR(st.st_mode):
        return None
    kind = "a regular file, not a directory" if stat.S_ISREG(st.st_mode) else "not a directory"
    return f"is {kind}" if probe == path else f"cannot be created: {probe!r} is {kind}"


def _unwritable(err: int, name: str, path: str, *, action: str = "create swap files in") -> OSError:
    if err == errno.EROFS:
        msg = f"{name} {path!r} is on a read-only file system; use a directory on a writable local disk"
    elif err in (errno.EACCES, errno.EPERM):
        msg = (f"{name} {path!r} is not writable by this user (permission denied); use a directory you "
               f"can write to, or give yourself write permission on it")
    else:
        msg = (f"cannot {action} {name} {path!r}: {os.strerror(err)}; use a writable directory on a "
               f"local disk")
    return OSError(err, msg)  # OSError(EACCES, ...) is a PermissionError


def prepare_swap_dir(directory, *, name: str = "swap directory") -> str:
    """Make ``directory`` ready to hold swap spaces; returns its absolute path.

    Missing directories on the way are created 0700 (swap files hold the model's state; only the
    owner may read them); an existing directory's mode is never changed. Raises
    NotADirectoryError when the path (or a parent) is not a directory, PermissionError or
    OSError(EROFS) when it cannot be written; each message is one line naming ``name`` (e.g.
    "OffloadConfig.nvme_dir"), the path and the fix.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(directory).__name__}")
    path = os.path.abspath(os.fspath(directory))
    problem = swap_dir_problem(path)
    if problem is not None:
        raise NotADirectoryError(errno.ENOTDIR, f"{name} {path!r} {problem}; use a directory path instead "
                                                f"(created 0700 if missing), or move that file away")
    missing = []
    probe = path
    while not os.path.isdir(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not os.path.isdir(d):  # made by someone else meanwhile
                raise NotADirectoryError(errno.ENOTDIR, f"{name} {path!r} cannot be created: {d!r} is not "
                                                        f"a directory; use a directory path instead") from None
        except OSError as e:
            raise _unwritable(e.errno, name, path, action="create swap directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        readonly = False
        with contextlib.suppress(OSError):
            readonly = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        raise _unwritable(errno.EROFS if readonly else errno.EACCES, name, path)
    return path


class SwapSpace:
    """Preallocated swap file in a private subdirectory of ``directory``, with a slot allocator.

    - ``directory`` is created (0700, with any missing parent) if missing. The space lives in its
      own ``zero_offload-<pid>-*`` subdirectory (0700) holding its owner file (see [Note: owner
      file]) and one file (0600) of ``capacity_bytes`` (rounded up to 4096), preallocated with
      posix_fallocate after checking free space, so a full disk is reported here, before training
      starts. Two spaces (or processes) on one directory never collide.
    - ``remove_stale`` (default True): first remove the spaces in ``directory`` whose owner process
      died without removing them (kill -9, a crash); a RuntimeWarning names any it had to keep.
    - ``mode``: None probes O_DIRECT with a real write and falls back to buffered I/O where the
      file system refuses it; IoMode.DIRECT requires it; IoMode.BUFFERED forces the page cache.
      ``.mode`` / ``.direct`` say which is in use.
    - Slots: ``alloc(nbytes)`` / ``free(slot)``; first fit over 4096-aligned extents.
    - I/O: ``write(slot, tensor)`` / ``read(slot, tensor)`` return IoHandles; ``await
      awrite(...)`` / ``await aread(...)`` never block the event loop. Transfers on one slot run in
      submission order (a read after a write sees it). Reading a slot never written since its
      alloc raises ValueError (its bytes would be stale).
    - ``close()`` waits for transfers and removes the file and subdirectory; also at interpreter
      exit. Thread-safe.
    """

    def __init__(self, directory, *, capacity_bytes: int, engine: AioEngine | None = None,
                 mode: IoMode | str | None = None, remove_stale: bool = True):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
        _check_int("capacity_bytes", capacity_bytes, minimum=1)
        capacity = round_up(capacity_bytes)
        if engine is not None and not isinstance(engine, AioEngine):
            raise TypeError(f"engine must be an AioEngine or None, got {type(engine).__name__}")
        if engine is not None and engine.closed:
            raise ValueError("engine is closed; pass an open AioEngine or None")
        if mode is not None:
            try:
                mode = IoMode(mode)
            except ValueError:
                raise ValueError(f"mode must be None, 'direct' or 'buffered', got {mode!r}") from None

        directory = prepare_swap_dir(directory)
        if not isinstance(remove_stale, bool):
            raise TypeError(f"remove_stale must be True or False, got {remove_stale!r}")
        if remove_stale:
            free_stale_spaces(directory, stacklevel=3)  # the warning points at SwapSpace's caller
        free = psutil.disk_usage(directory).free
        if free < capacity:
            raise OSError(errno.ENOSPC, f"swap space needs {capacity} bytes but the file system of "
                                        f"{directory!r} has {free} bytes free; lower capacity_bytes or "
                                        f"pick another directory{disk_holders(directory)}", directory)

        try:
            private = tempfile.mkdtemp(prefix=f"{SPACE_PREFIX}{os.getpid()}-", dir=directory)  # 0700
        except OSError as e:
            raise _unwritable(e.errno, "swap directory", directory) from None
        path = os.path.join(private, SWAP_FILE)
        fd = None
        try:
            _write_owner(private)  # before the swap file exists: see [Note: owner file]
            # [Note: preallocation] fallocate through a buffered fd: glibc's emulation on file
            # systems without fallocate writes single bytes, which O_DIRECT would refuse.
            try:
                prealloc = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise _unwritable(e.errno, "swap directory", directory) from None
            try:
                os.posix_fallocate(prealloc, 0, capacity)
            except OSError as e:
                holders = disk_holders(directory) if e.errno == errno.ENOSPC else ""
                raise type(e)(e.errno, f"cannot preallocate {capacity} bytes for the swap file {path!r}: "
                                       f"{e.strerror}; lower capacity_bytes or free space{holders}",
                              path) from None
            finally:
                os.close(prealloc)
            fd = None if mode is IoMode.BUFFERED else _probe_direct(path)
            if fd is None and mode is IoMode.DIRECT:
                raise OSError(errno.EINVAL, f"the file system of {directory!r} does not support O_DIRECT; "
                                            f"pass mode=None (fall back to buffered) or another directory",
                              directory)
            self.mode = IoMode.BUFFERED if fd is None else IoMode.DIRECT
            if fd is None:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            self._owns_engine = engine is None
            self.engine = engine if engine is not None else AioEngine()
        except BaseException:
            if fd is not None:
                os.close(fd)
            _remove_created(path, private)
            raise

        self.directory = private
        self.path = path
        self.capacity_bytes = capacity
        self._lock = threading.Lock()
        self._files = _Files(directory=private, path=path, fd=fd, in_flight=set(), lock=self._lock)
        self._finalizer = weakref.finalize(self, self._files.remove)
        self._free: list[tuple[int, int]] = [(0, capacity)]  # see take_extent
        self._slots: dict[int, _SlotRecord] = {}  # offset -> record of each allocated slot
        self._written_end = 0
        """No byte of the file at or past this offset was ever written: it reads as zeros (the
        file is new and preallocated), see ``claim_zero``."""

    @property
    def direct(self) -> bool:
        """True when transfers bypass the page cache (O_DIRECT)."""
        return self.mode is IoMode.DIRECT

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def used_bytes(self) -> int:
        """Bytes of the file held by allocated slots (padded to 4096)."""
        with self._lock:
            return self.capacity_bytes - sum(size for _, size in self._free)

    # ---- slots

    def alloc(self, nbytes: int) -> Slot:
        """A slot for a payload of ``nbytes``; its transfers move ``slot.padded_nbytes``."""
        _check_int("nbytes", nbytes, minimum=1)
        size = round_up(nbytes)
        with self._lock:
            self._check_open()
            offset = take_extent(self._free, size)
            if offset is not None:
                slot = Slot(offset=offset, nbytes=nbytes)
                self._slots[offset] = _SlotRecord(slot=slot)
                return slot
            largest = max((extent for _, extent in self._free), default=0)
        raise RuntimeError(f"swap space full: a slot of {size} bytes does not fit (capacity {self.capacity_bytes}, "
                           f"largest free extent {largest}); create the SwapSpace with a larger capacity_bytes")

    def free(self, slot: Slot) -> None:
        """Return ``slot`` to the space; a transfer still running on it finishes first."""
        with self._lock:
            record = self._record(slot)
            del self._slots[slot.offset]
            last = record.last
        if last is not None:
            _wait_quietly(last)
        with self._lock:
            give_extent(self._free, slot.offset, slot.padded_nbytes, owner=f"swap space {self.path}")

    def claim_zero(self, slot: Slot) -> bool:
        """True when ``slot`` reads as zeros without a write: no byte of it was ever written (the
        new, preallocated file reads as zeros there); it may then be read. False: the caller
        writes its zeros (an extent freed and handed out again holds old bytes)."""
        with self._lock:
            record = self._record(slot)
            if record.written or slot.offset < self._written_end:
                return False
            record.written = True
            return True

    # ---- transfers

    def write(self, slot: Slot, tensor: torch.Tensor) -> IoHandle:
        """Write ``slot.padded_nbytes`` bytes from ``tensor`` (see [Note: buffer rule])."""
        return self._submit(slot, tensor, write=True, notify_fd=-1)

    def read(self, slot: Slot, tensor: torch.Tensor) -> IoHandle:
        """Read the slot into ``tensor``; ValueError if the slot was never written."""
        return self._submit(slot, tensor, write=False, notify_fd=-1)

    async def awrite(self, slot: Slot, tensor: torch.Tensor) -> None:
        """``write`` for asyncio: suspends until the transfer ends; raises its OSError."""
        await self._await(slot, tensor, write=True)

    async def aread(self, slot: Slot, tensor: torch.Tensor) -> None:
        """``read`` for asyncio: suspends until the transfer ends; raises its OSError."""
        await self._await(slot, tensor, write=False)

    async def _await(self, slot, tensor, *, write: bool) -> None:
        # [Note: async completion] the native engine writes to an eventfd when the transfer ends;
        # the event loop watches it, so no thread blocks and the loop never does. The engine writes
        # to its own dup of the fd, so cancelling here may close ours at any time.
        loop = asyncio.get_running_loop()
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            handle = self._submit(slot, tensor, write=write, notify_fd=efd)
            ready = loop.create_future()
            loop.add_reader(efd, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(efd)
        finally:
            os.close(efd)
        handle.wait()  # already done: raises the transfer's OSError, if any

    def _submit(self, slot: Slot, tensor: torch.Tensor, *, write: bool, notify_fd: int) -> IoHandle:
        with self._lock:
            record = self._record(slot)
            _check_buffer(tensor, slot.padded_nbytes)
            if not write and not record.written:
                raise ValueError(f"slot at offset {slot.offset} of {self.path} was never written since alloc, "
                                 f"so its bytes are stale; write it before reading")
            op = _native().IoOp.WRITE if write else _native().IoOp.READ
            handle = self.engine._submit(op, self._files.fd, tensor, slot.offset, slot.padded_nbytes,
                                         self.path, record.last, notify_fd)
            record.last = handle._request
            record.written = record.written or write
            if write:
                self._written_end = max(self._written_end, slot.offset + slot.padded_nbytes)
            in_flight = self._files.in_flight  # native requests only, for close()
            in_flight.difference_update([r for r in in_flight if r.done()])
            in_flight.add(handle._request)
        return handle

    def _record(self, slot: Slot) -> _SlotRecord:
        # caller holds self._lock
        self._check_open()
        if not isinstance(slot, Slot):
            raise TypeError(f"slot must be a Slot from SwapSpace.alloc, got {type(slot).__name__}")
        record = self._slots.get(slot.offset)
        if record is None or record.slot is not slot:
            raise ValueError(f"{slot} is not allocated in this SwapSpace (freed already, or from another "
                             f"space); use a slot returned by this space's alloc()")
        return record

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ValueError("SwapSpace is closed; create a new one")

    # ---- lifetime

    def close(self) -> None:
        """Wait for every transfer, then remove the swap file and its subdirectory. Idempotent."""
        self._finalizer()
        if self._owns_engine:
            self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{len(self._slots)} slots"
        return f"SwapSpace({self.path!r}, capacity_bytes={self.capacity_bytes}, mode={self.mode.value}, {state})"
