"""Ctrl-C during zero-offload train: exit 130, the checkpoint is whole and resumable."""
import json
import signal
import subprocess
import sys
import time


def test_sigint_saves_and_exits_130(tmp_path):
    ck = tmp_path / "ck"
    p = subprocess.Popen([sys.executable, "-m", "zero_offload", "train", "--no-progress", "--steps", "100000",
                          "--save-every", "0", "--out", str(ck)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            if line.startswith("training started"):
                break
        time.sleep(1.5)  # a few steps in
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "Ctrl-C" in err
    state = json.loads((ck / "train_state.json").read_text())
    assert 0 < state["step"] < 100000
    assert (ck / state["checkpoint"]).is_dir()
    r = subprocess.run([sys.executable, "-m", "zero_offload", "train", "--no-progress", "--resume",
                        "--steps", str(state["step"] + 1), "--sample-tokens", "0", "--out", str(ck)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"resumed from step {state['step']}" in r.stdout
