"""``ChunkStore.allocate(..., pin=True)`` and ``pin``: a copy that is not home is evictable the
moment it is VALID, so a caller that writes into a freshly allocated buffer takes it pinned at
once; ``pin`` refuses a copy whose memory is about to go (ABSENT, EVICTING)."""
import pytest
import torch

from zero_offload.store import BudgetError, ChunkStore, PayloadSpec, Residency, StoreConfig, StoreError, Tier

N = 1000


def test_allocate_and_pin_at_once_keeps_the_copy_from_a_concurrent_eviction():
    """``allocate(..., pin=True)``: the new copy (not home: evictable the moment it is VALID) is
    pinned under the same lock, so a fetch making room cannot evict it before the caller pins it
    (the worker's CPU copy of NVMe-homed params was evicted that way under load, and the update
    then wrote into memory being freed)."""
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 4096, "cpu": 1 << 20}))
    try:
        for _ in range(2):
            store.add_chunk({"params": PayloadSpec(N, torch.float32, Tier.CPU)})
        store.allocate(0, "params", Tier.GPU, pin=True).fill_(1)
        store.mark_dirty(0, "params", Tier.GPU)
        with pytest.raises(BudgetError):
            store.fetch(1, "params", Tier.GPU)  # nothing evictable: the pinned copy stays
        assert store.state(0, "params", Tier.GPU) is Residency.VALID
        store.unpin(0, "params", Tier.GPU)
        store.fetch(1, "params", Tier.GPU).wait()  # now it is evicted (written home first)
        assert store.state(0, "params", Tier.GPU) is Residency.ABSENT
        assert torch.equal(store.get(0, "params", Tier.CPU), torch.ones(N))
    finally:
        store.close()


def test_pin_refuses_an_absent_copy():
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 20, "cpu": 1 << 20}))
    try:
        store.add_chunk({"params": PayloadSpec(N, torch.float32, Tier.CPU)})
        with pytest.raises(StoreError, match=r"ABSENT.*allocate\(\.\.\., pin=True\)"):
            store.pin(0, "params", Tier.GPU)
    finally:
        store.close()
