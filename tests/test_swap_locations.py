"""Swap spaces of a whole swap location (swap_io [Note: swap locations]): the directory, its
rank<r>/ subdirectories (torchrun) and the temporary swap directories of runs given no swap
directory. find_all_spaces finds them all, remove_dead_spaces / `zero-offload clean` remove the
dead owners' (and the dead runs' temporary directories) and nothing else, `zero-offload info`
lists them; a disk short of space names them. Owners are faked (test_swap_stale._fake_space:
this pid with another start time is a dead owner); test_cli_run_dir kills a real run."""
import dataclasses
import errno
import os
import shutil
import tempfile

import psutil
import pytest

import zero_offload as zo
from zero_offload.runtime.placement import FitError
from zero_offload.swap_io import (OWNER_FILE, SWAP_FILE, TEMP_DIR_PREFIX, OwnerState, SpaceOwner, SwapSpace,
                                  find_all_spaces, remove_dead_spaces, temp_swap_dir)

from _cli_util import in_process
from _engine_util import DEVICE, config, mlp
from test_swap_stale import _fake_space

DEAD = dict(start_time=psutil.Process().create_time() - 3600)  # this pid, another process: dead


@pytest.fixture
def temp_location(tmp_path, monkeypatch):
    """The default temporary location ($TMPDIR) is ``tmp_path / "tmp"`` for this test."""
    loc = tmp_path / "tmp"
    loc.mkdir()
    monkeypatch.setenv("TMPDIR", str(loc))
    monkeypatch.setattr(tempfile, "tempdir", str(loc))
    return loc


def _temp_dir(root, name, *, owned=True, **changes):
    """A run's temporary swap directory, its owner file saying what ``changes`` say (else: this
    process); ``owned=False``: without an owner file (made before they existed)."""
    d = root / f"{TEMP_DIR_PREFIX}{name}"
    d.mkdir(mode=0o700)
    if owned:
        (d / OWNER_FILE).write_text(dataclasses.replace(SpaceOwner.of_this_process(), **changes).to_json())
    return d


def _layout(loc):
    """Every place a location holds spaces, dead and alive; returns {name: path}."""
    dead_temp = _temp_dir(loc, "dead", **DEAD)
    (dead_temp / "rank0").mkdir()
    live_temp = _temp_dir(loc, "live")
    old_temp = _temp_dir(loc, "old", owned=False)
    kept_temp = _temp_dir(loc, "kept", **DEAD)
    (kept_temp / "notes.txt").write_text("mine")
    (loc / "rank1").mkdir()
    (loc / "rank2").mkdir()  # empty: the user's or an earlier run's, left alone
    return {
        "top": _fake_space(loc, "zero_offload-1-top", **DEAD),
        "rank": _fake_space(loc / "rank1", "zero_offload-2-rank", **DEAD),
        "temp": _fake_space(dead_temp, "zero_offload-3-temp", **DEAD),
        "temp_rank": _fake_space(dead_temp / "rank0", "zero_offload-4-temprank", **DEAD),
        "live": _fake_space(live_temp, "zero_offload-5-live"),
        "old": _fake_space(old_temp, "zero_offload-6-old", **DEAD),
        "dead_temp": dead_temp, "live_temp": live_temp, "old_temp": old_temp, "kept_temp": kept_temp,
    }


def test_temp_swap_dir_records_its_owner(temp_location):
    with temp_swap_dir() as d:
        assert os.path.dirname(d) == str(temp_location) and os.path.basename(d).startswith(TEMP_DIR_PREFIX)
        assert SpaceOwner.read(os.path.join(d, OWNER_FILE)).pid == os.getpid()
        assert os.stat(d).st_mode & 0o777 == 0o700
        with SwapSpace(os.path.join(d, "rank0"), capacity_bytes=4096) as space:
            assert [f.path for f in find_all_spaces()] == [space.directory]
    assert not os.path.exists(d)


def test_find_and_remove_over_a_whole_location(tmp_path):
    p = _layout(tmp_path)
    found = {f.path: f.state for f in find_all_spaces(tmp_path)}
    spaces = ("top", "rank", "temp", "temp_rank", "live", "old")
    assert found == {str(p[k]): OwnerState.ALIVE if k == "live" else OwnerState.DEAD for k in spaces}

    before = sorted(str(x) for x in tmp_path.rglob("*"))
    dry = {f.path: reason for f, reason in remove_dead_spaces(tmp_path, dry_run=True)}
    assert sorted(str(x) for x in tmp_path.rglob("*")) == before  # a dry run removes nothing
    results = remove_dead_spaces(tmp_path)
    assert {f.path: reason for f, reason in results} == dry
    removed = {f.path for f, reason in results if reason is None}
    assert removed == {str(p[k]) for k in ("top", "rank", "temp", "temp_rank", "old", "dead_temp")}
    [(kept, reason)] = [(f, reason) for f, reason in results if reason is not None]
    assert kept.path == str(p["kept_temp"]) and kept.temp_dir and "notes.txt" in reason
    for path in removed:
        assert not os.path.exists(path)
    # left: the live run's, the user's file, directories not proven ours (rank<r>/, an old temp dir)
    assert sorted(os.listdir(p["live"])) == [OWNER_FILE, SWAP_FILE]
    assert sorted(os.listdir(p["kept_temp"])) == ["notes.txt", OWNER_FILE]
    assert os.listdir(p["old_temp"]) == [] and os.listdir(tmp_path / "rank1") == []
    assert sorted(os.listdir(tmp_path)) == sorted(["rank1", "rank2", p["live_temp"].name, p["old_temp"].name,
                                                   p["kept_temp"].name])


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_another_users_temp_dir_is_left_alone(tmp_path):
    theirs = _temp_dir(tmp_path, "theirs", **DEAD)
    space = _fake_space(theirs, "zero_offload-1-theirs", **DEAD)
    os.chown(theirs, 65534, 65534)
    assert find_all_spaces(tmp_path) == [] and remove_dead_spaces(tmp_path) == []
    assert sorted(os.listdir(space)) == [OWNER_FILE, SWAP_FILE]


@pytest.fixture
def cli(capfd):
    return lambda *argv: in_process(capfd, *argv)


def test_info_and_clean_default_to_the_temp_location(cli, temp_location):
    p = _layout(temp_location)
    r = cli("info", "--no-measure")
    assert r.returncode == 0, r.stderr
    assert "swap spaces:  6 (5 stale" in r.stdout, r.stdout
    for k in ("top", "rank", "temp", "temp_rank", "old"):
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith(str(p[k])))
        assert f"pid {os.getpid()} " in line and "dead" in line
    assert "remove the stale ones with: zero-offload clean\n" in r.stdout

    r = cli("clean")
    assert r.returncode == 1, r.stderr  # one temporary directory kept: it holds the user's file
    assert f"removed {p['temp_rank']} (4.2KiB, pid {os.getpid()}" in r.stdout  # swap + owner file
    assert f"removed {p['dead_temp']} (temporary swap directory" in r.stdout
    assert f"kept {p['kept_temp']} (temporary swap directory" in r.stdout
    assert "removed 5 stale swap space(s), 20.9KiB, and 1 temporary swap directory; 1 kept" in r.stdout
    assert "left alone 1 of running processes" in r.stdout
    assert [f.path for f in find_all_spaces()] == [str(p["live"])]


def test_clean_nvme_dir_covers_its_rank_dirs(cli, tmp_path):
    top = _fake_space(tmp_path, "zero_offload-1-a", **DEAD)
    (tmp_path / "rank3").mkdir()
    rank = _fake_space(tmp_path / "rank3", "zero_offload-2-b", **DEAD)
    r = cli("info", "--no-measure", "--nvme-dir", tmp_path)
    assert "swap spaces:  2 (2 stale" in r.stdout and str(rank) in r.stdout
    assert f"remove the stale ones with: zero-offload clean --nvme-dir {tmp_path}" in r.stdout
    r = cli("clean", "--nvme-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "removed 2 stale swap space(s)" in r.stdout
    assert not top.exists() and not rank.exists() and os.listdir(tmp_path / "rank3") == []


def test_short_disk_names_our_spaces(tmp_path, temp_location, monkeypatch):
    """Out of space: the error gives the bytes needed and free, our spaces on that disk by owner
    pid (dead or running) and the command that removes the dead ones."""
    swap = tmp_path / "swap"
    (swap / "rank0").mkdir(parents=True)
    dead = _fake_space(swap / "rank0", "zero_offload-1-dead", **DEAD)
    live = _fake_space(temp_location, "zero_offload-2-live")  # the default location, same disk
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=8192))
    monkeypatch.setattr(psutil, "disk_usage", lambda path: usage._replace(free=8192))
    pid = os.getpid()
    with pytest.raises(FitError) as e:
        zo.initialize(mlp(), optimizer=zo.AdamW(), device=DEVICE,
                      config=config(optimizer="nvme", nvme_dir=str(swap)))
    msg = str(e.value)
    assert "needs" in msg and "8192 bytes are free there" in msg
    assert f"{dead} (4.2KiB, pid {pid} dead)" in msg and f"{live} (4.2KiB, pid {pid} running)" in msg
    assert f"free it with zero-offload clean --nvme-dir {swap}" in msg and "\n" not in msg

    with pytest.raises(OSError) as e:
        SwapSpace(swap, capacity_bytes=1 << 20, remove_stale=False)
    assert e.value.errno == errno.ENOSPC
    assert "needs 1048576 bytes" in str(e.value) and "has 8192 bytes free" in str(e.value)
    assert f"{dead} (4.2KiB, pid {pid} dead)" in str(e.value)
    assert dead.exists() and live.exists()  # reported, not removed


def test_initialize_removes_dead_spaces_before_measuring_the_disk(tmp_path):
    """The engine clears its swap directory of dead runs' spaces first (their bytes count as free
    for the "auto" budget), even when its plan puts nothing on NVMe."""
    dead = _fake_space(tmp_path, "zero_offload-1-dead", **DEAD)
    engine = zo.initialize(mlp(), optimizer=zo.AdamW(), device=DEVICE,
                           config=config(optimizer="cpu", nvme_dir=str(tmp_path)))
    try:
        assert not dead.exists()
    finally:
        engine.close()
