"""Chunk H2D / D2H through the ChunkStore vs a raw copy of one large pinned tensor, same run.

Question: does moving a model's worth of chunks through the store (one fetch/flush per chunk,
residency bookkeeping, copy streams and events) reach the bandwidth of one big pinned copy?
Target: >= 90% of the raw copy.

  reference: one pinned host tensor of N*chunk bytes -> GPU (and back) with one copy_
  check:     the chunks' bytes arrive intact (compared after the timed runs)
  timing:    median of --reps runs; each run issues every fetch (or flush) back to back, then
             waits on all handles (host), as the prefetcher would keep them in flight

Without CUDA, 'gpu' is host memory (plain CPU copies on the store's copy threads) and the
reference is one torch copy of the same bytes: that measures only the Python overhead.

Usage: python benchmarks/bench_store.py [--chunk-mb 64] [--chunks 16] [--reps 7] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from zero_offload.store import ChunkStore, PayloadSpec, StoreConfig, Tier
from zero_offload.swap_io import aligned_empty


def _sync(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


def _median_time(fn, reps: int, cuda: bool) -> float:
    times = []
    for _ in range(reps):
        _sync(cuda)
        t0 = time.perf_counter()
        fn()
        _sync(cuda)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", default=None, help="write the markdown report here")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    chunk_bytes = args.chunk_mb << 20
    numel = chunk_bytes // dtype.itemsize
    total = chunk_bytes * args.chunks
    hw = torch.cuda.get_device_name() if cuda else f"CPU only ({platform.processor() or platform.machine()})"

    # ---- reference: one large pinned tensor
    host = aligned_empty(total, dtype=torch.uint8, pin=cuda)
    host.fill_(1)
    dev_buf = torch.empty(total, dtype=torch.uint8, device=dev)
    raw_h2d = _median_time(lambda: dev_buf.copy_(host, non_blocking=True), args.reps, cuda)
    raw_d2h = _median_time(lambda: host.copy_(dev_buf, non_blocking=True), args.reps, cuda)
    del dev_buf

    # ---- the store: chunks homed on the CPU (pinned), fetched to / flushed from the GPU tier
    store = ChunkStore(StoreConfig(device=dev, budgets={"gpu": 2 * total + (64 << 20), "cpu": 2 * total + (64 << 20)}))
    cids = [store.add_chunk({"params": PayloadSpec(numel, dtype, Tier.CPU),
                             "grads": PayloadSpec(numel, dtype, Tier.CPU)}) for _ in range(args.chunks)]
    for c in cids:
        store.get(c, "params", "cpu").fill_(c % 7 + 1)
        store.mark_dirty(c, "params", "cpu")

    def fetch_all():
        handles = [store.fetch(c, "params", Tier.GPU) for c in cids]
        for h in handles:
            h.wait()

    def evict_all():
        for c in cids:
            store.evict(c, "params", Tier.GPU)
        store.synchronize()

    h2d_times = []
    for _ in range(args.reps):
        evict_all()
        _sync(cuda)
        t0 = time.perf_counter()
        fetch_all()
        _sync(cuda)
        h2d_times.append(time.perf_counter() - t0)
    store_h2d = statistics.median(h2d_times)
    ok_h2d = all(bool((store.get(c, "params", Tier.GPU) == c % 7 + 1).all()) for c in cids)
    evict_all()

    grads = {c: store.allocate(c, "grads", Tier.GPU) for c in cids}
    for c, g in grads.items():
        g.fill_(c % 5 + 2)
    d2h_times = []
    for _ in range(args.reps):
        for c in cids:  # the GPU copy is the newest again (as after a backward)
            store.allocate(c, "grads", Tier.GPU)
        _sync(cuda)
        t0 = time.perf_counter()
        handles = [store.flush(c, "grads") for c in cids]
        for h in handles:
            h.wait()
        _sync(cuda)
        d2h_times.append(time.perf_counter() - t0)
    store_d2h = statistics.median(d2h_times)
    ok_d2h = all(bool((store.get(c, "grads", Tier.CPU) == c % 5 + 2).all()) for c in cids)
    store.close()

    gbs = lambda t: total / t / 1e9  # noqa: E731
    lines = [
        f"# ChunkStore H2D/D2H vs one raw pinned copy — {hw}, {datetime.date.today().isoformat()}",
        "",
        f"Command: `python benchmarks/bench_store.py --chunk-mb {args.chunk_mb} --chunks {args.chunks} "
        f"--reps {args.reps} --dtype {args.dtype}`",
        f"torch {torch.__version__}; {args.chunks} chunks x {args.chunk_mb} MiB = {total >> 20} MiB per direction; "
        f"medians of {args.reps} runs; store moves issued back to back, then all handles waited.",
        "",
        "| direction | raw pinned copy GB/s | store GB/s | store / raw | bytes intact |",
        "|---|---|---|---|---|",
        f"| H2D (cpu->gpu) | {gbs(raw_h2d):.1f} | {gbs(store_h2d):.1f} | {raw_h2d / store_h2d:.1%} | {ok_h2d} |",
        f"| D2H (gpu->cpu) | {gbs(raw_d2h):.1f} | {gbs(store_d2h):.1f} | {raw_d2h / store_d2h:.1%} | {ok_d2h} |",
        "",
    ]
    if not cuda:
        lines.append("No CUDA: 'gpu' is host memory, so this only measures the store's per-chunk overhead "
                     "against one torch copy on a shared, busy machine.")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    if not (ok_h2d and ok_d2h):
        raise SystemExit("bytes moved through the store do not match what was written")
    return report


if __name__ == "__main__":
    main()
