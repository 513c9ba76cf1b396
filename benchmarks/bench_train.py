"""Training throughput of zero_offload against plain PyTorch (and torchao), one GPU, one process.

Question: how close does offloaded training come to its bound, and how does it compare with what
users would run instead? Every number below is measured in the same run, on the same machine:

- ``torch``: plain PyTorch, no offload: fp32 params on the GPU, bf16 autocast,
  ``torch.optim.AdamW(fused=True)`` on the GPU. Its step is also the first bound component.
- ``engine``: ``zero_offload.initialize`` with the placement of the case (params / optimizer
  state on cpu, nvme or auto), bf16.
- ``OffloadAdamW``: model on the GPU (fp32 params + bf16 autocast, as torchao's recipe), Adam
  state on the CPU (or NVMe), stepped during backward.
- ``torchao``: ``torchao.optim.CPUOffloadOptimizer(AdamW fused, offload_gradients=True)`` on the
  same model, when torchao imports.

Bound components (issue 5, case 1): the no-offload step; CPU-Adam over all params (native
``adam_step``, bf16 grads -> bf16 params, the machine's thread count, timed on a sample of
``--adam-sample`` elements and scaled to P); PCIe traffic (bytes moved per step by the engine /
pinned copy bandwidth measured here, H2D and D2H overlapping: the larger of the two). Case 2
adds the disk: bytes read + written per step / O_DIRECT bandwidth measured here through
``SwapSpace`` (the engine's I/O path) with chunk-sized requests.

Metrics: median step time over ``--steps`` timed steps after ``--warmup``; tokens/s; model TFLOPS
= (6·P·T + 12·L·H·S·T) / step; peak GPU memory (``max_memory_allocated``); peak host RSS (psutil,
sampled every 20 ms by a thread, per case); GPU stall share (engine: ``stats().gpu_stall_share``;
OffloadAdamW: seconds ``step()`` waited / step time).

Usage (GPU machine; results in benchmarks/results/train_<hardware>_<date>.md):

    python benchmarks/bench_train.py --model 1.3b --batch 8 --cases torch,engine-cpu,offload-adamw,torchao \
        --nvme-dir /tmp/zo --md-out out.md --json-out out.json
    python benchmarks/bench_train.py --model 1.3b --cases engine-nvme,engine-auto --nvme-dir /tmp/zo
    python benchmarks/bench_train.py --layers 35 --hidden 4096 --heads 32 --vocab 32000 --batch 4 \
        --cases engine-largest

On a CPU-only machine it runs the same code on the CPU with a tiny model (``--model tiny``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

import psutil
import torch

import zero_offload as zo
from zero_offload.models import GPT, GPTConfig, preset

GiB = float(2 ** 30)
CASES = ("torch", "engine-cpu", "offload-adamw", "offload-adamw-fwd", "torchao", "engine-nvme",
         "engine-auto", "offload-adamw-nvme", "engine-largest", "engine-gpu", "engine-share",
         "offload-adamw-share")


# ---------------------------------------------------------------------------------------------
# measurement helpers

class RssSampler:
    """Peak resident set size of this process, sampled by a daemon thread every ``period`` s."""

    def __init__(self, period: float = 0.02):
        self._proc = psutil.Process()
        self._period = period
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(self._period)

    def reset(self) -> None:
        self._peak = self._proc.memory_info().rss

    @property
    def peak(self) -> int:
        return max(self._peak, self._proc.memory_info().rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[int], None], *, warmup: int, steps: int, device,
               after_warmup: Callable[[], None] | None = None) -> list[float]:
    """Run ``warmup`` + ``steps`` calls of ``step(i)``; the wall time of each timed call (the
    device is synchronised at the end of each step, for timing only)."""
    for i in range(warmup):
        step(i)
    sync(device)
    if after_warmup is not None:
        after_warmup()
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(warmup + i)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram = psutil.virtual_memory().total / GiB
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU (CPU as device)"
    return (f"{gpu}; {cpu}, {len(os.sched_getaffinity(0))} cores; {ram:.0f} GiB RAM; "
            f"torch {torch.__version__}; CPU-Adam path {_isa()}")


def _isa() -> str:
    from zero_offload import cpu_adam
    return cpu_adam.isa()


def measure_pcie(device: torch.device, nbytes: int = 512 << 20, repeats: int = 5) -> tuple[float, float]:
    """Pinned H2D and D2H bandwidth in GB/s (medians) of one large copy."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        ts = []
        for _ in range(repeats + 1):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            ts.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(ts[1:]) / 1e9
    del host, dev
    return out["h2d"], out["d2h"]


def measure_cpu_adam(n: int, *, threads: int | None, chunk: int | None = None, passes: int = 4) -> float:
    """Native CPU-Adam time in seconds for ``n`` params: fp32 master + moments, bf16 grads, bf16
    out; median of ``passes - 1`` passes after a warm-up pass. ``chunk``: elements per kernel
    call (the engine's chunk size), None for one call."""
    from zero_offload.cpu_adam import adam_step
    from zero_offload.swap_io import aligned_empty

    def buf(dtype):
        t = aligned_empty(n * dtype.itemsize, dtype=dtype)
        t.zero_() if dtype is not torch.bfloat16 else t.fill_(1e-3)
        return t

    p, m, v = buf(torch.float32), buf(torch.float32), buf(torch.float32)
    g, out = buf(torch.bfloat16), buf(torch.bfloat16)
    chunk = chunk or n
    ts = []
    for step in range(1, passes + 1):
        t0 = time.perf_counter()
        for lo in range(0, n, chunk):
            sl = slice(lo, min(n, lo + chunk))
            adam_step(p[sl], g[sl], m[sl], v[sl], step=step, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                      weight_decay=0.1, adamw=True, out_lowp=out[sl], threads=threads)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def measure_disk(directory: str, nbytes: int, *, request: int = 64 << 20,
                 io_threads: int = 4, block: int = 1 << 20) -> tuple[float, float, bool]:
    """O_DIRECT write and read bandwidth (GB/s) through SwapSpace, ``request``-sized transfers
    kept in flight together (as the engine issues chunk moves), fresh data each time."""
    from zero_offload.swap_io import AioEngine, SwapSpace, aligned_empty
    n = max(1, nbytes // request)
    bufs = [aligned_empty(request) for _ in range(min(n, 8))]
    for b in bufs:
        b.copy_(torch.randint(0, 255, (request,), dtype=torch.uint8))
    with SwapSpace(directory, capacity_bytes=n * request,
                   engine=AioEngine(threads=io_threads, block_size=block)) as space:
        slots = [space.alloc(request) for _ in range(n)]
        out = {}
        for name in ("write", "read"):
            t0 = time.perf_counter()
            handles = [getattr(space, name)(s, bufs[i % len(bufs)]) for i, s in enumerate(slots)]
            for h in handles:
                h.wait()
            out[name] = n * request / (time.perf_counter() - t0) / 1e9
        direct = space.direct
    return out["write"], out["read"], direct


# ---------------------------------------------------------------------------------------------
# cases

@dataclasses.dataclass
class Result:
    """One row of the results table."""

    case: str
    engine: str
    s_step: float
    tokens_s: float
    tflops: float
    peak_gpu_gib: float
    peak_rss_gib: float
    stall_share: float | None = None
    bytes_per_step: dict = dataclasses.field(default_factory=dict)
    losses: list = dataclasses.field(default_factory=list)
    notes: str = ""
    step_times: list = dataclasses.field(default_factory=list)


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        self.cfg = model_config(args)
        self.params = self.cfg.num_params()
        self.tokens = args.batch * self.cfg.seq_len * args.accum  # per optimizer step
        self.flops = self.cfg.flops_per_token(self.cfg.seq_len) * self.tokens
        self.rss = RssSampler()
        self.results: list[Result] = []
        self.bounds: dict = {}
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.randint(0, self.cfg.vocab_size, (args.batch, self.cfg.seq_len), generator=g),
                      torch.randint(0, self.cfg.vocab_size, (args.batch, self.cfg.seq_len), generator=g))
                     for _ in range(4)]

    def batch(self, i):
        x, y = self.data[i % len(self.data)]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def build(self, *, device, dtype=None) -> GPT:
        torch.manual_seed(0)
        model = GPT(self.cfg, device=device, dtype=dtype)
        model.set_activation_checkpointing(self.args.checkpointing)
        return model

    def start_case(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self.rss.reset()

    def record(self, case, engine, times, *, losses, stall=None, moved=None, notes="") -> Result:
        med = statistics.median(times)
        peak_gpu = torch.cuda.max_memory_allocated(self.device) / GiB if self.device.type == "cuda" else 0.0
        r = Result(case=case, engine=engine, s_step=med, tokens_s=self.tokens / med,
                   tflops=self.flops / med / 1e12, peak_gpu_gib=peak_gpu, peak_rss_gib=self.rss.peak / GiB,
                   stall_share=stall, bytes_per_step=moved or {}, losses=losses, notes=notes,
                   step_times=times)
        self.results.append(r)
        print(f"[{case}] {engine}: {med:.3f} s/step, {r.tokens_s:,.0f} tok/s, {r.tflops:.1f} TFLOPS, "
              f"GPU {peak_gpu:.1f} GiB, RSS {r.peak_rss_gib:.1f} GiB"
              + (f", stall {stall:.1%}" if stall is not None else "") + (f"; {notes}" if notes else ""),
              flush=True)
        return r

    def trace_steps(self, name, engine, step, n_steps):
        """Two more steps with the engine's (or optimizer's) trace on, written as a Chrome trace
        (open in Perfetto)."""
        from zero_offload.pipeline import Trace

        engine.trace = Trace()
        for i in range(2):
            step(n_steps + i)
        engine.synchronize()
        os.makedirs(self.args.trace_dir, exist_ok=True)
        path = os.path.join(self.args.trace_dir, f"trace_{name}.json")
        engine.trace.write(path)
        engine.trace = None
        print(f"[{name}] trace of 2 steps -> {path}", flush=True)

    trace_optimizer = trace_steps  # OffloadAdamW has the same trace / synchronize surface

    # -- plain torch --------------------------------------------------------------------------

    def optimizer_step(self, model, opt, losses):
        """One training step of a torch-style optimizer loop (torch, OffloadAdamW, torchao share
        it, so the three differ only in the optimizer): bf16 autocast on CUDA, grads set to None."""
        amp = self.device.type == "cuda"

        accum = self.args.accum

        def step(i):
            for k in range(accum):  # --accum micro-batches per optimizer step
                x, y = self.batch(i * accum + k)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=amp):
                    loss = model(x, y)
                (loss / accum if accum > 1 else loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return step

    def case_torch(self):
        self.start_case()
        model = self.build(device=self.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        losses = []
        amp = self.device.type == "cuda"

        step = self.optimizer_step(model, opt, losses)

        times = time_steps(step, warmup=self.args.warmup, steps=self.args.steps, device=self.device)
        r = self.record("torch", "torch, no offload, AdamW fused" + (", bf16 autocast" if amp else ""),
                        times, losses=[float(x) for x in losses])
        self.bounds["no_offload_step_s"] = r.s_step
        del model, opt

    # -- the engine ---------------------------------------------------------------------------

    def case_engine(self, name, *, params, optimizer, nvme=False, cpu_budget="auto", build_dtype=None,
                    build_device="meta", steps=None, warmup=None):
        self.start_case()
        nvme_dir = self.nvme_dir() if nvme or optimizer == "auto" or params == "auto" else None
        model = self.build(device=build_device, dtype=build_dtype)  # meta: initialize fills it
        cap = self.args.gpu_cap
        if cap and self.device.type == "cuda":  # the engine's whole process held to `cap` GiB
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GiB / total), torch.cuda.current_device())
        gpu_budget = int((self.args.gpu_budget or cap) * GiB) if (self.args.gpu_budget or cap) else "auto"
        cfg = zo.OffloadConfig(params=params, optimizer=optimizer, nvme_dir=nvme_dir, dtype="bf16",
                               chunk_mb=self.args.chunk_mb, prefetch_depth=self.args.depth,
                               cpu_budget=cpu_budget, gpu_budget=gpu_budget, threads=self.args.threads,
                               grad_accum=self.args.accum, grad_sync=self.args.grad_sync,
                               moments_dtype=self.args.moments_dtype,
                               activation_reserve=("auto" if self.args.activation_reserve is None
                                                   else int(self.args.activation_reserve * GiB)))
        t0 = time.perf_counter()
        engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-4, weight_decay=0.1), config=cfg,
                               device=self.device,
                               init=model.init_param if build_device == "meta" else None)
        init_s = time.perf_counter() - t0
        del model
        losses = []

        accum = self.args.accum

        def step(i):
            for k in range(accum):  # --accum micro-batches; the engine updates at the last
                x, y = self.batch(i * accum + k)
                loss = engine(x, y)
                engine.backward(loss / accum if accum > 1 else loss)
                engine.step()
            losses.append(loss.detach())

        n_steps = steps or self.args.steps
        times = time_steps(step, warmup=warmup if warmup is not None else self.args.warmup, steps=n_steps,
                           device=self.device, after_warmup=engine.reset_stats)
        st = engine.stats()
        moved = {hop: n / n_steps for hop, n in st.bytes_moved.items()}
        held = {t: n / GiB for t, n in st.bytes_held.items()}
        notes = (f"init {init_s:.0f} s; held GiB " + ", ".join(f"{t} {n:.1f}" for t, n in held.items())
                 + f"; hit rate {st.prefetch_hit_rate:.0%}"
                 + (f", fetched ahead {st.prefetch_ahead_rate:.0%}" if hasattr(st, "prefetch_ahead_rate") else "")
                 + f"; per step: forward {st.forward_s / n_steps:.3f} s, backward {st.backward_s / n_steps:.3f} s, "
                 f"step() {st.step_s / n_steps:.3f} s, CPU-Adam kernels {st.adam_s / n_steps:.3f} s "
                 f"(worker busy {st.worker_busy_s / n_steps:.3f} s), "
                 f"fetch stall {st.fetch_stall_s / n_steps:.3f} s, update stall {st.update_stall_s / n_steps:.3f} s")
        homes = [h.optimizer.value for h in engine.plan.homes if h.optimizer is not None]
        notes += "; optimizer homes " + ", ".join(f"{t} {homes.count(t)}" for t in sorted(set(homes))) \
            + f" of {len(homes)} chunks"
        r = self.record(name, f"zero_offload engine, params {params}, optimizer {optimizer}"
                        + (f", moments {self.args.moments_dtype}" if self.args.moments_dtype != "fp32" else ""),
                        times,
                        losses=[float(x) for x in losses], stall=st.gpu_stall_share, moved=moved, notes=notes)
        r.bytes_per_step["held_gib"] = held
        if self.args.trace_dir:
            self.trace_steps(name, engine, step, n_steps)
        engine.close()
        del engine
        if cap and self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
        return r

    # -- optimizer only -----------------------------------------------------------------------

    def case_offload_adamw(self, name="offload-adamw", *, state="cpu", threads=None, steps=None, warmup=None,
                           overlap_forward=False):
        self.start_case()
        model = self.build(device=self.device)
        share = {}
        if state == "auto":  # the GPU share: --gpu-budget GiB of optimizer state on the GPU
            if not self.args.gpu_budget:
                raise SystemExit("offload-adamw-share needs --gpu-budget GiB (the optimizer's GPU share)")
            share["gpu_budget"] = int(self.args.gpu_budget * GiB)
            if self.args.gpu_cap and self.device.type == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.args.gpu_cap * GiB / total),
                                                           torch.cuda.current_device())
        opt = zo.OffloadAdamW(model.parameters(), lr=1e-4, weight_decay=0.1, state=state, **share,
                              nvme_dir=self.nvme_dir() if state == "nvme" else None,
                              chunk_mb=self.args.adamw_chunk_mb or self.args.chunk_mb,
                              threads=threads or self.args.threads,
                              **({"overlap_forward": True} if overlap_forward else {}))
        losses = []

        step = self.optimizer_step(model, opt, losses)

        times = time_steps(step, warmup=self.args.warmup if warmup is None else warmup,
                           steps=steps or self.args.steps, device=self.device, after_warmup=opt.reset_stats)
        s = opt.stats
        total = sum(times)
        read, written = opt.nvme_bytes()
        moved = {"gpu->cpu": s.d2h_bytes / len(times), "cpu->gpu": s.h2d_bytes / len(times),
                 "nvme->cpu": read / len(times), "cpu->nvme": written / len(times)}
        self.record(name, f"zero_offload OffloadAdamW (state {state}; fp32 params on GPU, bf16 autocast; "
                    f"{'update overlaps backward and the next forward' if overlap_forward else 'update overlaps backward'}; "
                    f"CPU-Adam threads {opt._threads or 'all'})",
                    times, losses=[float(x) for x in losses], stall=s.step_wait_s / total, moved=moved,
                    notes=f"CPU-Adam {s.adam_s / len(times):.3f} s/step on the worker")
        if self.args.trace_dir and hasattr(opt, "trace"):
            self.trace_optimizer(name, opt, step, len(times))
        opt.close()
        del model, opt

    def case_torchao(self):
        try:
            from torchao.optim import CPUOffloadOptimizer
        except Exception as e:  # report, don't fail the run
            print(f"[torchao] not importable: {e!r}", flush=True)
            self.results.append(Result(case="torchao", engine="torchao CPUOffloadOptimizer", s_step=float("nan"),
                                       tokens_s=float("nan"), tflops=float("nan"), peak_gpu_gib=float("nan"),
                                       peak_rss_gib=float("nan"), notes=f"not importable: {e!r}"))
            return
        import torchao
        self.start_case()
        model = self.build(device=self.device)
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True,
                                  fused=True, lr=1e-4, weight_decay=0.1)
        losses = []

        step = self.optimizer_step(model, opt, losses)

        times = time_steps(step, warmup=self.args.warmup, steps=self.args.steps, device=self.device)
        self.record("torchao", f"torchao {torchao.__version__} CPUOffloadOptimizer (fp32 params on GPU, bf16 "
                    f"autocast; AdamW fused on CPU, offload_gradients)", times, losses=[float(x) for x in losses])
        del model, opt

    # -- bounds -------------------------------------------------------------------------------

    def measure_bounds(self):
        h2d, d2h = measure_pcie(self.device)
        self.bounds["pcie_h2d_GBps"], self.bounds["pcie_d2h_GBps"] = h2d, d2h
        # [Note: CPU-Adam bound] Over all params, in the engine's chunk-sized calls, on every core
        # (the engine itself leaves two cores to the threads driving the GPU), when host memory
        # has room for a second copy of the optimizer state (16 B/param); otherwise from a
        # sample. On the H100 host the two differed by up to 14% per param, either way, between
        # calls (host noise), so both are recorded when both are measured.
        n = min(self.params, self.args.adam_sample)
        sample_s = measure_cpu_adam(n, threads=self.args.threads)
        rate = n / sample_s
        self.bounds["cpu_adam_sample_params"] = n
        self.bounds["cpu_adam_sample_all_params_s"] = self.params / rate
        need = self.params * 16 * 1.3
        if self.params <= n:
            all_s = sample_s
            self.bounds["cpu_adam_bound_from"] = "all params"
        elif psutil.virtual_memory().available > need + (8 << 30):
            chunk = int(self.args.chunk_mb * 2 ** 20) // 2
            all_s = measure_cpu_adam(self.params, threads=self.args.threads, chunk=chunk)
            self.bounds["cpu_adam_bound_from"] = "all params"
        else:
            all_s = self.params / rate
            self.bounds["cpu_adam_bound_from"] = f"a sample of {n / 1e6:.0f}M params"
        gc.collect()
        self.bounds["cpu_adam_params_per_s"] = self.params / all_s
        self.bounds["cpu_adam_all_params_s"] = all_s
        rate = self.params / all_s
        print(f"[bounds] PCIe pinned H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s; CPU-Adam {rate / 1e9:.2f} "
              f"Gparam/s -> {all_s:.3f} s for {self.params / 1e9:.2f}B params (measured over "
              f"{self.bounds['cpu_adam_bound_from']}; a {n / 1e6:.0f}M sample gives "
              f"{self.bounds['cpu_adam_sample_all_params_s']:.3f} s)", flush=True)

    def measure_disk_bounds(self):
        w, r, direct = measure_disk(self.nvme_dir(), self.args.disk_probe_mb << 20,
                                    request=max(4096, int(self.args.chunk_mb * 2 ** 20) // 4096 * 4096))
        self.bounds["disk_write_GBps"], self.bounds["disk_read_GBps"] = w, r
        self.bounds["disk_o_direct"] = direct
        print(f"[bounds] disk ({'O_DIRECT' if direct else 'buffered'}): write {w:.2f} GB/s, read {r:.2f} GB/s",
              flush=True)

    def nvme_dir(self) -> str:
        if self.args.nvme_dir is None:
            self.args.nvme_dir = tempfile.mkdtemp(prefix="zo_bench_")
        os.makedirs(self.args.nvme_dir, exist_ok=True)
        return self.args.nvme_dir

    def bound_for(self, r: Result) -> dict:
        """Bound components for an engine row, from its bytes per step and this run's bandwidths."""
        b = self.bounds
        out = {}
        if "no_offload_step_s" in b:
            out["no-offload step"] = b["no_offload_step_s"]
        if "cpu_adam_all_params_s" in b:
            out[f"CPU-Adam over {b.get('cpu_adam_bound_from', 'all params')}"] = b["cpu_adam_all_params_s"]
        mv = r.bytes_per_step
        if mv and b.get("pcie_h2d_GBps", float("nan")) == b.get("pcie_h2d_GBps"):
            out["PCIe traffic"] = max(mv.get("cpu->gpu", 0) / (b["pcie_h2d_GBps"] * 1e9),
                                      mv.get("gpu->cpu", 0) / (b["pcie_d2h_GBps"] * 1e9))
        if mv and mv.get("nvme->cpu", 0) + mv.get("cpu->nvme", 0) > 0 and "disk_read_GBps" in b:
            out["disk traffic"] = (mv.get("nvme->cpu", 0) / (b["disk_read_GBps"] * 1e9)
                                   + mv.get("cpu->nvme", 0) / (b["disk_write_GBps"] * 1e9))
        return out


def model_config(args) -> GPTConfig:
    if args.layers is not None:
        return GPTConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.hidden,
                         seq_len=args.seq)
    cfg = preset(args.model)
    return dataclasses.replace(cfg, seq_len=args.seq) if args.seq else cfg


# ---------------------------------------------------------------------------------------------
# report

def markdown(bench: Bench, header: str) -> str:
    cfg, args = bench.cfg, bench.args
    lines = [f"# Training throughput: {header}", "",
             f"Machine: {machine(bench.device)}", "",
             f"Model: GPT {bench.params / 1e9:.2f}B params ({cfg.n_layer}L, hidden {cfg.d_model}, {cfg.n_head} "
             f"heads, vocab {cfg.vocab_size}, seq {cfg.seq_len}, tied embedding), micro-batch {args.batch}, "
             f"bf16, random tokens. Median of {args.steps} steps after {args.warmup} warm-up "
             f"(NVMe cases: {args.nvme_steps} after 1). Chunk {args.chunk_mb:g} MiB, prefetch depth {args.depth}.",
             "", f"Command: `{' '.join(sys.argv)}`", "",
             "| case | engine | s/step | tokens/s | TFLOPS | peak GPU GiB | peak host RSS GiB | GPU stall share |",
             "|---|---|---|---|---|---|---|---|"]
    for r in bench.results:
        stall = "" if r.stall_share is None else f"{r.stall_share:.1%}"
        lines.append(f"| {r.case} | {r.engine} | {r.s_step:.3f} | {r.tokens_s:,.0f} | {r.tflops:.1f} | "
                     f"{r.peak_gpu_gib:.1f} | {r.peak_rss_gib:.1f} | {stall} |")
    b = bench.bounds
    lines += ["", "Measured in this run: "
              + "; ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in b.items()), ""]
    torch_row = next((r for r in bench.results if r.case == "torch"), None)
    for r in bench.results:
        if not r.case.startswith("engine") and not r.case.startswith("offload"):
            continue
        comps = bench.bound_for(r)
        if not comps:
            continue
        bound = max(comps.values())
        lines.append(f"- **{r.case}**: bound = max(" + ", ".join(f"{k} {v:.3f} s" for k, v in comps.items())
                     + f") = {bound:.3f} s; step / bound = **{r.s_step / bound:.2f}x**"
                     + (f"; vs plain torch {r.s_step / torch_row.s_step:.2f}x" if torch_row else ""))
        mv = {k: v for k, v in r.bytes_per_step.items() if isinstance(v, (int, float)) and v}
        if mv:
            lines.append("  bytes/step: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in mv.items()))
        if r.notes:
            lines.append(f"  {r.notes}")
    for r in bench.results:
        if r.losses:
            lines.append(f"- losses {r.case}: " + ", ".join(f"{x:.4f}" for x in r.losses))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.3b", help="preset name (zero_offload.models.PRESETS)")
    ap.add_argument("--layers", type=int, help="custom model: layers (with --hidden/--heads/--vocab)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches per optimizer step (tokens/step = batch x seq x accum), "
                         "torch and engine cases")
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing on every block (torch and engine cases)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nvme-steps", type=int, default=2)
    ap.add_argument("--cases", default="torch,engine-cpu,offload-adamw,torchao",
                    help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--depth", type=int, default=2, help="prefetch depth")
    ap.add_argument("--chunk-mb", type=float, default=64.0)
    ap.add_argument("--threads", type=int, default=None, help="CPU-Adam threads (default: all cores)")
    ap.add_argument("--trace-dir", default=None,
                    help="after timing, trace two more engine steps into DIR/trace_<case>.json "
                         "(Chrome trace: open in https://ui.perfetto.dev)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the whole run (seconds; default: Python's own)")
    ap.add_argument("--adamw-chunk-mb", type=float, default=None,
                    help="chunk_mb of the OffloadAdamW cases (MiB of fp32 master per chunk; default: "
                         "--chunk-mb)")
    ap.add_argument("--adamw-threads", type=int, default=None,
                    help="CPU-Adam threads of the OffloadAdamW cases (default: --threads)")
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--gpu-cap", type=float, default=None,
                    help="engine cases: hold the process to this many GiB of GPU memory "
                         "(torch.cuda.set_per_process_memory_fraction) and use it as gpu_budget")
    ap.add_argument("--gpu-budget", type=float, default=None,
                    help="engine cases: gpu_budget in GiB; offload-adamw-share: its gpu_budget (required)")
    ap.add_argument("--activation-reserve", type=float, default=None,
                    help="engine cases: OffloadConfig.activation_reserve in GiB (default: half the budget)")
    ap.add_argument("--moments-dtype", default="fp32", choices=("fp32", "bf16"),
                    help="engine cases: OffloadConfig.moments_dtype (bf16: stochastically rounded, inexact)")
    ap.add_argument("--grad-sync", default="every", choices=("every", "final"),
                    help="engine cases with --accum > 1: OffloadConfig.grad_sync")
    ap.add_argument("--largest-cpu-budget", default="auto",
                    help="engine-largest: cpu_budget (optimizer state beyond it spills to NVMe)")
    ap.add_argument("--largest-params", default="gpu", help="engine-largest: params placement")
    ap.add_argument("--adam-sample", type=int, default=128 << 20, help="elements for the CPU-Adam bound")
    ap.add_argument("--disk-probe-mb", type=int, default=4096)
    ap.add_argument("--cpu", action="store_true", help="use the CPU as the device even with CUDA")
    ap.add_argument("--md-out", default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    bench = Bench(args)
    print(f"machine: {machine(bench.device)}\nmodel: {bench.params / 1e9:.3f}B params, {bench.tokens} tokens/step",
          flush=True)
    bench.measure_bounds()
    if any("nvme" in c or c in ("engine-auto", "engine-largest") for c in cases):
        bench.measure_disk_bounds()
    failures = {}
    for case in cases:
        try:
            if case == "torch":
                bench.case_torch()
            elif case == "engine-cpu":
                bench.case_engine(case, params="cpu", optimizer="cpu")
            elif case == "engine-nvme":
                bench.case_engine(case, params="cpu", optimizer="nvme", nvme=True, steps=args.nvme_steps, warmup=1)
            elif case == "engine-auto":
                bench.case_engine(case, params="cpu", optimizer="auto", nvme=True)
            elif case == "engine-gpu":
                bench.case_engine(case, params="gpu", optimizer="cpu")
            elif case == "engine-share":  # [Note: GPU share]: optimizer state of the first chunks on the GPU
                bench.case_engine(case, params="gpu", optimizer="auto", nvme=True)
            elif case == "offload-adamw":
                bench.case_offload_adamw(threads=args.adamw_threads)
            elif case == "offload-adamw-fwd":
                bench.case_offload_adamw(case, threads=args.adamw_threads, overlap_forward=True)
            elif case == "offload-adamw-share":  # state="auto": the first chunks' state on the GPU
                bench.case_offload_adamw(case, state="auto", threads=args.adamw_threads, overlap_forward=True)
            elif case == "offload-adamw-nvme":
                bench.case_offload_adamw(case, state="nvme", threads=args.adamw_threads,
                                         steps=args.nvme_steps, warmup=1)
            elif case == "torchao":
                bench.case_torchao()
            elif case == "engine-largest":
                bench.case_engine(case, params=args.largest_params, optimizer="auto", nvme=True,
                                  cpu_budget=args.largest_cpu_budget, steps=args.nvme_steps, warmup=1)
        except Exception as e:  # keep the other cases' numbers; the failure goes in the report
            import traceback
            traceback.print_exc()
            failures[case] = repr(e)
            gc.collect()
    bench.rss.stop()
    title = args.title or f"{bench.params / 1e9:.2f}B GPT"
    md = markdown(bench, title)
    if failures:
        md += "\nFailed cases:\n" + "".join(f"- {c}: `{e}`\n" for c, e in failures.items())
    print(md)
    if args.md_out:
        with open(args.md_out, "w") as fh:
            fh.write(md)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"machine": machine(bench.device), "date": datetime.date.today().isoformat(),
                       "params": bench.params, "tokens_per_step": bench.tokens, "bounds": bench.bounds,
                       "results": [dataclasses.asdict(r) for r in bench.results], "failures": failures,
                       "argv": sys.argv}, fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
