"""`python benchmarks/bench_io.py ARGS` = `zero-offload bench io ARGS` (code: zero_offload/bench/io.py)."""
import os
import sys

from zero_offload.bench.io import main

if __name__ == "__main__":
    sys.exit(main(prog=f"python {os.path.relpath(__file__)}"))
