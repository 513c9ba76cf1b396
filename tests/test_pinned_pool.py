"""Pinned pool: exact 4 KiB-rounded sizes carved from one slab, reuse, growth, and host RSS
following the formula (home copies + pool), unlike a power-of-two caching allocator."""
import gc

import psutil
import pytest
import torch

from zero_offload.runtime.pinned_pool import PinnedPool
from zero_offload.store import ChunkStore, PayloadSpec, StoreConfig, Tier

MiB = 1 << 20


def test_buffers_are_aligned_exact_and_carved_from_one_slab():
    pool = PinnedPool(10 * MiB, pin=False)
    a = pool.acquire(3 * MiB + 1)
    b = pool.acquire(5000)
    assert a.nbytes == 3 * MiB + 4096 and b.nbytes == 8192
    for buf in (a, b):
        assert buf.raw.data_ptr() % 4096 == 0
    assert b.raw.data_ptr() == a.raw.data_ptr() + a.nbytes  # carved back to back
    assert pool.reserved_bytes == 10 * MiB
    assert pool.in_use_bytes == a.nbytes + b.nbytes
    a.raw.fill_(1)
    b.raw.fill_(2)
    assert int(a.raw.sum()) == a.nbytes  # no overlap
    v = b.view(torch.float32, 100)
    assert v.dtype == torch.float32 and v.numel() == 100


def test_release_reuses_and_coalesces():
    pool = PinnedPool(4 * MiB, pin=False)
    bufs = [pool.acquire(MiB) for _ in range(4)]
    ptrs = [b.raw.data_ptr() for b in bufs]
    for b in (bufs[1], bufs[2], bufs[0], bufs[3]):
        pool.release(b)
    assert pool.in_use_bytes == 0
    big = pool.acquire(4 * MiB)  # only possible if the four extents merged back
    assert big.raw.data_ptr() == ptrs[0]
    assert pool.stats.grows == 0
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(bufs[0])


def test_growth_and_fixed_pool_error():
    pool = PinnedPool(MiB, pin=False)
    pool.acquire(MiB)
    extra = pool.acquire(2 * MiB)
    assert pool.stats.grows == 1 and pool.reserved_bytes == 3 * MiB
    pool.release(extra)
    assert pool.trim() == 2 * MiB and pool.reserved_bytes == MiB
    fixed = PinnedPool(MiB, pin=False, growable=False)
    fixed.acquire(MiB // 2)
    with pytest.raises(MemoryError, match="larger capacity_bytes, or growable=True"):
        fixed.acquire(MiB)
    with pytest.raises(ValueError, match="positive int"):
        fixed.acquire(0)


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_host_rss_follows_the_formula():
    # 12 chunks of 12 MiB of home CPU state + a 48 MiB pool of staging buffers: once every home
    # has been used, RSS has grown by their sum, within a tolerance (no power-of-two rounding:
    # 12 MiB would round to 16 MiB). Unpinned homes are fresh zero pages until first used
    # (initialize touches no byte it does not write): right after add_chunk only the pool, which
    # is touched when made, is resident.
    chunk_numel = 3 * MiB  # fp32: 12 MiB
    n_chunks, pool_bytes = 12, 48 * MiB
    before = _rss()
    store = ChunkStore(StoreConfig(device="cpu", budgets={"cpu": 1 << 30, "gpu": 64 * MiB}, pool_bytes=pool_bytes))
    for _ in range(n_chunks):
        store.add_chunk({"master": PayloadSpec(chunk_numel, torch.float32, Tier.CPU)})
    expected = n_chunks * chunk_numel * 4 + pool_bytes
    assert store.bytes("cpu") + store.pool.reserved_bytes == expected
    assert abs(_rss() - before - pool_bytes) < 0.08 * expected + 8 * MiB, ((_rss() - before) / MiB, pool_bytes / MiB)
    for cid in range(n_chunks):
        assert not store.get(cid, "master", "cpu").any()  # zeros, as add_chunk promises
        store.get(cid, "master", "cpu", write=True).fill_(1.0)
        store.mark_dirty(cid, "master", "cpu")
    grown = _rss() - before
    assert abs(grown - expected) < 0.08 * expected + 8 * MiB, (grown / MiB, expected / MiB)
    store.close()
