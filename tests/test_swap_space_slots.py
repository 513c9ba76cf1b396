"""SwapSpace slot allocator and misuse errors."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from _aio_util import random_buffer
from zero_offload.swap_io import Slot, SwapSpace, aligned_empty

CAPACITY = 64 * 4096


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    with SwapSpace(tmp_path_factory.mktemp("slots"), capacity_bytes=CAPACITY) as s:
        yield s


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9 * 4096)), max_size=40))
def test_alloc_free_never_overlap_and_coalesce(space, ops):
    live = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            try:
                live.append(space.alloc(n))
            except RuntimeError as e:
                assert "swap space full" in str(e)
                assert space.used_bytes + round_up(n) > CAPACITY or len(live) > 1  # full or fragmented
        else:
            space.free(live.pop(n % len(live)))
        extents = sorted((s.offset, s.offset + s.padded_nbytes) for s in live)
        assert all(a[1] <= b[0] for a, b in zip(extents, extents[1:]))
        assert all(0 <= a and b <= CAPACITY and a % 4096 == 0 for a, b in extents)
        assert space.used_bytes == sum(s.padded_nbytes for s in live)
    for s in live:
        space.free(s)
    assert space.used_bytes == 0
    whole = space.alloc(CAPACITY)  # freed extents merged back into one
    space.free(whole)


def round_up(n):
    return -(-n // 4096) * 4096


def test_full_space_error(space):
    a = space.alloc(CAPACITY - 4096)
    with pytest.raises(RuntimeError, match="swap space full: a slot of 8192 bytes.*larger capacity_bytes"):
        space.alloc(8192)
    space.free(a)


def test_read_before_write_raises(space):
    slot = space.alloc(4096)
    with pytest.raises(ValueError, match="never written since alloc"):
        space.read(slot, aligned_empty(4096))
    space.write(slot, random_buffer(4096))
    space.read(slot, aligned_empty(4096)).wait()
    space.free(slot)
    again = space.alloc(4096)  # same offset, fresh slot: stale again
    with pytest.raises(ValueError, match="never written"):
        space.read(again, aligned_empty(4096))
    space.free(again)


def test_misuse(space, tmp_path):
    slot = space.alloc(8192)
    with pytest.raises(ValueError, match="data_ptr.*multiple of 4096"):
        space.write(slot, aligned_empty(8192 + 1)[1:])
    with pytest.raises(ValueError, match="transfer moves 8192 bytes"):
        space.write(slot, aligned_empty(4096))
    with pytest.raises(ValueError, match="contiguous"):
        space.write(slot, aligned_empty(16384, dtype=torch.int32).view(2, -1).t())
    with pytest.raises(TypeError, match="slot must be a Slot"):
        space.write((0, 8192), aligned_empty(8192))
    with pytest.raises(ValueError, match="not allocated in this SwapSpace"):
        space.write(Slot(offset=slot.offset, nbytes=4096), aligned_empty(8192))
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        space.alloc(0)
    space.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        space.free(slot)
    with SwapSpace(tmp_path, capacity_bytes=8192) as other:
        mine = space.alloc(8192)
        theirs = other.alloc(8192)
        assert theirs == mine  # same offset and size, but another space's slot
        with pytest.raises(ValueError, match="not allocated in this SwapSpace"):
            space.write(theirs, aligned_empty(8192))
        space.free(mine)
