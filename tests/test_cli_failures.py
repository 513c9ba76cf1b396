"""zero-offload: every runtime failure is one line on stderr, ``zero-offload: error: ...``, with
exit 1 (2 for a usage/config error) and no traceback unless --debug is given. The command runs
in-process (_cli_util) but in test_nvme_dir_that_is_a_file and test_version, which run it as a
process: the exit status and the stderr seen from outside."""
import errno
import json
import os
import subprocess
import sys

import pytest

from zero_offload import cli

from _cli_util import in_process

TRAIN = ["train", "--no-progress", "--steps", "2", "--sample-tokens", "0", "--batch-size", "4", "--seq-len", "32"]


def zo(*argv):
    """The command as a process: ``python -m zero_offload``."""
    return subprocess.run([sys.executable, "-m", "zero_offload", *argv], capture_output=True, text=True, timeout=300)


@pytest.fixture
def run(capfd):
    """The command in-process."""
    return lambda *argv: in_process(capfd, *argv)


def inject(monkeypatch, fault, root):
    """One OS failure for paths under ``root``: a read-only file system ("erofs": EROFS on creating
    a file) or a full disk ("enospc": ENOSPC on fsync), which a test cannot otherwise produce
    without mounting file systems. Undone by monkeypatch at the end of the test."""
    root = os.path.abspath(root)
    real_open, real_fsync = os.open, os.fsync
    under = lambda path: os.path.abspath(os.fsdecode(path)).startswith(root)  # noqa: E731

    def fake_open(path, flags, *a, **k):
        if flags & os.O_CREAT and under(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_open(path, flags, *a, **k)

    def fake_fsync(fd):
        if under(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    if fault == "erofs":
        monkeypatch.setattr(os, "open", fake_open)
    else:
        monkeypatch.setattr(os, "fsync", fake_fsync)


def one_line(r, code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("zero-offload: error: ")
    return lines[0]


def test_nvme_dir_that_is_a_file(tmp_path):
    f = tmp_path / "swap"
    f.write_text("mine")
    r = zo(*TRAIN, "--nvme-dir", str(f), "--out", str(tmp_path / "ck"))
    # 1 while the API raises an OSError (FileExistsError) for it; 2 if it is refused as a bad
    # config value (ValueError) instead
    assert r.returncode in (1, 2)
    line = one_line(r, r.returncode)
    assert str(f) in line and "nvme" in line.lower()
    assert f.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0500 directory anyway; "
                    "test_nvme_dir_on_a_read_only_file_system covers the read-only case")
def test_nvme_dir_without_write_permission(run, tmp_path):
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    try:
        line = one_line(run(*TRAIN, "--nvme-dir", str(d), "--out", str(tmp_path / "ck")), 1)
    finally:
        d.chmod(0o700)
    assert f"--nvme-dir {d}" in line and "ermission" in line


def test_nvme_dir_on_a_read_only_file_system(run, monkeypatch, tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    inject(monkeypatch, "erofs", d)
    line = one_line(run(*TRAIN, "--nvme-dir", str(d), "--out", str(tmp_path / "ck")), 1)
    assert f"--nvme-dir {d}" in line and "read-only" in line and "writable directory" in line


def test_budget_that_cannot_fit_and_debug_traceback(run, tmp_path):
    cfg = tmp_path / "tight.json"
    cfg.write_text(json.dumps({"params": "gpu", "gpu_budget": 1000}))
    argv = [*TRAIN, "--config", str(cfg), "--out", str(tmp_path / "ck")]
    line = one_line(run(*argv), 1)
    assert "gpu_budget" in line and "Raise gpu_budget" in line
    for debug in (["--debug", *argv], [*argv, "--debug"]):  # before or after the command
        r = run(*debug)
        assert r.returncode == 1
        assert "Traceback" in r.stderr and "FitError" in r.stderr
        assert r.stderr.strip().splitlines()[-1] == line


def test_out_that_is_a_file(run, tmp_path):
    f = tmp_path / "out"
    f.write_text("mine")
    line = one_line(run(*TRAIN, "--out", str(f)), 2)
    assert f"--out {f} is a file" in line and f.read_text() == "mine"


def test_corrupted_checkpoint(run, tmp_path):
    ck = tmp_path / "ck"
    assert run(*TRAIN, "--out", str(ck)).returncode == 0
    state = json.loads((ck / "train_state.json").read_text())
    meta = ck / state["checkpoint"] / "engine.pt"
    meta.write_bytes(meta.read_bytes()[:100])  # truncated
    line = one_line(run(*TRAIN[:2], "--resume", "--steps", "3", "--out", str(ck)), 1)
    assert "engine.pt" in line and "truncated" in line  # checkpoint.py verifies and names the file


def test_full_disk_during_save(run, monkeypatch, tmp_path):
    ck = tmp_path / "ck"
    inject(monkeypatch, "enospc", ck)
    line = one_line(run(*TRAIN, "--out", str(ck)), 1)
    assert "no space left" in line.lower() and "free space" in line


def test_unexpected_exception_is_one_line_with_the_debug_hint(monkeypatch, capsys, tmp_path):
    def boom(settings):
        raise KeyError("boom")
    monkeypatch.setattr(cli, "build_model", boom)
    code = cli.main([*TRAIN, "--out", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("zero-offload: error: KeyError: 'boom'") and "(run with --debug for the traceback)" in err
    code = cli.main(["--debug", *TRAIN, "--out", str(tmp_path / "ck2")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" in err and "--debug for the traceback" not in err


def test_exit_code_mapping_first_match_wins():
    from zero_offload.runtime.checkpoint import CheckpointError
    from zero_offload.runtime.placement import FitError

    def code(e):
        return next(c for types, c in cli._exit_codes() if isinstance(e, types))
    assert code(cli.UsageError("x")) == 2 and code(ValueError("x")) == 2
    assert code(FitError("x")) == 1  # a ValueError, but the machine's limits, not a typo
    assert code(CheckpointError("x")) == 1 and code(OSError(errno.EROFS, "x")) == 1
    assert code(RuntimeError("x")) == 1


def test_version():
    import zero_offload

    r = zo("--version")
    assert r.returncode == 0 and r.stdout == f"zero-offload {zero_offload.__version__}\n"
