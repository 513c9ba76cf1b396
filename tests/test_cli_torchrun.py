"""`zero-offload train` under torchrun (2 CPU processes, gloo): one report from rank 0, every
rank training its own batches on the shared engine, checkpoints written once and resumed by two
ranks."""
import os
import subprocess
import sys

import pytest

from zero_offload.runtime.checkpoint import verify

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun test on Linux")


def _torchrun(tmp_path, *args, timeout=240):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "zero_offload", "train", "--preset", "tiny", "--batch-size", "2", "--seq-len", "32",
           "--no-progress", "--sample-tokens", "0", "--optimizer", "cpu", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_train_runs_on_two_ranks_and_resumes(tmp_path):
    out = tmp_path / "run"
    r = _torchrun(tmp_path, "--steps", "4", "--save-every", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("training started") == 1  # rank 0 reports, rank 1 is quiet
    assert "x 2 ranks" in r.stdout
    assert verify(out / "step_0000004")
    r = _torchrun(tmp_path, "--steps", "6", "--resume", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 4" in r.stdout
    assert verify(out / "step_0000006")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_0000004", "step_0000006"]
