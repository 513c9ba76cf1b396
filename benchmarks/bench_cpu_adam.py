"""`python benchmarks/bench_cpu_adam.py ARGS` = `zero-offload bench adam ARGS` (code: zero_offload/bench/cpu_adam.py)."""
import os
import sys

from zero_offload.bench.cpu_adam import main

if __name__ == "__main__":
    sys.exit(main(prog=f"python {os.path.relpath(__file__)}"))
