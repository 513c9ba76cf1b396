"""What the benchmark scripts read about their host: /proc memory counters and the machine's
description for a report. Imports nothing heavy at module level (bench_host_bytes.py and
fair/case.py import it before ``import torch``, so their samplers see torch's import).

Scripts run as ``python3 benchmarks/x.py`` find it on their own path; fair/case.py puts
benchmarks/ on the path first."""
import os
import threading


def proc_kib(path: str, key: str) -> int:
    """The kB value of line ``key:`` in a /proc file (0 if absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def statm_rss_bytes() -> int:
    """Resident set size from /proc/self/statm: two counters, no page-table walk."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class TimedSampler(threading.Thread):
    """A daemon thread that calls ``sample()`` every ``period`` s, and once more at each edge of
    the timed steps and at ``stop()``; ``timed`` tells ``sample`` that the steps run (read only
    cheap counters then). Subclasses write ``sample``."""

    def __init__(self, period: float, name: str):
        super().__init__(daemon=True, name=name)
        self.period, self.timed = period, False
        self._halt = threading.Event()  # (not ``_stop``: threading.Thread has a method of that name)

    def run(self):
        while not self._halt.wait(self.period):
            self.sample()

    def sample(self):
        raise NotImplementedError

    def enter_timed(self):
        self.sample()
        self.timed = True

    def leave_timed(self):
        self.timed = False
        self.sample()

    def stop(self):
        self._halt.set()
        self.sample()


def machine() -> dict:
    """The GPU, CPU model, usable cores, RAM, torch version and date, for a report."""
    import datetime
    import platform

    import psutil
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)), "ram_gib": round(psutil.virtual_memory().total / 2 ** 30),
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}
