"""AioEngine: concurrent requests from several threads, and `after` ordering without waiting."""
import os
import threading

import torch

from _aio_util import open_direct, random_buffer
from zero_offload.swap_io import AioEngine, aligned_empty

MIB = 1 << 20


def test_concurrent_regions_from_threads(tmp_path):
    path = str(tmp_path / "f")
    fd = open_direct(path)
    errors = []
    with AioEngine(threads=4, block_size=256 << 10, queue_depth=8) as engine:
        def worker(k):
            try:
                src, dst = random_buffer(MIB + 4096 * k), aligned_empty(MIB + 4096 * k)
                for _ in range(3):
                    engine.write(fd, src, offset=k * 4 * MIB, path=path).wait()
                    engine.read(fd, dst, offset=k * 4 * MIB, path=path).wait()
                    assert torch.equal(src, dst), f"region {k} corrupted"
                    src = random_buffer(MIB + 4096 * k)
            except BaseException as e:  # reported in the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    os.close(fd)
    assert not errors, errors


def test_read_after_write_ordered_without_waiting(tmp_path):
    """Writes of different data to one region, each read submitted right after its write with
    `after`: every read sees exactly the write before it."""
    path = str(tmp_path / "f")
    fd = open_direct(path)
    with AioEngine(threads=4, block_size=64 << 10, queue_depth=16) as engine:
        srcs = [random_buffer(2 * MIB) for _ in range(8)]
        dsts = [aligned_empty(2 * MIB) for _ in range(8)]
        last = None
        for src, dst in zip(srcs, dsts):
            last = engine.write(fd, src, offset=0, path=path, after=last)
            last = engine.read(fd, dst, offset=0, path=path, after=last)
        last.wait()
        for src, dst in zip(srcs, dsts):
            assert torch.equal(src, dst)
    os.close(fd)


def test_dropped_handle_keeps_buffer_alive(tmp_path):
    """The engine keeps the buffer of an unfinished transfer alive when the caller drops it."""
    path = str(tmp_path / "f")
    fd = open_direct(path)
    with AioEngine(threads=1, block_size=4096, queue_depth=1) as engine:
        src = random_buffer(8 * MIB)
        expected = src.clone()
        engine.write(fd, src, offset=0, path=path)
        del src  # the handle is dropped too; the write must still see valid memory
    out = aligned_empty(8 * MIB)
    with AioEngine() as engine:
        engine.read(fd, out, offset=0, path=path).wait()
    os.close(fd)
    assert torch.equal(out, expected)
