"""zero-offload train --resume trusts the checkpoints, not only train_state.json: a state file
zero_offload did not write is one line naming it (and left alone); a missing or damaged one, or
a newest checkpoint that is gone, falls back to the newest whole checkpoint, which holds its
run's settings, with one line saying so; the save points checked against the user's directories
are those after the resume step. The command runs in-process (_cli_util)."""
import json
import re
import shutil

import pytest

from _cli_util import in_process


@pytest.fixture
def run(capfd):
    return lambda *argv: in_process(capfd, "train", "--no-progress", "--sample-tokens", "0",
                                    "--batch-size", "2", "--seq-len", "16", *argv)


class _Uncaptured:
    """Stands in for capfd (function-scoped) in the module's fixture: its output is not checked."""

    @staticmethod
    def readouterr():
        return "", ""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step run saved at steps 2 and 3 (--keep 2), run once for the module; tests copy it."""
    ck = tmp_path_factory.mktemp("trained") / "ck"
    r = in_process(_Uncaptured, "train", "--no-progress", "--sample-tokens", "0", "--batch-size", "2",
                   "--seq-len", "16", "--steps", "3", "--save-every", "1", "--out", str(ck))
    assert r.returncode == 0, "the module's training run failed"
    return ck


def copy(trained, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    return ck


def final_loss(stdout: str, step: int) -> str:
    m = re.search(rf"^step {step}: loss ([0-9.]+)", stdout, re.M)
    assert m, stdout
    return m.group(1)


def names(d):
    return sorted(p.name for p in d.iterdir())


STATE = "train_state.json"


@pytest.mark.parametrize("text, why", [
    ('{"epoch": 3, "loss": 1.5}', "has no \"writer\""),
    ('[1, 2, 3]', "holds a JSON list, not an object"),
    ('step=3\n', "is not JSON"),
    ('{"writer": "my trainer", "step": 3}', 'has "writer": "my trainer"'),
])
def test_a_state_file_zero_offload_did_not_write_is_one_line_and_left_alone(run, tmp_path, text, why):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / STATE).write_text(text)
    r = run("--resume", "--steps", "4", "--out", str(ck))
    assert r.returncode == 2, r
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"zero-offload: error: {ck / STATE} {why}"), line
    assert "not a state file zero_offload wrote" in line and "move it out of --out" in line, line
    assert "training started" not in r.stdout
    assert names(ck) == [STATE] and (ck / STATE).read_text() == text
    # a fresh run there refuses it the same way, --overwrite too: it is not ours to replace
    for extra in ((), ("--overwrite",)):
        r = run("--steps", "1", "--out", str(ck), *extra)
        assert r.returncode == 2, r
        (line,) = r.stderr.strip().splitlines()
        assert str(ck / STATE) in line and "zero_offload" in line and "--out" in line, line
        assert names(ck) == [STATE] and (ck / STATE).read_text() == text


def test_a_damaged_state_file_of_ours_without_checkpoints_is_one_line(run, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / STATE).write_text('{"writer": "zero_offload train", "step": "3", "checkpoints": []}')
    r = run("--resume", "--steps", "4", "--out", str(ck))
    assert r.returncode == 2, r
    (line,) = r.stderr.strip().splitlines()
    assert str(ck / STATE) in line and "\"step\"" in line and "no checkpoint" in line, line
    assert "--overwrite" in line, line


def test_a_deleted_newest_checkpoint_falls_back_to_the_previous_whole_one(run, trained, tmp_path):
    ck = copy(trained, tmp_path)
    assert names(ck) == ["step_0000002", "step_0000003", STATE]
    shutil.rmtree(ck / "step_0000003")
    r = run("--resume", "--steps", "4", "--out", str(ck))
    assert r.returncode == 0, r
    (line,) = [ln for ln in r.stderr.splitlines() if "step_0000003" in ln]
    assert "step_0000003 is missing" in line and f"{ck / 'step_0000002'} (step 2)" in line, line
    assert "resumed from step 2" in r.stdout
    assert names(ck) == ["step_0000003", "step_0000004", STATE]  # saved again (--save-every 1)


@pytest.mark.parametrize("damage", ["missing", "garbled"])
def test_whole_checkpoints_resume_without_their_state_file(run, trained, tmp_path, damage):
    ck = copy(trained, tmp_path)
    straight = run("--resume", "--steps", "4", "--out", str(copy(trained, tmp_path / "straight")))
    assert straight.returncode == 0, straight
    if damage == "missing":
        (ck / STATE).unlink()
    else:  # ours (it names its writer), with a field gone bad
        state = json.loads((ck / STATE).read_text())
        (ck / STATE).write_text(json.dumps({**state, "checkpoints": "step_0000003"}))
    r = run("--resume", "--steps", "4", "--out", str(ck))
    assert r.returncode == 0, r
    (line,) = [ln for ln in r.stderr.splitlines() if STATE in ln]
    assert f"resuming from {ck / 'step_0000003'} (step 3)" in line and "settings saved in it" in line, line
    assert "resumed from step 3" in r.stdout
    assert final_loss(r.stdout, 4) == final_loss(straight.stdout, 4)
    assert names(ck) == ["step_0000003", "step_0000004", STATE]
    state = json.loads((ck / STATE).read_text())
    assert state["step"] == 4 and [c["name"] for c in state["checkpoints"]] == ["step_0000003", "step_0000004"]


def test_a_garbled_state_file_names_the_checkpoint_to_resume_once_it_is_moved(run, trained, tmp_path):
    ck = copy(trained, tmp_path)
    (ck / STATE).write_text('{"writer": "zero_offload train", "st')  # not JSON: no proof it is ours
    r = run("--resume", "--steps", "4", "--out", str(ck))
    assert r.returncode == 2, r
    (line,) = r.stderr.strip().splitlines()
    assert "is not JSON" in line and "step_0000003" in line and "move it out of --out" in line, line
    (ck / STATE).rename(tmp_path / "moved.json")
    r = run("--resume", "--steps", "4", "--out", str(ck))
    assert r.returncode == 0, r
    assert "resumed from step 3" in r.stdout


def test_a_fresh_run_does_not_replace_checkpoints_without_a_state_file(run, trained, tmp_path):
    ck = copy(trained, tmp_path)
    (ck / STATE).unlink()
    r = run("--steps", "1", "--out", str(ck))
    assert r.returncode == 2, r
    (line,) = r.stderr.strip().splitlines()
    assert "step_0000003" in line and "--resume" in line and "--overwrite" in line, line
    assert names(ck) == ["step_0000002", "step_0000003"]


def test_save_points_before_the_resume_step_are_not_checked(run, trained, tmp_path):
    # step_0000002 holds a file of the user's: the resumed run (from step 3, --save-every 1) saves
    # steps 4 and 5 only, so it is no obstacle and stays as it is
    ck = copy(trained, tmp_path)
    (ck / "step_0000002" / "notes.txt").write_text("mine")
    r = run("--resume", "--steps", "5", "--out", str(ck))
    assert r.returncode == 0, r
    assert (ck / "step_0000002" / "notes.txt").read_text() == "mine"
    assert names(ck) == ["step_0000002", "step_0000004", "step_0000005", STATE]

    # one of the save points after it is still refused before any step
    ck = copy(trained, tmp_path / "again")
    (ck / "step_0000005").mkdir()
    (ck / "step_0000005" / "w.pt").write_text("mine")
    r = run("--resume", "--steps", "6", "--out", str(ck))
    assert r.returncode == 2, r
    assert "holds step_0000005" in r.stderr and "training started" not in r.stdout


def test_a_whole_checkpoint_of_the_run_newer_than_the_state_file_is_resumed(run, trained, tmp_path):
    # killed between step_0000003's save and the state write: the state names step 2 only, but
    # step_0000003 is whole and of the same run (its run state says so), so the run goes on from it
    ck = copy(trained, tmp_path)
    state = json.loads((ck / STATE).read_text())
    (ck / STATE).write_text(json.dumps({**state, "step": 2, "checkpoint": "step_0000002",
                                        "checkpoints": [{"name": "step_0000002", "step": 2}]}))
    shutil.copytree(ck / "step_0000002", ck / "step_0000007")  # a copy under another name is no checkpoint of 7
    r = run("--resume", "--steps", "4", "--out", str(ck))
    assert r.returncode == 0, r
    assert "resumed from step 3" in r.stdout and not r.stderr.strip(), r
    assert names(ck) == ["step_0000003", "step_0000004", STATE]
