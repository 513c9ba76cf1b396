"""zero-offload info reports the swap spaces killed runs left (and creates no directory);
zero-offload clean removes the stale ones and nothing else. The command runs in-process
(_cli_util); the swap spaces are held and left by other processes (test_swap_stale)."""
import json
import os

import pytest

from zero_offload.swap_io import OWNER_FILE, SWAP_FILE

from _cli_util import in_process
from test_swap_stale import killed_space, start_holder


@pytest.fixture
def cli(capfd):
    return lambda *argv: in_process(capfd, *argv)


def test_info_does_not_create_the_directory(cli, tmp_path):
    missing = tmp_path / "not" / "there"
    r = cli("info", "--no-measure", "--nvme-dir", str(missing))
    assert r.returncode == 0, r.stderr
    assert f"swap dir:     {missing}: does not exist" in r.stdout
    assert not (tmp_path / "not").exists()
    r = cli("info", "--no-measure", "--json", "--nvme-dir", str(missing))
    nvme = json.loads(r.stdout)["nvme"]
    assert nvme["exists"] is False and "does not exist" in nvme["error"] and nvme["swap_spaces"] == []
    assert not (tmp_path / "not").exists()


def test_info_reports_stale_spaces_and_clean_removes_only_them(cli, tmp_path):
    proc, live = start_holder(tmp_path)
    try:
        stale = killed_space(tmp_path)  # after the live one: a new SwapSpace removes stale spaces
        (tmp_path / "user.bin").write_bytes(b"keep")
        r = cli("info", "--no-measure", "--nvme-dir", str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert "swap spaces:  2 (1 stale" in r.stdout, r.stdout
        stale_line = next(line for line in r.stdout.splitlines() if line.strip().startswith(stale))
        assert "dead" in stale_line and "1.0MiB" in stale_line
        live_line = next(line for line in r.stdout.splitlines() if line.strip().startswith(live))
        assert f"pid {proc.pid} " in live_line and "running" in live_line
        assert f"remove the stale ones with: zero-offload clean --nvme-dir {tmp_path}" in r.stdout
        assert os.path.exists(os.path.join(stale, SWAP_FILE))  # info only looks

        info = json.loads(cli("info", "--no-measure", "--json", "--nvme-dir", str(tmp_path)).stdout)["nvme"]
        by_path = {sp["path"]: sp for sp in info["swap_spaces"]}
        assert by_path[stale]["owner"] == "dead" and by_path[stale]["stale"] is True
        assert by_path[stale]["bytes"] >= 1 << 20 and info["stale_bytes"] == by_path[stale]["bytes"]
        assert by_path[live]["owner"] == "alive" and by_path[live]["pid"] == proc.pid
        assert info["clean_command"] == f"zero-offload clean --nvme-dir {tmp_path}"

        r = cli("clean", "--nvme-dir", str(tmp_path), "--dry-run")
        assert r.returncode == 0, r.stderr
        assert f"would remove {stale}" in r.stdout and "left alone 1" in r.stdout
        assert os.path.exists(os.path.join(stale, SWAP_FILE))

        r = cli("clean", "--nvme-dir", str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert f"removed {stale}" in r.stdout and "removed 1 stale swap space(s), 1.0MiB" in r.stdout
        assert not os.path.exists(stale)
        assert sorted(os.listdir(live)) == [OWNER_FILE, SWAP_FILE]
        assert (tmp_path / "user.bin").read_bytes() == b"keep"
        r = cli("info", "--no-measure", "--nvme-dir", str(tmp_path))
        assert "swap spaces:  1, none stale" in r.stdout and "zero-offload clean" not in r.stdout
    finally:
        proc.communicate("\n", timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["user.bin"]


def test_clean_refuses_a_missing_or_file_dir(cli, tmp_path):
    r = cli("clean", "--nvme-dir", str(tmp_path / "nope"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr
    (tmp_path / "f").write_bytes(b"x")
    r = cli("clean", "--nvme-dir", str(tmp_path / "f"))
    assert r.returncode == 2 and "regular file" in r.stderr and r.stderr.count("\n") == 1
    assert (tmp_path / "f").read_bytes() == b"x"
