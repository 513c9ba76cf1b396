"""Prefetcher: order recording and re-recording, look-ahead per hop, farthest-next-use eviction,
and stall time falling with depth on a synthetic consumer (sleep as compute) vs on demand."""
import time

import pytest
import torch

from zero_offload.prefetch import Prefetcher
from zero_offload.store import ChunkStore, PayloadSpec, Residency, StoreConfig, Tier

MiB = 1 << 20


def small_store(n=6, gpu_chunks=3, **kw):
    s = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": gpu_chunks * 4096, "cpu": 1 << 24}, **kw))
    for c in range(n):
        s.add_chunk({"params": PayloadSpec(1024, torch.float32, Tier.CPU)})
        s.get(c, "params", "cpu").fill_(c)
    return s


def test_records_then_prefetches_depth_ahead():
    store = small_store()
    pf = Prefetcher(store, depth=2)
    order = [0, 1, 2, 3, 4, 5]
    pf.start_pass()
    for c in order:
        with pf.chunk(c) as t:
            assert torch.equal(t["params"], torch.full((1024,), float(c)))
    assert pf.order == order and pf.stats.prefetches == 0  # first pass: on demand only
    pf.start_pass()
    assert not pf.recording
    with pf.chunk(0):
        store.synchronize()
        assert store.state(1, "params", "gpu") is Residency.VALID
        assert store.state(2, "params", "gpu") is Residency.VALID
        assert store.state(3, "params", "gpu") is Residency.ABSENT
    for c in order[1:]:
        store.synchronize()  # stands in for compute long enough for the prefetch to land
        with pf.chunk(c):
            pass
    snap = pf.snapshot()
    assert snap.uses == 12 and snap.hits == 5  # pass 2: all but chunk 0 were prefetched
    # pass 1: 6 on demand; pass 2: 6 (0 on demand, 1..5 ahead) + 2 of the next pass (wrap-around)
    assert snap.bytes_moved["cpu->gpu"] == 4096 * (6 + 6 + 2)
    assert store.peak_bytes("gpu") <= 3 * 4096
    store.close()


def test_order_change_is_re_recorded():
    store = small_store()
    pf = Prefetcher(store, depth=1)
    for order in ([0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 1, 3], [0, 2, 1, 3]):
        pf.start_pass()
        for c in order:
            with pf.chunk(c) as t:
                assert t["params"][0].item() == c
    assert pf.stats.rerecords == 1
    assert pf.order == [0, 2, 1, 3]
    assert not pf.recording
    store.close()


def test_depth_zero_fetches_on_demand_only():
    store = small_store()
    pf = Prefetcher(store, depth=0)
    for _ in range(2):
        pf.start_pass()
        for c in range(4):
            with pf.chunk(c):
                assert store.bytes("gpu") == 4096
    assert pf.stats.prefetches == 0
    store.close()


def test_policy_evicts_farthest_next_use():
    store = small_store(n=4, gpu_chunks=3)
    pf = Prefetcher(store, depth=0, evict_after_use=False)
    order = [0, 1, 2, 3]
    for _ in range(2):
        pf.start_pass()
        for c in order:
            with pf.chunk(c):
                pass
    # Room for 3 of 4 chunks, nothing evicted after use: fetching chunk 3 evicts the copy whose
    # next use is farthest. Next come 0, 1, 2 (the next pass), so 2 goes and 0, 1, 3 stay
    # (LRU would have evicted 0).
    resident = {c for c in order if store.state(c, "params", "gpu") is not Residency.ABSENT}
    assert resident == {0, 1, 3}
    store.close()


def test_bad_arguments():
    store = small_store(n=1)
    with pytest.raises(ValueError, match="depth must be an int >= 0"):
        Prefetcher(store, depth=-1)
    with pytest.raises(ValueError, match="nvme_depth must be an int >= depth"):
        Prefetcher(store, depth=2, nvme_depth=1)
    with pytest.raises(ValueError, match="'gpu' or 'cpu'"):
        Prefetcher(store, depth=1, hops=[("params", "nvme")])
    store.close()


def _stall(tmp_path, depth: int) -> tuple[float, float]:
    """Stall seconds and wall seconds of the third pass over 10 NVMe-homed chunks of 16 MiB,
    each used for 25 ms of simulated compute; CPU holds only 5 chunks, so on-demand use must
    read from the file every time. (Each chunk is written first: an extent of the swap file
    never written reads as zeros without touching the disk.)"""
    nbytes = 16 * MiB
    store = ChunkStore(StoreConfig(device="cpu", nvme_dir=tmp_path,
                                   budgets={"gpu": 5 * nbytes, "cpu": 5 * nbytes, "nvme": 12 * nbytes}))
    try:
        cids = [store.add_chunk({"params": PayloadSpec(nbytes // 4, torch.float32, Tier.NVME)}) for _ in range(10)]
        for c in cids:
            store.allocate(c, "params", "cpu").fill_(float(c))
            store.mark_dirty(c, "params", "cpu")
            store.evict(c, "params", "cpu")  # written home first
        store.synchronize()
        pf = Prefetcher(store, depth=depth, nvme_depth=2 * depth)
        for p in range(3):
            pf.start_pass()
            s0, t0 = pf.stats.stall_s, time.perf_counter()
            for c in cids:
                with pf.chunk(c):
                    time.sleep(0.025)
        return pf.stats.stall_s - s0, time.perf_counter() - t0
    finally:
        store.close()


@pytest.mark.nvme
def test_stall_falls_as_depth_rises(tmp_path):
    serial_stall, serial_wall = _stall(tmp_path, depth=0)
    deep_stall, deep_wall = _stall(tmp_path, depth=2)
    # On demand, every use waits for a 16 MiB read + copy; with depth 2 those overlap the
    # sleeps. Generous margins for a busy 2-core machine (wall time is too noisy to assert).
    assert serial_stall > 0.02, serial_stall
    assert deep_stall < 0.5 * serial_stall, (deep_stall, serial_stall)
