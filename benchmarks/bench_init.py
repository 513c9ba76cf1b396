"""How long do ``zero_offload.initialize``, ``engine.close()`` and the process's exit take, per
billion parameters? (issue 24, part 4: start and stop at memory speed; goal: initialize <= 3 s
per billion params on the GPU hosts, close and exit never the slowest part)

Each case runs in a process of its own (the driver starts one per case: no case sees another's
page cache of the model, pinned memory or allocator), and in it:

  reference: the values the model's own init gives (``GPT.init_param`` in ``named_parameters``
             order after ``torch.manual_seed(seed)``, one parameter at a time on one thread), or
             the tensors of the weights file
  timing:    ``initialize`` of a GPT preset built on the meta device, filled by
             ``init=model.init_param`` ("meta-*") or streamed from a safetensors file
             ("weights-*": written by the driver before the cases, so it is in the page cache);
             then ``--steps`` training steps, ``close()``, and the exit (from the case's last
             line to the driver seeing the process end: interpreter teardown and freeing the
             memory)
  check:     after the timed initialize (``--check``; by default up to 3e9 params), the engine's
             values of a first, a middle and a last parameter equal the reference bit for bit

Cases (``--cases``): ``meta-auto`` / ``weights-auto`` (params "auto", optimizer "auto", with
``--nvme-dir`` when given), ``meta-cpu`` / ``weights-cpu`` (params "cpu", optimizer "cpu"),
``meta-nvme`` (params "cpu", optimizer "nvme"; needs ``--nvme-dir``), ``meta-auto-open`` (as
meta-auto, but the process exits with the engine open: exit frees it), ``pin-probe`` (no
engine: GiB/s of touching fresh host memory and of pinning it with and without the touch, over
``--probe-gib``). Default: every case that applies (meta-nvme only with ``--nvme-dir``).

Each row carries ``params``, ``world`` (1), ``init_s``, ``init_s_per_b`` (seconds per 1e9
params), ``close_s``, ``exit_s``, ``init_cpu_s`` / ``close_cpu_s`` (the process's CPU seconds in
them, all threads: the work, apart from what a busy machine adds to the wall time), ``host_bytes_per_param`` (peak RSS of the case's process
from its start, divided by the params) and, with ``--profile`` (default), the top functions of
``initialize`` by own time.

Usage (GPU machine; results in benchmarks/results/init_<hardware>_<date>.json):

    python3 benchmarks/bench_init.py --model 1.3b --json-out OUT/init.json [--nvme-dir /mnt/nvme/zo]
    python3 benchmarks/bench_init.py --model 13b --cases meta-auto --steps 1 --nvme-dir /mnt/nvme/zo --json-out OUT/init13.json
    python3 benchmarks/bench_init.py --model tiny --steps 1 --json-out /tmp/init.json   # a CPU smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from _host import machine

T_START = time.time()

GiB = float(2 ** 30)
CASES = {
    "meta-auto": dict(source="meta", params="auto", optimizer="auto"),
    "meta-cpu": dict(source="meta", params="cpu", optimizer="cpu"),
    "weights-auto": dict(source="weights", params="auto", optimizer="auto"),
    "weights-cpu": dict(source="weights", params="cpu", optimizer="cpu"),
    "meta-nvme": dict(source="meta", params="cpu", optimizer="nvme"),
    "meta-auto-open": dict(source="meta", params="auto", optimizer="auto", close=False),
}
SEED = 0
WEIGHTS_FILE = "model.safetensors"


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM); 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key)), 0)
    except OSError:
        return 0


def _config(args):
    from zero_offload.models import preset
    return preset(args.model, **({"n_layer": args.n_layer} if args.n_layer else {}))


def _sample_names(model) -> list:
    names = [n for n, _ in model.named_parameters()]
    return sorted({names[0], names[len(names) // 2], names[-1]})


def _reference(model, cfg, names, weights) -> dict:
    """The sampled parameters' reference values (see the module docstring)."""
    import torch
    if weights is not None:
        from safetensors import safe_open
        with safe_open(weights, framework="pt", device="cpu") as f:
            keys = set(f.keys())
            return {n: f.get_tensor(n if n in keys else "wte.weight") for n in names}
    from zero_offload.models import GPT
    ref = GPT(cfg, device="meta")
    out = {}
    torch.manual_seed(SEED)
    with torch.no_grad():
        for name, p in ref.named_parameters():  # one at a time: memory stays one parameter
            t = torch.empty(p.shape)
            ref.init_param(name, t)
            if name in names:
                out[name] = t
    return out


def run_case(args) -> dict:
    import cProfile
    import pstats

    import torch
    import zero_offload as zo
    from zero_offload.models import GPT

    case = CASES[args.case]
    from zero_offload.runtime import swap_io
    if args.huge_pages is not None:  # [Note: huge pages]: the A/B against the engine's default
        swap_io.HUGE_PAGES = args.huge_pages
    if args.populate_threads is not None:  # [Note: fault in]: the A/B against the engine's default
        swap_io.POPULATE_THREADS = args.populate_threads
    t_imported = time.time()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda":
        torch.ones(1, device=device)  # the CUDA context first: not the engine's time
    cfg = _config(args)
    n = cfg.num_params()
    rss0 = _status("VmRSS:")
    with torch.device("meta"):
        model = GPT(cfg)
    weights = os.path.join(args.weights_dir, WEIGHTS_FILE) if case["source"] == "weights" else None
    nvme_dir = args.nvme_dir if case["optimizer"] in ("auto", "nvme") or case["params"] == "auto" else None
    ocfg = zo.OffloadConfig(params=case["params"], optimizer=case["optimizer"], nvme_dir=nvme_dir,
                            dtype="bf16", chunk_mb=args.chunk_mb, threads=args.threads,
                            activation_reserve=(int(args.activation_reserve * GiB) if args.activation_reserve
                                                else "auto"))
    torch.manual_seed(SEED)
    prof = cProfile.Profile() if args.profile else None
    t0, c0 = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-4, weight_decay=0.1), config=ocfg, device=device,
                           **({"weights": weights} if weights else {"init": model.init_param}))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if prof is not None:
        prof.disable()
    init_s, init_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    rss_init = _status("VmRSS:")
    print(f"[{args.case}] {args.model} {n / 1e9:.3f}B params: initialize {init_s:.2f} s "
          f"({init_s / (n / 1e9):.2f} s per billion)", flush=True)

    check = None
    if args.check or (args.check is None and n <= 3e9):
        names = _sample_names(model)
        expect = _reference(model, cfg, names, weights)
        got = engine.state_dict()
        bad = [k for k in names if not torch.equal(got[k].float().cpu(), expect[k].float())]
        check = {"params_compared": names, "equal": not bad, "differ": bad}
        del got, expect
        print(f"[{args.case}] check: {'equal' if not bad else 'DIFFER: ' + ', '.join(bad)} ({', '.join(names)})",
              flush=True)

    g = torch.Generator().manual_seed(1)
    step_s = []
    for _ in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
        t = time.perf_counter()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        engine.synchronize()
        step_s.append(time.perf_counter() - t)
    rss_steps = _status("VmRSS:")

    close_s = None
    close_cpu_s = None
    if case.get("close", True):
        t, c = time.perf_counter(), time.process_time()
        engine.close()
        close_s, close_cpu_s = time.perf_counter() - t, time.process_time() - c
        print(f"[{args.case}] close {close_s:.2f} s", flush=True)
    top = []
    if prof is not None:
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.profile_top]
        top = [{"function": f"{os.path.basename(f)}:{line}({fn})", "calls": v[1], "own_s": round(v[2], 4),
                "cumulative_s": round(v[3], 4)} for (f, line, fn), v in rows]
    peak = _status("VmHWM:")
    homes = [h.optimizer.value for h in engine.plan.homes if h.optimizer is not None]
    params_homes = [h.params.value for h in engine.plan.homes if h.params is not None]
    return {
        "case": args.case, "source": case["source"], "placement": {"params": case["params"],
                                                                   "optimizer": case["optimizer"]},
        "model": args.model, "params": n, "world": 1, "device": str(device), "huge_pages": swap_io.HUGE_PAGES,
        "populate_threads": swap_io.POPULATE_THREADS,
        "init_s": init_s, "init_s_per_b": init_s / (n / 1e9), "init_cpu_s": init_cpu_s,
        "init_parts": engine.init_seconds,
        "close_s": close_s, "close_s_per_b": None if close_s is None else close_s / (n / 1e9),
        "close_cpu_s": close_cpu_s,
        "step_s": step_s, "closed": close_s is not None,
        "import_s": t_imported - T_START,
        "host_bytes_per_param": peak / n, "host_bytes_per_param_over_start": (peak - rss0) / n,
        "rss_after_init_per_param": (rss_init - rss0) / n, "rss_after_steps_per_param": (rss_steps - rss0) / n,
        "check": check,
        "optimizer_homes": {t: homes.count(t) for t in sorted(set(homes))},
        "params_homes": {t: params_homes.count(t) for t in sorted(set(params_homes))},
        "profile_top": top,
    }


PROBE_WAYS = ("fill", "fill-1", "populate-1", "populate-4", "populate-8", "populate-16", "populate-8-huge",
              "fill-huge", "host-alloc")
"""The pin probe's ways to make a pinned buffer: torch's fill on its threads (``-1``: one thread),
``madvise(MADV_POPULATE_WRITE)`` over N threads ([Note: fault in] in swap_io.py), either in
transparent huge pages (``-huge``), each then ``cudaHostRegister``; and ``cudaHostAlloc`` (torch's
``pin_memory=True``), which does both."""


def run_pin_probe(args) -> dict:
    """What host memory costs before the engine uses it, on this machine: GiB/s of bringing fresh
    pages in (each of ``PROBE_WAYS``) and of pinning them (cudaHostRegister), each way twice
    over ``--probe-gib`` (the second round in the reverse order); every buffer is kept until the
    end, so that no way gets pages another one freed (the kernel would hand them out again,
    already backed by the host of a VM). Then unregistering and unmapping rates."""
    import mmap

    import torch
    from zero_offload.runtime import swap_io
    nbytes = int(args.probe_gib * GiB)
    cuda = torch.cuda.is_available()
    cudart = torch.cuda.cudart() if cuda else None
    out = {"case": "pin-probe", "bytes": nbytes, "threads": torch.get_num_threads(), "ways": {}}
    for key in ("enabled", "defrag"):
        with contextlib.suppress(OSError):
            with open(f"/sys/kernel/mm/transparent_hugepage/{key}") as f:
                out[f"thp_{key}"] = f.read().strip()
    with contextlib.suppress(OSError):
        out["kernel"] = os.uname().release
    kept = []
    threads = torch.get_num_threads()

    def one(way: str) -> dict:
        if way == "host-alloc":
            if not cuda:
                return {}
            t0 = time.perf_counter()
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            kept.append(t)
            return {"both_gib_s": nbytes / GiB / (time.perf_counter() - t0)}
        m = mmap.mmap(-1, nbytes)
        if way.endswith("-huge"):
            m.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(memoryview(m), dtype=torch.uint8)
        t0 = time.perf_counter()
        if way.startswith("fill"):
            if way == "fill-1":
                torch.set_num_threads(1)
            t.zero_()
            torch.set_num_threads(threads)
            how = "fill"
        else:
            how = swap_io.fault_in(t, threads=int(way.split("-")[1]))
        t1 = time.perf_counter()
        row = {"touch_gib_s": nbytes / GiB / (t1 - t0), "how": how}
        if cuda:
            ok = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)) == 0
            t2 = time.perf_counter()
            if ok:
                row["register_gib_s"] = nbytes / GiB / (t2 - t1)
                row["both_gib_s"] = nbytes / GiB / (t2 - t0)
        kept.append((m, t, cuda and "register_gib_s" in row))
        return row

    for rnd, order in enumerate((PROBE_WAYS, PROBE_WAYS[::-1])):
        for way in order:
            row = one(way)
            out["ways"].setdefault(way, []).append(row)
            print(f"[pin-probe] round {rnd} {way}: {json.dumps(row)}", flush=True)
    registered = [k[1].data_ptr() for k in kept if isinstance(k, tuple) and k[2]]
    t0 = time.perf_counter()
    for ptr in registered:
        cudart.cudaHostUnregister(ptr)
    if registered:
        out["unregister_gib_s"] = len(registered) * nbytes / GiB / (time.perf_counter() - t0)
    maps = [k[0] for k in kept if isinstance(k, tuple)]
    kept.clear()  # the tensors (and their memoryviews) go: the maps can close
    t0 = time.perf_counter()
    for m in maps:
        m.close()
    out["unmap_gib_s"] = len(maps) * nbytes / GiB / (time.perf_counter() - t0) if maps else None
    print(f"[pin-probe] {json.dumps({k: v for k, v in out.items() if k != 'ways'})}", flush=True)
    return out


def write_weights(args) -> float:
    """The weights file of the "weights-*" cases: ``GPT(preset)`` built on the CPU after
    ``torch.manual_seed(SEED)``, saved as safetensors (the tied head stored once, as
    ``save_pretrained`` does). Returns the seconds it took."""
    import torch
    from safetensors.torch import save_file
    from zero_offload.models import GPT
    t = time.perf_counter()
    torch.manual_seed(SEED)
    model = GPT(_config(args))
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, os.path.join(args.weights_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    return time.perf_counter() - t



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1.3b", help="a zero_offload.models preset (1.3b: 1.31B params)")
    p.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)} (default: all "
                                                 f"that apply)")
    p.add_argument("--n-layer", type=int, default=None, help="the preset with this many blocks (a model "
                                                                 "between two presets' sizes)")
    p.add_argument("--steps", type=int, default=2, help="training steps between initialize and close")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--chunk-mb", type=float, default=64)
    p.add_argument("--threads", type=int, default=None, help="OffloadConfig.threads (default: the engine's)")
    p.add_argument("--nvme-dir", default=None, help="swap directory of the auto and nvme cases")
    p.add_argument("--weights-dir", default=None, help="where the weights file is written (default: a "
                                                       "temporary directory, removed after)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="compare sampled parameters with the reference after initialize (default: up to "
                        "3e9 params; the check gathers the model's fp32 values and replays its init)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="cProfile initialize; each row lists its top functions by own time")
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--probe-gib", type=float, default=4.0, help="memory the pin-probe case touches and pins")
    p.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=None,
                   help="host buffers advised to transparent huge pages or not (default: the engine's "
                        "own, swap_io.HUGE_PAGES: off since the pin probe of session 16)")
    p.add_argument("--populate-threads", type=int, default=None,
                   help="threads bringing a pinned buffer's pages in (swap_io.POPULATE_THREADS; 0: torch's "
                        "fill; default: the engine's own)")
    p.add_argument("--activation-reserve", type=float, default=None,
                   help="GiB of OffloadConfig.activation_reserve (default: 'auto')")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is there")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per case")
    p.add_argument("--json-out", default=None)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in this process
    p.add_argument("--case-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case is not None:
        result = run_pin_probe(args) if args.case == "pin-probe" else run_case(args)
        result["t_end"] = time.time()
        with open(args.case_out, "w") as f:
            json.dump(result, f)
        return 0  # the driver times the exit from t_end
    cases = ([c for c in args.cases.split(",") if c] if args.cases else
             [c for c in CASES if c != "meta-nvme" or args.nvme_dir] + ["pin-probe"])
    unknown = [c for c in cases if c not in CASES and c != "pin-probe"]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    if "meta-nvme" in cases and not args.nvme_dir:
        p.error("meta-nvme needs --nvme-dir")
    results, failed = [], []
    with tempfile.TemporaryDirectory(prefix="zo_bench_init_") as tmp:
        weights_s = None
        if any(CASES.get(c, {}).get("source") == "weights" for c in cases):
            args.weights_dir = args.weights_dir or tmp
            os.makedirs(args.weights_dir, exist_ok=True)
            weights_s = write_weights(args)
            print(f"weights file written in {weights_s:.1f} s", flush=True)
        for case in cases:  # one process per case
            out = os.path.join(tmp, f"{case}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                   "--case", case, "--case-out", out]
            if args.weights_dir:
                cmd += ["--weights-dir", args.weights_dir]
            try:
                rc = subprocess.run(cmd, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            ended = time.time()
            if rc or not os.path.exists(out):
                failed.append({"case": case, "exit": rc})
                print(f"[{case}] failed ({rc})", flush=True)
                continue
            with open(out) as f:
                row = json.load(f)
            row["exit_s"] = ended - row.pop("t_end")
            print(f"[{case}] exit {row['exit_s']:.2f} s", flush=True)
            results.append(row)
    report = {"question": "initialize, close and exit seconds per billion params", "machine": machine(),
              "args": {k: v for k, v in vars(args).items() if k not in ("case", "case_out")},
              "weights_written_s": weights_s, "rows": results, "failed": failed}
    for r in results:
        if r["case"] == "pin-probe":
            continue
        print(f"[{r['case']}] {r['params'] / 1e9:.3f}B: init {r['init_s']:.2f} s = {r['init_s_per_b']:.2f} s/B, "
              f"close {'-' if r['close_s'] is None else format(r['close_s'], '.2f')} s, exit {r['exit_s']:.2f} s, "
              f"peak host {r['host_bytes_per_param']:.1f} B/param"
              + ("" if r["check"] is None else f", values {'equal' if r['check']['equal'] else 'DIFFER'}"),
              flush=True)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed or any(r.get("check") is not None and not r["check"]["equal"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
