"""NVMe tier: home copies on a swap file, NVMe->GPU staged through pinned CPU memory, write-behind,
and the optimizer round trip (read ahead, update on the CPU, write back, evict); discard frees a
chunk in every tier."""
import pytest
import torch

from zero_offload.store import ChunkStore, Hop, PayloadSpec, Residency, StoreConfig, StoreError, Tier

pytestmark = pytest.mark.nvme
MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    s = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 64 * MiB, "cpu": 64 * MiB, "nvme": 256 * MiB},
                               nvme_dir=tmp_path))
    yield s
    s.close()


def test_home_on_nvme_starts_as_zeros(store):
    cid = store.add_chunk({"master": PayloadSpec(3000, torch.float32, Tier.NVME)})
    store.fetch(cid, "master", "cpu")
    assert torch.equal(store.get(cid, "master", "cpu"), torch.zeros(3000))
    assert store.bytes("nvme") == 12288


def test_nvme_to_gpu_stages_through_cpu_and_waits_for_the_read(store):
    # 16 MiB: the NVMe read takes milliseconds, so a CPU->GPU copy that did not wait for it
    # (a RAW hazard) would copy zeros or a mix.
    numel = 4 * MiB
    cid = store.add_chunk({"params": PayloadSpec(numel, torch.float32, Tier.NVME)})
    data = torch.randn(numel)
    store.allocate(cid, "params", "cpu").copy_(data)
    store.flush(cid, "params").wait()
    store.evict(cid, "params", "cpu")
    store.synchronize()
    assert store.state(cid, "params", "cpu") is Residency.ABSENT
    moved0 = dict(store.stats.bytes_moved)
    store.fetch(cid, "params", "gpu")  # one call: nvme->cpu, then cpu->gpu chained behind it
    assert torch.equal(store.get(cid, "params", "gpu"), data)
    hops = {h.value: n - moved0[h] for h, n in store.stats.bytes_moved.items()}
    assert hops == {"nvme->cpu": numel * 4, "cpu->gpu": numel * 4, "gpu->cpu": 0, "cpu->nvme": 0}
    assert store.state(cid, "params", "cpu") is Residency.VALID  # the staging copy is a cache


def test_optimizer_round_trip(store):
    n = 100_000
    names = ("master", "exp_avg", "exp_avg_sq")
    cids = [store.add_chunk({k: PayloadSpec(n, torch.float32, Tier.NVME) for k in names}) for _ in range(4)]
    ref = {(c, k): torch.zeros(n) for c in cids for k in names}
    for step in range(3):
        for c in cids:
            for k in names:
                store.fetch(c, k, "cpu")  # read ahead
        for c in cids:
            for k in names:
                buf = store.get(c, k, "cpu", write=True)
                buf.add_(step + c)
                ref[c, k] += step + c
                store.mark_dirty(c, k, "cpu")
                store.flush(c, k)  # write behind
                store.evict(c, k, "cpu")
    store.synchronize()
    assert store.bytes("cpu") == 0
    for c in cids:
        for k in names:
            store.fetch(c, k, "cpu")
            assert torch.equal(store.get(c, k, "cpu"), ref[c, k])


def test_gpu_copy_flushed_to_nvme_home(store):
    cid = store.add_chunk({"params": PayloadSpec(5000, torch.bfloat16, Tier.NVME)})
    store.allocate(cid, "params", "gpu").fill_(2.5)
    store.evict(cid, "params", "gpu")  # only newest copy: written home (via CPU) first
    store.evict(cid, "params", "cpu")
    store.synchronize()
    assert store.state(cid, "params", "nvme") is Residency.VALID
    store.fetch(cid, "params", "cpu")
    assert torch.equal(store.get(cid, "params", "cpu"), torch.full((5000,), 2.5, dtype=torch.bfloat16))


# ChunkStore.discard: a chunk's copies in every tier, home copies included, are freed once the
# moves on them finish (Engine.close hands values back chunk by chunk with it); the other
# chunks are untouched and any later use of the discarded one raises.

def _chunk(store, n, fill):
    cid = store.add_chunk({"params": PayloadSpec(n, torch.float32, Tier.CPU),
                           "master": PayloadSpec(n, torch.float32, Tier.NVME)})
    store.allocate(cid, "params", "cpu").fill_(fill)
    store.allocate(cid, "master", "cpu").fill_(fill + 0.5)
    store.flush(cid, "master")  # write-behind still in flight when discard runs
    store.fetch(cid, "params", "gpu")
    return cid


def test_discard_frees_every_tier_and_leaves_the_other_chunks(store):
    n = 256 * 1024  # 1 MiB a payload
    a, b = _chunk(store, n, 1.0), _chunk(store, n, 2.0)
    held = {t: store.bytes(t) for t in ("gpu", "cpu", "nvme")}
    assert held == {"gpu": 2 * MiB, "cpu": 4 * MiB, "nvme": 2 * MiB}
    store.discard(a)
    assert {t: store.bytes(t) for t in held} == {"gpu": MiB, "cpu": 2 * MiB, "nvme": MiB}
    # b is whole: its values in every tier, its master read back from its NVMe home
    store.synchronize()
    assert torch.equal(store.get(b, "params", "gpu"), torch.full((n,), 2.0))
    store.evict(b, "master", "cpu")
    store.fetch(b, "master", "cpu")
    assert torch.equal(store.get(b, "master", "cpu"), torch.full((n,), 2.5))
    for use in (lambda: store.get(a, "params", "cpu"), lambda: store.fetch(a, "master", "cpu"),
                lambda: store.discard(a)):
        with pytest.raises(StoreError, match="chunk 0 was discarded"):
            use()
    # a third chunk comes and goes: the NVMe bytes held are b's alone again
    c = _chunk(store, n, 3.0)
    store.discard(c)
    assert store.bytes("nvme") == MiB


def test_discard_refuses_a_chunk_in_use_and_changes_nothing(store):
    n = 1024
    a = _chunk(store, n, 1.0)
    with store.use(a, "params", "cpu"):
        with pytest.raises(StoreError, match="discard: chunk 0 payload 'params' in tier 'cpu' is in use"):
            store.discard(a)
    assert torch.equal(store.get(a, "params", "cpu"), torch.ones(n))
    store.discard(a)
    assert store.bytes("cpu") == 0


def _nvme_home(store, data, *, cached):
    """A chunk whose NVMe home holds ``data``; ``cached``: a valid host cache copy beside it."""
    cid = store.add_chunk({"master": PayloadSpec(data.numel(), data.dtype, Tier.NVME)})
    store.allocate(cid, "master", "cpu").copy_(data)
    store.flush(cid, "master").wait()
    if not cached:
        store.evict(cid, "master", "cpu")
    store.synchronize()
    return cid


@pytest.mark.parametrize("cached", [False, True], ids=["from-disk", "from-cache"])
def test_rehome_from_nvme_into_host_memory_and_back(store, cached):
    """The GPU share frees host memory and NVMe state moves into it (placement.py, [Note:
    measured share]): the newest bytes come along, the slot is freed, the home is host memory
    and serves reads and writes; and back to a slot of the swap file."""
    data = torch.randn(300_000)
    cid = _nvme_home(store, data, cached=cached)
    read0 = store.stats.bytes_moved[Hop.NVME_TO_CPU]
    store.rehome(cid, "master", Tier.CPU)
    assert store.home(cid, "master") is Tier.CPU and store.bytes("nvme") == 0
    assert store.bytes("cpu") == 1_200_128  # the home, 4 KiB-rounded; no cache copy beside it
    assert store.stats.bytes_moved[Hop.NVME_TO_CPU] - read0 == (0 if cached else data.numel() * 4)
    assert torch.equal(store.get(cid, "master", "cpu"), data)
    store.get(cid, "master", "cpu", write=True).add_(1.0)
    store.mark_dirty(cid, "master", "cpu")
    store.rehome(cid, "master", Tier.NVME)
    assert store.home(cid, "master") is Tier.NVME and store.bytes("cpu") == 0
    store.fetch(cid, "master", "cpu")
    assert torch.equal(store.get(cid, "master", "cpu"), data + 1.0)


def test_rehome_writes_a_newer_cache_copy_home_first(store):
    """A written host cache copy of an NVMe home is the newest: its bytes reach the new home."""
    cid = _nvme_home(store, torch.zeros(50_000), cached=True)
    store.get(cid, "master", "cpu", write=True).fill_(7.0)
    store.mark_dirty(cid, "master", "cpu")
    store.rehome(cid, "master", Tier.CPU)
    assert torch.equal(store.get(cid, "master", "cpu"), torch.full((50_000,), 7.0))


def test_a_failed_read_leaves_the_nvme_home_whole(store, monkeypatch):
    data = torch.randn(40_000)
    cid = _nvme_home(store, data, cached=False)
    space = store._swap_space()

    def broken(slot, tensor):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(space, "read", broken)
    with pytest.raises(OSError, match="Input/output"):
        store.rehome(cid, "master", Tier.CPU)
    monkeypatch.undo()
    assert store.home(cid, "master") is Tier.NVME and store.bytes("cpu") == 0
    store.fetch(cid, "master", "cpu")
    assert torch.equal(store.get(cid, "master", "cpu"), data)


def test_rehome_between_the_device_and_nvme_goes_through_host_memory(store):
    data = torch.randn(30_000)
    cid = _nvme_home(store, data, cached=False)
    store.rehome(cid, "master", Tier.GPU)
    assert store.home(cid, "master") is Tier.GPU and store.bytes("nvme") == 0 and store.bytes("cpu") == 0
    assert torch.equal(store.get(cid, "master", "gpu"), data)
    store.rehome(cid, "master", Tier.NVME)
    assert store.home(cid, "master") is Tier.NVME and store.bytes("gpu") == 0
    store.fetch(cid, "master", "cpu")
    assert torch.equal(store.get(cid, "master", "cpu"), data)


def test_a_failed_second_hop_moves_the_payload_back(store, monkeypatch):
    data = torch.randn(30_000)
    cid = _nvme_home(store, data, cached=False)
    store.rehome(cid, "master", Tier.GPU)
    space = store._swap_space()

    def full(nbytes):
        raise RuntimeError("swap space full: a slot of 122880 bytes does not fit")

    monkeypatch.setattr(space, "alloc", full)
    with pytest.raises(RuntimeError, match="swap space full"):
        store.rehome(cid, "master", Tier.NVME)
    monkeypatch.undo()
    assert store.home(cid, "master") is Tier.GPU and store.bytes("cpu") == 0
    assert torch.equal(store.get(cid, "master", "gpu"), data)
