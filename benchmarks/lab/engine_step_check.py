"""Quick step-time check of the offload engine on one GPU (a GPT of ~350M params by default).

Reference, then timing, in one run (STYLE.md: llm.c dev/cuda): plain torch without offload
(AdamW fused, bf16 autocast) on the same model and batch, the CPU-Adam rate over all params
(the kernel alone, the threads the engine uses), then the engine in a few configurations. For
each: median s/step after warm-up, and where the time went (host time of forward and backward,
stalls on fetches and on CPU updates, worker time in adam_step, bytes per hop per step).

The bound for params and optimizer offloaded to the CPU is max(no-offload step, CPU-Adam over
all params, PCIe bytes / bandwidth); step / bound is the figure of merit (issue 5 asks <= 1.2).

Usage: python benchmarks/lab/engine_step_check.py [--preset 350m] [--batch 8] [--steps 6]
         [--cases cpu,cpu-clip,auto] [--json-out PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import zero_offload as zo
from zero_offload import cpu_adam
from zero_offload.models import GPT, preset

CASES = {
    # name: (OffloadConfig overrides, description)
    "cpu": (dict(params="cpu", optimizer="cpu"), "params cpu, optimizer cpu, overlap (no clip)"),
    "cpu-clip": (dict(params="cpu", optimizer="cpu", grad_clip=1.0), "params cpu, optimizer cpu, clip 1.0 (exact step after backward)"),
    "auto": (dict(params="auto", optimizer="cpu"), "params auto (GPU homes), optimizer cpu"),
}


def timed(fn, *, warmup: int, steps: int) -> list:
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        fn(warmup + i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="350m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk-mb", type=float, default=64.0)
    ap.add_argument("--cases", default="cpu,cpu-clip,auto")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    cfg = preset(args.preset)
    data = [torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(i))
            for i in range(4)]

    def batch(i):
        ids = data[i % len(data)]
        return ids[:, :-1].to(dev, non_blocking=True), ids[:, 1:].to(dev, non_blocking=True)

    out = {"gpu": torch.cuda.get_device_name(), "preset": args.preset, "batch": args.batch,
           "params": cfg.num_params(), "cases": {}}
    print(f"# {args.preset}: {cfg.num_params() / 1e6:.0f}M params, batch {args.batch} x {cfg.seq_len}, "
          f"{out['gpu']}, CPU-Adam {cpu_adam.isa()}", flush=True)

    # 1. plain torch, no offload
    torch.manual_seed(0)
    model = GPT(cfg, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def torch_step(i):
        x, y = batch(i)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_torch = statistics.median(timed(torch_step, warmup=args.warmup, steps=args.steps))
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()

    # 2. CPU-Adam over all params (bf16 grads, bf16 copy-out: what the engine runs)
    from zero_offload.engine import _adam_threads
    threads = _adam_threads(zo.OffloadConfig(), dev)
    n = cfg.num_params()
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g, lowp = torch.randn(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    ts = []
    for step in range(1, 4):
        t0 = time.perf_counter()
        cpu_adam.adam_step(p, g, m, v, step=step, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=0.1, adamw=True, out_lowp=lowp, threads=threads)
        ts.append(time.perf_counter() - t0)
    t_adam = statistics.median(ts)
    del p, m, v, g, lowp
    gc.collect()
    pcie = 3 * 2 * n / 50e9  # params H2D twice (forward, backward) + grads D2H, bf16, ~50 GB/s
    bound = max(t_torch, t_adam, pcie)
    out.update(torch_step_s=t_torch, cpu_adam_s=t_adam, cpu_adam_threads=threads, pcie_est_s=pcie, bound_s=bound)
    print(f"torch no-offload {t_torch:.3f} s/step; CPU-Adam all params {t_adam:.3f} s ({threads} threads, "
          f"{n / t_adam / 1e9:.2f} Gparam/s); PCIe estimate {pcie:.3f} s; bound {bound:.3f} s", flush=True)

    # 3. the engine
    for name in args.cases.split(","):
        over, desc = CASES[name]
        torch.manual_seed(0)
        model = GPT(cfg)  # fp32 on the CPU, as a user larger than the GPU would build it
        t0 = time.perf_counter()
        engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1),
                               config=zo.OffloadConfig(dtype="bf16", chunk_mb=args.chunk_mb, **over))
        init_s = time.perf_counter() - t0
        del model

        def step(i):
            x, y = batch(i)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()

        for i in range(args.warmup):
            step(i)
        engine.synchronize()
        engine.reset_stats()
        times = timed(step, warmup=0, steps=args.steps)
        st = engine.stats()
        med = statistics.median(times)
        k = args.steps
        rec = dict(desc=desc, s_step=med, step_over_bound=med / bound, init_s=init_s,
                   forward_s=st.forward_s / k, backward_s=st.backward_s / k, step_call_s=st.step_s / k,
                   fetch_stall_s=st.fetch_stall_s / k, update_stall_s=st.update_stall_s / k,
                   adam_s=st.adam_s / k, gpu_stall_share=st.gpu_stall_share,
                   hit_rate=st.prefetch_hit_rate, bytes_per_step={h: b / k for h, b in st.bytes_moved.items()},
                   peak_gib={t: b / 2**30 for t, b in st.peak_bytes.items()},
                   homes={"params_gpu": engine.plan.count(params=zo.Tier.GPU), "chunks": len(engine.plan.homes)},
                   torch_peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30)
        out["cases"][name] = rec
        print(f"[{name}] {desc}: {med:.3f} s/step = {med / bound:.2f}x bound ({med / t_torch:.2f}x torch); "
              f"fwd {rec['forward_s']:.3f} bwd {rec['backward_s']:.3f} step() {rec['step_call_s']:.3f}; stalls: "
              f"fetch {rec['fetch_stall_s']:.3f} update {rec['update_stall_s']:.3f}; adam {rec['adam_s']:.3f} s/step; "
              f"GB/step " + ", ".join(f"{h} {b / 1e9:.2f}" for h, b in rec["bytes_per_step"].items() if b)
              + f"; init {init_s:.1f} s", flush=True)
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
