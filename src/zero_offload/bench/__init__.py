"""Benchmarks that ship with the package and answer a user's question about their machine:
``cpu_adam`` (``zero-offload bench adam``: CPU-Adam vs torch's) and ``io`` (``zero-offload bench
io``: the swap I/O engine vs ``dd``). Each module has ``main(argv, *, prog) -> int``. The
repository's own benchmarks (training step, chunk store) and lab scripts stay in ``benchmarks/``.
"""
