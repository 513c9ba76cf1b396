"""NVMe swap I/O: aligned host buffers, the native O_DIRECT engine, and swap spaces.

Three layers, each usable alone:

- ``aligned_empty``: a CPU tensor whose data is 4096-aligned and whose memory extends to a
  multiple of 4096 bytes (what O_DIRECT needs), optionally registered with CUDA as pinned memory.
- ``AioEngine`` / ``IoHandle``: a pool of native I/O threads doing pread/pwrite on aligned
  buffers, each request split into ``block_size`` pieces; the GIL is released while waiting.
- ``SwapSpace``: one private directory of preallocated files, a slot allocator for fixed-size
  payloads, blocking-handle and asyncio fronts.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import enum
import errno
import mmap
import os
import tempfile
import threading
import weakref

import psutil
import torch

ALIGNMENT = 4096
"""O_DIRECT rule used everywhere here: buffer addresses, file offsets and sizes are multiples."""


def round_up(nbytes: int, multiple: int = ALIGNMENT) -> int:
    """Smallest multiple of ``multiple`` that is >= ``nbytes``."""
    return -(-nbytes // multiple) * multiple


def _check_pin(pin) -> bool:
    if pin is None:
        return torch.cuda.is_available()
    if not isinstance(pin, bool):
        raise TypeError(f"pin must be True, False or None (None = pin when CUDA exists), got {pin!r}")
    if pin and not torch.cuda.is_available():
        raise RuntimeError(
            "aligned_empty(pin=True) needs CUDA, but torch.cuda.is_available() is False; "
            "pass pin=False, or pin=None to pin only when CUDA exists")
    return pin


def _cuda_unregister(ptr: int, owner) -> None:
    # [Note: pinned lifetime] `owner` (the mmap) is an argument of this finalizer, so it is
    # still mapped while we unregister; it is unmapped only after this returns.
    del owner
    torch.cuda.cudart().cudaHostUnregister(ptr)


def aligned_empty(nbytes: int, *, dtype: torch.dtype = torch.uint8, pin: bool | None = False) -> torch.Tensor:
    """A 1-D CPU tensor of ``nbytes // dtype.itemsize`` elements, ready for O_DIRECT.

    Its data pointer is 4096-aligned and the memory it owns runs to ``round_up(nbytes, 4096)``
    bytes (at least 4096), so a transfer of the padded size stays inside it. The contents are
    zero (fresh anonymous pages, touched lazily).

    pin: ``True`` registers the memory with CUDA (``cudaHostRegister``: exact size, not the
    power-of-two caching host allocator) and unregisters it when the memory is freed; raises
    RuntimeError without CUDA. ``None`` pins exactly when CUDA is available. ``False`` (the
    default) leaves it pageable.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    itemsize = dtype.itemsize
    if nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a multiple of {dtype}'s item size {itemsize}; "
                         f"pass a whole number of elements")
    pin = _check_pin(pin)
    padded = max(round_up(nbytes), ALIGNMENT)
    # [Note: aligned memory] An anonymous mmap is page-aligned and zero-filled. torch.frombuffer
    # keeps a reference to the memoryview for as long as the storage lives, and the memoryview
    # keeps the mmap mapped, so every view of the tensor keeps the memory alive.
    owner = mmap.mmap(-1, padded)
    view = memoryview(owner)
    base = torch.frombuffer(view, dtype=torch.uint8)
    ptr = base.data_ptr()
    if ptr % ALIGNMENT:
        raise RuntimeError(f"mmap returned an address {ptr:#x} that is not 4096-aligned; "
                           f"this platform's page size is unsupported")
    if pin:
        err = torch.cuda.cudart().cudaHostRegister(ptr, padded, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister({padded} bytes) failed with CUDA error {int(err)}; "
                               f"the host may be out of lockable memory (see ulimit -l), "
                               f"or pass pin=False")
        weakref.finalize(view, _cuda_unregister, ptr, owner)
    return base[:nbytes].view(dtype)


# ---------------------------------------------------------------------------------------------
# Engine


def _native():
    from zero_offload import _C  # deferred: importing swap_io for aligned_empty needs no build
    return _C


def _check_int(name: str, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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
    """A write was submitted since alloc: reads are allowed."""


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
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with contextlib.suppress(FileNotFoundError, OSError):
        os.rmdir(directory)  # only if empty: never removes what someone else put there


def _probe_direct(path: str) -> int | None:
    """Open ``path`` with O_DIRECT and write one aligned block; the fd, or None if refused."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    probe = mmap.mmap(-1, ALIGNMENT)  # page-aligned
    try:
        os.pwrite(fd, probe, 0)
    except OSError as e:
        os.close(fd)
        if e.errno == errno.EINVAL:
            return None
        raise
    finally:
        probe.close()
    return fd


class SwapSpace:
    """Preallocated swap file in a private subdirectory of ``directory``, with a slot allocator.

    - ``directory`` is created (0700) if missing. The space lives in its own ``zero_offload-<pid>-*``
      subdirectory (0700) holding one file (0600) of ``capacity_bytes`` (rounded up to 4096),
      preallocated with posix_fallocate after checking free space, so a full disk is reported
      here, before training starts. Two spaces (or processes) on one directory never collide.
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
                 mode: IoMode | str | None = None):
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
        directory = os.path.abspath(os.fspath(directory))
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

        if os.path.exists(directory) and not os.path.isdir(directory):
            raise NotADirectoryError(errno.ENOTDIR, f"swap directory {directory!r} is not a directory; "
                                                    f"pass a directory path", directory)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as e:
            raise type(e)(e.errno, f"cannot create swap directory {directory!r}: {e.strerror}; "
                                   f"pass a directory you can write to", directory) from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"swap directory {directory!r} is not writable; "
                                                f"pass a directory you can write to", directory)
        free = psutil.disk_usage(directory).free
        if free < capacity:
            raise OSError(errno.ENOSPC, f"swap space needs {capacity} bytes but the file system of "
                                        f"{directory!r} has {free} bytes free; lower capacity_bytes or "
                                        f"pick another directory", directory)

        private = tempfile.mkdtemp(prefix=f"zero_offload-{os.getpid()}-", dir=directory)  # 0700
        path = os.path.join(private, "swap.bin")
        fd = -1
        try:
            # [Note: preallocation] fallocate through a buffered fd: glibc's emulation on file
            # systems without fallocate writes single bytes, which O_DIRECT would refuse.
            prealloc = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(prealloc, 0, capacity)
            except OSError as e:
                raise type(e)(e.errno, f"cannot preallocate {capacity} bytes for the swap file {path!r}: "
                                       f"{e.strerror}; lower capacity_bytes or free space", path) from None
            finally:
                os.close(prealloc)
            if mode is IoMode.BUFFERED:
                fd = -1
            else:
                fd = _probe_direct(path)
                if fd is None and mode is IoMode.DIRECT:
                    raise OSError(errno.EINVAL, f"the file system of {directory!r} does not support O_DIRECT; "
                                                f"pass mode=None (fall back to buffered) or another directory",
                                  directory)
            self.mode = IoMode.DIRECT if fd is not None and fd >= 0 else IoMode.BUFFERED
            if self.mode is IoMode.BUFFERED:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            self._owns_engine = engine is None
            self.engine = engine if engine is not None else AioEngine()
        except BaseException:
            if fd is not None and fd >= 0:
                os.close(fd)
            _remove_created(path, private)
            raise

        self.directory = private
        self.path = path
        self.capacity_bytes = capacity
        self._lock = threading.Lock()
        self._files = _Files(directory=private, path=path, fd=fd, in_flight=set(), lock=self._lock)
        self._finalizer = weakref.finalize(self, self._files.remove)
        self._free: list[list[int]] = [[0, capacity]]  # sorted [offset, size] extents
        self._slots: dict[int, _SlotRecord] = {}  # offset -> record of each allocated slot

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
            for i, (offset, extent) in enumerate(self._free):
                if extent >= size:
                    if extent == size:
                        del self._free[i]
                    else:
                        self._free[i] = [offset + size, extent - size]
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
            start, size = slot.offset, slot.padded_nbytes
            i = bisect.bisect_left(self._free, [start, size])
            self._free.insert(i, [start, size])
            # merge with the next extent, then with the previous one
            if i + 1 < len(self._free) and start + size == self._free[i + 1][0]:
                self._free[i][1] += self._free.pop(i + 1)[1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
                self._free[i - 1][1] += self._free.pop(i)[1]

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
