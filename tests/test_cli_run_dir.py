"""zero-offload train's --out: --overwrite removes only what zero_offload wrote, and only once the
new run's first checkpoint is whole; --keep checkpoints are kept; --resume falls back past a
damaged one; orphans of killed saves are cleaned, the user's files never; the swap space of a run killed with
SIGKILL is removed by the next run. The command runs in-process (_cli_util), but for the run
killed with SIGKILL."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

import zero_offload.runtime.checkpoint as ckpt
from zero_offload.run_settings import human_bytes
from zero_offload.swap_io import TEMP_DIR_PREFIX, find_all_spaces
from _cli_util import in_process


@pytest.fixture
def run(capfd):
    return lambda *argv: in_process(capfd, "train", "--no-progress", "--sample-tokens", "0", *argv)


def names(d):
    return sorted(p.name for p in d.iterdir())


def test_overwrite_keeps_user_files_and_old_checkpoint_until_first_save(run, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"  # the default temporary location, where the killed run swaps
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "notes.txt").write_text("mine")
    (ck / "step_0000099").mkdir()  # the user's, named like ours but without the marker
    (ck / "step_0000099" / "w.pt").write_text("mine too")
    r = run("--steps", "2", "--save-every", "0", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    old = ck / "step_0000002"
    ckpt.verify(old)

    # killed before its first save: the old run's checkpoint and state stay whole
    p = subprocess.Popen([sys.executable, "-m", "zero_offload", "train", "--no-progress", "--overwrite",
                          "--steps", "100000", "--save-every", "0", "--out", str(ck)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            if line.startswith("training started"):
                break
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert names(ck) == ["notes.txt", "step_0000002", "step_0000099", "train_state.json"]
    ckpt.verify(old)
    [left] = find_all_spaces()  # kill -9 left its swap space, in its temporary swap directory
    assert left.stale and os.path.dirname(left.path).startswith(str(tmp / TEMP_DIR_PREFIX))
    r = run("--resume", "--steps", "3", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    assert "resumed from step 2" in r.stdout
    # the next run's start removed it and said so
    assert (f"removed 1 swap space(s) of dead runs ({human_bytes(left.nbytes)}) in {tmp} and 1 of their "
            f"temporary swap directories") in r.stdout
    assert find_all_spaces() == [] and not [n for n in os.listdir(tmp) if n.startswith(TEMP_DIR_PREFIX)]

    r = run("--overwrite", "--steps", "1", "--save-every", "0", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    assert names(ck) == ["notes.txt", "step_0000001", "step_0000099", "train_state.json"]
    assert (ck / "notes.txt").read_text() == "mine"
    assert (ck / "step_0000099" / "w.pt").read_text() == "mine too"
    state = json.loads((ck / "train_state.json").read_text())
    assert [c["name"] for c in state["checkpoints"]] == ["step_0000001"]


def test_out_dot_overwrite_touches_only_ours(run, tmp_path):
    (tmp_path / "train.py").write_text("print('my script')")
    r = run("--steps", "1", "--save-every", "0", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    r = run("--overwrite", "--steps", "2", "--save-every", "0", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert names(tmp_path) == ["step_0000002", "train.py", "train_state.json"]


def test_keep_fallback_and_orphans(run, tmp_path):
    ck = tmp_path / "ck"
    r = run("--steps", "4", "--save-every", "1", "--keep", "3", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    assert names(ck) == ["step_0000002", "step_0000003", "step_0000004", "train_state.json"]

    victim = ck / "step_0000004" / "chunk_00000.pt"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 100)
    shutil.copytree(ck / "step_0000003", ck / "step_0000009")  # a save killed before the state write
    partial = ck / ".step_0000010.tmp-999999999-0"  # a save killed while writing
    partial.mkdir()
    (partial / ".zero_offload").write_text(ckpt._MARKER_TEXT)
    (ck / "step_0000011").mkdir()  # the user's
    (ck / "step_0000011" / "keep.txt").write_text("mine")

    # --save-every 0: the resumed run keeps the checkpoint's settings (save every step) unless
    # told otherwise; here it saves only at the end, so the damaged step_0000004 must go as an orphan.
    r = run("--resume", "--steps", "5", "--save-every", "0", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "damaged" in ln]
    assert len(lines) == 1, r.stderr
    assert "step_0000004" in lines[0] and f"truncated: {size - 100} of {size} bytes" in lines[0]
    assert "step_0000003 (step 3)" in lines[0]
    assert "resumed from step 3" in r.stdout
    assert names(ck) == ["step_0000003", "step_0000005", "step_0000011", "train_state.json"]
    assert (ck / "step_0000011" / "keep.txt").read_text() == "mine"
    ckpt.verify(ck / "step_0000005")


def test_a_save_point_taken_by_a_directory_of_the_users_is_refused_before_training(run, tmp_path):
    # this run saves step_0000002 (its last step) and step_0000001 (--save-every 1): a directory
    # of the user's under either name would be replaced, so the run stops before any step with
    # one line naming it; the user's files stay. step_0000099 is no save point: left alone.
    ck = tmp_path / "ck"
    for name in ("step_0000001", "step_0000099"):
        (ck / name).mkdir(parents=True)
        (ck / name / "w.pt").write_text("mine")
    r = run("--steps", "2", "--save-every", "1", "--out", str(ck))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"zero-offload: error: --out {ck} holds step_0000001, which zero_offload did not write (or which "
        f"holds files it did not write), and this run saves a checkpoint under that name; move it out "
        f"or pass another --out"]
    assert "training started" not in r.stdout
    assert names(ck) == ["step_0000001", "step_0000099"]
    assert all((ck / n / "w.pt").read_text() == "mine" for n in names(ck))
