"""SwapSpace on a file system without O_DIRECT: detected at open, buffered I/O, mode reported."""
import errno
import os
import subprocess

import pytest
import torch

from _aio_util import random_buffer
from zero_offload import swap_io
from zero_offload.swap_io import IoMode, SwapSpace, aligned_empty


def _refuse_o_direct(monkeypatch):
    """Make O_DIRECT opens fail with EINVAL, as on file systems that lack it."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(swap_io.os, "open", fake_open)


def _roundtrip(space):
    slot = space.alloc(5000)
    src, dst = random_buffer(5000), aligned_empty(5000)
    space.write(slot, src).wait()
    space.read(slot, dst).wait()
    assert torch.equal(src, dst)


def test_detects_missing_o_direct_and_falls_back(tmp_path, monkeypatch):
    _refuse_o_direct(monkeypatch)
    with SwapSpace(tmp_path, capacity_bytes=1 << 20) as space:
        assert space.mode is IoMode.BUFFERED and not space.direct
        _roundtrip(space)


def test_direct_required_but_refused(tmp_path, monkeypatch):
    _refuse_o_direct(monkeypatch)
    with pytest.raises(OSError, match="does not support O_DIRECT; pass mode=None"):
        SwapSpace(tmp_path, capacity_bytes=1 << 20, mode="direct")
    assert os.listdir(tmp_path) == []


def test_probe_write_refused(tmp_path, monkeypatch):
    """Some file systems accept the O_DIRECT open but refuse the write: also buffered."""
    def fake_pwrite(fd, data, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(swap_io.os, "pwrite", fake_pwrite)
    with SwapSpace(tmp_path, capacity_bytes=1 << 20) as space:
        assert space.mode is IoMode.BUFFERED
    assert os.listdir(tmp_path) == []


def test_forced_buffered_and_default_direct_on_ext4(tmp_path):
    with SwapSpace(tmp_path, capacity_bytes=1 << 20, mode=IoMode.BUFFERED) as space:
        assert space.mode is IoMode.BUFFERED
        flags = int(open(f"/proc/self/fdinfo/{space._files.fd}").read().split("flags:")[1].split()[0], 8)
        assert not flags & os.O_DIRECT
        _roundtrip(space)
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if fs in ("ext2/ext3", "xfs", "btrfs"):  # these support O_DIRECT
        with SwapSpace(tmp_path, capacity_bytes=1 << 20) as space:
            assert space.mode is IoMode.DIRECT
            flags = int(open(f"/proc/self/fdinfo/{space._files.fd}").read().split("flags:")[1].split()[0], 8)
            assert flags & os.O_DIRECT
            _roundtrip(space)


def test_dev_shm(tmp_path):
    """tmpfs: O_DIRECT on kernels >= 6.6, buffered before; either way the round trip works."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    with SwapSpace("/dev/shm", capacity_bytes=1 << 20) as space:
        assert space.mode in (IoMode.DIRECT, IoMode.BUFFERED)
        _roundtrip(space)
