"""Fresh memory is zeros without a fill: a new chunk's CPU homes are not written (the pages come
as zeros on first use), ``allocate(zero=True)`` fills only what may hold old bytes, and an NVMe
home on an extent of the swap file never written reads as zeros without a write of zeros
(``SwapSpace.claim_zero``), while a reused extent is written with zeros as before."""
import pytest
import torch

from zero_offload.runtime import swap_io
from zero_offload.runtime.swap_io import SwapSpace
from zero_offload.store import ChunkStore, PayloadSpec, StoreConfig, Tier

MiB = 1 << 20


def test_allocate_zero_gives_zeros_fresh_or_reused():
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 64 * MiB, "cpu": 64 * MiB}))
    try:
        cid = store.add_chunk({"master": PayloadSpec(5000, torch.float32, Tier.CPU),
                               "params": PayloadSpec(5000, torch.float32, Tier.GPU)})
        home = store.allocate(cid, "master", "cpu", zero=True)  # fresh: nothing to fill
        assert not home.any()
        home.fill_(7.0)
        store.mark_dirty(cid, "master", "cpu")
        assert not store.allocate(cid, "master", "cpu", zero=True).any()  # written since: filled
        store.get(cid, "master", "cpu", write=True).fill_(3.0)
        assert not store.allocate(cid, "master", "cpu", zero=True).any()
        staging = store.allocate(cid, "params", "cpu")  # a pool buffer (not the home)
        staging.fill_(5.0)
        store.mark_dirty(cid, "params", "cpu")
        store.evict(cid, "params", "cpu")
        store.synchronize()
        assert torch.equal(store.get(cid, "params", "gpu"), torch.full((5000,), 5.0))
        again = store.allocate(cid, "params", "cpu", zero=True)  # the pool's memory again
        assert not again.any()
    finally:
        store.close()


def test_claim_zero_only_for_extents_never_written(tmp_path):
    with SwapSpace(tmp_path, capacity_bytes=64 * MiB) as space:
        a = space.alloc(MiB)
        assert space.claim_zero(a)
        buf = swap_io.aligned_empty(MiB, pin=False)
        buf.fill_(9)
        space.read(a, buf).wait()  # allowed: it reads as zeros
        assert not buf.any()
        b = space.alloc(MiB)
        data = swap_io.aligned_empty(MiB, pin=False)
        data.fill_(1)
        space.write(b, data).wait()
        assert not space.claim_zero(b)  # written
        space.free(b)
        c = space.alloc(MiB)  # b's extent again: old bytes
        assert c.offset == b.offset and not space.claim_zero(c)
        with pytest.raises(ValueError, match="never written since alloc"):
            space.read(c, buf)
        d = space.alloc(MiB)  # past every write: zeros
        assert d.offset > b.offset and space.claim_zero(d)


@pytest.mark.nvme
def test_nvme_homes_of_new_chunks_need_no_zero_writes(tmp_path, monkeypatch):
    writes = []
    real = SwapSpace.write

    def counting(self, slot, tensor):
        writes.append(slot.offset)
        return real(self, slot, tensor)

    monkeypatch.setattr(SwapSpace, "write", counting)
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 64 * MiB, "cpu": 64 * MiB, "nvme": 256 * MiB},
                                   nvme_dir=tmp_path))
    try:
        names = ("master", "exp_avg")
        cids = [store.add_chunk({k: PayloadSpec(30_000, torch.float32, Tier.NVME) for k in names}) for _ in range(3)]
        assert writes == []
        store.fetch(cids[1], "exp_avg", "cpu")
        assert not store.get(cids[1], "exp_avg", "cpu").any()
        store.allocate(cids[0], "master", "cpu").fill_(2.0)  # written, then its chunk discarded:
        store.mark_dirty(cids[0], "master", "cpu")
        store.flush(cids[0], "master").wait()
        assert len(writes) == 1
        store.synchronize()
        store.discard(cids[0])
        cid = store.add_chunk({k: PayloadSpec(30_000, torch.float32, Tier.NVME) for k in names})
        assert len(writes) == 2  # the new chunk's master reuses the written extent: zeros written
        store.fetch(cid, "master", "cpu")
        store.fetch(cid, "exp_avg", "cpu")
        assert not store.get(cid, "master", "cpu").any() and not store.get(cid, "exp_avg", "cpu").any()
    finally:
        store.close()
