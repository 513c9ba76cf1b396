"""SGD, Lion, Adafactor and Muon on the CPU: zero_offload's native kernels vs torch, side by side
in one process.

Question: how fast are the native updates (ops/cpu_rules.py) on the update an offload engine does
(fp32 params, bf16 grads in, optionally bf16 params out), against what torch offers for the same
update on the CPU?

Rows, per rule, all on the same --threads (torch.set_num_threads and our `threads`):
  SGD (momentum 0.9, dampening 0, weight_decay 1e-4, not Nesterov: torch's common recipe)
    ours                 sgd_step(param, grad_bf16, buf)                        one pass
    ours + copy-out      sgd_step(param, grad_bf16, buf, out_lowp=param_bf16)   one pass
    torch foreach        g32.copy_(grad_bf16); SGD(foreach=True).step()
    torch fused          g32.copy_(grad_bf16); SGD(fused=True).step()
    torch foreach + out  the foreach row, then out.copy_(param)
  Lion (betas (0.9, 0.99), weight_decay 0.1)
    ours, ours + copy-out  lion_step(...), as above
    torch ops            g32.copy_(grad_bf16); c = m * b1 + (1 - b1) g; p *= 1 - lr wd;
                         p -= lr sign(c); m = m * b2 + (1 - b2) g  (torch has no Lion; these are
                         the reference's ops, in place, into buffers allocated once)
    torch ops + out      the same, then out.copy_(param)
  torch cannot give an fp32 param a bf16 grad without changing its grad_dtype, so its rows widen
  the grad into an fp32 buffer allocated once (as an engine would), and the copy-out is a
  separate pass. Every row has its own param and state; the bf16 grad is shared (read only).
  Adafactor and Muon (whole params: the matrices of --layers GPT blocks of --d-model, per block
  (3d, d), (d, d), (4d, d), (d, 4d) as nn.Linear weights; d=2048, 24 layers is the 1.31B model's
  1.2B matrix elements), one step over every matrix per repeat, all with the copy-out:
  Adafactor (lr 1e-2, weight_decay 1e-2, torch's defaults otherwise)
    ours + copy-out      adafactor_step per matrix: three passes (20 bytes/element)
    torch ops + out      runtime/rules.py AdafactorRule.device_step on the host buffers: the
                         torch.optim.Adafactor op chain, grad widened per matrix, then the
                         copy-out (what the engine's CPU job ran before the native kernels)
  Muon's host passes (momentum 0.95, Nesterov, weight_decay 0.1; Newton-Schulz excluded: it runs
  on the GPU, and a fixed bf16 matrix stands in for its result)
    ours + copy-out      muon_momentum (update -> bf16) + muon_apply per matrix (24 bytes/element)
    torch ops + out      g = grad.float(); buf.lerp_(g, 1 - m); u = g.lerp(buf, m).bfloat16();
                         p.mul_(1 - lr wd); p.add_(ortho, alpha=-lr'); out.copy_(p) (the previous
                         CPU job's host part)

Reference -> check -> timing: first, on a small size (--check-numel), three steps of ours must
equal torch.optim.SGD(foreach=False) and the torch-ops Lion bit for bit (params, state and the
copy-out), Muon's passes its torch ops bit for bit, and Adafactor the torch ops within 1e-6
(relative norm of the difference: its sums of squares are fp64 here, fp32 in torch); then the
timing. Each repeat runs every row of a rule once, in a fresh random order,
so machine noise hits them alike; the first --warmup repeats are not counted. Reported per row:
median ms per step and its IQR (75th - 25th percentile) over --repeats (>= 20), Gelem/s, GB/s of
the update's minimum traffic (SGD: fp32 param and buffer read + written, bf16 grad read = 18
bytes/element, + 2 with the copy-out; Lion: the same with exp_avg) and the ratio of torch's best
comparable row's median to ours.

    python benchmarks/bench_cpu_rules.py --numel 100M --threads 16 --repeats 21
    python benchmarks/bench_cpu_rules.py --numel 4M --threads 2 --repeats 20 --json-out /tmp/rules.json
    python benchmarks/bench_cpu_rules.py --rules adafactor,muon --d-model 2048 --layers 24 --threads 32
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from typing import Callable

import torch

from zero_offload.ops.cpu_adam import default_threads, isa
from zero_offload.ops.cpu_rules import adafactor_step, lion_step, muon_apply, muon_momentum, sgd_step
from zero_offload.runtime.rules import AdafactorArgs, AdafactorRule, adafactor_state_shapes, muon_lr
from zero_offload.runtime.update_rule import Segment, StepBuffers

SGD = dict(lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=False)
LION = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)
ADAFACTOR = dict(lr=1e-2, weight_decay=1e-2)
MUON = dict(lr=2e-2, momentum=0.95, nesterov=True, weight_decay=0.1)
BYTES = {"sgd": 18, "lion": 18,  # fp32 param + state read and written, bf16 grad read
         "adafactor": 20,        # (param + grad) + grad + (param, grad, param, out): 6 + 2 + 12
         "muon": 24}             # (grad, buf, buf, update) + (param, ortho, param, out): 12 + 12
RULES = ("sgd", "lion", "adafactor", "muon")
MIN_REPEATS = 20


def _count(text: str) -> int:
    """'100M' -> 100_000_000 (K, M, G suffixes, powers of ten)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    try:
        if text and text[-1] in scale:
            return int(float(text[:-1]) * scale[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an element count: {text!r} (e.g. 100M, 4000000)") from None


def _lion_torch(param, exp_avg, g32, c, *, lr, betas, weight_decay):
    """Lion in torch ops, in place, into the preallocated ``c`` (the tests' reference, except
    that sign(NaN) is torch's 0: no NaN arises here)."""
    beta1, beta2 = betas
    torch.mul(exp_avg, beta1, out=c).add_(g32, alpha=1 - beta1)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(c.sign_(), alpha=-lr)
    exp_avg.mul_(beta2).add_(g32, alpha=1 - beta2)


# ---------------------------------------------------------------------------------------------
# Reference -> check.


def check(numel: int, threads: int) -> None:
    """Three steps of ours == the references, bit for bit (params, state, copy-out)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen).bfloat16() for _ in range(3)]
    # SGD vs torch.optim.SGD(foreach=False)
    param, buf, out = start.clone(), torch.empty(numel), torch.empty(numel, dtype=torch.bfloat16)
    ref = start.clone()
    opt = torch.optim.SGD([ref], foreach=False, **SGD)
    for step, grad in enumerate(grads):
        sgd_step(param, grad, buf, out, first_step=step == 0, threads=threads, **SGD)
        ref.grad = grad.float()
        opt.step()
    _same("SGD param", param, ref)
    _same("SGD momentum_buffer", buf, opt.state[ref]["momentum_buffer"])
    _same("SGD out_lowp", out, param.bfloat16())
    # Lion vs the torch ops
    param, m, out = start.clone(), torch.zeros(numel), torch.empty(numel, dtype=torch.bfloat16)
    ref, ref_m, c = start.clone(), torch.zeros(numel), torch.empty(numel)
    for grad in grads:
        lion_step(param, grad, m, out, threads=threads, **LION)
        _lion_torch(ref, ref_m, grad.float(), c, **LION)
    _same("Lion param", param, ref)
    _same("Lion exp_avg", m, ref_m)
    _same("Lion out_lowp", out, param.bfloat16())


def gpt_shapes(d_model: int, layers: int) -> list[tuple[int, int]]:
    """The matrices of ``layers`` GPT blocks (nn.Linear weights: out x in)."""
    d = d_model
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers


def _adafactor_torch(param, grad, state, out, shape, step):
    """AdafactorRule.device_step (torch.optim.Adafactor's op chain) on one param's host buffers."""
    args = AdafactorArgs(lr=ADAFACTOR["lr"], beta2_decay=-0.8, eps1=None, eps2=1e-3, d=1.0,
                         weight_decay=ADAFACTOR["weight_decay"])
    spans, flat = {}, {}
    for k, t in state.items():
        spans[k], flat[k] = (0, t.numel()), t
    bufs = StepBuffers(cid=0, param=param, grad=grad, state=flat, lowp=out)
    AdafactorRule().device_step(bufs, [Segment(0, param.numel(), step, args, shape=shape, spans=spans)])


def _muon_torch(param, grad, buf, update, ortho, out, shape):
    """The previous CPU job's host part of torch.optim.Muon, torch ops (``update``: the bf16 input
    Newton-Schulz would get; ``ortho``: its stand-in result)."""
    m = MUON["momentum"]
    g = grad.float()
    buf.lerp_(g, 1 - m)
    update.copy_(g.lerp(buf, m))
    param.mul_(1 - MUON["lr"] * MUON["weight_decay"])
    param.add_(ortho, alpha=-muon_lr(MUON["lr"], None, shape))
    out.copy_(param)


def _muon_ours(param, grad, buf, update, ortho, out, shape, threads):
    muon_momentum(grad, buf, update, momentum=MUON["momentum"], nesterov=MUON["nesterov"], threads=threads)
    muon_apply(param, ortho, out, lr=MUON["lr"], weight_decay=MUON["weight_decay"],
               adjusted_lr=muon_lr(MUON["lr"], None, shape), threads=threads)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def check_whole(threads: int) -> None:
    """Adafactor within 1e-6 of the torch ops over three steps (a matrix, a batch of matrices, a
    vector); Muon's passes bit for bit."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(67, 131), (3, 17, 9), (1037,)]:
        start = torch.randn(shape, generator=gen).flatten()
        param, ref = start.clone(), start.clone()
        state = {k: torch.zeros(math.prod(v)) for k, v in adafactor_state_shapes(shape).items()}
        ref_state = {k: v.clone() for k, v in state.items()}
        out, ref_out = (torch.empty(start.numel(), dtype=torch.bfloat16) for _ in range(2))
        for step in (1, 2, 3):
            grad = torch.randn(start.numel(), generator=gen).bfloat16()
            adafactor_step(param, grad, **state, out_lowp=out, shape=shape, step=step, threads=threads, **ADAFACTOR)
            _adafactor_torch(ref, grad, ref_state, ref_out, shape, step)
        for what, ours, theirs in [("param", param, ref), *((k, state[k], ref_state[k]) for k in state)]:
            if _rel(ours, theirs) > 1e-6:
                sys.exit(f"check failed: Adafactor {what} of shape {shape} is {_rel(ours, theirs):.2e} from the torch "
                         f"ops (> 1e-6); not timing")
        _same("Adafactor out_lowp", out, param.bfloat16())
    shape = (67, 131)
    numel = math.prod(shape)
    start = torch.randn(numel, generator=gen)
    rows = [[start.clone(), torch.zeros(numel), torch.empty(numel, dtype=torch.bfloat16),
             torch.empty(numel, dtype=torch.bfloat16)] for _ in range(2)]
    for _ in range(3):
        grad, ortho = torch.randn(numel, generator=gen).bfloat16(), torch.randn(numel, generator=gen).bfloat16()
        p, b, u, o = rows[0]
        _muon_ours(p, grad, b, u, ortho, o, shape, threads)
        p, b, u, o = rows[1]
        _muon_torch(p, grad, b, u, ortho, o, shape)
    for what, ours, theirs in zip(("param", "momentum_buffer", "update", "out_lowp"), *rows):
        _same(f"Muon {what}", ours, theirs)


def _same(what: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    if not torch.equal(ours, ref):
        bad = (ours != ref).nonzero().flatten()
        sys.exit(f"check failed: {what} differs from the reference in {bad.numel()} of {ours.numel()} elements "
                 f"(first at {bad[0].item()}: {ours[bad[0]].item()!r} vs {ref[bad[0]].item()!r}); not timing")


# ---------------------------------------------------------------------------------------------
# Timing.


def sgd_rows(numel: int, threads: int, grad: torch.Tensor) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (one step, bytes per element of its minimum traffic)."""
    def ours(out):
        param, buf = torch.randn(numel), torch.zeros(numel)
        sgd_step(param, grad, buf, out, first_step=True, threads=threads, **SGD)  # the buffer exists from now on
        return lambda: sgd_step(param, grad, buf, out, first_step=False, threads=threads, **SGD)

    g32 = torch.empty(numel)

    def torch_sgd(copy_out: bool, **impl):
        param = torch.randn(numel)
        param.grad = g32
        opt = torch.optim.SGD([param], **SGD, **impl)
        out = torch.empty(numel, dtype=torch.bfloat16) if copy_out else None
        g32.copy_(grad)
        opt.step()  # creates the momentum buffer

        def step():
            g32.copy_(grad)
            opt.step()
            if out is not None:
                out.copy_(param)
        return step

    return {
        "ours": (ours(None), BYTES["sgd"]),
        "ours + copy-out": (ours(torch.empty(numel, dtype=torch.bfloat16)), BYTES["sgd"] + 2),
        "torch foreach": (torch_sgd(False, foreach=True), BYTES["sgd"]),
        "torch fused": (torch_sgd(False, fused=True), BYTES["sgd"]),
        "torch foreach + out": (torch_sgd(True, foreach=True), BYTES["sgd"] + 2),
    }


def lion_rows(numel: int, threads: int, grad: torch.Tensor) -> dict[str, tuple[Callable[[], None], int]]:
    def ours(out):
        param, m = torch.randn(numel), torch.zeros(numel)
        return lambda: lion_step(param, grad, m, out, threads=threads, **LION)

    g32, c = torch.empty(numel), torch.empty(numel)

    def torch_ops(copy_out: bool):
        param, m = torch.randn(numel), torch.zeros(numel)
        out = torch.empty(numel, dtype=torch.bfloat16) if copy_out else None

        def step():
            g32.copy_(grad)
            _lion_torch(param, m, g32, c, **LION)
            if out is not None:
                out.copy_(param)
        return step

    return {
        "ours": (ours(None), BYTES["lion"]),
        "ours + copy-out": (ours(torch.empty(numel, dtype=torch.bfloat16)), BYTES["lion"] + 2),
        "torch ops": (torch_ops(False), BYTES["lion"]),
        "torch ops + out": (torch_ops(True), BYTES["lion"] + 2),
    }


def adafactor_rows(shapes: list, threads: int, grads: list) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (one step over every matrix, bytes per element)."""
    def make(ours: bool):
        params = [torch.randn(math.prod(s)) for s in shapes]
        outs = [torch.empty(math.prod(s), dtype=torch.bfloat16) for s in shapes]
        states = [{k: torch.zeros(math.prod(v)) for k, v in adafactor_state_shapes(s).items()} for s in shapes]
        step = [0]

        def run():
            step[0] += 1
            for p, g, st, o, s in zip(params, grads, states, outs, shapes):
                if ours:
                    adafactor_step(p, g, **st, out_lowp=o, shape=s, step=step[0], threads=threads, **ADAFACTOR)
                else:
                    _adafactor_torch(p, g, st, o, s, step[0])
        return run

    return {"ours + copy-out": (make(True), BYTES["adafactor"]),
            "torch ops + out": (make(False), BYTES["adafactor"])}


def muon_rows(shapes: list, threads: int, grads: list) -> dict[str, tuple[Callable[[], None], int]]:
    orthos = [torch.randn(math.prod(s)).bfloat16() for s in shapes]
    update = torch.empty(max(math.prod(s) for s in shapes), dtype=torch.bfloat16)  # one staging buffer

    def make(ours: bool):
        params = [torch.randn(math.prod(s)) for s in shapes]
        bufs = [torch.zeros(math.prod(s)) for s in shapes]
        outs = [torch.empty(math.prod(s), dtype=torch.bfloat16) for s in shapes]

        def run():
            for p, g, b, x, o, s in zip(params, grads, bufs, orthos, outs, shapes):
                u = update[:p.numel()]
                if ours:
                    _muon_ours(p, g, b, u, x, o, s, threads)
                else:
                    _muon_torch(p, g, b, u, x, o, s)
        return run

    return {"ours + copy-out": (make(True), BYTES["muon"]),
            "torch ops + out": (make(False), BYTES["muon"])}


def measure(rows: dict, repeats: int, warmup: int, seed: int) -> dict[str, list[float]]:
    """Seconds per step of every row, over `repeats` repeats, rows in a fresh random order each."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in rows}
    names = list(rows)
    for rep in range(warmup + repeats):
        rng.shuffle(names)
        for name in names:
            fn = rows[name][0]
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
            if rep >= warmup:
                times[name].append(seconds)
    return times


def summarize(rule: str, rows: dict, times: dict, numel: int) -> list[dict]:
    out = []
    for name, samples in times.items():
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        median = statistics.median(samples)
        out.append(dict(rule=rule, row=name, median_ms=median * 1e3, iqr_ms=(q3 - q1) * 1e3,
                        gelem_s=numel / median / 1e9, gb_s=numel * rows[name][1] / median / 1e9,
                        samples=len(samples)))
    # speed-up of ours over torch's best row that does the same work (with / without copy-out)
    for r in out:
        if r["row"].startswith("ours"):
            same = [t["median_ms"] for t in out if t["row"].startswith("torch")
                    and (("out" in t["row"]) == ("copy-out" in r["row"]))]
            r["torch_best_over_ours"] = min(same) / r["median_ms"] if same else None
    return out


def table(results: list[dict]) -> str:
    lines = ["| rule | row | median ms | IQR ms | Gelem/s | GB/s (min traffic) | torch best / ours |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = r.get("torch_best_over_ours")
        lines.append(f"| {r['rule']} | {r['row']} | {r['median_ms']:.3f} | {r['iqr_ms']:.3f} | {r['gelem_s']:.2f} | "
                     f"{r['gb_s']:.1f} | {'' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=_count, default=_count("100M"), help="elements per param (default 100M)")
    parser.add_argument("--threads", type=int, default=default_threads(),
                        help="threads for every row (ours and torch's); default: the CPUs this process may use")
    parser.add_argument("--repeats", type=int, default=21, help=f"timed repeats (>= {MIN_REPEATS})")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repeats first")
    parser.add_argument("--rules", default="sgd,lion", help="comma-separated: sgd, lion, adafactor, muon")
    parser.add_argument("--d-model", type=int, default=2048,
                        help="adafactor, muon: the GPT blocks' width (default 2048, the 1.31B model's)")
    parser.add_argument("--layers", type=int, default=24,
                        help="adafactor, muon: how many blocks' matrices (default 24, the 1.31B model's)")
    parser.add_argument("--check-numel", type=_count, default=_count("1M") + 37,
                        help="elements of the bit-for-bit check before timing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the row order")
    parser.add_argument("--json-out", help="also write the results here")
    args = parser.parse_args(argv)
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    bad = [r for r in rules if r not in RULES]
    if bad or not rules:
        parser.error(f"--rules: unknown {bad or rules!r}; choose from {', '.join(RULES)}")
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats must be >= {MIN_REPEATS} (the median and IQR need them), got {args.repeats}")
    if args.threads < 1 or args.numel < 1 or args.d_model < 1 or args.layers < 1:
        parser.error("--threads, --numel, --d-model and --layers must be >= 1")

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for any child process; torch's pool is set above
    elementwise = [r for r in rules if r in ("sgd", "lion")]
    whole = [r for r in rules if r in ("adafactor", "muon")]
    if elementwise:
        check(min(args.check_numel, args.numel + 37), args.threads)
    if whole:
        check_whole(args.threads)
    shapes = gpt_shapes(args.d_model, args.layers)
    total = sum(math.prod(s) for s in shapes)
    print(f"# {', '.join(rules)} on the CPU: fp32 params, bf16 grads, {args.threads} threads, ISA {isa()}, torch "
          f"{torch.__version__}, {platform.processor() or platform.machine()}, {args.repeats} repeats "
          f"(+{args.warmup} warm-up); " + "; ".join(
              ([f"sgd/lion: {args.numel:,} elements"] if elementwise else [])
              + ([f"adafactor/muon: {len(shapes)} matrices of {args.layers} GPT blocks of d_model {args.d_model} "
                  f"({total:,} elements)"] if whole else []))
          + "; check passed (SGD, Lion, Muon bit-equal to the references, Adafactor within 1e-6)")
    results = []
    if elementwise:
        grad = torch.randn(args.numel).bfloat16()
        for rule in elementwise:
            rows = (sgd_rows if rule == "sgd" else lion_rows)(args.numel, args.threads, grad)
            results += summarize(rule, rows, measure(rows, args.repeats, args.warmup, args.seed), args.numel)
            del rows  # free this rule's buffers before the next
        del grad
    if whole:
        grads = [torch.randn(math.prod(s)).bfloat16() for s in shapes]
        for rule in whole:
            rows = (adafactor_rows if rule == "adafactor" else muon_rows)(shapes, args.threads, grads)
            results += summarize(rule, rows, measure(rows, args.repeats, args.warmup, args.seed), total)
            del rows
    print(table(results))
    if args.json_out:
        meta = dict(numel=args.numel, d_model=args.d_model, layers=args.layers, whole_numel=total,
                    threads=args.threads, isa=isa(), torch=torch.__version__,
                    repeats=args.repeats, warmup=args.warmup, date=time.strftime("%Y-%m-%d"))
        with open(args.json_out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
