"""What the fair harness can run, and what a plan says (standard library only: the driver
imports it without torch).

A plan is a list of items ``case[:knob=value,...]@N``: one case at N GPUs (ranks), run in its
own process group by ``run.py``. Named plans are in ``PLANS``; items are separated by spaces or
';'. Knobs are case.py flags without
the leading dashes (``fsdp2:fsdp-reshard=1@4``, ``ds-zero3:ds-prefetch-bucket=5e7@4``), or their
short aliases in ``KNOB_ALIASES`` (``reshard``, ``prefetch``, ``reduce``, ``ratio``, ``sub-group``).
``compile=1`` (engine, ddp) compiles each block (``block.compile()``, inductor) before the case
wraps the model: ``engine@1 engine:compile=1@1 ddp@1 ddp:compile=1@1`` (the "compile" plan)
measures compiled against eager, with the engine and at the ceiling.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CaseInfo:
    """One case: its recipe (what the row's "recipe" column says) and where it runs."""

    recipe: str
    short: str
    """The recipe in a few words (the summary's column)."""
    compute: str = "bf16"
    """What the matmuls see: "autocast" (fp32 params cast per op) or "bf16" (bf16 params): the
    step-0 losses of one compute kind agree (same weights, same data)."""
    gpu_only: bool = False
    max_world: int | None = None
    knobs: tuple = ()
    startup_s: float = 25.0
    """Process start to the first step at 1.31B on the GPU machine (import, init, weights)."""
    step_s: dict = dataclasses.field(default_factory=dict)
    """Expected s/step at 1.31B, batch 8x1024 per rank, by N (from BASELINES.md and the
    2026-11-27 fair calls, rounded up: the slowest host seen): the driver's deadline check."""
    startup_per_b: float = 6.0
    """Seconds of start-up per billion params beyond the 1.31B of ``startup_s`` ([Note: estimates
    scale with the model]): the engines' meta init draws ~2.4 s per billion (bench_init.py's
    meta-auto), doubled for the pinning and the shared node; DeepSpeed's zero.Init gathers every
    parameter once more, and the torch cases draw per parameter on the CPU and copy to the GPU."""
    startup_per_rank_b: float = 0.0
    """Seconds of start-up per billion params of each rank's shard beyond the 1.31B's, on top of
    ``startup_per_b`` (the engines: every rank draws every value, but makes, pins and frees the
    homes of its own shard only). Session 22 on 2x H200, the case's wall less its steps: 79 s at
    27.65B and 37 s at 12.75B on 2 ranks, 87 s at 14.01B on one, where the whole-model rate of
    4.5 s/B had priced them at 154, 86 and 92 s and dropped two pairs' engine rows."""
    work_exponent: float | None = None
    """How a step grows with the work beyond the 1.31B model (None: ``WORK_EXPONENT``; [Note:
    estimates scale with the model])."""


TORCH_AUTOCAST = "fp32 params + bf16 autocast, AdamW fp32 state"
BF16_MASTER = "bf16 work + fp32 master"
DS3_KNOBS = ("ds-prefetch-bucket", "ds-reduce-bucket", "ds-sub-group")
CASES: dict[str, CaseInfo] = {
    "ddp": CaseInfo(
        TORCH_AUTOCAST + " on the GPU, fused (no offload: the ceiling)",
        short="fp32 + autocast", compute="autocast", knobs=("compile",), startup_s=20,
        step_s={1: 0.17, 2: 0.18, 4: 0.19}),
    "ddp-bf16": CaseInfo(
        "bf16 params, no fp32 master, AdamW state bf16 on the GPU, fused (no offload: the ceiling of "
        "the engine's own bf16-params recipe)",
        short="bf16 params", startup_s=20, step_s={1: 0.15, 2: 0.16, 4: 0.17}),
    "engine": CaseInfo(
        "bf16 working params (no autocast), fp32 master + moments on the CPU; zero_offload engine "
        "params=cpu optimizer=cpu",
        short=BF16_MASTER, knobs=("opt", "compile", "engine-optimizer", "engine-moments"), startup_s=35,
        startup_per_b=1.0, startup_per_rank_b=3.0, step_s={1: 0.45, 2: 0.40, 4: 0.65}),
    "engine-auto": CaseInfo(
        "bf16 working params (no autocast), fp32 master + moments on the CPU; zero_offload engine "
        "params=auto optimizer=auto",
        short=BF16_MASTER, knobs=("opt", "gpu-cap", "activation-reserve", "engine-params", "engine-moments"),
        startup_s=35,
        startup_per_b=1.0, startup_per_rank_b=3.0, step_s={1: 0.35, 2: 0.35, 4: 0.35}),
    "offload-adamw": CaseInfo(
        TORCH_AUTOCAST + " on the CPU (zero_offload OffloadAdamW, overlap_forward=True; knob "
        "overlap=0: overlap_forward=False; knob opt=: the rule's offload optimizer)",
        short="fp32 + autocast", compute="autocast", knobs=("overlap-forward", "opt"), startup_s=25,
        step_s={1: 0.5, 2: 0.45, 4: 0.45}),
    "torch-opt": CaseInfo(
        "fp32 params + bf16 autocast, the opt= knob's torch.optim rule on the GPU (no offload; muon: "
        "torch.optim.Muon on the hidden matrices + AdamW fused on the rest)",
        short="fp32 + autocast", compute="autocast", knobs=("opt",), startup_s=20,
        step_s={1: 0.25, 2: 0.25, 4: 0.25}),
    "torchao": CaseInfo(
        TORCH_AUTOCAST + " on the CPU (torchao CPUOffloadOptimizer, AdamW fused, offload_gradients=True)",
        short="fp32 + autocast", compute="autocast", gpu_only=True, max_world=1,
        startup_s=25, step_s={1: 1.5}),
    "fsdp2": CaseInfo(
        "bf16 compute params (MixedPrecisionPolicy param bf16, reduce fp32), fp32 sharded params + "
        "AdamW state on the CPU (CPUOffloadPolicy pin_memory, torch.optim.AdamW fused)",
        short="bf16 compute + fp32 master", gpu_only=True, knobs=("fsdp-reshard",),
        startup_s=30, startup_per_b=8.0, step_s={1: 2.4, 2: 2.5, 4: 1.5}),
    "ds-zero2": CaseInfo(
        "DeepSpeed bf16 params, fp32 master + moments on the CPU (ZeRO-2 + offload_optimizer cpu, "
        "DeepSpeedCPUAdam)",
        short=BF16_MASTER, gpu_only=True, startup_s=45, startup_per_b=10.0, step_s={1: 1.0, 2: 0.9, 4: 0.9}),
    "ds-zero3": CaseInfo(
        "DeepSpeed bf16 params, fp32 master + moments on the CPU (ZeRO-3, offload_param + "
        "offload_optimizer cpu, DeepSpeedCPUAdam)",
        short=BF16_MASTER, gpu_only=True, knobs=DS3_KNOBS + ("ds-nvme",), startup_s=50, startup_per_b=6.1,
        step_s={1: 1.1, 2: 1.2, 4: 1.3}, work_exponent=0.6),
    "ds-zero3-ratio": CaseInfo(
        "DeepSpeed bf16 params on the GPU, fp32 master + moments: the ds-ratio share on the CPU "
        "(DeepSpeedCPUAdam), the rest on the GPU (ZeRO-3, offload_optimizer cpu with ratio)",
        short=BF16_MASTER, gpu_only=True, knobs=("ds-ratio",) + DS3_KNOBS,
        startup_s=50, startup_per_b=8.0, step_s={1: 0.9, 2: 0.9, 4: 0.9}),
    "ds-muon": CaseInfo(
        "DeepSpeed bf16 params, fp32 master + optimizer state on the GPU (no offload: DeepSpeed's Muon "
        "offload path is not supported), ZeRO-2 (knob ds-stage=1: ZeRO-1 with fp32 grad accumulation, "
        "DeepSpeed's BF16_Optimizer); optimizer type Muon: DeepSpeed's Muon on the blocks' matrices "
        "(momentum 0.95, Nesterov, 5 quintic Newton-Schulz steps in bf16 = ns_method standard, lr x "
        "sqrt(max(1, rows/cols)) as torch's 'original'), AdamW on the rest (torch.optim.AdamW, foreach, "
        "through DeepSpeed's torch_adam). Differences from torch-opt[opt=muon]: bf16 params + fp32 "
        "master, not fp32 params + autocast; at ZeRO-2 grads and Muon momentum in bf16 (DeepSpeed keeps "
        "the momentum in the grad's dtype; ds-stage=1: fp32); Newton-Schulz is DeepSpeed's own (same "
        "coefficients, another op order: 15-19% from torch's on a tiny GPT's first update, both bf16), "
        "torch.compiled; "
        "AdamW foreach, not fused; use_muon re-tagged to torch's split (DeepSpeed's name rule would also "
        "give Muon the tied embedding wte and wpe: the row's ds_muon_retagged)",
        short=BF16_MASTER, gpu_only=True, knobs=("ds-stage",), startup_s=75,
        step_s={1: 0.5, 2: 0.5, 4: 0.5}),  # not yet measured: torch-opt[opt=muon] 0.28 s + ZeRO's copies
}

COMMON_KNOBS = ("threads", "tree")
"""Knobs every case takes, applied by the driver:

- ``threads=T`` runs the case with T CPU threads per rank instead of the run's rule (cores // N),
  for a thread sweep (``fsdp2:threads=8@2``): quote each engine at the best count it reached, never
  above cores // N, and name the count in the row.
- ``tree=NAME`` runs the case with zero_offload imported from ``.trees/NAME/src`` (another commit's
  source with its extension built in place; ``benchmarks/fair/tree.sh`` makes one) instead of the
  installed package: a before/after comparison of two commits in one call, interleaved in the
  shuffled order (``engine:tree=before@1 engine@1``). The row records the path it imported."""

CASE_KNOBS = ("checkpointing", "profile")
"""Knobs every case takes as its own flag (``ckpt=1``: activation checkpointing for this item
only, e.g. the engine under a GPU cap; ``ckpt=0.5`` the first half of the blocks; the row's
``checkpointing`` says which fraction; ``profile=N``: N more steps after the timed ones under
torch.profiler, a trace in the logs and the top ops in the case log)."""

OPTS = ("adamw", "sgd", "lion", "adafactor", "muon")
"""Values of the ``opt=`` knob (engine, offload-adamw, torch-opt): the update rule of the case
(issue 25: each rule offloaded vs the same torch optimizer without offload vs AdamW offloaded)."""

DS_MUON_STAGES = ("1", "2")
"""Values of ds-muon's ``ds-stage=`` knob: the ZeRO stages DeepSpeed 0.19.8 runs Muon at without
offload and without zero.Init (2: the default; 1 with fp32 grad accumulation: BF16_Optimizer).
Stage 0 applies the raw gradient (no Newton-Schulz, DeepSpeed PR 8442); stage 3 needs zero.Init."""

KNOB_CHOICES = {"engine-params": ("auto", "gpu"), "engine-optimizer": ("cpu", "nvme"),
                "engine-moments": ("fp32", "bf16"), "ds-nvme": ("0", "1"),
                "fsdp-reshard": ("0", "1"), "overlap-forward": ("0", "1"), "compile": ("0", "1")}
"""Knobs with a fixed set of values, checked when the plan is read (not when the case starts)."""

KNOB_ALIASES = {"ckpt": "checkpointing", "reserve": "activation-reserve", "params": "engine-params",
                "optimizer": "engine-optimizer", "moments": "engine-moments", "nvme": "ds-nvme", "overlap": "overlap-forward", "reshard": "fsdp-reshard", "prefetch": "ds-prefetch-bucket",
                "reduce": "ds-reduce-bucket", "ratio": "ds-ratio", "sub-group": "ds-sub-group"}

# [Note: plan order is priority] (run.py): when a plan's expected time exceeds the deadline, its
# last items are the ones not run; the rest run in shuffled order. Each plan keeps the engine and
# the ddp ceiling of every N first: ratios compare rows of one run only.
_N1 = ("engine ddp torchao ds-zero3 fsdp2:reshard=0 ds-zero2 offload-adamw ddp-bf16 engine-auto").split()
_N2 = "engine ddp ds-zero3 fsdp2:reshard=0 ds-zero2 offload-adamw engine-auto".split()
_N4 = ("engine ddp ds-zero2 ds-zero3 fsdp2:reshard=0 fsdp2:reshard=1 offload-adamw engine-auto "
       "ds-zero3:prefetch=5e7,reduce=5e8 ds-zero3-ratio:ratio=0.5").split()
# The 2-GPU call of a full rerun, with the 4-GPU DeepSpeed GPU share (and the engine at 4 beside it:
# ratios compare rows of one call). Measured case times on the x4 kind (2026-11-27 calls: 22-93 s a
# case, setup ~70 s) make n1, n4 and n2r about 8-9 minutes each.
_N2R = ["engine@2", "ddp@2", "ds-zero2@2", "ds-zero3@2", "fsdp2:reshard=0@2", "offload-adamw@2",
        "engine@4", "ds-zero3-ratio:ratio=0.5@4", "fsdp2:reshard=1@2", "engine-auto@2"]
_N4A = "engine ddp ds-zero3 fsdp2:reshard=0 ds-zero2 offload-adamw".split()
_N4B = ("engine ddp ds-zero3:prefetch=5e7,reduce=5e8 fsdp2:reshard=1 ds-zero3-ratio:ratio=0.5 "
        "engine-auto").split()
PLANS: dict[str, list[str]] = {
    "n1": [f"{c}@1" for c in _N1],
    "n2": [f"{c}@2" for c in _N2],
    "n4": [f"{c}@4" for c in _N4],
    # the 2- and 4-GPU plan, by priority; about 15 min of cases: one 10-minute call runs
    # its first part (the rows name the rest), or split it: n2, n4a, n4b (each call its own
    # engine and ddp rows, so each call's ratios stand alone)
    "n2n4": [f"{c}@{n}" for c in ("engine", "ddp", "ds-zero3", "fsdp2:reshard=0", "ds-zero2") for n in (4, 2)]
            + [f"{c}@4" for c in _N4[5:]] + [f"{c}@2" for c in _N2[5:]],
    "n2r": _N2R,
    "n4a": [f"{c}@4" for c in _N4A],
    "n4b": [f"{c}@4" for c in _N4B],
    # the thread sweep of the engines that run torch's CPU AdamW on the intra-op pool (FSDP2,
    # torchao) beside the engine at the same counts: cores // N is the cap of every count
    "threads": ["engine@2", "ddp@2", "fsdp2:reshard=1,threads=8@2", "fsdp2:reshard=1,threads=16@2",
                "engine:threads=16@2", "engine@1", "torchao:threads=16@1", "torchao:threads=32@1",
                "fsdp2:reshard=1,threads=8@4"],
    # issue 22's DeepSpeed sweeps on the 2-GPU kind: ZeRO-3 with params and optimizer offloaded at
    # the HF "auto" buckets (the case's default), DeepSpeed's own defaults and larger ones, and its
    # GPU share (offload_optimizer.ratio) at two ratios, beside the engine host-only and "auto", the
    # DDP ceiling and the bf16-params ceiling of the engine's recipe
    "ds2": ["engine@2", "ddp@2", "ds-zero3@2", "ds-zero3:prefetch=5e7,reduce=5e8@2",
            "ds-zero3-ratio:ratio=0.5@2", "engine-auto@2", "ddp-bf16@2", "ds-zero3:prefetch=2e8,reduce=1e9@2",
            "ds-zero3-ratio:ratio=0.25@2"],
    # the opt-in bf16 moments on one GPU (issue 24 part 3): host-only, where they halve the moments'
    # host bytes and the CPU step's traffic, and under "auto"; beside the exact fp32 moments
    "moments": ["engine@1", "engine:moments=bf16@1", "engine-auto@1", "engine-auto:moments=bf16@1", "ddp@1"],
    # compiled blocks against eager, through the engine and at the ceiling (compile=1: the
    # warm-up steps compile; the rows report compile_s)
    "compile": ["engine@1", "engine:compile=1@1", "ddp@1", "ddp:compile=1@1"],
    # issue 23's before/after (needs .trees/before: benchmarks/fair/tree.sh pack before 0795af2):
    # the engine (params cpu and auto) and OffloadAdamW (overlap_forward on and off) on one GPU,
    # the engine on 2 GPUs, each beside the same case of the commit the restructuring started from
    # issue 24 on one GPU: the engine held to torchao's footprint (25.6 GiB, its measured peak at
    # 1.31B) beside torchao and the ceiling; reserve=17.5: the activations' GiB the first plan leaves
    # (the last item: "auto"'s own first plan, half the budget, under the same cap)
    "share1": ["engine-auto:gpu-cap=25.6,reserve=17.5@1", "torchao@1", "ddp@1", "engine-auto@1",
               "engine-auto:gpu-cap=25.6@1"],
    # issue 23's before/after on one GPU (i23 without its 2-GPU pair)
    "i23n1": ["engine@1", "engine:tree=before@1", "offload-adamw:overlap=0@1",
              "offload-adamw:overlap=0,tree=before@1", "engine-auto@1", "engine-auto:tree=before@1",
              "offload-adamw@1", "offload-adamw:tree=before@1"],
    "i23": ["engine@1", "engine:tree=before@1", "offload-adamw:overlap=0@1", "offload-adamw:overlap=0,tree=before@1",
            "engine@2", "engine:tree=before@2", "engine-auto@1", "engine-auto:tree=before@1",
            "offload-adamw@1", "offload-adamw:tree=before@1"],
    # issue 24 part 1 (auto across the node) at 1 and 2 GPUs; the 4-GPU goal is "n4"'s engine-auto
    "auto": ["engine-auto@2", "ddp@2", "engine-auto@1", "ddp@1", "engine@2", "engine@1"],
    # issue 24's measurement on the 4-GPU kind: "auto" at 1, 2 and 4 GPUs beside DDP without
    # offload at each N (the >= 90% goal at 4), the engine host-only at 4; then the rules whose
    # state "auto" puts in the GPU share
    "auto124": ["engine-auto@4", "ddp@4", "engine-auto@2", "ddp@2", "engine-auto@1", "ddp@1", "engine@4",
                "engine-auto:opt=adafactor@1", "engine-auto:opt=muon@1"],
    # issue 25: each rule offloaded (engine, OffloadOptimizer) vs its torch optimizer on the GPU
    # vs AdamW offloaded (lion has no torch.optim rule)
    "rules": ["engine@1", "engine:opt=muon@1", "torch-opt:opt=muon@1", "torch-opt@1", "engine:opt=sgd@1",
              "torch-opt:opt=sgd@1", "engine:opt=adafactor@1", "torch-opt:opt=adafactor@1", "engine:opt=lion@1",
              "offload-adamw:opt=muon@1", "offload-adamw@1"],
    # issue 24 part 3, the largest models (--model 30b / 14b, --init seeded:0, --checkpointing; one
    # case fills most of a call: device.sh's phases run two models in one call): "big4" the
    # largest on the 4-GPU node, "big4-base" DeepSpeed ZeRO-3 and FSDP2 offload beside the engine at
    # the size they fit (14b), "big1" the largest on one H100 + its host, "7b4" the 6.58B at 32K
    # tokens per step over 4 GPUs (--batch 8)
    # issue 24's 4-GPU gap: "auto" and DDP at 4 and 2 GPUs, each with 3 untimed profiled steps
    # after its timed ones (the traces in the logs, the top ops in each case log)
    "gap4": ["engine-auto:profile=3@4", "ddp:profile=3@4", "engine-auto:profile=3@2", "ddp:profile=3@2"],
    "big4": ["engine-auto@4", "engine@4"],
    "big4-base": ["engine-auto@4", "ds-zero3@4", "fsdp2:reshard=1@4"],
    "big1": ["engine-auto@1", "engine@1"],
    "7b4": ["engine-auto@4", "engine@4", "ds-zero3@4"],
    # issue 25's Muon row: Muon offloaded (engine host-only and auto, OffloadMuon) vs AdamW offloaded
    # vs torch.optim.Muon on the GPU vs DeepSpeed's Muon without offload (its ZeRO-1 path last)
    "muon": ["engine:opt=muon@1", "engine@1", "engine-auto:opt=muon@1", "offload-adamw:opt=muon@1",
             "torch-opt:opt=muon@1", "ds-muon@1", "torch-opt@1", "ds-muon:ds-stage=1@1"],
    # what runs on a CPU (tests, smoke): no GPU-only case
    "cpu": ["ddp@1", "ddp-bf16@1", "engine@1", "engine-auto@1", "offload-adamw@1", "ddp@2", "engine@2"],
}


def recipe(case: str, knobs: dict) -> str:
    """The row's recipe: the case's, with what a knob changes in it named (``moments=bf16``: the
    engine's Adam moments in bf16, inexact)."""
    text = CASES[case].recipe
    if "engine-moments" in CASES[case].knobs and knobs.get("engine-moments", "fp32") != "fp32":
        text = text.replace("fp32 master + moments", "fp32 master + bf16 moments (stochastic rounding, "
                            "inexact: knob moments=bf16)")
    return text


@dataclasses.dataclass(frozen=True)
class Item:
    """One (case, knobs, N) of a plan."""

    case: str
    world: int
    knobs: tuple = ()  # ((flag, value), ...) in the order given

    @property
    def label(self) -> str:
        """The case with its knobs, e.g. ``ds-zero3[prefetch=5e7,reduce=5e8]``."""
        if not self.knobs:
            return self.case
        short = {v: k for k, v in KNOB_ALIASES.items()}
        return f"{self.case}[" + ",".join(f"{short.get(k, k)}={v}" for k, v in self.knobs) + "]"

    @property
    def slug(self) -> str:
        """The label as a file name piece."""
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.label).strip("_")
        return f"{name}_n{self.world}"

    def case_args(self) -> list:
        out = []
        for k, v in self.knobs:
            if k in COMMON_KNOBS:  # the driver applies these (threads: OMP and case.py's --threads)
                continue
            out += [f"--{k}", str(v)]
        return out


def parse_item(text: str) -> Item:
    """``case[:knob=value,...]@N`` -> Item; ValueError (one line, naming the fix) otherwise."""
    body, at, n = text.strip().rpartition("@")
    if not at or not n.isdigit() or int(n) < 1:
        raise ValueError(f"plan item {text!r}: write case[:knob=value,...]@N with N >= 1, e.g. ddp@2")
    name, _, knob_text = body.partition(":")
    if name not in CASES:
        raise ValueError(f"plan item {text!r}: unknown case {name!r}; choose from {', '.join(CASES)}")
    info = CASES[name]
    knobs = []
    for kv in filter(None, knob_text.split(",")):
        k, eq, v = kv.partition("=")
        k = KNOB_ALIASES.get(k.strip(), k.strip())
        if not eq or not v.strip():
            raise ValueError(f"plan item {text!r}: knob {kv!r} needs a value (knob=value)")
        if ":" in v or "=" in v:
            raise ValueError(f"plan item {text!r}: knob {kv!r} holds another knob; separate knobs with ',' "
                             f"(case:knob=value,knob=value@N)")
        if k not in info.knobs + COMMON_KNOBS + CASE_KNOBS:
            raise ValueError(f"plan item {text!r}: case {name} takes no knob {k!r}; its knobs: "
                             f"{', '.join(info.knobs) or 'none'}")
        if k == "checkpointing":
            try:
                checkpoint_fraction(v.strip())
            except ValueError as e:
                raise ValueError(f"plan item {text!r}: {e}") from None
        if k in KNOB_CHOICES and v.strip() not in KNOB_CHOICES[k]:
            raise ValueError(f"plan item {text!r}: {k}={v.strip()}: choose from {', '.join(KNOB_CHOICES[k])}")
        if k == "opt" and v.strip() not in OPTS:
            raise ValueError(f"plan item {text!r}: opt={v.strip()} is not a rule; choose from {', '.join(OPTS)}")
        if k == "ds-stage" and v.strip() not in DS_MUON_STAGES:
            raise ValueError(f"plan item {text!r}: ds-stage={v.strip()}: DeepSpeed runs Muon at ZeRO stage "
                             f"{' or '.join(DS_MUON_STAGES)} here (no offload; stage 0 runs no Newton-Schulz)")
        knobs.append((k, v.strip()))
    return Item(case=name, world=int(n), knobs=tuple(knobs))


def parse_plan(text: str) -> list:
    """A named plan (``PLANS``; several joined by '+'), or items separated by spaces or ';'
    (a knob list uses ',')."""
    names = text.split("+")
    if all(n in PLANS for n in names):
        return [parse_item(i) for n in names for i in PLANS[n]]
    items = [parse_item(t) for t in text.replace(";", " ").split()]
    if not items:
        raise ValueError(f"--plan {text!r} names no case; use a plan from {', '.join(PLANS)} or items "
                         f"like 'ddp@1 engine@1'")
    return items


def threads_for(world: int, cores: int, policy: str = "auto") -> int:
    """Per-rank CPU threads for every case at ``world`` ranks: ``auto`` = floor(cores / world),
    or a fixed integer."""
    if policy == "auto":
        return max(1, cores // world)
    if not policy.isdigit() or int(policy) < 1:
        raise ValueError(f"--threads-per-rank {policy!r}: use 'auto' (cores // N) or an integer >= 1")
    return int(policy)


REF_PARAMS = 1_313_722_368
"""The 1.31B preset ("1.3b") the CaseInfo times were measured at."""
REF_STEP_FLOPS = 69_519_884_156_928
"""Its training FLOPs per rank per step: flops_per_token(1024) x 8 x 1024 tokens, no
checkpointing (tests/test_bench_fair.py checks both against the preset)."""
NVME_STEP_S_PER_B = 12.0
"""Seconds a step takes per billion params with the optimizer state on the x1 VM's disk: session
16 measured 15.7 s at 1.31B (engine:optimizer=nvme@1; the state read and written each step)."""
NVME_STARTUP_S = 10.0
"""Start-up beside that (the swap file, DeepSpeed's aio buffers)."""
LONG_STEP_S = 10.0
"""case.py's LONG_STEP_S: a step longer than this runs 5 timed steps (the protocol's minimum)."""


def checkpoint_fraction(text) -> float:
    """A ``ckpt`` value: 1 checkpoints every block, a fraction F the first round(F x layers), 0 none."""
    try:
        fraction = float(text)
    except (TypeError, ValueError):
        fraction = -1.0
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"checkpointing {text!r}: give 0, 1 or the fraction of blocks to checkpoint (0.5)")
    return fraction


WORK_EXPONENT = 0.75
"""A step's time grows as work ** 0.75 beyond the 1.31B model, not in proportion: the per-step
overheads of the small model (launches, collectives' latency, the host's per-chunk bookkeeping)
do not grow with it. Measured in session 14 on the 4-GPU node, 6.58B with checkpointing at 8x1024
per rank (work 6.7): engine-auto 1.01 s, FSDP2 2.02 s, DeepSpeed ZeRO-3 3.1 s a step, against
linear estimates of 3.0, 10 and 8.7 s (a case past the deadline by its estimate is not run:
ZeRO-3 was dropped twice); at 30.5B (work 31) engine-auto ran 6.59 s, work ** 0.75 gives 5.9.
Session 16 at 14.01B (work 14.3) on the same node: DeepSpeed ZeRO-3 5.33 s/step (251 s a case,
where the estimate said 364 and dropped it), 3.11 at 6.58B in s14: its step grows as work ** 0.6
(``CaseInfo.work_exponent``); engine-auto 1.93 s and 123 s a case, FSDP2 3.93 s and 229 s."""


def step_flops(flops_per_token: int, *, batch: int, seq: int, checkpointing: float) -> float:
    """Model FLOPs one rank computes per step (checkpointing runs each checkpointed block's forward
    twice: 4/3 of the work with every block)."""
    return flops_per_token * batch * seq * (1.0 + float(checkpointing) / 3)


def expected_seconds(item: Item, *, params: int, warmup: int, steps: int, cuda: bool,
                     flops: float | None = None) -> float:
    """The driver's estimate of one case's wall time (process start to exit).

    [Note: estimates scale with the model] ``startup_s`` and ``step_s`` are for the 1.31B model
    at 8x1024 tokens per rank. Start-up grows by ``startup_per_b`` seconds per billion params
    beyond it, and by ``startup_per_rank_b`` per billion of each rank's shard; a step by the
    larger of the params ratio (what the CPU optimizer, the PCIe copies and the host memory do:
    per param) and the FLOPs ratio (``flops``: ``step_flops`` of this run against
    ``REF_STEP_FLOPS``; None: the params ratio alone). A step over ``LONG_STEP_S`` makes
    case.py time 5 steps, not ``steps``."""
    info = CASES[item.case]
    scale = params / REF_PARAMS
    if not cuda:  # tiny CPU presets: a few seconds of imports and init
        return 8.0 + item.world * 2.0 + (warmup + steps) * 0.05 * max(1.0, scale * 1000)
    step = info.step_s.get(item.world) or max(info.step_s.values())
    work = max(scale, (flops / REF_STEP_FLOPS) if flops else 0.0, 0.02)
    exponent = WORK_EXPONENT if info.work_exponent is None else info.work_exponent
    step *= work if work <= 1.0 else work ** exponent
    beyond = max(0.0, (params - REF_PARAMS) / 1e9)
    startup = info.startup_s + info.startup_per_b * beyond + info.startup_per_rank_b * beyond / item.world
    knobs = dict(item.knobs)
    if knobs.get("engine-optimizer") == "nvme" or knobs.get("ds-nvme") == "1":  # the disk's pace
        step = max(step, NVME_STEP_S_PER_B * params / 1e9)
        startup += NVME_STARTUP_S
    if step > LONG_STEP_S:
        steps = min(steps, 5)
    return startup + (warmup + steps) * step


def case_timeout(expected_s: float) -> float:
    """--case-timeout when none is given: twice the estimate, at least 300 s (the 1.31B default)."""
    return max(300.0, 2.0 * expected_s)
