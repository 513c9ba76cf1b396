"""Transient payloads ([Note: transient payloads] in runtime/store.py): homed on the CPU, a
transient payload holds host memory only from a write until ``release``, in a slot of the
store's bounded window; homed on the GPU, device memory over the same span; the bytes round-trip
exactly, slots are reused, a full window raises (never waits), and misuse raises before
anything changes."""
import pytest
import torch

from zero_offload.store import ChunkStore, PayloadSpec, Residency, StoreConfig, StoreError, Tier
from zero_offload.runtime.pinned_pool import SlotWindow

N = 1000  # elements: not a multiple of 4 KiB in bytes


def _store(slots=2, chunks=3, numel=N):
    s = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 22, "cpu": 1 << 22}, window_slots=slots))
    for _ in range(chunks):
        s.add_chunk({"master": PayloadSpec(numel, torch.float32, Tier.CPU),
                     "grads": PayloadSpec(numel, torch.bfloat16, Tier.CPU, transient=True)})
    return s


def _send_down(store, cid, values):
    """What the chunk group does: the device copy written, then flushed into the window."""
    store.allocate(cid, "grads", Tier.GPU).copy_(values)
    store.mark_dirty(cid, "grads", Tier.GPU)
    store.flush(cid, "grads", Tier.CPU).wait()
    store.evict(cid, "grads", Tier.GPU)


def test_no_host_memory_until_written_and_after_release():
    store = _store()
    try:
        assert store.windowed(0, "grads") and not store.windowed(0, "master")
        master = 3 * 4096  # 4000 bytes rounded up, per chunk
        assert store.bytes(Tier.CPU) == master  # no grads bytes anywhere
        assert store.state(0, "grads", Tier.CPU) is Residency.ABSENT
        values = torch.randn(N).to(torch.bfloat16)
        _send_down(store, 1, values)
        assert torch.equal(store.get(1, "grads", Tier.CPU), values)
        assert store.bytes(Tier.CPU) == master + 4096 and store.window.taken == 1
        store.release(1, "grads")
        assert store.window.taken == 0 and store.bytes(Tier.CPU) == master
        assert store.bytes(Tier.GPU) == 0
        for tier in (Tier.GPU, Tier.CPU):
            assert store.state(1, "grads", tier) is Residency.ABSENT
        with pytest.raises(StoreError, match="transient payload holds no bytes"):
            store.fetch(1, "grads", Tier.GPU)
    finally:
        store.close()


def test_slots_are_reused_and_a_full_window_raises_before_any_change():
    store = _store(slots=2)
    try:
        for cid in (0, 1):
            _send_down(store, cid, torch.full((N,), float(cid + 1), dtype=torch.bfloat16))
        assert store.window.taken == 2 and store.window.made == 2
        store.allocate(2, "grads", Tier.GPU).fill_(7)
        store.mark_dirty(2, "grads", Tier.GPU)
        with pytest.raises(StoreError, match=r"window's 2 slot\(s\) all hold bytes.*release"):
            store.flush(2, "grads", Tier.CPU)
        assert store.state(2, "grads", Tier.CPU) is Residency.ABSENT  # nothing changed
        assert store.state(2, "grads", Tier.GPU) is Residency.VALID
        store.release(0, "grads")
        store.flush(2, "grads", Tier.CPU).wait()
        assert torch.equal(store.get(2, "grads", Tier.CPU), torch.full((N,), 7.0, dtype=torch.bfloat16))
        assert torch.equal(store.get(1, "grads", Tier.CPU), torch.full((N,), 2.0, dtype=torch.bfloat16))
        assert store.window.made == 2  # the released slot was taken again, no new memory
    finally:
        store.close()


def test_allocate_writes_straight_into_a_slot():
    store = _store(slots=1)
    try:
        store.allocate(0, "grads", Tier.CPU).fill_(5)
        store.mark_dirty(0, "grads", Tier.CPU)
        assert store.window.taken == 1
        store.fetch(0, "grads", Tier.GPU).wait()
        assert torch.equal(store.get(0, "grads", Tier.GPU), torch.full((N,), 5.0, dtype=torch.bfloat16))
        store.release(0, "grads")
        assert store.window.taken == 0 and store.state(0, "grads", Tier.GPU) is Residency.ABSENT
    finally:
        store.close()


def test_release_refuses_misuse():
    store = _store()
    try:
        with pytest.raises(StoreError, match="not a transient payload"):
            store.release(0, "master")
        _send_down(store, 0, torch.ones(N, dtype=torch.bfloat16))
        store.pin(0, "grads", Tier.CPU)
        with pytest.raises(StoreError, match="in use"):
            store.release(0, "grads")
        assert store.window.taken == 1  # nothing changed
        store.unpin(0, "grads", Tier.CPU)
        store.release(0, "grads")
        store.release(0, "grads")  # nothing held: a no-op
        assert store.window.taken == 0
    finally:
        store.close()


def test_a_store_without_a_window_refuses_a_transient_host_payload():
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 20, "cpu": 1 << 20}))
    try:
        with pytest.raises(StoreError, match="transient.*no window.*window_slots"):
            store.add_chunk({"grads": PayloadSpec(N, torch.float32, Tier.CPU, transient=True)})
        assert store.num_chunks == 0
        store.add_chunk({"grads": PayloadSpec(N, torch.float32, Tier.GPU, transient=True)})  # no window needed
        assert store.bytes(Tier.GPU) == 0 and not store.windowed(0, "grads")
    finally:
        store.close()


def test_a_transient_gpu_home_holds_memory_only_from_a_write_to_its_release():
    """The GPU share's grads: ABSENT until allocated, counted while held (the peak sees them),
    freed by ``release``; reading them then raises; a park leaves them out."""
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 22, "cpu": 1 << 22}))
    try:
        for _ in range(2):
            store.add_chunk({"master": PayloadSpec(N, torch.float32, Tier.GPU),
                             "grads": PayloadSpec(N, torch.bfloat16, Tier.GPU, transient=True)})
        home = store.bytes(Tier.GPU)
        assert home == 2 * 4096 and store.state(0, "grads", Tier.GPU) is Residency.ABSENT
        store.allocate(0, "grads", Tier.GPU, pin=True).fill_(3)
        assert store.bytes(Tier.GPU) == home + 4096 and store.peak_bytes(Tier.GPU) == home + 4096
        assert torch.equal(store.get(0, "grads", Tier.GPU), torch.full((N,), 3.0, dtype=torch.bfloat16))
        with pytest.raises(StoreError, match="in use"):
            store.release(0, "grads")
        store.unpin(0, "grads", Tier.GPU)
        store.release(0, "grads")
        assert store.bytes(Tier.GPU) == home and store.state(0, "grads", Tier.GPU) is Residency.ABSENT
        with pytest.raises(StoreError, match="holds no bytes.*allocate"):
            store.fetch(0, "grads", Tier.GPU)
        store.allocate(1, "grads", Tier.GPU).fill_(1)  # dead bytes when parked: freed, not moved
        assert store.gpu_home_bytes() == home and store.park("cpu") == home
        assert store.bytes(Tier.GPU) == 0
        store.unpark()
        assert store.bytes(Tier.GPU) == home and store.state(1, "grads", Tier.GPU) is Residency.ABSENT
    finally:
        store.close()


def test_rehome_moves_no_bytes_and_the_window_comes_back():
    """Between uses a transient payload's bytes are dead: a GPU home holds none until written;
    back on the CPU it takes a slot only when written."""
    store = _store(slots=1, chunks=1)
    try:
        _send_down(store, 0, torch.ones(N, dtype=torch.bfloat16))
        store.release(0, "grads")
        store.rehome(0, "grads", Tier.GPU)
        assert not store.windowed(0, "grads") and store.home(0, "grads") is Tier.GPU
        assert store.state(0, "grads", Tier.GPU) is Residency.ABSENT and store.bytes(Tier.GPU) == 0
        store.allocate(0, "grads", Tier.GPU).fill_(5)
        store.rehome(0, "grads", Tier.CPU)  # (dead bytes: dropped)
        assert store.windowed(0, "grads") and store.bytes(Tier.GPU) == 0
        assert store.state(0, "grads", Tier.CPU) is Residency.ABSENT
        _send_down(store, 0, torch.full((N,), 2.0, dtype=torch.bfloat16))
        assert torch.equal(store.get(0, "grads", Tier.CPU), torch.full((N,), 2.0, dtype=torch.bfloat16))
    finally:
        store.close()


def test_rehome_changes_whether_a_payload_is_transient():
    """A chunk joining the GPU share from a persistent host home: transient on the device; back
    to a store without a window: an ordinary host home again, zeroed. No bytes move either way;
    nothing else may become transient on NVMe."""
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 22, "cpu": 1 << 22}))
    try:
        store.add_chunk({"grads": PayloadSpec(N, torch.bfloat16, Tier.CPU)})
        store.get(0, "grads", Tier.CPU, write=True).fill_(9)
        store.rehome(0, "grads", Tier.GPU, transient=True)
        assert store.payload_spec(0, "grads").transient and store.bytes(Tier.CPU) == 0
        assert store.bytes(Tier.GPU) == 0
        with pytest.raises(StoreError, match="no window"):
            store.rehome(0, "grads", Tier.CPU)  # transient on the CPU needs a window: nothing changes
        assert store.home(0, "grads") is Tier.GPU
        store.rehome(0, "grads", Tier.CPU, transient=False)
        assert not store.payload_spec(0, "grads").transient
        assert torch.equal(store.get(0, "grads", Tier.CPU), torch.zeros(N, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="not on nvme"):
            PayloadSpec(N, torch.bfloat16, Tier.NVME, transient=True)
    finally:
        store.close()


def test_discard_gives_the_slot_back():
    store = _store(slots=1, chunks=2)
    try:
        _send_down(store, 0, torch.ones(N, dtype=torch.bfloat16))
        store.discard(0)
        assert store.window.taken == 0
        _send_down(store, 1, torch.ones(N, dtype=torch.bfloat16))
    finally:
        store.close()


def test_slot_window_bounds_and_sizes():
    w = SlotWindow(2)
    w.grow_to(5000)
    a = w.acquire(100)
    assert a.nbytes == 8192  # every slot serves the largest payload
    b = w.acquire(8192)
    with pytest.raises(MemoryError, match="2 slot"):
        w.acquire(1)
    w.release(a)
    with pytest.raises(RuntimeError, match="released twice"):
        w.release(a)
    c = w.acquire(3 * 4096)  # larger than any slot: the free one is replaced
    assert c.nbytes == 3 * 4096 and w.made == 2 and w.reserved_bytes == 8192 + 3 * 4096
    w.release(b)
    w.release(c)
    assert w.taken == 0
    with pytest.raises(ValueError, match="slots"):
        SlotWindow(-1)

