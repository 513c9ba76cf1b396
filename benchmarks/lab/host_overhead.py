"""The engine's host time per step beside plain torch, on the CPU, where the model's own work is
negligible: a preset's layer structure (its modules, parameters and chunk count) at a tiny width.

A step that the host thread's launches bound (1.31B on 4 H200s before session 24: the GPU busy
123 ms of a 210 ms step) costs what the engine's hooks cost on the host. This measures that
cost without a GPU: the median of per-step times of plain torch (bf16 params, fused AdamW) and of
the engine on the same shapes, each case in the same process after warm-up. The difference is
the engine's Python per step on this host (a GPU host's cores are faster; the ratio between
configurations is what carries over). ``--profile`` prints where the engine's time went.

Usage: python benchmarks/lab/host_overhead.py [--preset 1.3b] [--width 64] [--chunks 50]
         [--cases auto,host] [--steps 40] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import zero_offload as zo
from zero_offload.models import GPT, preset

CASES = {
    "auto": dict(params="auto", optimizer="auto"),  # every chunk resident ([Note: resident chunks])
    "host": dict(params="cpu", optimizer="cpu"),    # every chunk paged from the host
}


def median_ms(step, *, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1.3b")
    ap.add_argument("--width", type=int, default=64, help="d_model (heads: width / 16)")
    ap.add_argument("--chunks", type=int, default=50, help="chunks of this size (fewer where whole parameters do not split)")
    ap.add_argument("--cases", default="auto,host")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = preset(args.preset, d_model=args.width, n_head=max(1, args.width // 16), vocab_size=256, seq_len=32)
    x, y = torch.randint(0, 256, (1, 32)), torch.randint(0, 256, (1, 32))

    torch.manual_seed(0)
    model = GPT(cfg).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def plain_step():
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    plain = median_ms(plain_step, warmup=args.warmup, steps=args.steps)
    n_params = sum(1 for _ in model.parameters())
    chunk_mb = sum(p.numel() for p in model.parameters()) * 4 / args.chunks / 2**20
    print(f"{args.preset} shapes at width {args.width}: {n_params} parameters, "
          f"{sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))} modules with parameters")
    print(f"plain torch          {plain:7.1f} ms/step")
    for name in args.cases.split(","):
        torch.manual_seed(0)
        engine = zo.initialize(GPT(cfg), optimizer=zo.AdamW(lr=1e-4), device="cpu",
                               config=dict(CASES[name], chunk_mb=chunk_mb, threads=1))

        def step():
            engine.backward(engine(x, y))
            engine.step()
        try:
            ms = median_ms(step, warmup=args.warmup, steps=args.steps)
            print(f"engine {name:<6} {len(engine.group.chunks):>3} chunks {ms:7.1f} ms/step "
                  f"(+{ms - plain:.1f} ms over plain torch)")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(10):
                    step()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        finally:
            engine.close()


if __name__ == "__main__":
    main()
