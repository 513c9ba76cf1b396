"""ChunkStore.discard: a chunk's copies in every tier, home copies included, are freed once the
moves on them finish (``Engine.close`` hands values back chunk by chunk with it); the other
chunks are untouched and any later use of the discarded one raises."""
import pytest
import torch

from zero_offload.store import ChunkStore, PayloadSpec, StoreConfig, StoreError, Tier

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    s = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 64 * MiB, "cpu": 64 * MiB, "nvme": 64 * MiB},
                               nvme_dir=tmp_path))
    yield s
    s.close()


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
    # the freed swap slot is taken again by a new chunk (the NVMe budget would not fit three)
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
