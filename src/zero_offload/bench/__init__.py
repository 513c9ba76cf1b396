"""Benchmarks that ship with the package and answer a user's question about their machine:
``cpu_adam`` (``zero-offload bench adam``: CPU-Adam vs torch's and DeepSpeed's) and ``io``
(``zero-offload bench io``: the swap I/O engine vs the disk at the same queue depth). Each module has ``main(argv, *, prog) -> int``. The
repository's own benchmarks (training step, chunk store) and lab scripts stay in ``benchmarks/``.
"""
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Optional


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() where it has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took (time.perf_counter)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def command_line(prog: str, argv: Optional[list[str]]) -> str:
    """The command a benchmark's ``main(argv, prog=prog)`` runs, as its results record it."""
    return " ".join([prog] + (argv if argv is not None else sys.argv[1:]))


def publish(report: str, record: dict, *, md_path: Optional[str], json_path: Optional[str]) -> None:
    """Prints the markdown ``report``; writes it to ``md_path`` and ``record`` to ``json_path``
    (each when given)."""
    print(report)
    if md_path:
        Path(md_path).write_text(report)
    if json_path:
        Path(json_path).write_text(json.dumps(record, indent=1))
