"""How long do ``engine.park()`` and ``engine.resume()`` take, and how much GPU memory does a park
give back? (issue 26, part 4: RL colocation, the GPU lent to an inference engine between updates)

Each case runs in a process of its own (the driver starts one per case, so no case sees another's
allocator, pinned memory or page cache), trains ``--warmup`` steps, then ``--round-trips`` times:
one training step, park, resume. Per round trip it records the wall time of ``park`` and of
``resume`` (each a blocking call: the bytes have landed when it returns) and, before and after
the park and after the resume, ``torch.cuda.memory_allocated`` and ``memory_reserved`` and the
driver's free memory (``torch.cuda.mem_get_info``). Reference and check: a checksum of every
device-homed payload before the park equals the one after the resume (the exactness itself, step
for step against an engine that never parked, is tests/test_engine_park*.py's), and after the park
the allocated memory is back at what it was before ``initialize`` (the engine keeps nothing on
the device). Medians over the round trips, the first reported apart (it pins fresh host memory).

Cases (``--cases``): ``auto`` (params "auto", optimizer "auto": the params and as much optimizer
state as fits on the GPU, the rest on the host), ``auto-keep`` (the same, resumed with
``keep_host_memory=True``: each park after the first reuses the pinned host memory of the last)
and ``cpu`` (params "cpu", optimizer "cpu": the device holds only paged-in and prefetched params
copies and the model's buffers).

Usage (GPU machine; results in benchmarks/results/park_<hardware>_<date>.json):

    python benchmarks/bench_park.py --model 1.3b --batch 8 --cases auto,auto-keep,cpu --round-trips 5 --json-out out.json
    python benchmarks/bench_park.py --model tiny --batch 2 --round-trips 5   # a CPU smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from _host import machine

GiB = float(2 ** 30)
CASES = {"auto": dict(params="auto", optimizer="auto"), "auto-keep": dict(params="auto", optimizer="auto"),
         "cpu": dict(params="cpu", optimizer="cpu")}
KEEP = {"auto-keep"}
"""Cases that resume with ``keep_host_memory=True`` (the next park reuses the pinned host memory)."""
PAYLOADS = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "accum")


def _memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "driver_free": free, "driver_total": total}


def _checksum(engine) -> list:
    """Two byte sums of every payload homed on the device (a round trip must keep them)."""
    store, out = engine.store, []
    for cid in range(store.num_chunks):
        for name in PAYLOADS:
            if store.has_payload(cid, name) and store.payload_spec(cid, name).home.value == "gpu":
                raw = store.get(cid, name, "gpu").view(torch.uint8)
                out.append((raw.sum(dtype=torch.int64).item(), raw[1::3].sum(dtype=torch.int64).item()))
    return out


def run_case(args) -> dict:
    import zero_offload as zo
    from zero_offload.models import GPT, preset

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if device.type == "cuda":  # the context and cuBLAS's workspace first: the baseline below is what is ours
        torch.ones(64, 64, device=device, dtype=torch.bfloat16) @ torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    cfg_model = preset(args.model)
    nvme_dir = args.nvme_dir or (tempfile.mkdtemp(prefix="zo_park_") if args.target == "nvme" else None)
    base = _memory(device)
    torch.manual_seed(0)
    model = GPT(cfg_model, device="meta")
    cfg = zo.OffloadConfig(**CASES[args.case], dtype="bf16", nvme_dir=nvme_dir, chunk_mb=args.chunk_mb,
                           threads=args.threads)
    t0 = time.perf_counter()
    engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-4, weight_decay=0.1), config=cfg, device=device,
                           init=model.init_param)
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, cfg_model.vocab_size, (args.batch, cfg_model.seq_len), generator=g),
             torch.randint(0, cfg_model.vocab_size, (args.batch, cfg_model.seq_len), generator=g))
            for _ in range(4)]

    def step(i) -> float:
        t = time.perf_counter()
        x, y = data[i % len(data)]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.synchronize()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    for i in range(args.warmup):
        step(i)
    trips = []
    for k in range(args.round_trips):
        step_s = step(args.warmup + k)
        before, sums = _memory(device), _checksum(engine)
        device_bytes = engine.store.bytes("gpu")
        parked = engine.park(args.target)
        after_park = _memory(device)
        if device.type == "cuda":  # what is left, less cuBLAS's per-stream workspaces (torch's own)
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            after_park["allocated_without_cublas_workspaces"] = torch.cuda.memory_allocated(device)
        resumed = engine.resume(keep_host_memory=args.case in KEEP)
        after_resume, sums_back = _memory(device), _checksum(engine)
        first_step_s = step(args.warmup + args.round_trips + k)  # the step right after the resume
        trip = {"step_s": step_s, "step_after_resume_s": first_step_s,
                "park_s": parked.seconds, "resume_s": resumed.seconds, "where": parked.where,
                "bytes_parked": parked.nbytes, "bytes_resumed": resumed.nbytes,
                "store_device_bytes_before": device_bytes,
                "before": before, "after_park": after_park, "after_resume": after_resume,
                "checksum_kept": sums == sums_back}
        if device.type == "cuda":
            trip["freed_allocated"] = before["allocated"] - after_park["allocated"]
            trip["freed_reserved"] = before["reserved"] - after_park["reserved"]
            trip["freed_driver"] = after_park["driver_free"] - before["driver_free"]
            trip["left_allocated"] = after_park["allocated"] - base["allocated"]
            trip["left_allocated_without_cublas"] = (after_park["allocated_without_cublas_workspaces"]
                                                     - base["allocated"])
        trips.append(trip)
        print(f"[{args.case}] trip {k}: park {parked.seconds:.3f} s, resume {resumed.seconds:.3f} s, "
              f"{parked.nbytes / GiB:.2f} GiB parked on {parked.where}"
              + (f", freed {trip['freed_driver'] / GiB:.2f} GiB to the driver, "
                 f"{trip['left_allocated'] / 2**20:.1f} MiB left allocated "
                 f"({trip['left_allocated_without_cublas'] / 2**20:.1f} MiB without cuBLAS's workspaces)"
                 if "freed_driver" in trip else "")
              + f", checksum {'kept' if trip['checksum_kept'] else 'CHANGED'}", flush=True)
    engine.close()

    later = trips[1:] or trips

    def med(key):
        return statistics.median(t[key] for t in later)
    summary = {"park_s": med("park_s"), "resume_s": med("resume_s"), "first_park_s": trips[0]["park_s"],
               "first_resume_s": trips[0]["resume_s"], "step_s": med("step_s"),
               "step_after_resume_s": med("step_after_resume_s"), "bytes_parked": med("bytes_parked"),
               "park_gib_s": med("bytes_parked") / GiB / max(med("park_s"), 1e-9),
               "resume_gib_s": med("bytes_resumed") / GiB / max(med("resume_s"), 1e-9),
               "store_device_bytes_before": med("store_device_bytes_before"),
               "checksums_kept": all(t["checksum_kept"] for t in trips)}
    if device.type == "cuda":
        for key in ("freed_allocated", "freed_reserved", "freed_driver", "left_allocated",
                    "left_allocated_without_cublas"):
            summary[key] = med(key)
    return {"case": args.case, "placement": CASES[args.case], "keep_host_memory": args.case in KEEP,
            "target": args.target, "model": args.model,
            "params": cfg_model.num_params(), "batch": args.batch, "init_s": init_s,
            "round_trips": args.round_trips, "medians_over": f"round trips 2..{len(trips)}" if len(trips) > 1
            else "the one round trip", "summary": summary, "trips": trips,
            "baseline_before_initialize": base, "plan": {
                "optimizer_on_gpu": sum(1 for h in engine.plan.homes if getattr(h.optimizer, "value", None) == "gpu"),
                "params_on_gpu": sum(1 for h in engine.plan.homes if getattr(h.params, "value", None) == "gpu"),
                "chunks": len(engine.plan.homes)}}



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a zero_offload.models preset (1.3b: 1.31B params)")
    p.add_argument("--cases", default="auto,auto-keep,cpu", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--target", default="cpu", choices=("auto", "cpu", "nvme"), help="engine.park(target)")
    p.add_argument("--round-trips", type=int, default=5, help="park/resume round trips (>= 5 for medians)")
    p.add_argument("--warmup", type=int, default=2, help="training steps before the first round trip")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--chunk-mb", type=float, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--nvme-dir", default=None)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is there")
    p.add_argument("--json-out", default=None)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in this process
    p.add_argument("--case-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.round_trips < 1:
        p.error("--round-trips must be >= 1")
    if args.case is not None:
        result = run_case(args)
        with open(args.case_out, "w") as f:
            json.dump(result, f)
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    results, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:  # one process per case
            out = os.path.join(tmp, f"{case}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                   "--case", case, "--case-out", out]
            rc = subprocess.call(cmd)
            if rc or not os.path.exists(out):
                failed.append(case)
                print(f"[{case}] failed (exit {rc})", flush=True)
                continue
            with open(out) as f:
                results.append(json.load(f))
    report = {"question": "park/resume wall time and GPU memory freed", "machine": machine(),
              "args": {k: v for k, v in vars(args).items() if k not in ("case", "case_out")}, "results": results,
              "failed": failed}
    for r in results:
        s = r["summary"]
        print(f"[{r['case']}] {r['model']} params {r['placement']['params']}, optimizer {r['placement']['optimizer']}"
              f" -> {r['target']}: park {s['park_s']:.3f} s ({s['park_gib_s']:.1f} GiB/s), resume "
              f"{s['resume_s']:.3f} s ({s['resume_gib_s']:.1f} GiB/s), {s['bytes_parked'] / GiB:.2f} GiB parked"
              + (f", freed {s['freed_driver'] / GiB:.2f} GiB to the driver ({s['freed_allocated'] / GiB:.2f} allocated, "
                 f"{s['freed_reserved'] / GiB:.2f} reserved), {s['left_allocated'] / 2**20:.1f} MiB left"
                 if "freed_driver" in s else "")
              + f"; first park {s['first_park_s']:.3f} s; step {s['step_s']:.3f} s, right after resume "
              f"{s['step_after_resume_s']:.3f} s; checksums {'kept' if s['checksums_kept'] else 'CHANGED'}",
              flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed or not all(r["summary"]["checksums_kept"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
