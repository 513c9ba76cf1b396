"""Which prefetch depth makes a training step faster, measured until the answer is not noise.

``zero-offload bench prefetch`` builds one engine per depth (same model, same start, same
budgets), then times real training steps in interleaved blocks until the depths separate or
``--max-seconds`` runs out, and either recommends a depth that is measurably faster than the
configured one (``--prefetch-depth``, default 2: the *baseline*) or says "no depth measurably
better; keep N". The JSON record holds every step time, so ``decide`` reproduces the verdict.

[Note: one engine per depth] The engine has no public way to change ``prefetch_depth`` on a live
engine (the depth sizes the prefetcher's window, the pipeline's state read-ahead and the host
staging area at initialize), and re-initializing per block costs seconds to minutes (building
the model, copying it into the tiers, writing NVMe homes, recording the access order in a
warm-up step) against blocks of a few steps. So every depth gets its own engine up front and the
engines live together: the bench needs (number of depths) x the model's homes in memory and on
disk. "auto" budgets are pinned before the first engine is built to 1/n of what is free then,
so every depth gets the same placement and budgets (a budget resolved per initialize would give
later engines less room, a different placement or fewer kept copies: a confound, not a depth
effect). Idle engines hold their homes but use no CPU (their workers block on a queue).

[Note: interleaved blocks] Round r runs a block at every depth, starting at depth index
r mod n, so drift of the host (other processes, page cache, clocks, thermals) hits every depth
alike instead of all of depth 0's steps coming first. A block is one untimed settle step, which
refills this engine's pipeline and prefetch window after the other engines ran, then ``--block``
timed steps; after the block ``engine.synchronize()`` (untimed) lets its queued CPU updates
finish, so they never overlap another depth's timed steps. Stall per step is the engine's fetch
+ update stall counters read around each timed step.

[Note: separation rule] ``decide``: for every depth d other than the baseline K, the gain
``1 - median(d) / median(K)`` with a percentile-bootstrap confidence interval (each depth's
blocks of steps resampled on their own: steps of one block share the host's load of that moment,
so whole blocks are the independent units; ``resamples`` draws from a fixed seed, so the JSON's step times give
the same interval again). A percentile bootstrap over a handful of blocks is not trustworthy (3
blocks have 10 distinct resamples), so the bench measures at least ``MIN_CI_BLOCKS`` blocks per
depth by default (``--steps`` defaults to ``MIN_CI_BLOCKS x --block``); fewer, when asked for, get
a one-line warning and a verdict marked suggestive. The level is Bonferroni-corrected over the m comparisons (each
interval at ``1 - (1 - confidence) / m``). d is *faster* when the interval lies above 0 and the
gain is at least ``tolerance``; *not faster* when the whole interval lies below ``tolerance``;
*undecided* otherwise. The depths have *separated* when no comparison is undecided. Among the
faster depths, the smallest whose median is within ``tolerance`` of the fastest one's is
recommended; with none, the baseline is kept. The measuring loop looks at the data only when the
steps per depth have doubled since the last look (``steps``, 2x, 4x, ...) and at the end, so the
repeated looks add few chances of a false "faster" (tests/test_cli_bench_report.py checks the rate
on identical synthetic depths).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

# numpy and torch are imported where used: the CLI builds this command's parser (HELP,
# add_arguments) before it imports torch (cli.py [Note: torch after parsing]).

DEFAULT_DEPTHS = (0, 1, 2, 4, 8)
DEFAULT_MAX_SECONDS = 120.0
DEFAULT_BLOCK = 3
MIN_CI_BLOCKS = 10
"""Blocks per depth the bootstrap interval needs before its verdict is more than suggestive (the
default --steps measures this many)."""
RESAMPLES = 4000
BOOTSTRAP_SEED = 0


# ---------------------------------------------------------------------------------- decision

class Verdict(enum.Enum):
    """A depth against the baseline (see [Note: separation rule])."""

    FASTER = "faster"
    NOT_FASTER = "not faster"
    UNDECIDED = "undecided"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """One depth against the baseline: gain = 1 - median(depth) / median(baseline)."""

    depth: int
    gain: float
    low: float
    """Lower end of the (Bonferroni-corrected) bootstrap interval of the gain."""
    high: float
    verdict: Verdict


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """What ``decide`` concluded from the step times."""

    baseline: int
    recommended: int
    """A depth measurably faster than the baseline, or the baseline itself."""
    separated: bool
    """No comparison is undecided: more steps would not change the verdicts' direction."""
    comparisons: tuple[Comparison, ...]
    tolerance: float
    confidence: float
    resamples: int
    seed: int
    block: int
    """Steps per resampled block (see ``decide``)."""
    blocks: int
    """Blocks of the depth with the fewest: the independent units the interval comes from."""

    @property
    def suggestive(self) -> bool:
        """Fewer than MIN_CI_BLOCKS blocks per depth: the interval is not to be trusted."""
        return self.blocks < MIN_CI_BLOCKS

    @property
    def better(self) -> bool:
        return self.recommended != self.baseline

    def message(self) -> str:
        """The one line the bench prints for this decision."""
        undecided = [c.depth for c in self.comparisons if c.verdict is Verdict.UNDECIDED]
        caveat = (f" [suggestive only: the CI comes from {self.blocks} block{'s' if self.blocks > 1 else ''} per "
                  f"depth, fewer than {MIN_CI_BLOCKS}]" if self.suggestive else "")
        if self.better:
            c = next(c for c in self.comparisons if c.depth == self.recommended)
            line = (f"recommended prefetch depth: {self.recommended} ({c.gain:.1%} faster than depth "
                    f"{self.baseline}, {self.confidence:.0%} CI {c.low:.1%} to {c.high:.1%})")
            if undecided:
                line += f"; {_join(undecided)} not separated from {self.baseline}"
            return line + caveat
        if undecided:
            why = f"{_join(undecided)} not separated from {self.baseline} in the time given"
        else:
            why = f"every other depth is slower or less than {self.tolerance:.0%} faster"
        return f"no depth measurably better; keep {self.baseline} ({why})" + caveat

    def to_dict(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "comparisons"}
        return {**fields, "measurably_better": self.better, "message": self.message(),
                "comparisons": [{**dataclasses.asdict(c), "verdict": c.verdict.value} for c in self.comparisons]}


def _join(depths: Sequence[int]) -> str:
    return ("depth " if len(depths) == 1 else "depths ") + ", ".join(str(d) for d in depths)


def decide(samples: Mapping[int, Sequence[float]], *, baseline: int, tolerance: float = 0.03,
           confidence: float = 0.95, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED,
           block: int = 1) -> Decision:
    """Step times per depth (seconds) -> the ``Decision`` of [Note: separation rule].

    ``block``: the steps were measured in consecutive blocks of this many (each depth's count a
    multiple of it); the bootstrap resamples whole blocks, since steps of one block share the
    host's load of that moment and are not independent."""
    if baseline not in samples:
        raise ValueError(f"the baseline depth {baseline} has no step times; add it to the depths")
    if any(len(v) < 2 for v in samples.values()):
        raise ValueError("every depth needs at least 2 step times to compare; raise --steps")
    if block < 1 or any(len(v) % block for v in samples.values()):
        raise ValueError(f"every depth's step count must be a multiple of the block ({block})")
    if not (0.0 < confidence < 1.0) or tolerance < 0 or resamples < 100:
        raise ValueError(f"need 0 < confidence < 1, tolerance >= 0 and resamples >= 100; got "
                         f"{confidence}, {tolerance}, {resamples}")
    import numpy as np

    others = sorted(d for d in samples if d != baseline)
    alpha = (1.0 - confidence) / max(len(others), 1)
    rng = np.random.default_rng(seed)

    def boot_medians(values) -> np.ndarray:
        x = np.asarray(values, dtype=np.float64).reshape(-1, block)
        picked = x[rng.integers(0, len(x), size=(resamples, len(x)))]  # (resamples, blocks, block)
        return np.median(picked.reshape(resamples, -1), axis=1)

    base = np.asarray(samples[baseline], dtype=np.float64)
    base_boot = boot_medians(base)
    comparisons = []
    for d in others:
        gain = 1.0 - float(np.median(samples[d])) / float(np.median(base))
        boot = 1.0 - boot_medians(samples[d]) / base_boot
        low, high = (float(q) for q in np.quantile(boot, [alpha / 2, 1 - alpha / 2]))
        if low > 0 and gain >= tolerance:
            verdict = Verdict.FASTER
        elif high < tolerance:
            verdict = Verdict.NOT_FASTER
        else:
            verdict = Verdict.UNDECIDED
        comparisons.append(Comparison(depth=d, gain=gain, low=low, high=high, verdict=verdict))
    faster = [c for c in comparisons if c.verdict is Verdict.FASTER]
    recommended = baseline
    if faster:
        best = max(c.gain for c in faster)  # median(d) <= best median * (1 + tol) <=> the gains
        recommended = min(c.depth for c in faster if 1 - c.gain <= (1 - best) * (1 + tolerance))
    return Decision(baseline=baseline, recommended=recommended,
                    separated=all(c.verdict is not Verdict.UNDECIDED for c in comparisons),
                    comparisons=tuple(comparisons), tolerance=tolerance, confidence=confidence,
                    resamples=resamples, seed=seed, block=block,
                    blocks=min(len(v) for v in samples.values()) // block)


def decision_of_record(record: dict) -> Decision:
    """``decide`` again on a JSON record's step times and settings (the printed decision)."""
    d = record["decision"]
    samples = {r["depth"]: r["step_time_s"]["all"] for r in record["results"]}
    return decide(samples, baseline=d["baseline"], tolerance=d["tolerance"], confidence=d["confidence"],
                  resamples=d["resamples"], seed=d["seed"], block=d["block"])


def next_look(n: int) -> int:
    """Steps per depth at which the measuring loop looks next, after a look at ``n``."""
    return 2 * n


# ------------------------------------------------------------------------------------ plot

def plot_prefetch(results: Sequence[dict], path, *, title: str = "", recommended: Optional[int] = None,
                  baseline: Optional[int] = None) -> None:
    """PNG of step time (median and interquartile range) and stall per step against depth, plus
    bytes moved per step on each hop."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the plot needs matplotlib: `pip install matplotlib` "
                          "(or `pip install 'zero_offload[plot]'`)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = [r["depth"] for r in results]
    med = [r["step_time_s"]["median"] * 1e3 for r in results]
    lo = [m - r["step_time_s"]["q25"] * 1e3 for m, r in zip(med, results)]
    hi = [r["step_time_s"]["q75"] * 1e3 - m for m, r in zip(med, results)]
    stall = [r["stall_s_per_step"] * 1e3 if r["stall_s_per_step"] is not None else float("nan") for r in results]
    hops = sorted({h for r in results for h in r["bytes_per_step"]})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.errorbar(depths, med, yerr=[lo, hi], marker="o", capsize=3, label="step time (median, IQR)")
    ax1.plot(depths, stall, marker="s", label="stall waiting for chunks")
    if baseline is not None and baseline != recommended:
        ax1.axvline(baseline, color="grey", linestyle=":", label=f"baseline depth {baseline}")
    if recommended is not None:
        ax1.axvline(recommended, color="grey", linestyle="--", label=f"recommended depth {recommended}")
    ax1.set(xticks=depths, xlabel="prefetch depth (chunks in flight per hop)", ylabel="ms per step",
            ylim=(0, None))
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    width = 0.8 / max(len(hops), 1)
    for i, hop in enumerate(hops):
        ax2.bar([j + i * width for j in range(len(depths))],
                [r["bytes_per_step"].get(hop, 0) / 2**20 for r in results], width=width, label=hop)
    ax2.set(xticks=[j + width * (len(hops) - 1) / 2 for j in range(len(depths))], xticklabels=depths,
            xlabel="prefetch depth", ylabel="MiB moved per step")
    if hops:
        ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------- measuring

def _hardware_slug() -> str:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu{os.cpu_count()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _shared_budgets(cfg, n: int):
    """``cfg`` with each "auto" budget pinned to 1/n of what is free now (see [Note: one engine
    per depth]), resolved by the store's own rule (``resolve_budgets``: free less its reserve; the
    'gpu' tier of a machine without CUDA is host memory)."""
    from zero_offload.runtime.store import StoreConfig, Tier, resolve_budgets

    auto = resolve_budgets(StoreConfig(budgets={Tier.GPU: "auto", Tier.CPU: "auto", Tier.NVME: 0}))
    pinned = {}
    if cfg.cpu_budget == "auto":
        pinned["cpu_budget"] = auto[Tier.CPU] // n
    if cfg.gpu_budget == "auto":
        pinned["gpu_budget"] = auto[Tier.GPU] // n
    if cfg.nvme_budget == "auto" and cfg.nvme_dir:
        # As initialize does: a missing swap directory is created (0700) before it is measured;
        # each engine's swap file is then sized to its plan, not to this budget.
        from ..runtime.swap_io import auto_nvme_budget, prepare_swap_dir
        pinned["nvme_budget"] = auto_nvme_budget(prepare_swap_dir(cfg.nvme_dir, name="--nvme-dir")) // n
    return dataclasses.replace(cfg, **pinned), pinned


@dataclasses.dataclass(kw_only=True)
class _Runner:
    """One depth's engine and what its timed steps measured (mutable: the loop appends)."""

    depth: int
    engine: object
    model: object
    times: list = dataclasses.field(default_factory=list)
    stalls: list = dataclasses.field(default_factory=list)
    steps_run: int = 0
    steps_at_reset: int = 0
    loss_last: float = float("nan")


def _stall(engine) -> float:
    s = engine.stats()
    return s.fetch_stall_s + s.update_stall_s


def _step(runner: _Runner, corpus, settings, seq_len: int, *, timed: bool) -> None:
    import torch

    from ..run_settings import batch_generator

    engine = runner.engine
    cuda = engine.device.type == "cuda"
    x, y = corpus.batch(batch_size=settings.batch_size, seq_len=seq_len,
                        generator=batch_generator(settings.seed, runner.steps_run), device=engine.device)
    if cuda:
        torch.cuda.synchronize()
    stall0 = _stall(engine) if timed else 0.0
    t0 = time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    runner.loss_last = float(loss.detach().float().item())
    if cuda:
        torch.cuda.synchronize()
    if timed:
        runner.times.append(time.perf_counter() - t0)
        runner.stalls.append(_stall(engine) - stall0)
    runner.steps_run += 1
    if not math.isfinite(runner.loss_last):
        raise RuntimeError(f"loss is {runner.loss_last} at depth {runner.depth}, step {runner.steps_run}; "
                           f"lower --lr")


def _result(runner: _Runner, settings, seq_len: int) -> dict:
    import numpy as np

    stats = runner.engine.stats()
    n_all = max(stats.steps - runner.steps_at_reset, 1)  # timed and settle steps since reset_stats
    t = np.asarray(runner.times)
    med = float(np.median(t))
    model = runner.model
    flops = model.flops_per_token(seq_len) if hasattr(model, "flops_per_token") else None
    q25, q75 = (float(q) for q in np.quantile(t, [0.25, 0.75]))
    return {
        "depth": runner.depth,
        "n": len(runner.times),
        "step_time_s": {"median": med, "q25": q25, "q75": q75, "min": float(t.min()), "max": float(t.max()),
                        "all": list(runner.times)},
        "stall_s": list(runner.stalls),
        "stall_s_per_step": float(np.mean(runner.stalls)),
        "tokens_per_s": settings.batch_size * seq_len / med,
        "model_tflops": flops * settings.batch_size * seq_len / med / 1e12 if flops else None,
        "gpu_stall_share": stats.gpu_stall_share,
        "prefetch_hit_rate": stats.prefetch_hit_rate,
        "bytes_per_step": {hop: b / n_all for hop, b in stats.bytes_moved.items() if b},
        "peak_bytes": dict(stats.peak_bytes),
        "loss_last": runner.loss_last,
    }


def _print_table(results: Sequence[dict], decision: Decision) -> None:
    from ..run_settings import human_bytes

    by_depth = {c.depth: c for c in decision.comparisons}
    tiers = sorted({t for r in results for t in r["peak_bytes"]})
    hops = sorted({h for r in results for h in r["bytes_per_step"]})
    head = ["depth", "n", "median ms", "IQR ms", f"gain vs {decision.baseline} [{decision.confidence:.0%} CI]",
            "verdict", "stall ms/step", "tokens/s"] + [f"{h} /step" for h in hops] + [f"peak {t}" for t in tiers]
    rows = []
    for r in results:
        d, st = r["depth"], r["step_time_s"]
        mark = " *" if d == decision.recommended else ""
        c = by_depth.get(d)
        gain = "baseline" if c is None else f"{c.gain:+.1%} [{c.low:+.1%}, {c.high:+.1%}]"
        rows.append([f"{d}{mark}", str(r["n"]), f"{st['median'] * 1e3:.1f}",
                     f"{st['q25'] * 1e3:.1f}-{st['q75'] * 1e3:.1f}", gain,
                     "" if c is None else c.verdict.value, f"{r['stall_s_per_step'] * 1e3:.1f}",
                     f"{r['tokens_per_s']:,.0f}"] +
                    [human_bytes(r["bytes_per_step"].get(h, 0)) for h in hops] +
                    [human_bytes(r["peak_bytes"].get(t, 0)) for t in tiers])
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head))]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def run(args) -> int:
    """``zero-offload bench prefetch``: see the module docstring."""
    import numpy as np
    import torch

    import zero_offload

    from ..run_settings import (EXIT_OK, UsageError, describe_model, human_bytes, one_line, build_model,
                       remove_dead_runs_spaces, resolve)
    from ..data import CharCorpus

    with contextlib.ExitStack() as stack:
        default_steps = MIN_CI_BLOCKS * args.block
        defaults = dict(preset="small" if not torch.cuda.is_available() else "1.3b", hf_config=None,
                        steps=default_steps, batch_size=8, seq_len=None, seed=0, lr=None)
        cfg, spec, settings, _ = resolve(args, defaults=defaults, temp_dirs=stack)
        if settings.steps < 2:
            raise UsageError(f"--steps {settings.steps}: the comparison needs at least 2 timed steps per "
                             f"depth; pass --steps 2 or more (default {MIN_CI_BLOCKS} blocks: {default_steps})")
        min_blocks = -(-settings.steps // args.block)
        if min_blocks < MIN_CI_BLOCKS:
            print(f"zero-offload bench prefetch: warning: --steps {settings.steps} with --block {args.block} is "
                  f"{min_blocks} block{'s' if min_blocks > 1 else ''} per depth; the confidence interval resamples "
                  f"whole blocks and needs {MIN_CI_BLOCKS} or more to be trusted, so the verdict is suggestive "
                  f"only (pass --steps {default_steps} or more, or leave --steps at its default)",
                  file=sys.stderr, flush=True)
        baseline = cfg.prefetch_depth
        depths = list(args.depths)
        if baseline not in depths:
            depths = sorted(depths + [baseline])
            print(f"added depth {baseline} to --depths: it is the baseline (the configured prefetch depth; "
                  f"set it with --prefetch-depth)", flush=True)
        if len(depths) < 2:
            raise UsageError(f"--depths {','.join(map(str, depths))}: nothing to compare the baseline {baseline} with; "
                             f"pass two or more depths, e.g. --depths 0,1,2,4")
        remove_dead_runs_spaces(cfg.nvme_dir, print)  # before the free space is measured
        cfg, pinned = _shared_budgets(cfg, len(depths))
        torch.manual_seed(settings.seed)
        model, seq_len = build_model(settings)
        state = {k: v.clone() for k, v in model.state_dict().items()}  # same start at every depth
        del model
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print(f"zero-offload bench prefetch: {describe_model(settings)}, batch {settings.batch_size} x "
              f"{seq_len}, params on {cfg.params}, optimizer on {cfg.optimizer}, dtype {cfg.dtype}; "
              f"{_join(depths)} against the baseline {baseline}; one engine per depth"
              + (" (budgets per engine: " + ", ".join(f"{k.split('_')[0]} {human_bytes(v)}"
                                                      for k, v in pinned.items()) + ")" if pinned else ""),
              flush=True)
        corpus = CharCorpus.default()
        runners = []
        t_build = time.perf_counter()
        for depth in depths:
            torch.manual_seed(settings.seed)
            model, _ = build_model(settings)
            model.load_state_dict(state)
            engine = zero_offload.initialize(model, optimizer=spec,
                                             config=dataclasses.replace(cfg, prefetch_depth=depth))
            stack.callback(engine.close)
            r = _Runner(depth=depth, engine=engine, model=model)
            for _ in range(args.warmup):  # the first records the access order
                _step(r, corpus, settings, seq_len, timed=False)
            engine.synchronize()
            engine.reset_stats()  # byte counters, stall times and peaks cover the measured blocks
            r.steps_at_reset = engine.stats().steps
            runners.append(r)
        del state
        print(f"built {len(depths)} engines and ran {args.warmup} warm-up step(s) each in "
              f"{time.perf_counter() - t_build:.1f} s; measuring in interleaved blocks of 1 settle + "
              f"{args.block} timed steps, at least {settings.steps} timed steps ({min_blocks} blocks) per depth, "
              f"until the depths separate or {args.max_seconds:g} s pass", flush=True)

        def verdict() -> Decision:
            return decide({r.depth: r.times for r in runners}, baseline=baseline, tolerance=args.tolerance,
                          confidence=args.confidence, block=args.block)

        t0 = time.perf_counter()
        looks, rounds, look_at, decision = [], 0, settings.steps, None
        while True:
            for k in range(len(runners)):
                r = runners[(rounds + k) % len(runners)]
                _step(r, corpus, settings, seq_len, timed=False)  # settle: see [Note: interleaved blocks]
                for _ in range(args.block):
                    _step(r, corpus, settings, seq_len, timed=True)
                r.engine.synchronize()
            rounds += 1
            n = min(len(r.times) for r in runners)
            elapsed = time.perf_counter() - t0
            if n >= look_at:
                decision = verdict()
                looks.append(n)
                print(f"  {elapsed:6.1f} s, {n} steps per depth: " +
                      ", ".join(f"{r.depth}: {np.median(r.times) * 1e3:.1f} ms" for r in runners) +
                      ("" if decision.separated else " (not separated)"), flush=True)
                if decision.separated:
                    break
                look_at = next_look(n)
            if elapsed >= args.max_seconds and n >= settings.steps:
                if not looks or looks[-1] != n:
                    decision = verdict()
                    looks.append(n)
                break
        measure_s = time.perf_counter() - t0
        results = [_result(r, settings, seq_len) for r in runners]
    print()
    _print_table(results, decision)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = out / f"prefetch_{_hardware_slug()}_{stamp}"
    record = {
        "what": "zero-offload bench prefetch",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"hardware": _hardware_slug(), "host": platform.node(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
        "model": describe_model(settings), "batch_size": settings.batch_size, "seq_len": seq_len,
        "offload": cfg.to_dict(),
        "warmup_steps": args.warmup, "min_steps": settings.steps, "block": args.block, "blocks": decision.blocks,
        "max_seconds": args.max_seconds, "measure_s": measure_s, "rounds": rounds, "looks": looks,
        "tolerance": args.tolerance, "recommended_depth": decision.recommended,
        "decision": decision.to_dict(), "results": results,
    }
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    why = ("separated" if decision.separated else f"time budget {args.max_seconds:g} s reached")
    print(f"\n{decision.message()}", flush=True)
    print(f"({why} after {measure_s:.0f} s, {rounds} rounds, {min(r['n'] for r in results)} timed steps per "
          f"depth = {decision.blocks} blocks of {args.block}; rule: the gain's {decision.confidence:.0%} "
          f"percentile-bootstrap CI, from {decision.resamples} resamples (seed {decision.seed}) of each depth's "
          f"whole blocks, drawn for each depth on its own, of the median gain over depth {baseline}, "
          f"Bonferroni over {len(depths) - 1}, above 0 and a gain >= {args.tolerance:.0%})", flush=True)
    try:
        plot_prefetch(results, stem.with_suffix(".png"), recommended=decision.recommended, baseline=baseline,
                      title=f"prefetch depth: {describe_model(settings)} on {_hardware_slug()}")
    except ImportError as e:  # the measurements stand without the picture
        print(f"wrote {stem}.json (no PNG: {one_line(e)})")
    else:
        print(f"wrote {stem}.json and {stem}.png")
    return EXIT_OK


HELP = "step time per prefetch depth, measured until the depths separate; recommends one or keeps yours"

DESCRIPTION = """\
Builds one engine per depth (same model, start and budgets) and times real training steps in
interleaved blocks (1 untimed settle step + --block timed steps per depth, round-robin), so that
host drift hits every depth alike. Keeps measuring until every depth has separated from the
baseline (the configured prefetch depth, --prefetch-depth, default 2) or --max-seconds pass;
--steps is the minimum of timed steps per depth (default 10 blocks: 10 x --block; the time limit
never cuts below it). A depth is recommended only when the --confidence (95%) percentile-bootstrap
interval of its median gain over the baseline (4000 resamples of each depth's whole blocks) lies
above 0 (Bonferroni-corrected over the depths) and the gain is at least --tolerance; otherwise it
prints "no depth measurably better; keep N". With fewer than 10 blocks per depth it warns and
marks the verdict suggestive. Prints median, interquartile range, gain with its interval, steps and stall per
depth; writes every step time to a JSON record (and a PNG) in --out.
Memory: all engines live at once (the number of depths x the model's homes); "auto" budgets
are split evenly between them."""


def add_arguments(p) -> None:
    """The flags of ``bench prefetch`` (the model/offload flags are the CLI's run flags)."""
    from ..run_settings import depth_list, nonneg_int, number_type, positive_float, positive_int

    confidence = number_type(float, lambda v: 0.5 <= v < 1.0, "a confidence in [0.5, 1), e.g. 0.95")
    p.add_argument("--depths", type=depth_list, default=list(DEFAULT_DEPTHS),
                   help="comma-separated (default 0,1,2,4,8); the baseline is added when missing")
    p.add_argument("--max-seconds", type=positive_float, default=DEFAULT_MAX_SECONDS, metavar="S",
                   help=f"stop measuring after this many seconds when the depths have not separated "
                        f"(default {DEFAULT_MAX_SECONDS:g}; building the engines comes on top; a round "
                        f"started finishes)")
    p.add_argument("--block", type=positive_int, default=DEFAULT_BLOCK, metavar="N",
                   help=f"timed steps per depth in each round (default {DEFAULT_BLOCK}; each block "
                        f"starts with 1 untimed settle step)")
    p.add_argument("--warmup", type=nonneg_int, default=2, help="untimed steps per engine after building "
                   "it (default 2; the first records the access order)")
    p.add_argument("--tolerance", type=positive_float, default=0.03,
                   help="smallest gain over the baseline worth recommending, and the margin within "
                        "which the smallest faster depth is preferred (default 0.03)")
    p.add_argument("--confidence", type=confidence, default=0.95,
                   help="confidence of the bootstrap intervals (default 0.95)")
    p.add_argument("--out", default="zero_offload_bench", metavar="DIR", help="where the JSON and PNG go")
