"""A plain Prefetcher shared by two threads: the store's eviction policy asks the prefetcher how
soon a chunk is needed with the store's lock held, while the prefetcher's ``use`` calls the store
with its own lock held. The policy's query must not take the prefetcher's lock (deadlock).
Also ``ready``: the look-ahead stops at a chunk that is not ready, and ``chunk_ready`` resumes it."""
import threading

import torch

from zero_offload.prefetch import Prefetcher
from zero_offload.store import ChunkStore, PayloadSpec, Residency, StoreConfig, Tier


def store_with(n=6, gpu_chunks=3):
    s = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": gpu_chunks * 4096, "cpu": 1 << 24}))
    for c in range(n):
        s.add_chunk({"params": PayloadSpec(1024, torch.float32, Tier.CPU),
                     "other": PayloadSpec(1024, torch.float32, Tier.CPU)})
        s.get(c, "params", "cpu").fill_(c)
    return s


def frozen(pf, order):
    pf.start_pass()
    for c in order:
        with pf.chunk(c):
            pass
    pf.start_pass()


def test_eviction_does_not_wait_for_the_prefetchers_lock():
    store = store_with()
    pf = Prefetcher(store, depth=0)
    frozen(pf, range(6))
    for c in range(3):  # fill the 'gpu' tier with unpinned copies: the next fetch must evict
        store.fetch(c, "other", Tier.GPU)
    done = threading.Event()

    def make_room():
        store.fetch(3, "other", Tier.GPU)  # the policy asks pf.next_use, store lock held
        done.set()

    with pf._lock:  # what use() holds while it calls into the store
        t = threading.Thread(target=make_room, daemon=True)
        t.start()
        finished = done.wait(timeout=10)
    t.join(timeout=10)
    assert finished, "the store's eviction waited for the prefetcher's lock: two threads can deadlock"
    store.synchronize()  # the fetch is asynchronous: LOADING until its copy lands (CI saw that race)
    assert store.state(3, "other", Tier.GPU) is Residency.VALID
    store.close()


def test_ready_holds_the_look_ahead_back_until_chunk_ready():
    store = store_with()
    busy = {2}
    pf = Prefetcher(store, depth=2, ready=lambda cid: cid not in busy)
    frozen(pf, range(6))
    with pf.chunk(0):
        store.synchronize()
        assert store.state(1, "params", Tier.GPU) is Residency.VALID
        assert store.state(2, "params", Tier.GPU) is Residency.ABSENT  # not ready: held back
        busy.clear()
        pf.chunk_ready(2)
        store.synchronize()
        assert store.state(2, "params", Tier.GPU) is Residency.VALID
    store.close()
