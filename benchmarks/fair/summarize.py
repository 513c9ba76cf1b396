"""summary.md from the fair harness's rows: one table per (run, N); ratios only between rows of
the same run.

    python benchmarks/fair/summarize.py OUT/rows.jsonl [--out OUT/summary.md]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fairplan import CASES  # noqa: E402


def read_rows(path: str) -> list:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a killed driver: the rest still count
                print(f"summarize: {path}:{n} is not a JSON row (cut short?); skipped", file=sys.stderr)
    return rows


def _f(x, fmt=".3f", none="-"):
    return none if x is None else format(x, fmt)


def _status(r: dict) -> str:
    if r.get("error"):
        return f"**error**: {r['error']}"
    if r.get("not_run"):
        return f"not run: {r['not_run']}"
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    return ""


def _ok(r: dict) -> bool:
    return not _status(r) and r.get("median_s") is not None


def _notes(r: dict) -> str:
    out = []
    if r.get("steps_reason"):
        out.append(r["steps_reason"])
    if r.get("protocol_ok") is False:
        out.append("below protocol (warm-up >= 3, timed >= 20 / >= 5 for steps > 10 s)")
    if "fsdp2_fused_took_effect" in r:
        fused = "on" if r["fsdp2_fused_took_effect"] else f"OFF: {r.get('fsdp2_fused_error')}"
        out.append(f"fused AdamW {fused}")
    if "ds_subgroups_cpu_of_total" in r:
        c, t = r["ds_subgroups_cpu_of_total"]
        out.append(f"{c} of {t} sub-groups on the CPU")
    parts = r.get("engine_init_seconds")
    if parts:  # where the engine's initialize went (Engine.init_seconds)
        out.append("init " + ", ".join(f"{k} {parts[k]:.1f}" for k in ("homes", "values", "plan", "rest") if k in parts))
    placement = (r.get("engine_stats") or {}).get("placement") or {}
    share = placement.get("share") or {}
    if share.get("chunks") and (share.get("host_chunks") or share.get("nvme_chunks")):
        total = share["chunks"] + share.get("host_chunks", 0) + share.get("nvme_chunks", 0)
        out.append(f"GPU share {share['chunks']} of {total} chunks")
    if placement.get("replicas"):  # the engine's mode with ranks ([Note: replicas when all fits])
        out.append("params replicated on every GPU"
                   + (" (added by the measured first step)" if placement.get("replicas_added") else ""))
    if r.get("profiled_steps"):
        out.append(f"{r['profiled_steps']} untimed steps profiled (trace in the logs)")
    if r.get("torch_threads_per_rank") and any(t != r.get("threads") for t in r["torch_threads_per_rank"]):
        out.append(f"torch threads {r['torch_threads_per_rank']} != {r.get('threads')}")
    return "; ".join(out)


def _threads(r: dict) -> str:
    rep = dict(r.get("threads_reported") or {})
    torch_t = rep.pop("torch_after_build", r.get("threads"))
    other = ", ".join(f"{v}" for v in rep.values())
    return f"{torch_t}" + (f" / {other}" if other else "")


def table(rows: list, world: int) -> list:
    ok = {r["label"]: r for r in rows if _ok(r)}
    ref = {name: ok[name]["tokens_per_s"] for name in ("ddp", "engine") if name in ok}
    lines = [f"## N = {world}", "",
             "| case | recipe | s/step median [p25-p75] | wall s/step | tokens/s | TFLOPS/GPU | "
             + " | ".join(f"tok/s vs {k}" for k in ref) + (" | " if ref else "")
             + "step-0 loss | GPU peak GiB alloc/res | PSS/rank GiB | MemAvail drop GiB | host B/param | "
             "init s | threads torch / engine | notes |",
             "|" + "---|" * (14 + len(ref))]
    for r in sorted(rows, key=lambda r: (not _ok(r), -(r.get("tokens_per_s") or 0), r["label"])):
        info = CASES.get(r.get("case"))
        short = info.short if info else "?"
        if not _ok(r):
            lines.append("| " + " | ".join([r["label"], short] + [""] * (11 + len(ref)) + [_status(r)]) + " |")
            continue
        gpu = (max(r.get("gpu_peak_alloc_per_rank_gib") or [0]),
               max(r.get("gpu_peak_reserved_per_rank_gib") or [0]))
        drop = r.get("driver_memavail_drop_gib", r.get("memavail_drop_gib"))
        pss = r.get("pss_peak_per_rank_gib") or []
        vs = [f"{r['tokens_per_s'] / v:.2f}x" for v in ref.values()]
        lines.append(
            f"| {r['label']} | {short} | {r['median_s']:.3f} [{r['p25_s']:.3f}-{r['p75_s']:.3f}] | "
            f"{r['wall_mean_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['model_tflops_per_gpu']:.1f} | "
            + "".join(f"{v} | " for v in vs)
            + f"{r['step0_loss']:.4f} | {gpu[0]:.1f} / {gpu[1]:.1f} | "
            f"{max(pss) if pss else 0:.1f} (max of {len(pss)}) | {_f(drop, '.1f')} | "
            f"{_f(r.get('host_bytes_per_param', r.get('driver_host_bytes_per_param')), '.1f')} | "
            f"{_f(r.get('init_s'), '.0f')} | {_threads(r)} | {_notes(r)} |")
    groups = step0_groups(ok.values())
    if groups:
        lines += ["", "Step-0 loss spread (rows with the same weights (`init_fingerprint`) and data: equal "
                  "up to rounding within one compute kind): " + "; ".join(
                      f"{k}{f' [{w}]' if len({g[1] for g in groups}) > 1 else ''}: {min(v):.4f}-{max(v):.4f} "
                      f"over {len(v)} rows" for (k, w), v in groups.items())]
    return lines


def step0_groups(rows) -> dict:
    """(compute kind, init_fingerprint) -> the step-0 losses of those rows: only rows that start
    from identical weights (case.py [Note: seeded init]) and compute alike are compared."""
    out: dict = {}
    for r in rows:
        kind = CASES[r["case"]].compute if r.get("case") in CASES else "?"
        out.setdefault((kind, r.get("init_fingerprint", "?")), []).append(r["step0_loss"])
    return out


def _plan_text(rows: list) -> str:
    """The plan items of ``rows`` (``case:knob=v,...@N``, the knobs by their flag names)."""
    return " ".join(f"{r['case']}" + (":" + ",".join(f"{k}={v}" for k, v in r["knobs"].items())
                                      if r.get("knobs") else "") + f"@{r['world']}" for r in rows)


def _checkpointing(rows) -> str:
    """The run's activation checkpointing: on (every block), off, or each row's (ckpt=F knobs)."""
    fractions = {float(r.get("checkpointing") or 0.0) for r in rows}
    if len(fractions) > 1:
        return "per row (its ckpt= knob: the fraction of blocks)"
    f = fractions.pop() if fractions else 0.0
    return "on" if f == 1.0 else "off" if f == 0.0 else f"on the first {f:g} of the blocks"


def _commits(rows: list) -> str:
    """The commit every row ran, or each commit with the labels that ran it (the tree= knob)."""
    by: dict = {}
    for r in rows:
        by.setdefault(r.get("zero_offload_commit", "?"), []).append(f"{r.get('label', '?')}@{r.get('world', '?')}")
    if len(by) == 1:
        return next(iter(by))
    return "; ".join(f"{c} ({', '.join(labels)})" for c, labels in by.items())


def markdown(rows: list) -> str:
    out = ["# Fair training benchmark (benchmarks/fair)", ""]
    runs: dict = {}
    for r in rows:
        runs.setdefault(r.get("run_id", "?"), []).append(r)
    for run_id, rs in runs.items():
        first = next((r for r in rs if r.get("versions")), rs[0])
        v = first.get("versions") or {}

        def version(mod):
            return next((x["versions"][mod] for x in rs if (x.get("versions") or {}).get(mod)), "-")
        order = ", ".join(f"{r['label']}@{r['world']}" for r in sorted(rs, key=lambda r: r.get("order", 0)))
        out += [f"Run `{run_id}`: {v.get('gpu', first.get('device', '?'))}, driver {v.get('driver', '-')}, "
                f"{v.get('cpu', '?')} ({v.get('cores', '?')} cores), torch {v.get('torch', '?')} CUDA "
                f"{v.get('cuda', '-')}, deepspeed {version('deepspeed')}, torchao {version('torchao')}, "
                "zero_offload " + _commits(rs) + ".", "",
                f"Model {first.get('model', '?')} ({_f(first.get('params'), ',', '?')} params), "
                f"{first.get('batch_per_rank', '?')} x {first.get('seq', '?')} tokens per rank, checkpointing "
                f"{_checkpointing(rs)}; weights: "
                f"{first.get('init') or first.get('init_arg', '?')}; one process group per (case, N), in "
                f"shuffled order: {order}. s/step: median of the timed steps [IQR]; wall s/step: total wall "
                "time over the timed steps, ending after the engine's own finish, / steps; tokens/s "
                "global, from the median; PSS: peak per rank from process start; MemAvail drop: the node's "
                "MemAvailable before the launch minus its minimum during the case; B/param: that drop / "
                "params; threads: torch's per rank / what the engine or optimizer was given. Ratios "
                "compare rows of this run only.", ""]
        for world in sorted({r["world"] for r in rs}):
            out += table([r for r in rs if r["world"] == world], world) + [""]
    again = [r for r in rows if r.get("not_run", "").startswith("deadline")]
    if again:
        out += [f"Not run for the deadline; to run them: `--plan \"{_plan_text(again)}\"`", ""]
    out += ["Recipes:", ""] + [f"- `{k}`: {c.recipe}" for k, c in CASES.items()] + [""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", help="rows.jsonl written by run.py")
    ap.add_argument("--out", default=None, help="summary.md path (default: beside rows.jsonl)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.rows):
        print(f"summarize: {args.rows} does not exist; pass the rows.jsonl run.py wrote", file=sys.stderr)
        return 2
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.rows)), "summary.md")
    with open(out, "w") as f:
        f.write(markdown(read_rows(args.rows)))
    print(f"summarize: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
