"""Residency state machine: the legal-transition table is enforced, and misuse raises."""
import pytest
import torch

from zero_offload.store import (ChunkStore, IllegalTransition, PayloadSpec, Residency, StoreConfig, StoreError,
                                Tier, _LEGAL)

SPEC = {"params": PayloadSpec(1024, torch.float32, Tier.CPU)}


@pytest.fixture
def store():
    s = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 20, "cpu": 1 << 20}))
    s.add_chunk(SPEC)
    yield s
    s.close()


def _copy(store, tier):
    return store._payload(0, "params").copies[tier]


def test_every_illegal_transition_raises(store):
    copy = _copy(store, Tier.GPU)
    for src in Residency:
        for dst in Residency:
            copy.state = src
            if dst in _LEGAL[src]:
                continue
            with pytest.raises(IllegalTransition, match=f"{src.name} -> {dst.name}"):
                copy.to(dst, store)
            assert copy.state is src  # nothing changed
    copy.state = Residency.ABSENT


def test_life_cycle_through_the_states(store):
    assert store.state(0, "params", "cpu") is Residency.VALID
    assert store.state(0, "params", "gpu") is Residency.ABSENT
    h = store.fetch(0, "params", "gpu")
    assert store._payload(0, "params").copies[Tier.GPU].state in (Residency.LOADING, Residency.VALID)
    h.wait()
    assert store.state(0, "params", "gpu") is Residency.VALID
    store.get(0, "params", "cpu").fill_(3)
    store.mark_dirty(0, "params", "cpu")
    assert store.state(0, "params", "gpu") is Residency.STALE
    store.fetch(0, "params", "gpu")
    assert torch.equal(store.get(0, "params", "gpu"), torch.full((1024,), 3.0))
    store.evict(0, "params", "gpu")
    store.synchronize()
    assert store.state(0, "params", "gpu") is Residency.ABSENT


def test_writing_a_stale_copy_raises(store):
    store.fetch(0, "params", "gpu").wait()
    store.mark_dirty(0, "params", "cpu")
    with pytest.raises(StoreError, match="STALE.*allocate"):
        store.mark_dirty(0, "params", "gpu")


def test_get_of_absent_copy_says_fetch_first(store):
    with pytest.raises(StoreError, match=r"ABSENT.*fetch\(cid, name, 'gpu'\)"):
        store.get(0, "params", "gpu")


def test_home_copy_cannot_be_evicted(store):
    with pytest.raises(StoreError, match="home copy"):
        store.evict(0, "params", "cpu")
    assert store.state(0, "params", "cpu") is Residency.VALID


def test_pinned_copy_cannot_be_evicted(store):
    with store.use(0, "params", "gpu") as t:
        assert t.numel() == 1024
        with pytest.raises(StoreError, match="in use"):
            store.evict(0, "params", "gpu")
    store.evict(0, "params", "gpu")


def test_unpin_without_pin_raises(store):
    store.fetch(0, "params", "gpu").wait()
    with pytest.raises(StoreError, match="not pinned"):
        store.unpin(0, "params", "gpu")


def test_allocate_makes_newest_and_others_stale(store):
    buf = store.allocate(0, "params", "gpu")
    buf.fill_(7)
    assert store.state(0, "params", "cpu") is Residency.STALE
    store.flush(0, "params").wait()
    assert torch.equal(store.get(0, "params", "cpu"), torch.full((1024,), 7.0))


def test_evicting_the_only_newest_copy_writes_it_home(store):
    store.allocate(0, "params", "gpu").fill_(5)
    store.evict(0, "params", "gpu")
    assert torch.equal(store.get(0, "params", "cpu"), torch.full((1024,), 5.0))
    store.synchronize()
    assert store.state(0, "params", "gpu") is Residency.ABSENT
    assert store.bytes("gpu") == 0
