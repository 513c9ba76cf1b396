"""Benchmarks that ship with the package and answer a user's question about their machine:
``cpu_adam`` (``zero-offload bench adam``: CPU-Adam vs torch's) and ``io`` (``zero-offload bench
io``: the swap I/O engine vs ``dd``). Each module has ``main(argv, *, prog) -> int``. The
repository's own benchmarks (training step, chunk store) and lab scripts stay in ``benchmarks/``.
"""
import platform


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
