"""The GPU share's bf16-moment rounding on CUDA: the Triton kernel (ops/rounding_triton.py) against
the torch ops it replaces (rounding.stochastic_round_moments_bf16 + the copies into the bf16
moments), same inputs, same process, same GPU. Checks the bits first, then times each way with
CUDA events: ``--reps`` timed launches after 3 untimed, median and IQR in ms, the elements per
second, and the device memory each way allocates beyond its inputs and outputs.

    python benchmarks/lab/rounding_kernel.py --elements 268435456 --json-out rounding.json

One row per size on stdout (JSON), also written to ``--json-out``. Needs CUDA and Triton.
"""
import argparse
import json
import statistics
import sys

import torch

from zero_offload.ops import rounding
from zero_offload.ops.rounding_triton import round_moments_bf16_


def torch_ops(m, v, seed, out_m, out_v):
    a, b = rounding.stochastic_round_moments_bf16(m, v, seed)
    out_m.copy_(a)
    out_v.copy_(b)


def timed(fn, args, reps):
    for _ in range(3):
        fn(*args)
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args[:2], args[2] + i, *args[3:])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    q = statistics.quantiles(times, n=4)
    return {"median_ms": statistics.median(times), "p25_ms": q[0], "p75_ms": q[2], "reps": reps}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, nargs="+", default=[1 << 24, 1 << 28],
                    help="moments' numel per run (a 64 MiB chunk of bf16 params: 33554432)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("rounding_kernel.py: needs CUDA (run it on the GPU machine)")
    dev = torch.device("cuda")
    rows = []
    for n in a.elements:
        g = torch.Generator(device=dev).manual_seed(n)
        m = torch.randn(n, device=dev, generator=g) * 1e-3
        v = torch.rand(n, device=dev, generator=g) * 1e-6
        outs = {k: (torch.empty(n, device=dev, dtype=torch.bfloat16),
                    torch.empty(n, device=dev, dtype=torch.bfloat16)) for k in ("kernel", "torch")}
        round_moments_bf16_(m, v, 12345, *outs["kernel"])
        torch_ops(m, v, 12345, *outs["torch"])
        same = all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                   for x, y in zip(outs["kernel"], outs["torch"]))
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        k = timed(round_moments_bf16_, (m, v, 1, *outs["kernel"]), a.reps)
        k_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        t = timed(torch_ops, (m, v, 1, *outs["torch"]), a.reps)
        t_peak = torch.cuda.max_memory_allocated() - base
        row = {"elements": n, "same_bits": same, "gpu": torch.cuda.get_device_name(dev),
               "torch": torch.__version__, "kernel": k, "torch_ops": t,
               "speedup": t["median_ms"] / k["median_ms"],
               "extra_peak_bytes_per_element": {"kernel": k_peak / n, "torch_ops": t_peak / n},
               "kernel_gelem_per_s": n / k["median_ms"] / 1e6, "torch_ops_gelem_per_s": n / t["median_ms"] / 1e6}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del m, v, outs
        torch.cuda.empty_cache()
    if a.json_out:
        with open(a.json_out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    if not all(r["same_bits"] for r in rows):
        sys.exit("rounding_kernel.py: the kernel's bits differ from the torch ops'")


if __name__ == "__main__":
    main()
