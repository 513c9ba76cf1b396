"""AioEngine errors: alignment rule, bad configuration, OSError naming file/offset/size."""
import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _aio_util import open_direct, random_buffer
from zero_offload.swap_io import AioEngine, aligned_empty


@pytest.fixture
def engine():
    with AioEngine(threads=2) as e:
        yield e


@pytest.fixture
def fd(tmp_path):
    fd = open_direct(tmp_path / "f")
    yield fd
    os.close(fd)


def test_misaligned_offset_size_buffer(engine, fd):
    buf = aligned_empty(8192)
    with pytest.raises(ValueError, match="offset=100 is not a multiple of 4096"):
        engine.write(fd, buf, offset=100)
    with pytest.raises(ValueError, match="nbytes=5000 is not a multiple of 4096"):
        engine.write(fd, buf, offset=0, nbytes=5000)
    with pytest.raises(ValueError, match="data_ptr.*not a multiple of 4096"):
        engine.write(fd, buf[1:], offset=0)
    plain = torch.empty(4096 * 3, dtype=torch.uint8)[16:]  # whatever malloc gives, then off by 16
    with pytest.raises(ValueError, match="4096"):
        engine.write(fd, plain, offset=0)


def test_bad_buffers(engine, fd):
    with pytest.raises(TypeError, match="torch.Tensor"):
        engine.write(fd, bytearray(4096), offset=0)
    with pytest.raises(ValueError, match="contiguous"):
        engine.write(fd, aligned_empty(8192, dtype=torch.float32).view(2, -1).t(), offset=0)
    with pytest.raises(ValueError, match="transfer moves 8192 bytes"):
        engine.write(fd, aligned_empty(4096), offset=0, nbytes=8192)


def test_bad_config():
    with pytest.raises(ValueError, match="threads must be >= 1"):
        AioEngine(threads=0)
    with pytest.raises(TypeError, match="threads must be an int"):
        AioEngine(threads=2.0)
    with pytest.raises(ValueError, match="block_size=5000 is not a multiple of 4096"):
        AioEngine(block_size=5000)
    with pytest.raises(ValueError, match="queue_depth must be >= 1"):
        AioEngine(queue_depth=0)
    with pytest.raises(TypeError):
        AioEngine(4)  # keyword-only


def test_short_read_names_file_offset_size(engine, tmp_path):
    path = str(tmp_path / "short")
    fd = open_direct(path)
    try:
        engine.write(fd, random_buffer(4096), offset=0, path=path).wait()
        handle = engine.read(fd, aligned_empty(3 * 4096), offset=0, path=path)
        with pytest.raises(OSError) as info:
            handle.wait()
        assert info.value.errno == errno.EIO
        assert info.value.filename == path
        assert "short read of 8192 bytes at offset 4096" in str(info.value)
        assert handle.done()
    finally:
        os.close(fd)


def test_bad_fd_is_oserror(engine):
    r, w = os.pipe()
    os.close(w)
    handle = engine.read(r, aligned_empty(4096), offset=0, path="pipe")
    with pytest.raises(OSError) as info:
        handle.wait()
    os.close(r)
    assert info.value.errno == errno.ESPIPE and "read of 4096 bytes at offset 0 of pipe" in str(info.value)


def test_ordered_after_a_failure_fails(engine, tmp_path):
    path = str(tmp_path / "f")
    fd = open_direct(path)
    try:
        bad = engine.read(fd, aligned_empty(4096), offset=1 << 30, path=path)  # past the end
        after = engine.write(fd, random_buffer(4096), offset=0, path=path, after=bad)
        with pytest.raises(OSError, match="earlier request it was ordered after failed"):
            after.wait()
        assert os.path.getsize(path) == 0  # the write never ran
    finally:
        os.close(fd)


def test_closed_engine(fd):
    engine = AioEngine(threads=1)
    engine.close()
    with pytest.raises(ValueError, match="closed"):
        engine.write(fd, aligned_empty(4096), offset=0)


def test_efbig_from_rlimit_fsize(tmp_path):
    """A write past RLIMIT_FSIZE fails with EFBIG, reported as OSError naming file/offset/size."""
    script = textwrap.dedent(f"""
        import errno, os, resource
        from zero_offload.swap_io import AioEngine, aligned_empty
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        path = {str(tmp_path / "big")!r}
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        with AioEngine(threads=2, block_size=1 << 20) as engine:
            try:
                engine.write(fd, aligned_empty(4 << 20), offset=0, path=path).wait()
            except OSError as e:
                assert e.errno == errno.EFBIG, e
                assert e.filename == path and "bytes at offset" in str(e), e
                print("EFBIG-OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert "EFBIG-OK" in out.stdout
