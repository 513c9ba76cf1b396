"""zero-offload train: a short run writes a checkpoint and a sample; --resume continues it and
lands exactly where an uninterrupted run does; --config and flags combine. The command runs
in-process (_cli_util); test_cli_interrupt and test_cli_sigterm run it as a process."""
import json
import re

import pytest
import torch

from _cli_util import in_process


@pytest.fixture
def run(capfd):
    return lambda *argv: in_process(capfd, "train", "--no-progress", *argv)


def final_loss(stdout: str, step: int) -> float:
    m = re.search(rf"^step {step}: loss ([0-9.]+)", stdout, re.M)
    assert m, stdout
    return float(m.group(1))


def test_train_resume_matches_uninterrupted_run(run, tmp_path):
    ck = tmp_path / "ck"
    r = run("--steps", "4", "--save-every", "2", "--sample-tokens", "30", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    assert "params on cpu, optimizer on nvme" in r.stdout and "sample:\n" in r.stdout
    loss4 = final_loss(r.stdout, 4)
    first = float(re.search(r"\(first ([0-9.]+)\)", r.stdout).group(1))
    assert loss4 < first - 0.5  # the model learns
    state = json.loads((ck / "train_state.json").read_text())
    assert state["step"] == 4 and state["settings"]["preset"] == "tiny"
    assert sorted(p.name for p in ck.iterdir()) == ["step_0000002", "step_0000004", "train_state.json"]  # --keep 2

    again = run("--steps", "4", "--out", str(ck))  # would clobber the checkpoint
    assert again.returncode == 2 and "--resume" in again.stderr

    r = run("--resume", "--steps", "7", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    assert "resumed from step 4" in r.stdout
    assert json.loads((ck / "train_state.json").read_text())["step"] == 7
    resumed = final_loss(r.stdout, 7)

    straight = run("--steps", "7", "--sample-tokens", "0", "--out", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    assert final_loss(straight.stdout, 7) == resumed

    done = run("--resume", "--steps", "7", "--out", str(ck))
    assert done.returncode == 2 and "larger than 7" in done.stderr
    changed = run("--resume", "--steps", "9", "--preset", "small", "--out", str(ck))
    assert changed.returncode == 2 and "differs from the checkpoint's model" in changed.stderr


def test_config_file_with_flag_override(run, tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"params": "cpu", "optimizer": "cpu", "prefetch_depth": 1,
                               "optim": {"type": "adamw", "lr": 0.002},
                               "train": {"preset": "tiny", "steps": 2, "batch_size": 4, "seq_len": 32,
                                         "sample_tokens": 0}}))
    ck = tmp_path / "ck"
    r = run("--config", str(cfg), "--steps", "3", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    assert "optimizer on cpu" in r.stdout and "prefetch depth 1" in r.stdout
    state = json.loads((ck / "train_state.json").read_text())
    assert state["step"] == 3  # the flag beats the file
    assert state["settings"]["batch_size"] == 4 and state["settings"]["seq_len"] == 32
    assert state["offload"]["optimizer"] == "cpu" and state["offload"]["nvme_dir"] is None


def test_grad_accum_makes_a_step_of_several_micro_batches(run, tmp_path):
    # grad_accum 3 from --config: each step is 3 micro-batches and one update, so --save-every 1
    # saves at whole windows (it saved in the middle of one: a step counted one micro-batch)
    cfg = tmp_path / "accum.json"
    cfg.write_text(json.dumps({"grad_accum": 3}))
    ck = tmp_path / "ck"
    r = run("--config", str(cfg), "--steps", "2", "--save-every", "1", "--batch-size", "2", "--seq-len", "16",
            "--sample-tokens", "0", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    meta = torch.load(ck / "step_0000002" / "engine.pt", weights_only=False)
    assert meta["global_step"] == 2  # 2 updates, of 3 micro-batches each
    assert "tokens/s" in r.stdout
