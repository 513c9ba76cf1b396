"""SwapSpace set-up: permissions, private subdirectories, free-space and preallocation errors."""
import errno
import os
import re
import stat
import subprocess
import sys
import textwrap

import psutil
import pytest

from zero_offload.swap_io import SwapSpace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_permissions_and_preallocation(tmp_path):
    root = tmp_path / "new" / "swap"  # missing: created 0700
    with SwapSpace(root, capacity_bytes=10_000) as space:
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(space.directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(space.path).st_mode) == 0o600
        assert os.path.dirname(space.directory) == str(root)
        assert space.capacity_bytes == 12288
        st = os.stat(space.path)
        assert st.st_size == 12288 and st.st_blocks * 512 >= 12288  # preallocated, not sparse


def test_two_spaces_one_directory(tmp_path):
    a = SwapSpace(tmp_path, capacity_bytes=4096)
    b = SwapSpace(tmp_path, capacity_bytes=4096)
    assert a.path != b.path
    a.close()
    assert os.path.exists(b.path)
    b.close()
    assert os.listdir(tmp_path) == []


def test_two_processes_one_directory(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, torch
        from zero_offload.swap_io import SwapSpace, aligned_empty
        fill = int(sys.argv[1])
        with SwapSpace({str(tmp_path)!r}, capacity_bytes=1 << 20) as space:
            slot = space.alloc(1 << 20)
            buf = aligned_empty(1 << 20).fill_(fill)
            out = aligned_empty(1 << 20)
            for _ in range(20):
                space.write(slot, buf).wait()
                space.read(slot, out).wait()
                assert bool((out == fill).all()), "another process wrote into my file"
        print("OK")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(k)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (1, 2)]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and "OK" in out, err
    assert os.listdir(tmp_path) == []


def test_not_enough_free_space(tmp_path):
    free = psutil.disk_usage(str(tmp_path)).free
    with pytest.raises(OSError) as info:
        SwapSpace(tmp_path, capacity_bytes=free + (1 << 40))
    assert info.value.errno == errno.ENOSPC
    needed = -(-(free + (1 << 40)) // 4096) * 4096
    assert re.search(rf"needs {needed} bytes but .* has \d+ bytes free", str(info.value)), str(info.value)
    assert "lower capacity_bytes" in str(info.value)
    assert os.listdir(tmp_path) == []  # nothing created


def test_directory_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="cannot be created: .* is a regular file"):
        SwapSpace(f / "sub", capacity_bytes=4096)
    with pytest.raises(NotADirectoryError, match="is a regular file, not a directory"):
        SwapSpace(f, capacity_bytes=4096)
    assert f.read_bytes() == b"x"


def test_unwritable_directory(tmp_path):
    """As root permission bits do not bind, so use a read-only file system: /proc."""
    with pytest.raises(OSError, match="cannot create swap directory|not writable"):
        SwapSpace("/proc/zero_offload_swap_test", capacity_bytes=4096)
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="not writable"):
            SwapSpace(ro, capacity_bytes=4096)


def test_preallocation_efbig_leaves_nothing(tmp_path):
    """posix_fallocate past RLIMIT_FSIZE fails at open time with a clear error; no file remains."""
    script = textwrap.dedent(f"""
        import errno, resource
        from zero_offload.swap_io import SwapSpace
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            SwapSpace({str(tmp_path)!r}, capacity_bytes=8 << 20)
        except OSError as e:
            assert e.errno == errno.EFBIG, e
            assert "cannot preallocate 8388608 bytes" in str(e), e
            print("EFBIG-OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "EFBIG-OK" in out.stdout, out.stderr
    assert os.listdir(tmp_path) == []


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="directory must be"):
        SwapSpace(3, capacity_bytes=4096)
    with pytest.raises(ValueError, match="capacity_bytes must be >= 1"):
        SwapSpace(tmp_path, capacity_bytes=0)
    with pytest.raises(TypeError, match="capacity_bytes must be an int"):
        SwapSpace(tmp_path, capacity_bytes=4096.0)
    with pytest.raises(TypeError, match="engine must be"):
        SwapSpace(tmp_path, capacity_bytes=4096, engine="fast")
    with pytest.raises(ValueError, match="mode must be"):
        SwapSpace(tmp_path, capacity_bytes=4096, mode="turbo")
    assert os.listdir(tmp_path) == []
