"""A script that trains and ends without close() exits cleanly with its own status.

Before the fix such a script could abort at interpreter exit with "terminate called without an
active exception" (status 134): the pipeline's worker (a daemon thread) was still waiting for a
kernel (``kernel_wait``, GIL released) when the interpreter began to finalize; re-taking the GIL
then makes CPython end the thread with pthread_exit, whose forced unwind through pybind11's
``gil_scoped_release`` destructor (noexcept) calls std::terminate. The exit hook in
pipeline.py now drains and joins every live worker before finalization.

The ``slow`` scripts make the race deterministic: a long kernel queued ahead of the last step's
updates keeps the worker in ``kernel_wait`` past the end of the script, and an object whose
``__del__`` sleeps during finalization gives that kernel time to return while the interpreter
is finalizing (the window in which the abort happens). The plain scripts are the real thing,
repeated.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import atexit, sys, time
    import torch
    from torch import nn
    import zero_offload as zo
    from zero_offload import cpu_adam
    from zero_offload.offload_optim import OffloadAdamW

    mode, end, device, slow, nvme_dir = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5]

    class SlowTeardown:
        def __del__(self, sleep=time.sleep):  # the module's globals may be gone by now
            sleep(3.0)  # finalization is under way: a worker re-taking the GIL now aborts

    def long_kernels():
        # ~1.5 s of kernels queued ahead of the last step's updates: the worker then waits in
        # kernel_wait (every other part of its jobs done) while the script ends.
        n = 1 << 22
        buffers = torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
        kw = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True, threads=1)
        seconds = cpu_adam.adam_step(*buffers, **kw)
        return [cpu_adam.adam_step_async(*buffers, **kw) for _ in range(min(500, int(1.5 / seconds) + 1))]

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).to(device)
    x = torch.randn(16, 256, device=device)
    steps = 4
    if mode.startswith("engine"):
        engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-3), device=device,
                               config=dict(params=mode.split("-")[1], optimizer="cpu", dtype="fp32",
                                           chunk_mb=0.25, threads=1, gpu_budget=1 << 26,
                                           cpu_budget=1 << 28))
        for i in range(steps):
            if slow and i == steps - 1:
                pending = long_kernels()
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
    else:
        state = "nvme" if mode == "optim-nvme" else "cpu"
        opt = OffloadAdamW(model.parameters(), chunk_mb=0.25, threads=1, overlap_forward=True,
                           state=state, nvme_dir=nvme_dir if state == "nvme" else None)
        for i in range(steps):
            if slow and i == steps - 1:
                pending = long_kernels()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    pipeline = engine.pipeline if mode.startswith("engine") else opt._group.pipeline

    def report():  # an atexit hook: runs after zero_offload's (threading's hooks run first)
        done = not pipeline._queue and not pipeline.failed
        print("drained" if done else f"not drained: {pipeline._error!r}", flush=True)
    atexit.register(report)
    if slow:
        time.sleep(0.05)  # the worker reaches its kernel wait
        teardown = SlowTeardown()
    print("trained", flush=True)
    if end == "exception":
        raise RuntimeError("boom at the end of training")  # RAISE
    if end == "exit3":
        sys.exit(3)
    if end == "interrupt":
        raise KeyboardInterrupt
""")

MODES = ["engine-auto", "engine-cpu", "optim", "optim-nvme"]
RAISE = next(line for line in SCRIPT.splitlines() if line.endswith("# RAISE"))


def _run(tmp_path, mode: str, end: str, *, device: str = "cpu", slow: bool = False, times: int = 1):
    """Runs the script ``times`` times at once; the CompletedProcess of each."""
    script = tmp_path / "train_no_close.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), mode, end, device, "1" if slow else "0", str(tmp_path)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(times)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
        results.append(subprocess.CompletedProcess(args, p.returncode, out, err))
    return results


def _assert_clean(r, end: str) -> None:
    assert "terminate called" not in r.stderr, r.stderr
    # Every queued update ran (the store's executor was still there for the NVMe write-behind).
    assert r.stdout == "trained\ndrained\n", (r.stdout, r.stderr)
    if end == "normal":
        assert (r.returncode, r.stderr) == (0, "")
    elif end == "exit3":
        assert (r.returncode, r.stderr) == (3, "")
    elif end == "exception":
        # The traceback and nothing else.
        assert r.returncode == 1, r.stderr
        lines = [line for line in r.stderr.splitlines() if line.strip(" ^~")]  # 3.11+ carets
        assert lines == ["Traceback (most recent call last):",
                         f'  File "{r.args[1]}", line {SCRIPT.splitlines().index(RAISE) + 1}, in <module>',
                         "    " + RAISE.strip(),
                         "RuntimeError: boom at the end of training"], r.stderr
    else:  # interrupt: CPython re-raises SIGINT on itself so the parent sees the signal
        assert r.returncode == -signal.SIGINT, r.stderr
        assert r.stderr.strip().splitlines()[-1] == "KeyboardInterrupt", r.stderr


# Each front end and each way of ending once (the full cross product took ~7 minutes of the suite
# on a loaded 2-core host; engine-cpu and engine-auto share the engine's exit path).
@pytest.mark.parametrize("mode, end", [(m, "normal") for m in MODES if m != "engine-cpu"]
                         + [("optim", "exception"), ("engine-auto", "exit3"), ("optim", "interrupt")])
def test_updates_in_flight_at_exit(tmp_path, mode, end):
    """The worker is inside a kernel wait when the interpreter finalizes (deterministic)."""
    _assert_clean(*_run(tmp_path, mode, end, slow=True), end)


@pytest.mark.parametrize("mode", ["engine-auto", "optim"])
def test_plain_scripts_exit_cleanly_every_time(tmp_path, mode):
    """The scripts as a user writes them, no close(), run repeatedly (the abort was racy)."""
    for r in _run(tmp_path, mode, "normal", times=3):
        _assert_clean(r, "normal")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["engine-auto", "optim"])
@pytest.mark.parametrize("end", ["normal", "exception"])
def test_cuda_updates_in_flight_at_exit(tmp_path, mode, end):
    _assert_clean(*_run(tmp_path, mode, end, device="cuda", slow=True), end)
    for r in _run(tmp_path, mode, end, device="cuda", times=5):
        _assert_clean(r, end)
