"""What slows CPU-Adam down inside a training step? One process, the same buffers, one factor
at a time: the kernel over N params in chunk-sized calls (as the engine's worker makes them),
alone, with fewer threads, beside full-speed pinned H2D + D2H copies (the engine's PCIe
traffic), beside a Python thread that keeps the GIL busy (the engine's hooks), and on memory
advised for transparent huge pages.

    python benchmarks/lab/diag_adam_contention.py --params 1.31e9 --chunk-mb 64 --json-out out.json

Prints one row per setting: median seconds over all params (kernel time as the native code
measures it, and wall time of the calls from Python), and the ratio to the first row.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time

import torch

from zero_offload import cpu_adam
from zero_offload.swap_io import aligned_empty


def huge_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    nbytes = n * dtype.itemsize
    pad = (nbytes + (2 << 20) - 1) // (2 << 20) * (2 << 20) + (2 << 20)
    m = mmap.mmap(-1, pad)
    m.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(memoryview(m), dtype=torch.uint8)
    off = (-base.data_ptr()) % (2 << 20)
    return base[off:off + nbytes].view(dtype)


def buffers(n: int, alloc):
    p, m, v = (alloc(n, torch.float32) for _ in range(3))
    g, out = alloc(n, torch.bfloat16), alloc(n, torch.bfloat16)
    for t in (p, m, v):
        t.fill_(0.01)
    g.fill_(1e-3)
    out.zero_()
    return p, g, m, v, out


def run_pass(bufs, chunk: int, threads: int, step: int) -> tuple[float, float]:
    p, g, m, v, out = bufs
    kernel = 0.0
    t0 = time.perf_counter()
    for s in range(0, p.numel(), chunk):
        sl = slice(s, min(p.numel(), s + chunk))
        kernel += cpu_adam.adam_step(p[sl], g[sl], m[sl], v[sl], step=step, lr=1e-4, betas=(0.9, 0.95),
                                     eps=1e-8, weight_decay=0.1, adamw=True, out_lowp=out[sl],
                                     threads=threads)
    return kernel, time.perf_counter() - t0


class Background:
    """A background load running while the passes run."""

    def __init__(self, kind: str):
        self.kind, self.stop, self.bytes = kind, threading.Event(), 0
        self.thread = threading.Thread(target=getattr(self, kind), daemon=True)

    def __enter__(self):
        self.thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def pcie(self):
        nb = 256 << 20
        host_a = torch.empty(nb, dtype=torch.uint8, pin_memory=True)
        host_b = torch.empty(nb, dtype=torch.uint8, pin_memory=True)
        dev_a = torch.empty(nb, dtype=torch.uint8, device="cuda")
        dev_b = torch.empty(nb, dtype=torch.uint8, device="cuda")
        up, down = torch.cuda.Stream(), torch.cuda.Stream()
        while not self.stop.is_set():
            with torch.cuda.stream(up):
                dev_a.copy_(host_a, non_blocking=True)
            with torch.cuda.stream(down):
                host_b.copy_(dev_b, non_blocking=True)
            up.synchronize()
            down.synchronize()
            self.bytes += 2 * nb

    def gil(self):
        x = 0
        while not self.stop.is_set():
            for i in range(1000):
                x += i * i


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=1.31e9)
    ap.add_argument("--chunk-mb", type=float, default=64, help="chunk size in MiB of bf16 params")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    n = int(args.params)
    chunk = int(args.chunk_mb * 2 ** 20) // 2
    cores = cpu_adam.default_threads()
    cuda = torch.cuda.is_available()
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip() \
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else "n/a"
    print(f"{n / 1e9:.2f}B params, chunks of {chunk / 1e6:.1f}M, {cores} cores, THP: {thp}", flush=True)
    plain = buffers(n, lambda k, d: aligned_empty(k * d.itemsize, dtype=d, pin=cuda))
    rows = []
    step = [1]

    def measure(label, bufs, *, threads=cores, chunk_=chunk, load=None):
        ks, ws = [], []
        ctx = Background(load) if load else None
        if ctx:
            ctx.__enter__()
        try:
            for _ in range(args.repeats + 1):
                step[0] += 1
                k, w = run_pass(bufs, chunk_, threads, step[0])
                ks.append(k)
                ws.append(w)
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        k, w = statistics.median(ks[1:]), statistics.median(ws[1:])
        extra = ""
        if ctx and load == "pcie":
            extra = f"; background PCIe {ctx.bytes / 1e9:.1f} GB in all"
        rows.append({"setting": label, "kernel_s": k, "wall_s": w, "threads": threads})
        base = rows[0]["kernel_s"]
        print(f"{label:48s} kernel {k:.3f} s  wall {w:.3f} s  x{k / base:.2f}{extra}", flush=True)

    measure(f"one call over all params, {cores} threads", plain, chunk_=n)
    measure(f"chunked, {cores} threads", plain)
    measure(f"chunked, {max(1, cores - 2)} threads", plain, threads=max(1, cores - 2))
    if cuda:
        measure(f"chunked, {max(1, cores - 2)} threads + pinned H2D+D2H", plain, threads=max(1, cores - 2), load="pcie")
    measure(f"chunked, {max(1, cores - 2)} threads + GIL-busy thread", plain, threads=max(1, cores - 2), load="gil")
    default_interval = sys.getswitchinterval()
    for interval in (1e-3, 2e-4):
        sys.setswitchinterval(interval)
        measure(f"  same, switch interval {interval * 1e3:g} ms", plain, threads=max(1, cores - 2), load="gil")
    sys.setswitchinterval(default_interval)
    del plain
    huge = buffers(n, huge_empty)
    measure(f"huge pages: chunked, {cores} threads", huge)
    measure(f"huge pages: chunked, {max(1, cores - 2)} threads", huge, threads=max(1, cores - 2))
    if cuda:
        measure(f"huge pages: {max(1, cores - 2)} threads + pinned H2D+D2H", huge, threads=max(1, cores - 2), load="pcie")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"params": n, "chunk": chunk, "cores": cores, "thp": thp, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
