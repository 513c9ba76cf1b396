"""CPU-Adam throughput: zero_offload's kernel vs torch's CPU Adam, side by side in one process.

Question: is CPUAdam faster than torch.optim.Adam(fused=True) on the update an offload engine
really does, and how close is it to the memory bandwidth the machine has?

Cases, at each size (default 100M and 200M params), all on the same thread count (--threads sets
OMP_NUM_THREADS and torch.set_num_threads for every implementation, ours included):
  (a) fp32 grads, no copy-out:   CPUAdam.step  vs  torch Adam(fused=True).step  vs  Adam(foreach=True)
                                 vs  DeepSpeedCPUAdam.step
  (b) the offload update, bf16 grads in and bf16 params out:
        ours:   adam_step(param, grad_bf16, ..., out_lowp=param_bf16)   (one pass)
        torch:  g32.copy_(grad_bf16); Adam(fused=True).step(); out.copy_(param)
                (the "torch composite": g32 is the param's .grad and out the bf16 copy, both
                allocated once, so no step pays allocation or page faults, as in an engine)
        DeepSpeedCPUAdam composite: the same with its step. DeepSpeed 0.19's adam_update reads the
                grad in the param's dtype (cpu_adam_impl.cpp, step_invoker) and has no copy-out
                (ZeRO-Offload widens grads into an fp32 buffer and copies params out itself), so
                fp32 params + bf16 grads is not an option it has.
  DeepSpeedCPUAdam is imported lazily; its op JIT-builds on first use (about a minute). When
  deepspeed is missing or its op cannot build (or its step differs from torch's AdamW), its rows
  say "not available: <reason>".
  --moments bf16 adds to (b), in the same interleaved loop:
        ours, bf16 moments: adam_step(param, grad_bf16, m_bf16, v_bf16, ..., out_lowp=param_bf16,
                            seed=step)   (moments stored by stochastic rounding)
      and reports its throughput over the fp32-moment kernel's ("vs fp32 moments").
Reference -> check -> timing: before timing, the script checks that our result equals torch's
fused result bit for bit (all but the last numel % 16 elements, where torch runs a scalar loop);
with --moments bf16, also that the bf16-moment kernel gives the fp32-moment kernel's params on
the same (widened) moments and stores each moment as one of its two bf16 neighbours.

Reported per implementation: median seconds per step over --repeats (the implementations are
interleaved within each repeat, so machine noise hits them alike), Mparams/s, GB/s counting the
minimum traffic of the update (28 bytes/param for both cases: fp32 param, exp_avg, exp_avg_sq
read+written = 24, plus the grad read and, in (b), the bf16 copy written; 20 bytes/param with
bf16 moments), the ratio to torch,
and the percentage of an in-place read-modify-write bandwidth (x.mul_(c) over --rmw-gib GiB,
2 x bytes per pass) timed in the same interleaved loop. The percentage is given only where both
the update's working set (its bytes per param x params) and the RMW buffer exceed twice the L3
cache (read from sysfs): below that, it would compare cache speed with DRAM speed.

    zero-offload bench adam --threads 2 --sizes 100M,200M --repeats 5 \
        --json-out /tmp/cpu_adam.json --md-out cpu_adam_<hw>_<date>.md
    zero-offload bench adam --threads 2 --cases b --moments bf16 --repeats 9

(``python benchmarks/bench_cpu_adam.py ARGS`` in a source checkout runs the same ``main``.)
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import itertools
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from ..ops.cpu_adam import CPUAdam, adam_step, default_threads, isa, set_isa
from . import command_line, cpu_model, publish, timed

BYTES_PER_PARAM = 28  # see the module docstring
BYTES_PER_PARAM_BF16_MOMENTS = 20  # fp32 param r+w 8, bf16 exp_avg, exp_avg_sq r+w 8, bf16 grad, bf16 copy
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
OURS_B = "zero_offload adam_step"
OURS_B_BF16 = "zero_offload adam_step, bf16 moments"
TORCH_B = "torch composite"


@dataclass(frozen=True, kw_only=True)
class Result:
    """One implementation's timing of one case at one size."""

    case: str
    """"a" (fp32 grads, no copy-out), "b" (bf16 grads in, bf16 params out) or "rmw"."""
    impl: str
    numel: int
    """Params updated per step."""
    seconds: list[float] = field(default_factory=list)
    """Every timed step, in order."""
    median_s: float = 0.0
    mparams_per_s: float = 0.0
    """numel / median_s / 1e6."""
    gb_per_s: float = 0.0
    """The minimum traffic of the update (BYTES_PER_PARAM*) per median_s, in 1e9 bytes/s."""
    ratio_to_torch: Optional[float] = None
    """Our Mparams/s over torch fused's (case a) or torch composite's (case b)."""
    ratio_to_fp32_moments: Optional[float] = None
    """bf16-moment row (--moments bf16): its Mparams/s over the fp32-moment kernel's (case b)."""
    pct_of_rmw: Optional[float] = None
    """gb_per_s as a percentage of the RMW bandwidth measured in this run; None where the working
    set or the RMW buffer does not exceed twice the L3 cache (see ``l3_cache_bytes``)."""
    note: Optional[str] = None
    """Set on a row that was not timed: "not available: <reason>" (DeepSpeedCPUAdam)."""


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


RMW = "x.mul_(c), RMW reference"


def rmw_buffer(gib: float) -> torch.Tensor:
    """The in-place read-modify-write reference: x.mul_(c) over `gib` GiB of fp32 moves 2 x its
    bytes. Timed inside the same interleaved loop as the optimizers, so it sees the same noise."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.mul_(1.0)  # fault the pages in
    return x


def l3_cache_bytes() -> Optional[int]:
    """Total L3 cache of the machine in bytes (every distinct L3 instance once, from
    /sys/devices/system/cpu/cpu*/cache), or None where sysfs does not say."""
    total, seen = 0, set()
    for index in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            with open(f"{index}/level") as f:
                if f.read().strip() != "3":
                    continue
            with open(f"{index}/shared_cpu_list") as f:
                shared = f.read().strip()
            with open(f"{index}/size") as f:
                size = f.read().strip().upper()
        except OSError:
            continue
        if shared in seen:
            continue
        seen.add(shared)
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        total += int(size[:-1] if scale != 1 else size) * scale
    return total or None


def beyond_cache(nbytes: int, l3: Optional[int]) -> bool:
    """Whether ``nbytes`` of working set measures DRAM, not cache: more than twice the L3 (True
    when the L3 size is unknown; the report says so)."""
    return l3 is None or nbytes > 2 * l3


def check_parity() -> None:
    """Reference -> check: our step equals torch's fused step on a small buffer."""
    n = 100_003
    gen = torch.Generator().manual_seed(0)
    init, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    ref = init.clone().requires_grad_()
    ref.grad = grad.to(torch.bfloat16).float()
    torch.optim.AdamW([ref], fused=True, **HYPER).step()
    param, m, v, out = init.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
    adam_step(param, grad.to(torch.bfloat16), m, v, step=1, adamw=True, out_lowp=out, **HYPER)
    body = n - n % 16
    if not torch.equal(param[:body], ref.detach()[:body]) or not torch.equal(out, param.to(torch.bfloat16)):
        raise SystemExit("parity check failed: CPU-Adam differs from torch fused AdamW; not timing a wrong kernel")


def check_bf16_moments() -> None:
    """Reference -> check for --moments bf16: on the same moment values (bf16, widened to fp32 for
    the fp32 kernel) the bf16-moment kernel gives the fp32 kernel's params and copy-out bit for
    bit, and stores each new moment as the fp32 kernel's value truncated to bf16 or one ulp
    further from zero (the two stochastic-rounding outcomes)."""
    n = 100_003
    gen = torch.Generator().manual_seed(2)
    init, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    m0 = torch.randn(n, generator=gen).mul_(1e-2).to(torch.bfloat16)
    v0 = torch.rand(n, generator=gen).mul_(1e-4).to(torch.bfloat16)
    p32, m32, v32, out32 = init.clone(), m0.float(), v0.float(), torch.empty(n, dtype=torch.bfloat16)
    adam_step(p32, grad, m32, v32, step=3, adamw=True, out_lowp=out32, **HYPER)
    p16, m16, v16, out16 = init.clone(), m0.clone(), v0.clone(), torch.empty(n, dtype=torch.bfloat16)
    adam_step(p16, grad, m16, v16, step=3, adamw=True, out_lowp=out16, seed=3, **HYPER)
    ok = torch.equal(p16, p32) and torch.equal(out16, out32)
    for wide, low in ((m32, m16), (v32, v16)):
        trunc = wide.view(torch.int32).to(torch.int64) >> 16
        got = low.view(torch.int16).to(torch.int64)
        ok = ok and bool(((got == trunc) | (got == trunc + 1)).all())
    if not ok:
        raise SystemExit("bf16-moment check failed: the bf16-moment kernel differs from the fp32 one; not timing it")


class Composite:
    """Case (b) as an engine would run a stock optimizer: the bf16 grad widened into a preallocated
    fp32 buffer (the param's ``.grad``), the optimizer's step, then the params copied into a
    preallocated bf16 buffer. Nothing is allocated per step (the buffers' data_ptr never change)."""

    def __init__(self, param: torch.Tensor, grad16: torch.Tensor, make_optimizer):
        self.param, self.grad16 = param, grad16
        self.g32 = torch.empty_like(param, dtype=torch.float32)
        self.out = torch.empty_like(param, dtype=grad16.dtype)
        param.grad = self.g32
        self.optimizer = make_optimizer([param])

    def __call__(self) -> None:
        self.g32.copy_(self.grad16)
        self.optimizer.step()
        self.out.copy_(self.param.detach())


@contextlib.contextmanager
def omp_threads(threads: int):
    """OMP_NUM_THREADS set to ``threads`` for the whole run (DeepSpeed's op links its own libgomp,
    which reads the variable once, when it loads; torch's threads are set by torch.set_num_threads),
    then put back."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


def deepspeed_adam():
    """(DeepSpeedCPUAdam, None) when deepspeed imports, its cpu_adam op builds or loads, and one
    AdamW step on a small buffer matches torch's; else (None, the one-line reason). Call it inside
    ``omp_threads``: the op's OpenMP runtime takes its thread count from the environment."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        n = 10_007
        gen = torch.Generator().manual_seed(3)
        init, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        ours = init.clone().requires_grad_()
        ours.grad = grad.clone()
        DeepSpeedCPUAdam([ours], adamw_mode=True, **HYPER).step()  # builds/loads the op
        ref = init.clone().requires_grad_()
        ref.grad = grad.clone()
        torch.optim.AdamW([ref], **HYPER).step()
        torch.testing.assert_close(ours.detach(), ref.detach())
    except Exception as exc:  # not installed, op build error, wrong result: "not available"
        text = " ".join(str(exc).split())
        if isinstance(exc, AssertionError):
            text = "its AdamW step differs from torch's: " + text
        return None, f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
    return DeepSpeedCPUAdam, None


DEEPSPEED = {"a": "DeepSpeedCPUAdam", "b": "DeepSpeedCPUAdam composite"}


def bench_size(numel: int, *, repeats: int, threads: int, cases: str, with_foreach: bool,
               ds_cls, ds_reason: Optional[str] = None, rmw: torch.Tensor, gap_s: float,
               moments: str = "fp32") -> list[Result]:
    gen = torch.Generator().manual_seed(1)
    grad32 = torch.randn(numel, generator=gen).mul_(1e-2)
    grad16 = grad32.to(torch.bfloat16)
    impls: dict[tuple[str, str], Callable[[], None]] = {}  # each holds its optimizer and buffers

    def param(grad=None):
        p = torch.randn(numel, generator=gen).requires_grad_()
        p.grad = grad
        return p

    if "a" in cases:  # each optimizer its own param (same fp32 grads); impls holds the optimizers
        impls[("a", "zero_offload CPUAdam")] = CPUAdam(
            [param(grad32)], threads=threads, decoupled_weight_decay=True, **HYPER).step
        impls[("a", "torch Adam fused")] = torch.optim.AdamW([param(grad32)], fused=True, **HYPER).step
        if with_foreach:
            impls[("a", "torch Adam foreach")] = torch.optim.AdamW(
                [param(grad32)], foreach=True, **HYPER).step
        if ds_cls is not None:
            impls[("a", DEEPSPEED["a"])] = ds_cls([param(grad32)], adamw_mode=True, **HYPER).step

    if "b" in cases:
        flat = torch.randn(numel, generator=gen)

        def ours_b(p: torch.Tensor, moments: torch.dtype) -> Callable[[], None]:
            out = torch.empty(numel, dtype=torch.bfloat16)
            m, v = torch.zeros(numel, dtype=moments), torch.zeros(numel, dtype=moments)
            steps = itertools.count(1)

            def update():
                step = next(steps)  # also the seed of bf16 moments (fp32 moments ignore it)
                adam_step(p, grad16, m, v, step=step, adamw=True, out_lowp=out, threads=threads, seed=step,
                          **HYPER)
            return update

        impls[("b", OURS_B)] = ours_b(flat, torch.float32)
        if moments == "bf16":
            impls[("b", OURS_B_BF16)] = ours_b(flat.clone(), torch.bfloat16)
        impls[("b", TORCH_B)] = Composite(
            param(), grad16, lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER))
        if ds_cls is not None:
            impls[("b", DEEPSPEED["b"])] = Composite(param(), grad16, lambda ps: ds_cls(ps, adamw_mode=True, **HYPER))

    impls[("rmw", RMW)] = lambda: rmw.mul_(1.0000001)
    for fn in impls.values():  # warm-up: lazy state, page faults
        fn()
    times: dict[tuple[str, str], list[float]] = {key: [] for key in impls}
    for _ in range(repeats):
        for key, fn in impls.items():
            # [Note: idle gap before each timed step]: see --gap-ms
            if gap_s:
                time.sleep(gap_s)
            times[key].append(timed(fn))
    results = []
    for (case, impl), seconds in times.items():
        med = statistics.median(seconds)
        if case == "rmw":
            results.append(Result(case=case, impl=impl, numel=numel, seconds=seconds, median_s=med,
                                  gb_per_s=2 * rmw.numel() * 4 / med / 1e9))
            continue
        nbytes = bytes_per_param(impl)
        results.append(Result(case=case, impl=impl, numel=numel, seconds=seconds, median_s=med,
                              mparams_per_s=numel / med / 1e6, gb_per_s=nbytes * numel / med / 1e9))
    if ds_cls is None:  # its rows say why, where its timings would be
        results += [Result(case=case, impl=DEEPSPEED[case], numel=numel, note=f"not available: {ds_reason}")
                    for case in "ab" if case in cases]
    return results


def bytes_per_param(impl: str) -> int:
    return BYTES_PER_PARAM_BF16_MOMENTS if impl == OURS_B_BF16 else BYTES_PER_PARAM


def finish(results: list[Result], *, l3: Optional[int], rmw_bytes: int) -> list[Result]:
    """Adds the ratio to torch (and, for the bf16-moment row, to the fp32-moment kernel) and the %
    of the RMW bandwidth measured in the same loop (where both working sets exceed the cache)."""
    reference = {("a", r.numel): r for r in results if r.impl == "torch Adam fused"}
    reference.update({("b", r.numel): r for r in results if r.impl == TORCH_B})
    fp32_moments = {r.numel: r for r in results if r.case == "b" and r.impl == OURS_B}
    rmw = {r.numel: r.gb_per_s for r in results if r.case == "rmw"}
    done = []
    for r in results:
        if r.note is not None:
            done.append(r)
            continue
        if r.case == "rmw":
            done.append(Result(**{**asdict(r), "pct_of_rmw": 100.0 if beyond_cache(rmw_bytes, l3) else None}))
            continue
        ref = reference.get((r.case, r.numel))
        ratio = None if ref is None else r.mparams_per_s / ref.mparams_per_s
        base = fp32_moments.get(r.numel) if r.impl == OURS_B_BF16 else None
        vs_fp32 = None if base is None else r.mparams_per_s / base.mparams_per_s
        dram = beyond_cache(rmw_bytes, l3) and beyond_cache(bytes_per_param(r.impl) * r.numel, l3)
        done.append(Result(**{**asdict(r), "ratio_to_torch": ratio, "ratio_to_fp32_moments": vs_fp32,
                              "pct_of_rmw": 100 * r.gb_per_s / rmw[r.numel] if dram else None}))
    return done


def markdown(results: list[Result], meta: dict) -> str:
    l3 = meta["l3_bytes"]
    cache = (f"L3 cache {l3 / 2**20:g} MiB (sysfs): % of RMW is given only where the update's working set "
             f"and the RMW buffer both exceed {2 * l3 / 2**20:g} MiB (twice the L3); smaller ones run from "
             "cache and would be compared with DRAM speed." if l3 else
             "L3 cache size unknown (no sysfs): % of RMW is given at every size, and a size whose working "
             "set fits the cache compares cache speed with DRAM speed.")
    lines = [
        f"# CPU-Adam throughput — {meta['cpu']}, {meta['threads']} threads, {meta['date']}",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['cpu']} ({meta['cpus_online']} CPUs online, {meta['threads']} threads used: "
        f"OMP_NUM_THREADS={meta['omp_num_threads']}, torch.get_num_threads()={meta['torch_threads']}, ours "
        f"threads={meta['threads']}), torch {meta['torch']} (CPU capability {meta['torch_capability']}), "
        f"zero_offload ISA path {meta['isa']}.  ",
        f"RMW reference: x.mul_(c) over {meta['rmw_gib']} GiB of fp32 (read+write counted), timed in the same "
        "interleaved loop as the optimizers (its row in each size's block; % of RMW is relative to it).  ",
        cache + "  ",
        f"Medians of {meta['repeats']} interleaved steps, each after {meta['gap_ms']:g} ms idle; "
        f"GB/s counts {BYTES_PER_PARAM} B/param ({BYTES_PER_PARAM_BF16_MOMENTS} with bf16 moments). "
        "Parity check (bit-equal to torch fused AdamW) passed before timing.",
        "",
        "| case | params | implementation | median ms | Mparams/s | GB/s | vs torch | % of RMW |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = "—" if r.ratio_to_torch is None else f"{r.ratio_to_torch:.2f}x"
        pct = "—" if r.pct_of_rmw is None else f"{r.pct_of_rmw:.0f}%"
        if r.note is not None:
            lines.append(f"| {r.case} | {r.numel / 1e6:g}M | {r.impl} | {r.note} | — | — | — | — |")
            continue
        if r.case == "rmw":
            lines.append(f"| — | {r.numel / 1e6:g}M | {r.impl} | {r.median_s * 1e3:.1f} | — | "
                         f"{r.gb_per_s:.1f} | — | {pct} |")
            continue
        lines.append(f"| {r.case} | {r.numel / 1e6:g}M | {r.impl} | {r.median_s * 1e3:.1f} | "
                     f"{r.mparams_per_s:.0f} | {r.gb_per_s:.1f} | {ratio} | {pct} |")
    lines += ["", "(a) fp32 grads, no copy-out; torch = Adam(fused=True). (b) bf16 grads in, bf16 params out; "
              "torch composite = g32.copy_(grad_bf16) + fused step + out.copy_(param), both buffers allocated "
              "once; DeepSpeedCPUAdam composite = the same with DeepSpeed's step (it reads grads in the "
              "param's dtype and has no copy-out).", ""]
    bf16_rows = [r for r in results if r.ratio_to_fp32_moments is not None]
    if bf16_rows:
        lines.append("bf16 moments (stochastic rounding) vs fp32 moments, same kernel and case (b): " + ", ".join(
            f"{r.ratio_to_fp32_moments:.2f}x at {r.numel / 1e6:g}M ({r.median_s * 1e3:.1f} ms vs "
            f"{r.median_s * r.ratio_to_fp32_moments * 1e3:.1f} ms)" for r in bf16_rows) + ".")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None, *, prog: str = "python -m zero_offload.bench.cpu_adam") -> int:
    """Runs the benchmark with command-line arguments ``argv`` (default ``sys.argv[1:]``); ``prog``
    is how it was invoked, shown in ``--help`` and recorded as the command in the results."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for every implementation: OMP_NUM_THREADS, torch.set_num_threads and "
                             "ours (default: CPUs available)")
    parser.add_argument("--sizes", default="100M,200M",
                        help="comma-separated param counts (default 100M,200M: beyond the L3 of big servers)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per implementation (median reported)")
    parser.add_argument("--cases", default="ab", help="'a', 'b' or 'ab'")
    parser.add_argument(
        "--moments", default="fp32", choices=["fp32", "bf16"],
        help="bf16: also time case (b) with bf16 moments (stochastic rounding) beside the fp32-moment "
             "kernel and print the ratio (implies case b)")
    parser.add_argument("--isa", default=None, choices=["scalar", "avx2", "avx512"], help="force our ISA path")
    parser.add_argument("--no-foreach", action="store_true", help="skip torch foreach (slow at 100M on few threads)")
    parser.add_argument("--rmw-gib", type=float, default=1.0, help="buffer size of the RMW bandwidth reference")
    parser.add_argument(
        "--gap-ms", type=float, default=50.0,
        help="idle time before each timed step (default 50). [Note: idle gap before each timed step] "
             "In an offload training loop the optimizer step follows tens of ms of GPU work, so no CPU "
             "thread pool is still busy from the previous op. Back to back (0), torch's OpenMP threads "
             "spin for a while after each torch op and can compete for the cores with whatever runs next "
             "(our pool when ours is next, nothing when torch's own pool is next), which measures the "
             "order of the loop, not the kernels.")
    parser.add_argument("--json-out", default=None, help="write all results (every timing) as JSON here")
    parser.add_argument("--md-out", default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    threads = args.threads or default_threads()
    if threads < 1:
        parser.error("--threads must be >= 1")
    if not args.cases or set(args.cases) - set("ab"):
        parser.error(f"--cases must be 'a', 'b' or 'ab', got {args.cases!r}")
    cases = args.cases if args.moments == "fp32" or "b" in args.cases else args.cases + "b"
    if args.isa:
        set_isa(args.isa)
    torch.set_num_threads(threads)
    with omp_threads(threads):
        return _run(args, prog=prog, argv=argv, threads=threads, cases=cases)


def _run(args, *, prog: str, argv, threads: int, cases: str) -> int:
    """The benchmark of ``main``, with OMP_NUM_THREADS and torch's threads set to ``threads``."""
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    ds_cls, ds_reason = deepspeed_adam()
    print(f"DeepSpeedCPUAdam: {'available' if ds_cls else 'not available: ' + ds_reason}", flush=True)

    check_parity()
    print("parity check: ok", flush=True)
    if args.moments == "bf16":
        check_bf16_moments()
        print("bf16-moment check: ok", flush=True)
    rmw = rmw_buffer(args.rmw_gib)
    results = []
    for numel in sizes:
        results += bench_size(numel, repeats=args.repeats, threads=threads, cases=cases,
                              with_foreach=not args.no_foreach, ds_cls=ds_cls, ds_reason=ds_reason, rmw=rmw,
                              gap_s=args.gap_ms / 1e3, moments=args.moments)
        print(f"done {numel / 1e6:g}M", flush=True)
    l3 = l3_cache_bytes()
    results = finish(results, l3=l3, rmw_bytes=rmw.numel() * rmw.element_size())
    meta = {
        "cpu": cpu_model(), "cpus_online": os.cpu_count(), "threads": threads,
        "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ["OMP_NUM_THREADS"], "sizes": sizes,
        "l3_bytes": l3,
        "torch": torch.__version__, "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "isa": isa(), "rmw_gib": args.rmw_gib, "repeats": args.repeats, "gap_ms": args.gap_ms,
        "moments": args.moments,
        "date": datetime.date.today().isoformat(), "python": sys.version.split()[0],
        "command": command_line(prog, argv),
        "deepspeed": "available" if ds_cls else f"not available: {ds_reason}",
    }
    publish(markdown(results, meta), {"meta": meta, "results": [asdict(r) for r in results]},
            md_path=args.md_out, json_path=args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
