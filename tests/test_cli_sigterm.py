"""SIGTERM during zero-offload train is handled like Ctrl-C: stop after the current step, save a
whole checkpoint, exit 143 (128 + 15); --resume continues it. A second signal stops at once. One
that comes while the command is stopping on an error leaves that error's line last."""
import json
import signal
import subprocess
import sys
import time


def start(ck, *extra):
    p = subprocess.Popen([sys.executable, "-m", "zero_offload", "train", "--no-progress", "--steps", "100000",
                          "--save-every", "0", "--sample-tokens", "0", "--out", str(ck), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("training started"):
            break
    return p


def test_sigterm_saves_and_exits_143_then_resumes(tmp_path):
    ck = tmp_path / "ck"
    p = start(ck, "--dtype", "bf16")
    try:
        time.sleep(1.5)  # a few steps in
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert "SIGTERM: stopping after this step" in err and "Traceback" not in err
    state = json.loads((ck / "train_state.json").read_text())
    assert 0 < state["step"] < 100000
    assert (ck / state["checkpoint"] / "engine.pt").is_file()
    assert (f"zero-offload: stopped by SIGTERM at step {state['step']}; checkpoint saved at "
            f"{ck / state['checkpoint']}; resume with --resume --out {ck}") in err
    r = subprocess.run([sys.executable, "-m", "zero_offload", "train", "--no-progress", "--resume",
                        "--steps", str(state["step"] + 1), "--out", str(ck)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"resumed from step {state['step']}" in r.stdout and "dtype bf16" in r.stdout
    assert json.loads((ck / "train_state.json").read_text())["step"] == state["step"] + 1


def test_second_sigterm_stops_at_once(tmp_path):
    ck = tmp_path / "ck"
    p = start(ck)
    try:
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 143, err
    assert "Traceback" not in err


def test_sigterm_while_stopping_on_an_error_keeps_the_error_line(capfd, monkeypatch, tmp_path):
    """torchrun sends SIGTERM to every rank once one fails, often while the rank that saw the
    failure is unwinding (closing its engine): its last line stays the error, not "interrupted"."""
    import os

    from zero_offload.engine import Engine
    from _cli_util import in_process

    real_step, real_close = Engine.step, Engine.close

    def failing_step(self):
        if self.global_step == 1:
            raise RuntimeError("engine: rank 0 of 2: the step failed (simulated)")
        return real_step(self)

    def close_with_sigterm(self, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered while the failure unwinds
        return real_close(self, **kw)

    monkeypatch.setattr(Engine, "step", failing_step)
    monkeypatch.setattr(Engine, "close", close_with_sigterm)
    r = in_process(capfd, "train", "--no-progress", "--steps", "4", "--sample-tokens", "0",
                   "--batch-size", "2", "--seq-len", "32", "--out", tmp_path / "ck")
    assert r.returncode == 1, r
    assert r.stderr.strip().splitlines()[-1] == \
        "zero-offload: error: engine: rank 0 of 2: the step failed (simulated)", r.stderr
