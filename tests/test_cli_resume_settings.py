"""zero-offload train --resume continues with the checkpoint's settings; a --config file sets only
the fields it names. Precedence: defaults < checkpoint < --config < flags. The command runs
in-process (_cli_util)."""
import json
import re
import shutil

import pytest

from _cli_util import in_process


@pytest.fixture
def run(capfd):
    return lambda *argv: in_process(capfd, "train", "--no-progress", "--sample-tokens", "0",
                                    "--batch-size", "4", "--seq-len", "32", *argv)


def final_loss(stdout: str, step: int) -> float:
    m = re.search(rf"^step {step}: loss ([0-9.]+)", stdout, re.M)
    assert m, stdout
    return float(m.group(1))


def overrides(stdout: str) -> list:
    return [line for line in stdout.splitlines() if line.startswith("--resume:")]


def test_resume_keeps_the_checkpoints_dtype_and_continues_exactly(run, tmp_path):
    ck = tmp_path / "ck"
    r = run("--dtype", "bf16", "--prefetch-depth", "1", "--steps", "3", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    assert "dtype bf16, prefetch depth 1" in r.stdout

    r = run("--resume", "--steps", "5", "--out", str(ck))  # no placement/precision flags
    assert r.returncode == 0, r.stderr
    assert "dtype bf16, prefetch depth 1" in r.stdout, r.stdout  # was fp32, depth 2 (the CLI defaults)
    assert overrides(r.stdout) == ["--resume: --steps 5 overrides the checkpoint's 3"]
    state = json.loads((ck / "train_state.json").read_text())
    assert state["offload"]["dtype"] == "bf16" and state["offload"]["prefetch_depth"] == 1
    resumed = final_loss(r.stdout, 5)

    straight = run("--dtype", "bf16", "--prefetch-depth", "1", "--steps", "5", "--out", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    assert final_loss(straight.stdout, 5) == resumed


def test_resume_override_is_reported_and_takes_effect(run, tmp_path):
    ck = tmp_path / "ck"
    assert run("--lr", "0.003", "--steps", "2", "--out", str(ck)).returncode == 0
    other = tmp_path / "other"
    shutil.copytree(ck, other)  # the same step-2 run, resumed twice
    same = run("--resume", "--steps", "4", "--out", str(ck))
    assert same.returncode == 0, same.stderr
    assert overrides(same.stdout) == ["--resume: --steps 4 overrides the checkpoint's 2"]
    assert json.loads((ck / "train_state.json").read_text())["optim"]["lr"] == 0.003

    ck = other
    r = run("--resume", "--steps", "4", "--lr", "0.02", "--prefetch-depth", "0", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    assert set(overrides(r.stdout)) == {"--resume: --steps 4 overrides the checkpoint's 2",
                                        "--resume: --prefetch-depth 0 overrides the checkpoint's 2",
                                        "--resume: --lr 0.02 overrides the checkpoint's 0.003"}
    # the new lr is used after load_checkpoint restored the saved one
    assert final_loss(r.stdout, 4) != final_loss(same.stdout, 4)
    state = json.loads((ck / "train_state.json").read_text())
    assert state["optim"]["lr"] == 0.02 and state["offload"]["prefetch_depth"] == 0


def test_resume_refuses_a_different_model_in_one_line(run, tmp_path):
    ck = tmp_path / "ck"
    assert run("--steps", "1", "--out", str(ck)).returncode == 0
    r = run("--resume", "--steps", "2", "--preset", "small", "--out", str(ck))
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "--preset small differs from the checkpoint's model tiny" in line and "another --out" in line


def test_config_file_sets_only_the_fields_it_names(run, tmp_path):
    cfg = tmp_path / "depth.json"
    cfg.write_text(json.dumps({"prefetch_depth": 1}))
    ck = tmp_path / "ck"
    r = run("--config", str(cfg), "--steps", "1", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    default = run("--steps", "1", "--out", str(tmp_path / "default"))
    assert default.returncode == 0, default.stderr
    dtype = lambda out: re.search(r", dtype (\w+),", out).group(1)  # noqa: E731
    # the placement and dtype of a run without the file (was: params auto, optimizer cpu, bf16)
    assert "params on cpu, optimizer on nvme" in default.stdout
    assert "params on cpu, optimizer on nvme" in r.stdout and dtype(r.stdout) == dtype(default.stdout)
    assert "prefetch depth 1" in r.stdout
    state = json.loads((ck / "train_state.json").read_text())["offload"]
    assert (state["params"], state["optimizer"], state["prefetch_depth"]) == ("cpu", "nvme", 1)


def test_config_file_overrides_the_checkpoint_and_flags_override_the_file(run, tmp_path):
    ck = tmp_path / "ck"
    assert run("--steps", "1", "--out", str(ck)).returncode == 0
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"prefetch_depth": 3, "optimizer": "cpu"}))
    r = run("--resume", "--steps", "2", "--config", str(cfg), "--optimizer", "nvme", "--out", str(ck))
    assert r.returncode == 0, r.stderr
    assert f"--resume: prefetch_depth 3 from --config {cfg} overrides the checkpoint's 2" in r.stdout
    assert "optimizer on nvme" in r.stdout and "prefetch depth 3" in r.stdout
    assert not any("optimizer" in line for line in overrides(r.stdout))  # the flag restores the checkpoint's


@pytest.mark.parametrize("saved_world, world, flags, accum, line", [
    (2, 1, (), 2, "--resume: the checkpoint's global batch 32 (2 rank(s) x batch 16 x grad_accum 1) is "
                  "kept on 1 rank(s) by grad_accum 2: 1 x batch 16 x grad_accum 2"),
    (1, 2, (), 1, "--resume: the global batch changes from the checkpoint's 16 (1 rank(s) x batch 16 x "
                  "grad_accum 1) to 32 (2 rank(s) x batch 16 x grad_accum 1); to keep it, pass --batch-size 8"),
    (2, 1, ("--batch-size", "8"), 1, "--resume: the global batch changes from the checkpoint's 32 (2 rank(s) "
                                     "x batch 16 x grad_accum 1) to 8 (1 rank(s) x batch 8 x grad_accum 1); "
                                     "to keep it, pass --batch-size 32"),
    (2, 2, (), 1, None),
])
def test_another_world_size_keeps_the_global_batch_or_says_it_changes(capsys, saved_world, world, flags,
                                                                      accum, line):
    import contextlib

    from zero_offload import cli
    from zero_offload.run_settings import resolve

    args = cli.build_parser().parse_args(["train", "--optimizer", "cpu", *flags])
    saved = {"settings": {"preset": "tiny", "hf_config": None, "steps": 4, "batch_size": 16, "seq_len": 32,
                          "seed": 0, "lr": None}, "offload": {"params": "cpu", "optimizer": "cpu", "grad_accum": 1},
             "world": saved_world}
    with contextlib.ExitStack() as stack:
        cfg, _, _, _ = resolve(args, defaults=dict(preset="tiny", steps=4, batch_size=16), temp_dirs=stack,
                               saved=saved, world=world)
    assert cfg.grad_accum == accum
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if "global batch" in ln] == ([line] if line else [])
