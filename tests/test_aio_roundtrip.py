"""AioEngine round trips: os.urandom data written and read back through O_DIRECT, 1 B to 64 MiB."""
import os

import pytest
import torch

from _aio_util import open_direct, random_buffer
from zero_offload.swap_io import AioEngine, aligned_empty

SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3, 3 * (1 << 20) - 4096, 64 << 20]


@pytest.fixture(scope="module")
def engine():
    with AioEngine(threads=3, block_size=1 << 20, queue_depth=4) as e:
        yield e


@pytest.mark.parametrize("nbytes", SIZES)
def test_roundtrip(engine, tmp_path, nbytes):
    path = str(tmp_path / "f")
    fd = open_direct(path)
    try:
        src = random_buffer(nbytes)
        offset = 8192
        engine.write(fd, src, offset=offset, path=path).wait()
        dst = aligned_empty(nbytes)
        engine.read(fd, dst, offset=offset, path=path).wait()
        assert torch.equal(src, dst)
        # the file holds exactly those bytes at that offset (odd tails padded to 4096)
        assert os.path.getsize(path) == offset + max(-(-nbytes // 4096) * 4096, 4096)
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(nbytes) == bytes(src.numpy())
    finally:
        os.close(fd)


@pytest.mark.parametrize("threads,block_size,queue_depth", [(1, 4096, 1), (2, 65536, 1), (4, 1 << 18, 32)])
def test_roundtrip_configs(tmp_path, threads, block_size, queue_depth):
    """Many pieces per request, with fewer in flight than threads and more."""
    path = str(tmp_path / "f")
    fd = open_direct(path)
    try:
        with AioEngine(threads=threads, block_size=block_size, queue_depth=queue_depth) as engine:
            src = random_buffer(2 << 20)
            dst = aligned_empty(2 << 20)
            engine.write(fd, src, offset=0, path=path).wait()
            handle = engine.read(fd, dst, offset=0, path=path)
            handle.wait()
            assert handle.done()
            assert torch.equal(src, dst)
    finally:
        os.close(fd)


def test_any_dtype(engine, tmp_path):
    path = str(tmp_path / "f")
    fd = open_direct(path)
    try:
        src = aligned_empty(1000 * 4, dtype=torch.float32)
        src.copy_(torch.randn(1000))
        dst = aligned_empty(1000 * 4, dtype=torch.float32)
        engine.write(fd, src, offset=0).wait()
        engine.read(fd, dst, offset=0).wait()
        assert torch.equal(src, dst)
    finally:
        os.close(fd)
