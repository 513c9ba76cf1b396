"""Bad input and impossible requests raise clear errors before any state changes."""
import pytest
import torch

from zero_offload.store import BudgetError, ChunkStore, PayloadSpec, StoreConfig, StoreError, Tier


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="budgets\\['cpu'\\].*int >= 0, or 'auto'"):
        StoreConfig(device="cpu", budgets={"cpu": -1})
    with pytest.raises(ValueError, match="unknown tier 'disk'"):
        StoreConfig(device="cpu", budgets={"disk": 10})
    with pytest.raises(ValueError, match="io_block_size"):
        StoreConfig(device="cpu", io_block_size=1000)
    with pytest.raises(ValueError, match="copy_threads"):
        StoreConfig(device="cpu", copy_threads=0)
    with pytest.raises(ValueError, match="not a torch device"):
        StoreConfig(device="gpu0")
    with pytest.raises(TypeError):
        StoreConfig("cpu")  # kw-only
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cpu'"):
            StoreConfig(device="cuda")


def test_config_is_frozen():
    cfg = StoreConfig(device="cpu")
    with pytest.raises(Exception):
        cfg.io_threads = 8


def test_payload_spec_checks():
    with pytest.raises(ValueError, match="positive int"):
        PayloadSpec(0, torch.float32, Tier.CPU)
    with pytest.raises(TypeError, match="torch.dtype"):
        PayloadSpec(10, "float32", Tier.CPU)
    with pytest.raises(ValueError, match="unknown tier"):
        PayloadSpec(10, torch.float32, "ram")
    assert PayloadSpec(10, torch.float32, "nvme").home is Tier.NVME


def test_budget_too_small_for_one_chunk_names_budget_and_fix():
    store = ChunkStore(StoreConfig(device="cpu", budgets={"cpu": 8192, "gpu": 8192}))
    with pytest.raises(BudgetError, match=r"needs 16384 bytes in tier 'cpu'.*budget of 8192.*budgets\['cpu'\]"):
        store.add_chunk({"master": PayloadSpec(4096, torch.float32, Tier.CPU)})
    assert store.num_chunks == 0 and store.bytes("cpu") == 0  # nothing half-added
    store.add_chunk({"params": PayloadSpec(1024, torch.float32, Tier.CPU)})
    store.add_chunk({"params": PayloadSpec(1024, torch.float32, Tier.CPU)})
    with pytest.raises(BudgetError, match="nothing more can be evicted"):
        store.add_chunk({"params": PayloadSpec(1024, torch.float32, Tier.CPU)})
    store.close()


def test_fetch_raises_when_everything_in_the_tier_is_in_use():
    store = ChunkStore(StoreConfig(device="cpu", budgets={"cpu": 1 << 20, "gpu": 8192}))
    for _ in range(3):
        store.add_chunk({"params": PayloadSpec(1024, torch.float32, Tier.CPU)})
    store.fetch(0, "params", "gpu")
    store.fetch(1, "params", "gpu")
    store.pin(0, "params", "gpu")
    store.pin(1, "params", "gpu")
    with pytest.raises(BudgetError, match=r"tier 'gpu'.*8192.*lower the prefetch depth"):
        store.fetch(2, "params", "gpu")
    store.unpin(1, "params", "gpu")
    store.fetch(2, "params", "gpu").wait()  # now chunk 1's copy is evicted for it
    assert store.bytes("gpu") <= 8192
    store.close()


def test_lookup_errors_name_what_exists():
    store = ChunkStore(StoreConfig(device="cpu", budgets={"cpu": 1 << 20, "gpu": 1 << 20}))
    store.add_chunk({"params": PayloadSpec(16, torch.float32, Tier.CPU)})
    with pytest.raises(KeyError, match="chunks 0..0"):
        store.fetch(5, "params", "gpu")
    with pytest.raises(KeyError, match=r"no payload 'grads'.*\['params'\]"):
        store.fetch(0, "grads", "gpu")
    with pytest.raises(StoreError, match="nvme_dir"):
        store.fetch(0, "params", "nvme")
    with pytest.raises(StoreError, match="nvme_dir"):
        store.add_chunk({"m": PayloadSpec(16, torch.float32, Tier.NVME)})
    with pytest.raises(StoreError, match="NVMe has none"):
        store.allocate(0, "params", "nvme")
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.fetch(0, "params", "gpu")
