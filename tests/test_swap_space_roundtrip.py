"""SwapSpace round trips of os.urandom payloads, 1 B to 64 MiB, through handles and asyncio."""
import asyncio

import pytest
import torch

from _aio_util import random_buffer
from zero_offload.swap_io import SwapSpace, aligned_empty

SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3, 64 << 20]


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    with SwapSpace(tmp_path_factory.mktemp("swap"), capacity_bytes=80 << 20) as s:
        yield s


@pytest.mark.parametrize("nbytes", SIZES)
def test_handle_roundtrip(space, nbytes):
    slot = space.alloc(nbytes)
    try:
        assert slot.padded_nbytes % 4096 == 0 and slot.padded_nbytes >= nbytes
        src, dst = random_buffer(nbytes), aligned_empty(nbytes)
        space.write(slot, src).wait()
        space.read(slot, dst).wait()
        assert torch.equal(src, dst)
    finally:
        space.free(slot)


@pytest.mark.parametrize("nbytes", [1, 4097, 5 << 20])
def test_asyncio_roundtrip(space, nbytes):
    async def main():
        slot = space.alloc(nbytes)
        src, dst = random_buffer(nbytes), aligned_empty(nbytes)
        await space.awrite(slot, src)
        await space.aread(slot, dst)
        space.free(slot)
        return src, dst

    src, dst = asyncio.run(main())
    assert torch.equal(src, dst)


def test_bf16_payload(space):
    slot = space.alloc(3000 * 2)
    src = aligned_empty(3000 * 2, dtype=torch.bfloat16)
    src.copy_(torch.randn(3000))
    dst = aligned_empty(3000 * 2, dtype=torch.bfloat16)
    space.write(slot, src).wait()
    space.read(slot, dst).wait()
    space.free(slot)
    assert torch.equal(src, dst)


def test_slots_do_not_overlap(space):
    """Writing one slot leaves its neighbours' bytes alone (odd sizes padded)."""
    slots = [space.alloc(n) for n in (4097, 1, 12288, 5000)]
    data = [random_buffer(s.nbytes) for s in slots]
    for s, d in zip(slots, data):
        space.write(s, d).wait()
    space.write(slots[1], random_buffer(1)).wait()
    for i in (0, 2, 3):
        out = aligned_empty(slots[i].nbytes)
        space.read(slots[i], out).wait()
        assert torch.equal(out, data[i])
    for s in slots:
        space.free(s)
