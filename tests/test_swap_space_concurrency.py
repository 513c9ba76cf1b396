"""SwapSpace: concurrent transfers on different slots; read-after-write order on one slot."""
import asyncio
import threading

import torch

from _aio_util import random_buffer
from zero_offload.swap_io import AioEngine, SwapSpace, aligned_empty

MIB = 1 << 20


def test_threads_on_different_slots(tmp_path):
    errors = []
    with SwapSpace(tmp_path, capacity_bytes=40 * MIB, engine=None) as space:
        def worker(k):
            try:
                slot = space.alloc(MIB + 100 * k + 1)
                for _ in range(4):
                    src, dst = random_buffer(slot.nbytes), aligned_empty(slot.nbytes)
                    w = space.write(slot, src)
                    r = space.read(slot, dst)  # ordered after w, no wait in between
                    r.wait()
                    w.wait()
                    assert torch.equal(src, dst), f"slot {k} corrupted"
                space.free(slot)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert space.used_bytes == 0
    assert not errors, errors


def test_asyncio_gather_on_different_slots(tmp_path):
    async def main(space):
        slots = [space.alloc(2 * MIB + k) for k in range(6)]
        srcs = [random_buffer(s.nbytes) for s in slots]
        dsts = [aligned_empty(s.nbytes) for s in slots]
        await asyncio.gather(*(space.awrite(s, b) for s, b in zip(slots, srcs)))
        await asyncio.gather(*(space.aread(s, b) for s, b in zip(slots, dsts)))
        return srcs, dsts

    with SwapSpace(tmp_path, capacity_bytes=16 * MIB) as space:
        srcs, dsts = asyncio.run(main(space))
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


def test_event_loop_not_blocked(tmp_path):
    """While a slow transfer runs (1 thread, 4 KiB pieces), the loop keeps ticking."""
    async def main(space):
        slot = space.alloc(32 * MIB)
        ticks = 0
        done = False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await space.awrite(slot, random_buffer(32 * MIB))
        done = True
        await task
        return ticks

    with AioEngine(threads=1, block_size=4096, queue_depth=1) as engine:
        with SwapSpace(tmp_path, capacity_bytes=32 * MIB, engine=engine) as space:
            ticks = asyncio.run(main(space))
    assert ticks > 10


def test_read_after_write_on_one_slot(tmp_path):
    """Alternating writes and reads of one slot, none waited for until the end: each read sees
    the write submitted just before it."""
    with AioEngine(threads=4, block_size=64 << 10, queue_depth=16) as engine:
        with SwapSpace(tmp_path, capacity_bytes=4 * MIB, engine=engine) as space:
            slot = space.alloc(2 * MIB)
            srcs = [random_buffer(2 * MIB) for _ in range(6)]
            dsts = [aligned_empty(2 * MIB) for _ in range(6)]
            handles = []
            for src, dst in zip(srcs, dsts):
                handles.append(space.write(slot, src))
                handles.append(space.read(slot, dst))
            for h in handles:
                h.wait()
    for src, dst in zip(srcs, dsts):
        assert torch.equal(src, dst)
