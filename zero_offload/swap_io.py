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

import mmap
import weakref

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
