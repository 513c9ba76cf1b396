"""aligned_empty: 4096-aligned CPU tensors whose memory runs to a multiple of 4096 bytes."""
import gc

import pytest
import torch

from zero_offload.swap_io import aligned_empty


@pytest.mark.parametrize("nbytes", [0, 1, 7, 4095, 4096, 4097, 3 * 4096 + 5, 1 << 20])
def test_alignment_size_and_zeroed(nbytes):
    t = aligned_empty(nbytes)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.is_contiguous()
    assert t.numel() == nbytes
    assert t.data_ptr() % 4096 == 0
    storage = t.untyped_storage()
    # the memory the tensor owns extends to the padded size from its data pointer
    assert storage.data_ptr() + storage.nbytes() >= t.data_ptr() + max(-(-nbytes // 4096) * 4096, 4096)
    assert int(t.count_nonzero()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_dtypes(dtype):
    nbytes = 40 * dtype.itemsize
    t = aligned_empty(nbytes, dtype=dtype)
    assert t.dtype == dtype and t.numel() == 40 and t.data_ptr() % 4096 == 0
    t.copy_(torch.arange(40).to(dtype))
    assert torch.equal(t, torch.arange(40).to(dtype))


def test_views_keep_memory_alive():
    t = aligned_empty(3 * 4096)
    t.copy_(torch.arange(3 * 4096, dtype=torch.int64).to(torch.uint8))
    expected = t[4096:].clone()
    view = t[4096:]
    del t
    gc.collect()
    # allocate and scribble over fresh memory; the view's bytes must be untouched
    junk = [aligned_empty(3 * 4096).fill_(0xAB) for _ in range(8)]
    assert torch.equal(view, expected)
    del junk


def test_bad_input():
    with pytest.raises(TypeError, match="nbytes must be an int"):
        aligned_empty(4.0)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        aligned_empty(True)
    with pytest.raises(ValueError, match=">= 0"):
        aligned_empty(-1)
    with pytest.raises(ValueError, match="item size 4"):
        aligned_empty(6, dtype=torch.float32)
    with pytest.raises(TypeError, match="torch.dtype"):
        aligned_empty(8, dtype="float32")
    with pytest.raises(TypeError, match="pin must be"):
        aligned_empty(8, pin="yes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pin_without_cuda_raises_and_none_means_unpinned():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        aligned_empty(4096, pin=True)
    t = aligned_empty(4096, pin=None)
    assert not t.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_is_registered_and_copies():
    t = aligned_empty(1 << 20, dtype=torch.float32, pin=True)
    assert t.is_pinned() and t.data_ptr() % 4096 == 0
    t.copy_(torch.randn(t.numel()))
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), t)
    del t, d
    gc.collect()
    # after the memory is freed its registration is gone: registering fresh buffers keeps working
    for _ in range(4):
        t2 = aligned_empty(1 << 20, pin=True)
        assert t2.is_pinned()
        del t2
        gc.collect()


def _resident(t: torch.Tensor) -> int:
    """Pages of ``t`` in memory (mincore(2))."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    n = -(-t.numel() * t.element_size() // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(n * mmap.PAGESIZE), vec) == 0
    return sum(b & 1 for b in vec)


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_fault_in_brings_every_page_in_as_zeros(threads, monkeypatch):
    """[Note: fault in]: a fresh buffer has no pages; after ``fault_in`` every page is in and
    reads zero, whichever way ran (0 threads: torch's fill; else the kernel's populate, which
    this kernel (>= 5.14) accepts, or the fill where it refuses)."""
    from zero_offload.runtime import swap_io
    monkeypatch.setattr(swap_io, "_populate_ok", None)
    nbytes = 24 << 20
    t = aligned_empty(nbytes)
    assert _resident(t) == 0
    how = swap_io.fault_in(t, threads=threads)
    assert how == ("fill" if threads == 0 else ("populate" if swap_io._populate_ok else "fill"))
    assert _resident(t) == nbytes // 4096
    assert int(t.count_nonzero()) == 0


def test_fault_in_fills_where_the_kernel_refuses_and_raises_when_memory_runs_out(monkeypatch):
    """A kernel without MADV_POPULATE_WRITE (EINVAL): the buffer is filled, and later buffers
    go straight to the fill. No memory for the pages (ENOMEM): one line naming it and the fix."""
    import errno

    from zero_offload.runtime import swap_io
    calls = []

    def refuse(madvise, ptr, nbytes):
        calls.append(nbytes)
        return errno.EINVAL
    monkeypatch.setattr(swap_io, "_populate_ok", None)
    monkeypatch.setattr(swap_io, "_populate_range", refuse)
    t = aligned_empty(8 << 20)
    assert swap_io.fault_in(t, threads=2) == "fill" and calls and swap_io._populate_ok is False
    assert _resident(t) == (8 << 20) // 4096 and int(t.count_nonzero()) == 0
    calls.clear()
    assert swap_io.fault_in(aligned_empty(8 << 20), threads=2) == "fill" and not calls

    monkeypatch.setattr(swap_io, "_populate_ok", None)
    monkeypatch.setattr(swap_io, "_populate_range", lambda madvise, ptr, nbytes: errno.ENOMEM)
    with pytest.raises(MemoryError, match="could not give 8.0MiB of pages to a pinned buffer.*cpu_budget"):
        swap_io.fault_in(aligned_empty(8 << 20), threads=2)
