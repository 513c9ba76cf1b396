"""Host bytes per param from the start of the script (issue 24.2), one layout per process.

Question: how much host memory does the engine take per param, measured as the process's peak
PSS from its first line (before ``import torch``), and where does it go? With the grads window
(``host_grads="window"``) exact fp32 state should take <= 12.5 B/param with params on the GPU
(12 of state and a fixed window), and the step time should not move. With params on the host,
making them from the master (``host_params="from-master"``) should save their 2 B/param copy, at
the price of 4 B/param over PCIe per fetch instead of 2 (the row's ``h2d_bytes_per_param_per_step``)
and of the step time that costs.

A layout is ``HOST_GRADS`` or ``HOST_GRADS/HOST_PARAMS`` (``host_params`` "copy" when left out).
Usage (one GPU; each layout in a fresh process, so each peak is its own)::

    python benchmarks/bench_host_bytes.py --model 1.3b --params gpu --layouts persistent,window \\
        --json-out host_bytes.jsonl
    python benchmarks/bench_host_bytes.py --model 1.3b --params cpu \\
        --layouts persistent/copy,persistent/from-master,window/copy,window/from-master --json-out host_bytes.jsonl

Each row (JSON line): ``params``, ``world`` (1), ``host_bytes_per_param`` (peak PSS from the
start / params), ``host_grads``/``host_params`` as asked and as the plan resolved them, the chunks
whose params are made from the master, the host-to-device bytes per param per step, the PSS at
each stage (after ``import torch``, after CUDA is up, after
``initialize``, peak over training; per param beyond the CUDA stage too), the kernel's peak RSS
(VmHWM), what the store holds (the plan's ``need[cpu]``, bytes held, the pinned pool, the grads
window), s/step (median of the timed steps) and the seconds backward waited for a window slot.
The model is built on the meta device and initialized by ``initialize`` (no host copy of the
model, no file mapped): what is measured is the engine's.

The PSS sampler reads /proc/self/smaps_rollup every ``--mem-period`` s outside the timed steps
and only /proc/self/statm (RSS) during them (a PSS read walks the page tables: tens of ms per
read at this size, benchmarks/fair/case.py's [Note: no page-table walk while timing]); PSS is
read right before and after the timed steps as well.
"""
import os
import sys
import time

from _host import TimedSampler, proc_kib, statm_rss_bytes as rss


def pss() -> int:
    """This process's PSS in bytes."""
    return proc_kib("/proc/self/smaps_rollup", "Pss") * 1024


class Sampler(TimedSampler):
    """Peak PSS (outside timed steps) and peak RSS (during them) from the start."""

    def __init__(self, period: float):
        super().__init__(period, "host-bytes-sampler")
        self.peak_pss = pss()
        self.peak_rss_timed = 0

    def sample(self):
        if self.timed:
            self.peak_rss_timed = max(self.peak_rss_timed, rss())
        else:
            self.peak_pss = max(self.peak_pss, pss())


if __name__ == "__main__" and "--child" in sys.argv:  # first thing: the sampler sees torch's import
    _PERIOD = float(os.environ.get("HOST_BYTES_MEM_PERIOD", "0.2"))
    _SAMPLER = Sampler(_PERIOD)
    _SAMPLER.start()
    _START_PSS = _SAMPLER.peak_pss

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402


def child(args) -> dict:
    stages = {"start": _START_PSS}
    import torch
    stages["import_torch"] = pss()
    import zero_offload as zo
    from zero_offload.models import GPT, preset
    from zero_offload.runtime.store import Tier

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()
        torch.ones(1, device=device)
        torch.cuda.synchronize()
    stages["device_up"] = pss()
    cfg = preset(args.model, seq_len=args.seq)
    model = GPT(cfg, device="meta", dtype=torch.float32)
    model.set_activation_checkpointing(args.checkpointing)
    params = sum(p.numel() for p in model.parameters())  # the tied head once (distinct tensors)
    host_grads, _, host_params = args.layout.partition("/")
    ocfg = zo.OffloadConfig(params=args.params, optimizer=args.optimizer, dtype="bf16", threads=args.threads,
                            chunk_mb=args.chunk_mb, host_grads=host_grads, grads_window=args.grads_window,
                            host_params=host_params or "copy")
    t0 = time.perf_counter()
    engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-4, weight_decay=0.1), config=ocfg, device=device,
                           init=lambda name, t: t.normal_(0.0, 0.02))
    init_s = time.perf_counter() - t0
    stages["initialized"] = pss()
    g = torch.Generator().manual_seed(0)

    def step():
        ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=g).to(device)
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss

    for _ in range(args.warmup):
        step()
    engine.synchronize()
    stages["warm"] = pss()
    engine.reset_stats()
    times = []
    _SAMPLER.enter_timed()
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        engine.synchronize()
        times.append(time.perf_counter() - t)
    _SAMPLER.leave_timed()
    stages["trained"] = pss()
    st = engine.stats()
    store = engine.store
    held = {t.value: store.bytes(t) for t in Tier}
    row = {
        "what": "host_bytes", "model": args.model, "params": params, "world": 1, "layout": args.layout,
        "host_grads": engine.plan.request.host_grads, "grads_window_slots": engine.plan.grads_window,
        "host_params": engine.plan.request.host_params,
        "params_from_master_chunks": sum(1 for h in engine.plan.homes if h.from_master),
        "chunks": len(engine.plan.homes),
        "h2d_bytes_per_param_per_step": st.bytes_moved["cpu->gpu"] / max(1, args.steps) / params,
        "placement": {"params": args.params, "optimizer": args.optimizer}, "chunk_mb": args.chunk_mb,
        "batch": args.batch, "seq": cfg.seq_len, "device": torch.cuda.get_device_name(device)
        if device.type == "cuda" else "cpu",
        "s_per_step": statistics.median(times), "step_times": times, "init_s": init_s,
        "grads_window_wait_s_per_step": st.grads_window_wait_s / max(1, args.steps),
        "update_stall_s_per_step": st.update_stall_s / max(1, args.steps),
        "plan_need_cpu_bytes_per_param": engine.plan.need[Tier.CPU] / params,
        "store_held_bytes_per_param": {k: v / params for k, v in held.items()},
        "store_peak_cpu_bytes_per_param": store.peak_bytes(Tier.CPU) / params,
        "pinned_pool_bytes": store.pool.reserved_bytes, "grads_window_bytes": store.window.reserved_bytes,
        "pss_bytes": stages,
    }
    engine.close()
    _SAMPLER.stop()
    peak = _SAMPLER.peak_pss  # (RSS during the timed steps counts shared pages whole: reported beside it)
    row["peak_pss_bytes"] = _SAMPLER.peak_pss
    row["peak_rss_timed_bytes"] = _SAMPLER.peak_rss_timed
    row["vm_hwm_bytes"] = proc_kib("/proc/self/status", "VmHWM") * 1024
    row["host_bytes_per_param"] = peak / params  # from the start of the script
    row["host_bytes_per_param_beyond_device"] = (peak - stages["device_up"]) / params
    row["pss_bytes_per_param_by_stage"] = {k: v / params for k, v in stages.items()}
    return row


def _without_layouts(argv: list) -> list:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--layouts":
            skip = True
        elif not a.startswith("--layouts="):
            out.append(a)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1.3b", help="zero_offload.models preset")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--params", default="gpu", choices=["gpu", "cpu", "auto"])
    ap.add_argument("--optimizer", default="cpu", choices=["cpu", "auto"])
    ap.add_argument("--layouts", default="persistent,window",
                    help="HOST_GRADS[/HOST_PARAMS] values, one process each (e.g. persistent/from-master)")
    ap.add_argument("--grads-window", type=int, default=4)
    ap.add_argument("--chunk-mb", type=float, default=64.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--checkpointing", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json-out", default=None, help="append one JSON line per layout")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    rows = []
    for layout in args.layouts.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--layout", layout] + _without_layouts(sys.argv[1:])
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            row = {"what": "host_bytes", "layout": layout, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        if "error" in row:
            print(f"[{layout}] error: {row['error']}", flush=True)
        else:
            print(f"[{layout}] {row['params'] / 1e9:.2f}B params ({row['placement']['params']} params): "
                  f"{row['host_bytes_per_param']:.2f} B/param from the start "
                  f"({row['host_bytes_per_param_beyond_device']:.2f} beyond torch+CUDA), plan "
                  f"{row['plan_need_cpu_bytes_per_param']:.2f}, {row['s_per_step']:.3f} s/step, window wait "
                  f"{row['grads_window_wait_s_per_step'] * 1e3:.1f} ms/step, params from the master in "
                  f"{row['params_from_master_chunks']}/{row['chunks']} chunks, H2D "
                  f"{row['h2d_bytes_per_param_per_step']:.2f} B/param/step", flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(row) + "\n")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
