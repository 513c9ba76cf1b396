"""The store's park ([Note: parking] in runtime/store.py): the GPU tier is emptied (its caches
dropped, newest bytes written home first; the payloads homed there re-homed to host memory or
NVMe) and refilled by ``unpark`` with the same bytes; meanwhile the GPU tier refuses every call,
the other tiers serve the parked payloads (a write lands in the parked home and comes back), and
the budgets lent for the park are given back. NVMe parking stages a few payloads at a time, in a
swap space of its own that ``unpark`` (or ``close``) removes."""
import os

import pytest
import torch

from zero_offload.runtime.store import ChunkStore, PayloadSpec, Residency, StoreConfig, StoreError, Tier

N = 1000


@pytest.fixture(params=["cpu", "nvme"])
def parked(request, tmp_path):
    """A store with three chunks whose payload "a" is homed on the GPU tier (values i + arange)
    and "b" on the CPU (a copy fetched to the GPU, then written there: the only newest bytes)."""
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 20, "cpu": 1 << 20, "nvme": 1 << 20},
                                   nvme_dir=str(tmp_path)))
    for i in range(3):
        cid = store.add_chunk({"a": PayloadSpec(N, torch.float32, "gpu"),
                               "b": PayloadSpec(N // 2, torch.bfloat16, "cpu")})
        store.get(cid, "a", "gpu", write=True).copy_(torch.arange(N) + i)
        store.mark_dirty(cid, "a", "gpu")
        store.fetch(cid, "b", "gpu")
        store.get(cid, "b", "gpu", write=True).fill_(i)
        store.mark_dirty(cid, "b", "gpu")
    yield store, Tier.of(request.param)
    store.close()


def test_a_round_trip_keeps_every_byte_and_gives_the_budget_back(parked, tmp_path):
    store, to = parked
    budgets, host = dict(store.budgets), store.bytes(Tier.CPU)
    assert store.gpu_home_bytes() == 3 * 4096
    assert store.park(to) == 3 * 4096
    assert store.parked is to and store.home(0, "a") is to and store.payload_spec(0, "a").home is Tier.GPU
    assert store.bytes(Tier.GPU) == 0
    assert store.bytes(to) == (host if to is Tier.CPU else 0) + 3 * 4096
    for i in range(3):  # the cache on the GPU held the newest "b": written home before it went
        assert torch.equal(store.get(i, "b", "cpu"), torch.full((N // 2,), float(i), dtype=torch.bfloat16))
    assert store.unpark() == 3 * 4096
    assert store.parked is None and store.home(0, "a") is Tier.GPU and store.budgets == budgets
    assert store.bytes(Tier.CPU) == host and store.bytes(Tier.NVME) == 0
    for i in range(3):
        assert torch.equal(store.get(i, "a", "gpu"), torch.arange(N) + i)
        assert store.state(i, "b", "gpu") is Residency.ABSENT  # caches are not brought back
    assert not [n for n in os.listdir(tmp_path) if n.startswith("zero_offload-")]  # the parking space went


def test_while_parked_the_gpu_tier_refuses_and_the_others_serve(parked):
    store, to = parked
    store.park(to)
    for call in (lambda: store.fetch(0, "a", "gpu"), lambda: store.get(0, "b", "gpu"),
                 lambda: store.state(1, "a", "gpu"), lambda: store.evict(2, "b", "gpu")):
        with pytest.raises(StoreError, match=f"in tier 'gpu': the GPU tier is parked on {to.value} "
                                             r"\(ChunkStore.park\); call unpark\(\) before using it"):
            call()
    with pytest.raises(StoreError, match="add_chunk: the GPU tier is parked"):
        store.add_chunk({"a": PayloadSpec(N, torch.float32, "gpu")})
    with pytest.raises(StoreError, match=f"park: the GPU tier is parked on {to.value} already"):
        store.park(to)
    with store.use(1, "a", "cpu", write=True) as buf:  # a write while parked lands in the parked home
        assert torch.equal(buf, torch.arange(N) + 1.0)
        buf.fill_(-1)
    store.mark_dirty(1, "a", "cpu")
    if to is Tier.NVME:
        store.evict(1, "a", "cpu")  # written home (to the parking space) first
    store.unpark()
    assert torch.equal(store.get(1, "a", "gpu"), torch.full((N,), -1.0))


def test_refusals_change_nothing():
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 20, "cpu": 1 << 20}))
    try:
        store.add_chunk({"a": PayloadSpec(N, torch.float32, "gpu")})
        with pytest.raises(StoreError, match="unpark: the store is not parked"):
            store.unpark()
        with pytest.raises(StoreError, match="this store has no NVMe tier"):
            store.park("nvme")
        with pytest.raises(ValueError, match=r"park\(to=...\) takes 'cpu' or 'nvme'"):
            store.park("gpu")
        store.pin(0, "a", "gpu")
        with pytest.raises(StoreError, match=r"park: chunk 0 payload 'a' in tier 'gpu' is in use \(1 pin"):
            store.park("cpu")
        assert store.parked is None and store.bytes(Tier.GPU) == 4096
        store.unpin(0, "a", "gpu")
        store.park("cpu")
        store.unpark()
    finally:
        store.close()


def test_nvme_parking_stages_a_few_payloads_at_a_time(tmp_path, monkeypatch):
    from zero_offload.runtime import store as store_mod
    monkeypatch.setattr(store_mod, "_PARK_BATCH", 2)
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 20, "cpu": 1 << 20, "nvme": 0},
                                   nvme_dir=str(tmp_path)))
    try:
        for i in range(6):
            store.add_chunk({"a": PayloadSpec(N, torch.float32, "gpu")})
            store.get(i, "a", "gpu", write=True).fill_(i)
            store.mark_dirty(i, "a", "gpu")
        store.reset_peak()
        store.park("nvme")
        assert store.peak_bytes(Tier.CPU) <= 2 * 4096  # staging: one batch of payloads at a time
        assert store.bytes(Tier.CPU) == 0 and store.bytes(Tier.NVME) == 6 * 4096
        assert [n for n in os.listdir(tmp_path) if n.startswith("zero_offload-")]
        store.unpark()
        assert not [n for n in os.listdir(tmp_path) if n.startswith("zero_offload-")]
        for i in range(6):
            assert torch.equal(store.get(i, "a", "gpu"), torch.full((N,), float(i)))
        store.park("nvme")
    finally:
        store.close()  # closing while parked removes the parking space too
    assert not [n for n in os.listdir(tmp_path) if n.startswith("zero_offload-")]


def test_a_kept_buffer_waits_for_the_next_park_through_host_staging():
    """``unpark(keep=True)`` keeps each parking buffer for the next park; a host copy made in
    between (a CPU update's staging of a GPU-homed payload) takes pool memory, not the kept
    buffer (which its eviction would free, and the next park would pin fresh memory)."""
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 20, "cpu": 1 << 20}))
    try:
        cid = store.add_chunk({"a": PayloadSpec(N, torch.float32, "gpu")})
        store.park("cpu")
        kept = store.get(cid, "a", "cpu")  # (held here: its memory cannot be handed out again)
        store.unpark(keep=True)
        assert store.spare_bytes() == 4096
        staging = store.allocate(cid, "a", "cpu")  # a host copy of the GPU-homed payload
        staging.fill_(3.0)
        store.mark_dirty(cid, "a", "cpu")
        store.evict(cid, "a", "cpu")
        store.synchronize()
        assert staging.data_ptr() != kept.data_ptr() and store.spare_bytes() == 4096
        store.park("cpu")
        assert store.get(cid, "a", "cpu").data_ptr() == kept.data_ptr()  # the kept buffer again
        assert torch.equal(store.get(cid, "a", "cpu"), torch.full((N,), 3.0))
        store.unpark()
    finally:
        store.close()
