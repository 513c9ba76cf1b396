"""ChunkStore.set_budget (a placement plan resizing a tier) and evict(defer=True) (a copy still
read by someone is evicted at its last unpin, not under the reader)."""
import pytest
import torch

from zero_offload.store import BudgetError, ChunkStore, PayloadSpec, Residency, StoreConfig, StoreError, Tier

SPEC = {"params": PayloadSpec(1024, torch.float32, Tier.CPU)}  # 4096 bytes a copy


def store_with(n, gpu=1 << 20):
    s = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": gpu, "cpu": 1 << 20}))
    for c in range(n):
        s.add_chunk(SPEC)
        s.get(c, "params", Tier.CPU).fill_(c)
    return s


def test_set_budget_bounds_the_tier():
    s = store_with(3)
    s.fetch(0, "params", Tier.GPU)
    s.fetch(1, "params", Tier.GPU)
    with pytest.raises(BudgetError, match="holds 8192 bytes"):
        s.set_budget(Tier.GPU, 4096)
    assert s.budgets[Tier.GPU] == 1 << 20  # unchanged by the refusal
    with pytest.raises(ValueError, match="int >= 0"):
        s.set_budget("gpu", -1)
    s.set_budget("gpu", 8192)
    s.fetch(2, "params", Tier.GPU)  # must evict one to fit the new budget
    assert s.bytes(Tier.GPU) <= 8192
    assert torch.equal(s.get(2, "params", Tier.GPU), torch.full((1024,), 2.0))
    s.close()


def test_set_budget_refuses_nvme_once_the_swap_space_exists(tmp_path):
    s = ChunkStore(StoreConfig(device="cpu", budgets={"cpu": 1 << 20, "nvme": 1 << 20}, nvme_dir=tmp_path))
    s.add_chunk({"state": PayloadSpec(1024, torch.float32, Tier.NVME)})
    with pytest.raises(StoreError, match="before the first NVMe copy"):
        s.set_budget(Tier.NVME, 2 << 20)
    s.close()


def test_deferred_evict_waits_for_the_last_unpin():
    s = store_with(1)
    s.fetch(0, "params", Tier.GPU)
    s.get(0, "params", Tier.GPU)
    s.pin(0, "params", Tier.GPU)
    s.pin(0, "params", Tier.GPU)
    with pytest.raises(StoreError, match="defer=True"):
        s.evict(0, "params", Tier.GPU)
    s.evict(0, "params", Tier.GPU, defer=True)
    assert s.state(0, "params", Tier.GPU) is Residency.VALID  # still read by someone
    assert torch.equal(s.get(0, "params", Tier.GPU), torch.zeros(1024))
    s.unpin(0, "params", Tier.GPU)
    assert s.state(0, "params", Tier.GPU) is Residency.VALID
    s.unpin(0, "params", Tier.GPU)
    assert s.state(0, "params", Tier.GPU) is Residency.ABSENT  # the last unpin evicted it
    # a later pin/unpin of a fresh copy does not evict again: the request was used up
    s.fetch(0, "params", Tier.GPU)
    s.get(0, "params", Tier.GPU)
    s.pin(0, "params", Tier.GPU)
    s.unpin(0, "params", Tier.GPU)
    assert s.state(0, "params", Tier.GPU) is Residency.VALID
    with pytest.raises(StoreError, match="home copy"):
        s.pin(0, "params", Tier.CPU)
        s.evict(0, "params", Tier.CPU, defer=True)
    s.close()


def test_deferred_evict_of_an_unpinned_copy_is_immediate():
    s = store_with(1)
    s.fetch(0, "params", Tier.GPU)
    s.evict(0, "params", Tier.GPU, defer=True)
    assert s.state(0, "params", Tier.GPU) is Residency.ABSENT
    s.close()
