"""pinned_pool.HomesAhead ([Note: homes ahead]): host homes made on a thread in the order they
are asked for; another size, a failure on the thread or close() end the look-ahead (the caller
then allocates for itself), and nothing made is kept after close()."""
import pytest
import torch

from zero_offload.runtime import pinned_pool
from zero_offload.runtime.pinned_pool import HomesAhead
from zero_offload.runtime.store import ChunkStore, PayloadSpec, Tier

SIZES = [4096 * 3, 1000, 4096 * 256, 8]


def test_the_homes_come_in_order_aligned_zeroed_and_the_thread_ends():
    ahead = HomesAhead(SIZES, pin=False, ahead=2)
    try:
        for n in SIZES:
            buf = ahead.take(n)
            assert buf is not None and buf.dtype is torch.uint8 and buf.numel() == n
            assert buf.data_ptr() % 4096 == 0 and not buf.any()
        assert ahead.taken == len(SIZES) and ahead.ended is None
        assert ahead.take(8) is None and "nothing more" in ahead.ended
    finally:
        ahead.close()
    assert not ahead._thread.is_alive()


def test_another_size_ends_the_look_ahead():
    ahead = HomesAhead(SIZES, pin=False)
    assert ahead.take(SIZES[0]) is not None
    assert ahead.take(SIZES[1] + 1) is None
    assert "expected 1000" in ahead.ended and ahead.take(SIZES[1]) is None
    assert not ahead._thread.is_alive()


def test_a_failure_on_the_thread_gives_what_was_made_then_none(monkeypatch):
    real, calls = pinned_pool.aligned_empty, []

    def failing(nbytes, **kw):
        calls.append(nbytes)
        if len(calls) == 2:
            raise MemoryError("no room for the second home")
        return real(nbytes, **kw)

    monkeypatch.setattr(pinned_pool, "aligned_empty", failing)
    ahead = HomesAhead(SIZES, pin=False)
    assert ahead.take(SIZES[0]) is not None
    assert ahead.take(SIZES[1]) is None
    assert "MemoryError: no room for the second home" in ahead.ended
    assert not ahead._thread.is_alive()


def test_ahead_none_makes_every_home_ahead_and_an_early_end_frees_them_first():
    """``ahead=None``: the thread does not stop at a count. Another size then frees every buffer
    not taken before the caller allocates its own."""
    import gc
    import weakref
    sizes = [1 << 20] * 16
    made = []
    real = pinned_pool.aligned_empty

    def recording(nbytes, **kw):
        buf = real(nbytes, **kw)
        made.append(weakref.ref(buf))
        return buf

    pinned_pool.aligned_empty, saved = recording, pinned_pool.aligned_empty
    try:
        ahead = HomesAhead(sizes, pin=False, ahead=None)
        ahead._thread.join(timeout=30)
    finally:
        pinned_pool.aligned_empty = saved
    assert not ahead._thread.is_alive() and len(made) == len(sizes) and ahead._ready.qsize() == len(sizes)
    first = ahead.take(1 << 20)
    assert first is not None and ahead.take(4096) is None and "expected 1048576" in ahead.ended
    gc.collect()
    assert sum(r() is not None for r in made) == 1  # the one taken


def test_close_before_anything_is_taken_stops_the_thread():
    ahead = HomesAhead([1 << 20] * 64, pin=False, ahead=1)
    ahead.close()
    assert not ahead._thread.is_alive() and ahead.take(1 << 20) is None and ahead.ended == "closed"


def test_the_store_takes_its_host_homes_from_the_thread_and_says_which_sizes():
    specs = {"master": PayloadSpec(numel=3000, dtype=torch.float32, home=Tier.CPU),
             "params": PayloadSpec(numel=3000, dtype=torch.bfloat16, home=Tier.CPU),
             "grads": PayloadSpec(numel=3000, dtype=torch.bfloat16, home=Tier.GPU)}
    sizes = ChunkStore.host_home_sizes(specs)
    assert sizes == [12000, 6000]
    from zero_offload.runtime.store import StoreConfig
    store = ChunkStore(StoreConfig(device="cpu", budgets={"gpu": 1 << 24, "cpu": 1 << 24}))
    try:
        with store.homes_ahead(sizes * 2) as ahead:
            for _ in range(2):
                cid = store.add_chunk(specs)
                assert not store.get(cid, "master", Tier.CPU).any()
        assert ahead.taken == 4 and ahead.ended == "closed"
        with store.homes_ahead([999]) as ahead:  # a size the store never asks for: it allocates itself
            store.add_chunk(specs)
        assert ahead.taken == 0 and "expected 999" in ahead.ended
    finally:
        store.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_homes_made_on_the_thread_are_pinned_for_the_callers_device():
    ahead = HomesAhead([1 << 20, 1 << 21], pin=True)
    try:
        bufs = [ahead.take(1 << 20), ahead.take(1 << 21)]
        assert all(b is not None and b.is_pinned() for b in bufs)
        gpu = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
        bufs[0].copy_(gpu, non_blocking=True)
        torch.cuda.synchronize()
        assert bool(bufs[0].all())
    finally:
        ahead.close()
