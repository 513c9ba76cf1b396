"""ENOSPC on a real tiny file system (a 1 MiB tmpfs; needs permission to mount, i.e. root)."""
import errno
import os
import subprocess

import pytest

from _aio_util import random_buffer
from zero_offload.swap_io import AioEngine, SwapSpace


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tiny tmpfs here (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_space_larger_than_fs_refused_up_front(tiny_fs):
    with pytest.raises(OSError) as info:
        SwapSpace(tiny_fs, capacity_bytes=4 << 20)
    assert info.value.errno == errno.ENOSPC and "needs 4194304 bytes" in str(info.value)
    assert os.listdir(tiny_fs) == []
    with SwapSpace(tiny_fs, capacity_bytes=512 << 10) as space:  # fits
        assert space.capacity_bytes == 512 << 10


def test_engine_write_enospc_names_file(tiny_fs):
    path = str(tiny_fs / "raw")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with AioEngine(threads=2, block_size=256 << 10) as engine:
            with pytest.raises(OSError) as info:
                engine.write(fd, random_buffer(4 << 20), offset=0, path=path).wait()
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == path and "bytes at offset" in str(info.value)
    finally:
        os.close(fd)
