"""Swap spaces left by a killed process: found by their owner file, removed by the next SwapSpace
(only ours, only of dead processes on this host); see swap_io [Note: owner file]."""
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest

from zero_offload.swap_io import (OWNER_FILE, SWAP_FILE, OwnerState, SpaceOwner, SwapSpace, find_spaces,
                                  remove_stale_spaces)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HOLDER = textwrap.dedent("""
    import sys
    from zero_offload.swap_io import SwapSpace
    space = SwapSpace(sys.argv[1], capacity_bytes=1 << 20)
    print(space.directory, flush=True)
    sys.stdin.readline()  # hold the space until told (or killed)
    space.close()
""")


def start_holder(directory):
    """A process holding a SwapSpace in ``directory``; returns (process, its space's directory)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, proc.stderr.read()
    return proc, line


def killed_space(directory) -> str:
    """The directory of a SwapSpace whose process was killed with SIGKILL (the real case)."""
    proc, space_dir = start_holder(directory)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(os.listdir(space_dir)) == [OWNER_FILE, SWAP_FILE]  # kill -9 left it behind
    return space_dir


def test_owner_file_records_this_process(tmp_path):
    with SwapSpace(tmp_path, capacity_bytes=4096) as space:
        with open(os.path.join(space.directory, OWNER_FILE)) as f:
            data = json.load(f)
        assert data["format"] == "zero_offload swap space" and data["version"] == 1
        assert data["pid"] == os.getpid() and data["hostname"] == socket.gethostname()
        assert abs(data["start_time"] - psutil.Process().create_time()) < 1.0
        assert data["uid"] == os.geteuid()
        [found] = find_spaces(tmp_path)
        assert found.path == space.directory and found.state is OwnerState.ALIVE and not found.stale
        assert found.nbytes >= 4096
    assert os.listdir(tmp_path) == []  # close removes the owner file too


def test_space_of_a_killed_process_is_removed_by_the_next_space(tmp_path):
    stale = killed_space(tmp_path)
    (tmp_path / "user.txt").write_bytes(b"keep")  # the user's own file
    foreign = tmp_path / "zero_offload-1-foreign"  # looks like ours, but has no owner file
    foreign.mkdir()
    (foreign / SWAP_FILE).write_bytes(b"not ours")
    [found] = find_spaces(tmp_path)
    assert found.path == stale and found.state is OwnerState.DEAD and found.nbytes >= 1 << 20
    with SwapSpace(tmp_path, capacity_bytes=4096) as space:
        assert not os.path.exists(stale)
        assert sorted(os.listdir(tmp_path)) == sorted(["user.txt", "zero_offload-1-foreign",
                                                       os.path.basename(space.directory)])
    assert (tmp_path / "user.txt").read_bytes() == b"keep"
    assert (foreign / SWAP_FILE).read_bytes() == b"not ours"


def test_space_of_a_live_process_is_left_alone(tmp_path):
    proc, live = start_holder(tmp_path)
    try:
        with SwapSpace(tmp_path, capacity_bytes=4096):
            assert sorted(os.listdir(live)) == [OWNER_FILE, SWAP_FILE]
            assert [f.state for f in find_spaces(tmp_path) if f.path == live] == [OwnerState.ALIVE]
        assert remove_stale_spaces(tmp_path) == []
        assert os.path.exists(os.path.join(live, SWAP_FILE))
    finally:
        out, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 0, err
    assert os.listdir(tmp_path) == []  # it removed its own on close


def _fake_space(root, name, **changes):
    """A space directory whose owner file says what ``changes`` say (else: this process)."""
    d = root / name
    d.mkdir(mode=0o700)
    (d / SWAP_FILE).write_bytes(b"\0" * 4096)
    owner = dataclasses.replace(SpaceOwner.of_this_process(), **changes)
    (d / OWNER_FILE).write_text(owner.to_json())
    return d


def test_pid_reuse_and_other_hosts(tmp_path):
    # our own pid but another start time: the pid was reused, the owner is dead
    reused = _fake_space(tmp_path, "zero_offload-1-reused", start_time=psutil.Process().create_time() - 3600)
    other_host = _fake_space(tmp_path, "zero_offload-2-otherhost", hostname=socket.gethostname() + "-elsewhere",
                             pid=2 ** 22 + 1)
    other_ns = _fake_space(tmp_path, "zero_offload-3-otherns", pid_namespace=1, pid=2 ** 22 + 1)
    states = {os.path.basename(f.path): f.state for f in find_spaces(tmp_path)}
    assert states == {"zero_offload-1-reused": OwnerState.DEAD, "zero_offload-2-otherhost": OwnerState.UNKNOWN,
                      "zero_offload-3-otherns": OwnerState.UNKNOWN}
    SwapSpace(tmp_path, capacity_bytes=4096).close()
    assert not reused.exists()
    assert sorted(os.listdir(other_host)) == sorted(os.listdir(other_ns)) == [OWNER_FILE, SWAP_FILE]


def test_only_well_formed_owner_files_count(tmp_path):
    bad = tmp_path / "zero_offload-4-bad"
    bad.mkdir()
    (bad / SWAP_FILE).write_bytes(b"x")
    (bad / OWNER_FILE).write_text('{"format": "something else", "version": 1, "pid": 4}')
    target = _fake_space(tmp_path, "target", start_time=0.0)  # a dead space, but not named zero_offload-*
    (tmp_path / "zero_offload-5-link").symlink_to(target)  # a link to it is not followed either
    assert find_spaces(tmp_path) == []
    SwapSpace(tmp_path, capacity_bytes=4096).close()
    assert (bad / SWAP_FILE).read_bytes() == b"x"
    assert sorted(os.listdir(target)) == [OWNER_FILE, SWAP_FILE]


def test_stale_space_with_a_user_file_keeps_the_file(tmp_path):
    stale = killed_space(tmp_path)
    with open(os.path.join(stale, "notes.txt"), "w") as f:
        f.write("mine")
    [(space, reason)] = remove_stale_spaces(tmp_path, dry_run=True)
    assert space.path == stale and "did not write (notes.txt)" in reason
    assert os.path.exists(os.path.join(stale, SWAP_FILE))  # dry run: nothing removed
    with pytest.warns(RuntimeWarning, match="stale swap space .* was kept: .*notes.txt"):
        SwapSpace(tmp_path, capacity_bytes=4096).close()
    assert sorted(os.listdir(stale)) == ["notes.txt", OWNER_FILE]  # our swap file went, the rest stays


def test_remove_stale_false_leaves_them(tmp_path):
    stale = killed_space(tmp_path)
    SwapSpace(tmp_path, capacity_bytes=4096, remove_stale=False).close()
    assert sorted(os.listdir(stale)) == [OWNER_FILE, SWAP_FILE]
    [(space, reason)] = remove_stale_spaces(tmp_path)
    assert space.path == stale and reason is None and not os.path.exists(stale)
