"""The ``zero-offload`` command run in-process for the CLI tests: ``cli.main(argv)``, what it
writes to stdout and stderr captured at the file descriptors (pytest's ``capfd``), and its exit
code; the same three things a subprocess gives, without paying a Python + torch start-up (3-5 s
on 2 cores) per command.

What a command may change in the process is put back afterwards, so tests stay independent of
each other and of their order: the torch RNG (``train`` and ``bench prefetch`` seed it), torch's
thread count, the SIGINT/SIGTERM handlers (``main`` and ``train`` install their own and restore
them; restored here too should a test fail half-way), the working directory and ``sys.argv``.

The process boundary itself stays covered by subprocess tests: the exit status and the one line
of a failure seen from outside (test_cli_errors.test_subprocess_exit_code,
test_cli_failures.test_nvme_dir_that_is_a_file and test_version), Ctrl-C / SIGTERM / SIGKILL
(test_cli_interrupt, test_cli_sigterm, test_cli_run_dir), torchrun (test_cli_torchrun) and the
package as installed (test_cli_bench_fronts)."""
import os
import signal
import sys

import torch

from zero_offload import cli


class Result:
    """What ``subprocess.run(..., capture_output=True, text=True)`` returns, for the same asserts."""

    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

    def __repr__(self):
        return f"Result(returncode={self.returncode!r}, stderr={self.stderr[-2000:]!r})"


def in_process(capfd, *argv) -> Result:
    """``zero-offload *argv`` run by ``cli.main``; ``capfd`` is the test's fixture."""
    capfd.readouterr()  # only this command's output
    rng, threads = torch.random.get_rng_state(), torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    cwd, sys_argv = os.getcwd(), sys.argv[:]
    try:
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as e:  # main returns its code; handled as Python would, should that change
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        torch.random.set_rng_state(rng)
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            if h is not None:  # None: a handler not installed from Python, left as it is
                signal.signal(s, h)
        os.chdir(cwd)
        sys.argv[:] = sys_argv
    out, err = capfd.readouterr()
    return Result(code, out, err)
