"""Where does the offloaded Muon step's extra time go? (issue 25: Muon offloaded within 1.3x of
our offloaded AdamW; a diagnosis, not a comparison: the fair harness gives the numbers)

One variant per process (``--variant``; the driver, run without it, starts each in turn): the
1.31B GPT on one GPU, params and optimizer state on the CPU, torch's Muon recipe (Muon on the
blocks' matrices, AdamW on the rest) or AdamW alone, random weights, ``--warmup`` then
``--steps`` timed steps. Each prints its median s/step and the engine's per-step stats: forward,
backward, the forward's waits for updates, kernel seconds on the native thread and the worker's
busy time (its kernels plus its waits: what the cores could not use is step - kernel seconds).

Variants:
  adamw       AdamW on every param (the 1.3x reference)
  muon        Muon + AdamW as the engine runs it
  muon-gil    the same with ``sys.setswitchinterval(0.0005)``: how much the worker's re-takes of
              the GIL (up to 5 ms each by default while the main thread runs Python) cost
  muon-big    the same with 4x larger chunks (fewer, larger jobs: the per-job gaps amortised)
  muon-nons   Newton-Schulz replaced by its normalisation only (same copies, no iterations):
              what the GPU iterations cost when they run beside the model's kernels

``--trace PATH``: the Chrome trace of the variant's last two steps (the pipeline's spans).

Usage: python3 benchmarks/lab/muon_anatomy.py [--variants adamw,muon,...] [--json-out PATH]
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import time

VARIANTS = ("adamw", "muon", "muon-gil", "muon-big", "muon-nons")


def one(args) -> dict:
    import torch
    import zero_offload as zo
    from zero_offload.models import GPT, preset
    from zero_offload.runtime import rules
    from zero_offload.runtime.trace import Trace

    v = args.variant
    if v == "muon-gil":
        sys.setswitchinterval(0.0005)
    if v == "muon-nons":
        def normalised(update, coefficients, steps, eps):
            x = update.bfloat16()
            return x.div_(x.norm().clamp(min=eps))
        rules.newton_schulz = normalised
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (cpu: a smoke test)
    cfg = preset(args.model)
    torch.manual_seed(0)
    model = GPT(cfg, device="meta")
    hyper = dict(lr=1e-4, weight_decay=0.1)
    groups = None
    if v.startswith("muon"):
        spec = zo.Muon(**hyper)
        groups = [{"params": [n for n, p in model.named_parameters() if not (n.startswith("blocks.") and p.dim() == 2)],
                   "optimizer": zo.AdamW(**hyper, betas=(0.9, 0.95), eps=1e-8)}]
    else:
        spec = zo.AdamW(**hyper, betas=(0.9, 0.95), eps=1e-8)
    chunk_mb = 256.0 if v == "muon-big" else zo.OffloadConfig().chunk_mb
    engine = zo.initialize(model, optimizer=spec, param_groups=groups, device=dev, init=model.init_param,
                           config=zo.OffloadConfig(params="cpu", optimizer="cpu", dtype="bf16",
                                                   chunk_mb=chunk_mb, threads=args.threads))
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen) for _ in range(4)]

    def step(i):
        ids = data[i % len(data)].to(dev, non_blocking=True)
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()

    for i in range(args.warmup):
        step(i)
    engine.synchronize()
    engine.reset_stats()
    times = []
    trace = None
    for i in range(args.steps):
        if args.trace and i == args.steps - 2:
            trace = engine.trace = Trace()
        t0 = time.perf_counter()
        step(i)
        engine.synchronize()
        times.append(time.perf_counter() - t0)
    st = engine.stats()
    k = args.steps
    row = dict(variant=v, model=args.model, chunk_mb=chunk_mb, median_s=statistics.median(times),
               p25=statistics.quantiles(times, n=4)[0], p75=statistics.quantiles(times, n=4)[2],
               forward_s=st.forward_s / k, backward_s=st.backward_s / k, update_stall_s=st.update_stall_s / k,
               fetch_stall_s=st.fetch_stall_s / k, kernel_s=st.adam_s / k, worker_busy_s=st.worker_busy_s / k,
               chunks=len(engine.plan.homes), gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")
    if trace is not None:
        with gzip.open(args.trace, "wt") as f:
            json.dump(trace.to_chrome(), f)
    engine.close(write_back=False)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS, default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--model", default="1.3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--trace", default=None, help="(one variant) write its last two steps' Chrome trace here, gzipped")
    ap.add_argument("--trace-dir", default=None, help="(driver) one trace per variant here")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(one(args)), flush=True)
        return 0
    rows = []
    for v in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", v, "--model", args.model, "--batch", str(args.batch),
               "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.trace_dir:
            cmd += ["--trace", f"{args.trace_dir}/trace_{v}.json.gz"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode or not lines:
            print(f"[{v}] failed (exit {p.returncode}): {(p.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
            continue
        r = json.loads(lines[-1])
        rows.append(r)
        print(f"[{v}] {r['median_s']:.3f} s/step [{r['p25']:.3f}-{r['p75']:.3f}], {r['chunks']} chunks; per step: "
              f"forward {r['forward_s']:.3f} (waits for updates {r['update_stall_s']:.3f}), backward "
              f"{r['backward_s']:.3f}, kernels {r['kernel_s']:.3f}, worker busy {r['worker_busy_s']:.3f}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
