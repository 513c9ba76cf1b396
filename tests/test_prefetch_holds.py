"""The prefetcher's holds ([Note: holds] in prefetch.py): the one owner of "is chunk c on the
device for its consumer". A fake consumer records what it is asked to map and unmap: chunks
nobody holds stay parked up to ``park`` (oldest let go first), a chunk let go while the consumer
will use it again keeps its copy within ``keep_limit`` (dropped at ``release_idle``), a ``busy``
chunk waits for ``settle``, and a move the state table does not list raises."""
import pytest
import torch

from zero_offload.runtime.prefetch import Consumer, Prefetcher, Use
from zero_offload.runtime.store import (ChunkStore, IllegalTransition, PayloadSpec, Residency,
                                        StoreConfig, Tier)

NBYTES = 4096


class FakeConsumer:
    """Maps a chunk by pinning it through ``use`` (as the engine does); logs every call."""

    def __init__(self):
        self.pf = None
        self.log = []
        self.mapped = {}
        self.busy = set()
        self.reuse = False
        self.fail = set()

    def consumer(self) -> Consumer:
        return Consumer(map=self.map, unmap=self.unmap, busy=lambda cid: cid in self.busy,
                        reuse=lambda: self.reuse)

    def map(self, cid):
        if cid in self.fail:
            raise RuntimeError(f"map {cid} failed")
        self.mapped[cid] = self.pf.use(cid)["params"]
        self.log.append(("map", cid))

    def unmap(self, cid):
        del self.mapped[cid]
        self.log.append(("unmap", cid))


def setup(n=6, *, park=2, keep_limit=0, gpu_chunks=6):
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": gpu_chunks * NBYTES, "cpu": 1 << 24}))
    for c in range(n):
        store.add_chunk({"params": PayloadSpec(NBYTES // 4, torch.float32, Tier.CPU)})
        store.get(c, "params", "cpu").fill_(c)
    fake = FakeConsumer()
    fake.pf = pf = Prefetcher(store, depth=0, consumer=fake.consumer(), park=park, keep_limit=keep_limit)
    return store, pf, fake


def on_gpu(store, cid) -> bool:
    return store.state(cid, "params", Tier.GPU) is not Residency.ABSENT


def test_nested_holds_map_once_and_park_until_the_list_overflows():
    store, pf, fake = setup(park=2)
    assert pf.hold(0) is True and pf.hold(0) is False  # mapped by the first hold only
    assert fake.mapped[0][0].item() == 0
    pf.unhold(0)
    assert pf.status(0) is Use.HELD
    pf.unhold(0)
    assert pf.status(0) is Use.PARKED and 0 in fake.mapped  # parked: still mapped and pinned
    for c in (1, 2):
        pf.hold(c)
        pf.unhold(c)
    # Three parked chunks, room for two: the oldest (0) was let go, its copy dropped.
    assert [pf.status(c) for c in range(3)] == [Use.IDLE, Use.PARKED, Use.PARKED]
    assert fake.log == [("map", 0), ("map", 1), ("map", 2), ("unmap", 0)]
    assert not on_gpu(store, 0) and on_gpu(store, 1) and on_gpu(store, 2)
    assert pf.hold(1) is False and pf.status(1) is Use.HELD  # a parked chunk is held again as is
    pf.unhold(1)
    pf.release_idle()
    assert all(pf.status(c) is Use.IDLE for c in range(3)) and not fake.mapped
    assert not any(on_gpu(store, c) for c in range(3))
    store.close()


@pytest.mark.parametrize("room", [True, False])
def test_a_copy_let_go_for_reuse_is_kept_within_the_limit_until_idle(room):
    store, pf, fake = setup(park=0, keep_limit=6 * NBYTES if room else NBYTES // 2)
    fake.reuse = True
    pf.hold(0)
    pf.unhold(0)  # park=0: let go at once
    assert pf.status(0) is (Use.KEPT if room else Use.IDLE) and 0 not in fake.mapped
    assert on_gpu(store, 0) is room  # kept: unpinned, the copy stays valid
    assert pf.hold(0) is True and pf.status(0) is Use.HELD  # mapped again (a hit when kept)
    pf.unhold(0)
    fake.reuse = False
    pf.hold(1)
    pf.unhold(1)  # not reused: dropped
    assert pf.status(1) is Use.IDLE and not on_gpu(store, 1)
    pf.release_idle()
    assert pf.status(0) is Use.IDLE and not on_gpu(store, 0)  # no kept copy outlives the pass
    store.close()


def test_a_busy_chunk_waits_for_settle():
    store, pf, fake = setup(park=0)
    fake.busy.add(0)
    pf.hold(0)
    pf.unhold(0)
    assert pf.status(0) is Use.UNHELD and 0 in fake.mapped  # nobody holds it, still mapped
    pf.settle(0)
    assert pf.status(0) is Use.UNHELD  # still busy
    fake.busy.clear()
    pf.settle(0)
    assert pf.status(0) is Use.IDLE and 0 not in fake.mapped
    pf.settle(0)  # no-op once let go
    store.close()


def test_forget_holds_then_release_idle_lets_everything_go():
    store, pf, fake = setup(park=2)
    for c in (0, 1):
        pf.hold(c)
    pf.hold(0)
    pf.forget_holds()  # after an error in the consumer's pass
    assert pf.status(0) is Use.UNHELD and pf.status(1) is Use.UNHELD
    pf.release_idle()
    assert not fake.mapped and all(pf.status(c) is Use.IDLE for c in (0, 1))
    assert not on_gpu(store, 0) and not on_gpu(store, 1)  # every pin let go
    store.close()


def test_a_failed_map_changes_nothing():
    store, pf, fake = setup()
    fake.fail.add(3)
    with pytest.raises(RuntimeError, match="map 3 failed"):
        pf.hold(3)
    assert pf.status(3) is Use.IDLE and 3 not in fake.mapped
    fake.fail.clear()
    assert pf.hold(3) is True and pf.status(3) is Use.HELD
    store.close()


def test_moves_the_table_does_not_list_raise():
    store, pf, fake = setup()
    with pytest.raises(IllegalTransition, match="unhold: chunk 2 is IDLE, not held"):
        pf.unhold(2)
    pf.hold(2)
    pf.unhold(2)
    with pytest.raises(IllegalTransition, match="chunk 2 is PARKED"):
        pf.unhold(2)  # one unhold too many
    plain = Prefetcher(store, depth=0)
    with pytest.raises(TypeError, match="consumer"):
        plain.hold(0)
    with pytest.raises(ValueError, match="park must be an int >= 0"):
        Prefetcher(store, depth=0, park=-1)
    store.close()
