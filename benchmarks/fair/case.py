"""One training case of the fair harness, in its own process group (issue 22).

Launched by ``run.py`` as ``torchrun --standalone --nproc-per-node N benchmarks/fair/case.py
--case NAME ...`` for every N, 1 included; rank 0 writes one JSON row to ``--json-out`` (on a
failure: a row whose "error" is one line, and a non-zero exit; a failing rank other than 0 writes
its row to ``<json-out>.rank<r>``). Every case shares, by construction:

- threads: ``torch.set_num_threads(T)`` and ``OMP_NUM_THREADS == T`` (checked), and our
  engine / optimizer given ``threads=T`` (DeepSpeedCPUAdam's OpenMP loop and torch's CPU AdamW
  read the same T);
- weights: the fp32 state dict of ``--init`` (``make_init.py``: ``GPT`` built after
  ``torch.manual_seed(0)``), memory-mapped and copied into whatever the case trains; or, with
  ``--init seeded:SEED`` (no file: the only way at 14B-30B), the values ``GPT.init_weights``
  gives after ``torch.manual_seed(SEED)``, drawn per parameter in every case ([Note: seeded
  init]);
- data: the batch of step i on rank r comes from a generator seeded by (``--data-seed``, r, i)
  alone (the same at every N and in every case); inputs and next-token targets;
- AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.1, no clipping; ``--batch``
  sequences of ``--seq`` tokens per rank; ``--checkpointing`` applied to every case (the
  model's own per-block ``torch.utils.checkpoint``);
- timing: ``--warmup`` steps, then ``--steps`` timed steps, each between two device syncs, and
  the wall time from one sync before the first timed step to the end of the last one *and* the
  engine's own finish (``synchronize()``), so no work spills past the clock.

Cases and their recipes (the row's "recipe" says it; fairplan.CASES is the table):

- ``ddp``: torch DDP (plain model at N=1), fp32 params, bf16 autocast, ``torch.optim.AdamW(
  fused=True)`` on the GPU: the no-offload ceiling of the autocast recipe.
- ``ddp-bf16``: the same with bf16 params and no fp32 master (AdamW state in bf16): the
  no-offload ceiling of the engine's own recipe (bf16 working params) -- the difference named.
- ``engine``: ``zero_offload.initialize``, params="cpu", optimizer="cpu", dtype bf16 (bf16
  working params, no autocast; fp32 master and moments on the CPU).
- ``engine-auto``: the same with params="auto", optimizer="auto" (NVMe spill under --nvme-dir).
- ``offload-adamw``: DDP (plain model at N=1) + ``zero_offload.OffloadAdamW(overlap_forward=
  True)``, fp32 params + bf16 autocast (ddp's and torchao's recipe).
- ``torch-opt``: the ``ddp`` recipe with the ``--opt`` rule's torch optimizer on the GPU (no
  offload): the ceiling each offloaded rule is compared with (issue 25). ``--opt`` (the plan's
  ``opt=`` knob) also picks the rule of ``engine``, ``engine-auto`` and ``offload-adamw``: adamw (default), sgd
  (momentum 0.9), lion, adafactor, muon (torch's recipe: Muon on the blocks' matrices, AdamW on
  embeddings, norms, biases and the head); lr 1e-4 and weight decay 0.1 for all (SGD: L2).
- ``torchao``: ``torchao.optim.CPUOffloadOptimizer(AdamW, fused=True, offload_gradients=True)``,
  fp32 params + autocast; one GPU only.
- ``fsdp2``: ``fully_shard`` per block and the root with ``CPUOffloadPolicy(pin_memory=True)``,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``reshard_after_forward`` from
  ``--fsdp-reshard``; ``torch.optim.AdamW(fused=True)`` on the CPU shards (the row records
  whether fused took effect). No autocast: the policy casts the params.
- ``ds-zero2``: DeepSpeed ZeRO-2 + ``offload_optimizer`` cpu (pin_memory), overlap_comm,
  contiguous_gradients, bf16, 5e8 buckets (DeepSpeed's ZeRO-Offload tutorial).
- ``ds-zero3``: ZeRO-3 with ``offload_param`` and ``offload_optimizer`` cpu (pin_memory), bf16,
  overlap_comm, contiguous_gradients; buckets ``--ds-prefetch-bucket`` / ``--ds-reduce-bucket``
  (default the HF "auto" values 0.9 h^2 / h^2), persistence 10 h, sub_group_size 1e9.
  ``--ds-nvme 1`` (knob ``nvme=1``): the optimizer state on NVMe under ``--nvme-dir`` (ZeRO-Infinity,
  its docs' offload_optimizer settings and the aio defaults), beside ``engine:optimizer=nvme`` (the
  same placement: params on the host, the state in our swap file).
- ``ds-zero3-ratio``: ZeRO-3, params on the GPU, ``offload_optimizer`` cpu with ``ratio``
  ``--ds-ratio`` (the share of the optimizer's sub-groups on the CPU; the rest updates on the
  GPU). The split is per sub-group, so ``sub_group_size`` defaults to 1e8 here (with one
  sub-group per rank no split exists); the row records the split DeepSpeed made.
- ``ds-muon``: DeepSpeed's Muon (optimizer type "Muon") without offload, ZeRO-2 (``--ds-stage 1``:
  ZeRO-1 with fp32 grad accumulation), bf16, torch's Muon/AdamW split and hyperparameters where
  DeepSpeed has them (``ds_muon_config``; the recipe names every difference).

``--compile 1`` (knob ``compile=1``; engine, ddp and their variants): each block compiled
(``block.compile()``: inductor, default mode) before ``initialize`` / DDP; the warm-up steps
compile (the engine's first forward runs eagerly, the second compiles: use ``--warmup`` >= 3);
the row has dynamo's compile time (``compile_s``) and the graphs compiled during the timed steps
(``compile_in_timed_steps``, 0 when the warm-up was enough).

Memory: a thread started before ``import torch`` samples this process's PSS
(/proc/self/smaps_rollup) every ``--mem-period`` s outside the timed steps (RSS only during them:
[Note: no page-table walk while timing]); rank 0 also samples the node's MemAvailable
(/proc/meminfo). GPU peaks are torch's allocator peaks from after the build to the end.

On a CPU (``--device cpu``, gloo) ddp, ddp-bf16, engine, engine-auto and offload-adamw run with a
small preset; the GPU-only cases write a "needs CUDA" row and exit 0.
"""
import json
import os
import sys
import time

_T0 = time.time()  # process start, for --time-budget

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _host
from _host import TimedSampler, proc_kib as _proc_kib, statm_rss_bytes  # noqa: E402


def _read_pss_kib() -> int:
    return _proc_kib("/proc/self/smaps_rollup", "Pss")


def mem_available_kib() -> int:
    return _proc_kib("/proc/meminfo", "MemAvailable")


def _read_statm_rss_kib() -> int:
    """Resident set size from /proc/self/statm: two counters, no page-table walk."""
    return statm_rss_bytes() // 1024


def read_vm_hwm_kib() -> int:
    """The kernel's peak RSS of this process since it started (VmHWM)."""
    return _proc_kib("/proc/self/status", "VmHWM")


class MemSampler(TimedSampler):
    """This process's peak PSS (from its start, and since ``mark()``) and, with ``node=True``, the
    node's lowest MemAvailable, every ``period`` s.

    [Note: no page-table walk while timing] Reading /proc/self/smaps_rollup walks every page
    table of the process under its mm lock: 40-85 ms of CPU per read for a 1.31B case on the H100
    hosts (the calls of 2026-11-27 recorded it), so a 50 ms period kept one core per rank busy and
    stalled the case's own mmap/munmap for the whole run. Between ``enter_timed()`` and
    ``leave_timed()`` the sampler therefore reads only RSS (/proc/self/statm, two counters) and
    MemAvailable; PSS is read before the timed steps and right after them (the heap the steps
    built is still there), and the kernel's VmHWM bounds RSS over the whole process. The same
    holds around the build, ``initialize`` and the warm-up steps: at 14B on one H200 (session 21)
    each read took 130-285 ms of CPU at the 50 ms period, under the lock that every new host
    buffer's mmap, page population and pinning needs, and every import's too (the harness's
    initialize took 45 s where bench_init.py's, without a sampler, took 34-38 s; with the reads
    gone from initialize, 31.6 s)."""

    def __init__(self, period: float = 0.05):
        super().__init__(period, "fair-mem-sampler")
        self.node = False
        self.pss_peak = self.pss_peak_since_mark = _read_pss_kib()
        self.rss_peak_timed = 0
        self.avail_start = self.avail_min = mem_available_kib()
        self.samples = 0
        self.read_s = 0.0
        self.timed_samples = 0
        self.timed_read_s = 0.0

    def sample(self):
        t0 = time.thread_time()
        if self.timed:  # [Note: no page-table walk while timing]
            self.rss_peak_timed = max(self.rss_peak_timed, _read_statm_rss_kib())
        else:
            pss = _read_pss_kib()
            self.pss_peak = max(self.pss_peak, pss)
            self.pss_peak_since_mark = max(self.pss_peak_since_mark, pss)
        if self.node:
            self.avail_min = min(self.avail_min, mem_available_kib())
        spent = time.thread_time() - t0  # the sampler's own CPU time
        if self.timed:
            self.timed_samples += 1
            self.timed_read_s += spent
        else:
            self.samples += 1
            self.read_s += spent

    def mark(self):
        self.pss_peak_since_mark = _read_pss_kib()


if __name__ == "__main__":  # first thing: the sampler sees the whole process, torch's import included
    _SAMPLER = MemSampler(float(os.environ.get("FAIR_MEM_PERIOD", "0.05")))
    _SAMPLER.start()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fairplan import CASES, DS_MUON_STAGES, checkpoint_fraction, recipe  # noqa: E402

GiB = float(2 ** 30)
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.1
LONG_STEP_S = 10.0  # a warm-up step longer than this: 5 timed steps are the protocol's minimum


class CaseError(Exception):
    """A known reason the case cannot run (one line, naming the fix)."""


# ------------------------------------------------------------------------------------ data

def batch_for(step: int, rank: int, *, batch: int, seq: int, vocab: int, seed: int):
    """Step ``step``'s batch on rank ``rank``: (inputs, next-token targets), int64 [batch, seq],
    from a generator seeded by (seed, rank, step) alone: the same in every case and at every N."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 100_003 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def load_init(path: str, cfg) -> dict:
    """The state dict of ``make_init.py`` (memory-mapped), checked against the model's shape."""
    if not os.path.isfile(path):
        raise CaseError(f"--init {path} does not exist; write it with benchmarks/fair/make_init.py "
                        f"--model <preset> --out {path} (run.py does)")
    blob = torch.load(path, mmap=True, weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != "zo-fair-init-1":
        raise CaseError(f"--init {path} is not a make_init.py file; rewrite it with "
                        f"benchmarks/fair/make_init.py")
    want = dataclasses.asdict(cfg)
    got = blob["config"]
    diff = [k for k in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len", "mlp_ratio", "bias",
                        "tie_embeddings") if got.get(k) != want.get(k)]
    if diff:
        raise CaseError(f"--init {path} holds a model with other {', '.join(diff)} than --model/--seq "
                        f"ask; write one for this model with make_init.py")
    return blob["state_dict"]


class Weights:
    """The first values of every case (``--init``): a make_init.py file, or ``seeded:SEED``.

    [Note: seeded init] ``seeded:SEED`` draws the values ``GPT.init_weights`` gives after
    ``torch.manual_seed(SEED)`` on the CPU: ``GPT.init_param`` per distinct parameter, in
    ``named_parameters()`` order, in fp32 from torch's global CPU generator. The engine cases get
    them through ``zero_offload.initialize(model, init=model.init_param)`` right after the seed
    (the engine's own meta path, ops/rng.py's parallel draws); every other case draws the same
    stream here one parameter at a time (``tensors``, on ``threads`` threads through the same
    ``ParallelDraws``) and copies each into what it trains: the whole model on the device (torch
    cases), each rank's rows of a DTensor (fsdp2 built on meta), or rank 0's gathered parameter
    (ds-zero3 under ``zero.Init``). No full host copy of the model anywhere, and the same weights
    in every case: the step-0 losses of one compute kind agree as with a file. The row's
    ``init`` says how its values were made and ``init_fingerprint`` names them (rows are
    compared only when it is equal)."""

    def __init__(self, spec: str, cfg, threads: int):
        self.spec, self.cfg, self.threads = spec, cfg, threads
        self.sd = None
        self.seed = None
        if spec.startswith("seeded"):
            _, _, seed = spec.partition(":")
            if not seed.strip().lstrip("-").isdigit():
                raise CaseError(f"--init {spec!r}: write seeded:SEED with an integer SEED, e.g. seeded:1234")
            self.seed = int(seed)
            self.label = ("seeded: init_weights values (torch.manual_seed(%d), GPT.init_param per parameter "
                          "in named_parameters order, fp32 on the CPU)" % self.seed)
            self.fingerprint = f"seeded:{self.seed}:init_std={cfg.init_std}"
        else:
            self.sd = load_init(spec, cfg)
            self.label = "file: make_init.py state dict, memory-mapped"
            self.fingerprint = file_fingerprint(spec)

    @property
    def seeded(self) -> bool:
        return self.seed is not None

    def __getitem__(self, name: str):
        if self.sd is None:
            raise CaseError(f"--init {self.spec}: seeded values come in order (Weights.tensors), not by name")
        return self.sd[name]

    def tensors(self, model):
        """(name, param, fp32 CPU values) for every distinct parameter of ``model`` in
        ``named_parameters()`` order ([Note: seeded init]); one parameter's values at a time."""
        if not self.seeded:
            for name, p in model.named_parameters():
                yield name, p, self.sd[name]
            return
        from zero_offload.models import GPT
        from zero_offload.ops.rng import ParallelDraws
        torch.manual_seed(self.seed)
        with ParallelDraws(threads=max(1, self.threads)) as draws:
            for name, p in model.named_parameters():
                values = torch.empty(tuple(getattr(p, "ds_shape", p.shape)), dtype=torch.float32)
                with draws.mode():  # never held across the yield: the caller's ops run outside it
                    GPT.init_param(model, name, values)
                yield name, p, values

    def load(self, model) -> int:
        """Fill a model whose parameters are materialized (on any device, in any dtype)."""
        if not self.seeded:
            return _load_module(model, self.sd)
        n = 0
        with torch.no_grad():
            for _, p, values in self.tensors(model):
                p.copy_(values)
                n += 1
        return n

    def engine_init(self, model):
        """``init=`` for ``zero_offload.initialize`` of ``model`` built on meta: the file's
        tensors, or ``model.init_param`` from the seeded generator ([Note: seeded init])."""
        if not self.seeded:
            sd = self.sd
            return lambda name, t: t.copy_(sd[name])
        torch.manual_seed(self.seed)
        return model.init_param

    def release(self) -> None:
        self.sd = None  # unmaps the init file once the case holds its own copy


def file_fingerprint(path: str) -> str:
    """size + sha256 of the first and last MiB: tells two init files apart, cheaply."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return f"{size}:{h.hexdigest()[:16]}"


# ------------------------------------------------------------------------------------ cases

@dataclasses.dataclass
class Runner:
    """A built case: ``step(x, y)`` runs one training step and returns the loss (detached);
    ``finish()`` waits for the engine's own outstanding work; ``close()`` releases it."""

    step: Callable
    config: dict
    finish: Callable = lambda: None
    close: Callable = lambda: None
    threads: dict = dataclasses.field(default_factory=dict)
    on_timed: Callable = lambda: None  # called once, before the first timed step (reset stats)
    extra: Callable = lambda: {}  # after the timed steps: case-specific facts for the row
    note: Callable = lambda: ""  # after each warm-up step: one line for the case log ("" none)
    init_parts: dict = dataclasses.field(default_factory=dict)  # where init's time went (the engine's)


def _load_module(model, sd) -> int:
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise CaseError(f"the init state dict does not match the model (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}); rewrite it with make_init.py")
    return len(sd)


def set_checkpointing(model, fraction: float) -> None:
    """Activation checkpointing of the first round(fraction x layers) blocks (GPT's per-block
    switch; a model without one takes all or none)."""
    if 0.0 < fraction < 1.0 and hasattr(model, "blocks"):
        model.set_activation_checkpointing(False)
        model.set_activation_checkpointing(True, layers=range(round(fraction * len(model.blocks))))
    else:
        model.set_activation_checkpointing(fraction > 0.0)


def _torch_model(args, cfg, device, sd, dtype=None):
    from zero_offload.models import GPT
    model = GPT(cfg, device="meta", dtype=dtype)
    model.to_empty(device=device)
    sd.load(model) if isinstance(sd, Weights) else _load_module(model, sd)
    set_checkpointing(model, args.checkpointing)
    return model


def _torch_loop(model, opt, device, *, autocast: bool):
    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _ddp(model, device, world):
    if world == 1:
        return model, {"wrapper": "none (one rank)"}
    from torch.nn.parallel import DistributedDataParallel as DDP
    kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
    info = {"wrapper": "DistributedDataParallel", "ddp_kwargs": {k: str(v) for k, v in kw.items()}}
    return DDP(model, **kw), info


def _hidden(name: str, p) -> bool:
    """The params Muon takes in torch's recipe: the blocks' matrices."""
    return name.startswith("blocks.") and p.dim() == 2


def _rule_kwargs(opt: str) -> dict:
    """The hyperparameters of the ``--opt`` rule (torch's names; the same for every case)."""
    return {"adamw": dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
            "sgd": dict(lr=LR, momentum=0.9, weight_decay=WD),
            "lion": dict(lr=LR, weight_decay=WD),
            "adafactor": dict(lr=LR, weight_decay=WD),
            "muon": dict(lr=LR, weight_decay=WD)}[opt]


class _Both:
    """Two optimizers stepped as one (Muon + AdamW)."""

    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def _torch_rule(opt: str, model):
    """The ``--opt`` rule as torch's optimizer on the model's device (AdamW fused)."""
    if opt == "adamw":
        return torch.optim.AdamW(model.parameters(), **_rule_kwargs(opt), fused=True)
    if opt == "muon":
        named = list(model.named_parameters())
        return _Both(torch.optim.Muon([p for n, p in named if _hidden(n, p)], **_rule_kwargs(opt)),
                     torch.optim.AdamW([p for n, p in named if not _hidden(n, p)], **_rule_kwargs("adamw"),
                                       fused=True))
    if opt == "lion":
        raise CaseError("opt=lion has no torch.optim rule: torch-opt runs torch's optimizers only")
    cls = {"sgd": torch.optim.SGD, "adafactor": torch.optim.Adafactor}[opt]
    return cls(model.parameters(), **_rule_kwargs(opt))


def _compile_blocks(args, model) -> dict:
    """``--compile 1``: each block compiled (``block.compile()``: inductor, default mode) before
    the case wraps the model; the warm-up steps compile. The row's config says so."""
    if args.compile != "1":
        return {}
    for block in model.blocks:
        block.compile()
    return {"compile": "each block: block.compile() (inductor, mode default), before wrapping"}


class _CompileClock:
    """Dynamo's own accounting: compile time and graphs by the end of the warm-up (``mark``,
    before the first timed step) and after the timed steps; a graph compiled while timing is
    named in the row (``compile_in_timed_steps``)."""

    def __init__(self, args):
        self.on = args.compile == "1"
        self.at_timed = None

    def _now(self) -> dict:
        from torch._dynamo.utils import counters
        try:
            from torch._dynamo.utils import calculate_time_spent
            spent = {k: float(v) for k, v in calculate_time_spent().items()}
        except (ImportError, AttributeError, TypeError):
            spent = {}
        return {"graphs": counters["stats"]["unique_graphs"], "frames": counters["stats"]["calls_captured"],
                "graph_breaks": sum(counters["graph_break"].values()), "time_spent_s": spent}

    def mark(self) -> None:
        if self.on:
            self.at_timed = self._now()

    def facts(self) -> dict:
        if not self.on:
            return {}
        end = self._now()
        spent = self.at_timed["time_spent_s"]
        return {"compile_s": spent.get("total_wall_time", spent.get("entire_frame_compile")),
                "compile_warmup": self.at_timed, "compile_end": end,
                "compile_in_timed_steps": end["graphs"] - self.at_timed["graphs"]}


def build_ddp(args, cfg, device, world, sd, bf16_params=False, rule=False):
    model = _torch_model(args, cfg, device, sd, dtype=torch.bfloat16 if bf16_params else None)
    compiled = _compile_blocks(args, model)
    clock = _CompileClock(args)
    wrapped, info = _ddp(model, device, world)
    if rule:  # torch-opt
        opt = _torch_rule(args.opt, model)
        first = opt.opts[0] if isinstance(opt, _Both) else opt
        return Runner(step=_torch_loop(wrapped, opt, device, autocast=True),
                      config={**info, "params_dtype": "fp32", "autocast": "bf16", "opt": args.opt,
                              "optimizer": f"torch.optim.{type(first).__name__}"
                                           + (" + AdamW(fused)" if args.opt == "muon" else "")
                                           + f" on {device.type}", "optimizer_kwargs": _rule_kwargs(args.opt)},
                      threads={"optimizer": "n/a (GPU optimizer)" if device.type == "cuda"
                               else f"torch intra-op ({torch.get_num_threads()})"})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    return Runner(step=_torch_loop(wrapped, opt, device, autocast=not bf16_params),
                  on_timed=clock.mark, extra=clock.facts,
                  config={**info, **compiled, "params_dtype": "bf16" if bf16_params else "fp32",
                          "autocast": "off" if bf16_params else "bf16",
                          "optimizer": f"torch.optim.AdamW(fused={opt.defaults.get('fused')}) on {device.type}",
                          "optimizer_defaults": _jsonable(opt.defaults)},
                  threads={"optimizer": f"torch intra-op ({torch.get_num_threads()})"
                           if device.type == "cpu" else "n/a (GPU optimizer)"})


def build_engine(args, cfg, device, world, sd, auto=False):
    t_model = time.perf_counter()
    import zero_offload as zo
    from zero_offload.models import GPT
    model = GPT(cfg, device="meta")  # initialize fills the tiers chunk by chunk from --init
    set_checkpointing(model, args.checkpointing)
    compiled = _compile_blocks(args, model)  # before initialize: each block is one unit
    clock = _CompileClock(args)
    nvme = not auto and args.engine_optimizer == "nvme"
    if nvme and not args.nvme_dir:
        raise CaseError("engine with optimizer=nvme needs a swap directory: give the run --nvme-dir DIR")
    ocfg = zo.OffloadConfig(params=args.engine_params if auto else "cpu",
                            optimizer="auto" if auto else args.engine_optimizer,
                            dtype="bf16", threads=args.threads, moments_dtype=args.engine_moments,
                            nvme_dir=args.nvme_dir if (auto or nvme) and args.nvme_dir else None,
                            activation_reserve=int(args.activation_reserve * GiB) if args.activation_reserve
                            else "auto")
    # by name, looked up only for the rule asked (a tree= commit older than the rules has AdamW only)
    spec = getattr(zo, {"adamw": "AdamW", "sgd": "SGD", "lion": "Lion", "adafactor": "Adafactor",
                        "muon": "Muon"}[args.opt])(**_rule_kwargs(args.opt))
    groups = None
    if args.opt == "muon":  # torch's recipe: AdamW for what is not a hidden matrix
        groups = [{"params": [n for n, p in model.named_parameters() if not _hidden(n, p)],
                   "optimizer": zo.AdamW(**_rule_kwargs("adamw"))}]
    t_model = time.perf_counter() - t_model  # the import, the model on meta, compile
    engine = zo.initialize(model, optimizer=spec, config=ocfg, device=device, param_groups=groups,
                           init=sd.engine_init(model))

    step = _engine_step(engine)

    def extra():
        st = engine.stats()
        return {"engine_stats": _jsonable(st.as_dict()), "engine_init_seconds": getattr(engine, "init_seconds", None),
                "engine_held_gib": {str(k): v / GiB for k, v in st.bytes_held.items()},
                "engine_peak_gib": {str(k): v / GiB for k, v in st.peak_bytes.items()}, **clock.facts()}

    def on_timed():
        engine.reset_stats()
        clock.mark()
    # close(write_back=False): the case needs no trained values back in the module; with N ranks
    # the default write-back gives every rank a whole fp32 copy on the host (a meta-built model's
    # origin), 122 GB per rank at 30.5B, minutes outside any timed part (the first 30B try ran out
    # of its case budget there)
    def note():  # where the state is after the step (the share grows after the first one)
        r = engine.plan.report()
        share = r["share"]
        return (f"state chunks gpu/host/nvme {share['chunks']}/{share['host_chunks']}/{share['nvme_chunks']}, "
                f"grown {r['grown']}, from NVMe {r.get('promoted', 0)}, "
                f"moved out for the first step {r.get('evicted', 0)}")

    runner = Runner(step=step, finish=engine.synchronize, close=lambda: engine.close(write_back=False),
                  on_timed=on_timed, note=note,
                  extra=extra, config={**compiled, "offload_config": _jsonable(engine.config.to_dict()),
                                       "opt": args.opt, "optimizer": f"zero_offload.{type(spec).__name__}"
                                       + (" + AdamW" if args.opt == "muon" else "")},
                  threads={"engine_cpu_adam": engine.config.threads}, init_parts={"model": t_model, **getattr(engine, "init_seconds", {})})  # (tree=: older engines lack it)
    return runner


def build_offload_adamw(args, cfg, device, world, sd):
    import zero_offload as zo
    model = _torch_model(args, cfg, device, sd)
    wrapped, info = _ddp(model, device, world)
    kw = dict(threads=args.threads, overlap_forward=args.overlap_forward == "1")
    cls = getattr(zo, {"adamw": "OffloadAdamW", "sgd": "OffloadSGD", "lion": "OffloadLion",
                       "adafactor": "OffloadAdafactor", "muon": "OffloadMuon"}[args.opt])
    if args.opt == "muon":  # torch's recipe: AdamW for what is not a hidden matrix
        named = list(model.named_parameters())
        opts = [cls([p for n, p in named if _hidden(n, p)], **_rule_kwargs(args.opt), **kw),
                zo.OffloadAdamW([p for n, p in named if not _hidden(n, p)], **_rule_kwargs("adamw"), **kw)]
    else:
        opts = [cls(model.parameters(), **_rule_kwargs(args.opt), **kw)]
    opt = _Both(*opts) if len(opts) > 1 else opts[0]
    kw = {**kw, **_rule_kwargs(args.opt)}

    def each(method: str) -> Callable:
        return lambda: [getattr(o, method)() for o in opts] and None

    def extra():
        stats = [_jsonable(dataclasses.asdict(o.stats)) for o in opts]
        return {"offload_adamw_stats": stats[0], **({"offload_stats_per_optimizer": stats} if len(stats) > 1 else {})}
    return Runner(step=_torch_loop(wrapped, opt, device, autocast=True), finish=each("synchronize"),
                  close=each("close"), on_timed=each("reset_stats"), extra=extra,
                  config={**info, "params_dtype": "fp32", "autocast": "bf16", "opt": args.opt,
                          "optimizer": f"zero_offload.{cls.__name__}" + (" + OffloadAdamW" if len(opts) > 1 else ""),
                          "optimizer_kwargs": _jsonable(kw)},
                  threads={"offload_adamw_cpu_adam": args.threads})


def build_torchao(args, cfg, device, world, sd):
    import torchao
    from torchao.optim import CPUOffloadOptimizer
    model = _torch_model(args, cfg, device, sd)
    kw = dict(offload_gradients=True, fused=True, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    return Runner(step=_torch_loop(model, opt, device, autocast=True),
                  config={"params_dtype": "fp32", "autocast": "bf16", "torchao": torchao.__version__,
                          "optimizer": "torchao.optim.CPUOffloadOptimizer(torch.optim.AdamW)",
                          "optimizer_kwargs": _jsonable(kw)},
                  threads={"optimizer": f"torch intra-op ({torch.get_num_threads()})"})


def build_fsdp2(args, cfg, device, world, sd):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    reshard = bool(int(args.fsdp_reshard))
    # seeded and the fp32 model over a third of a GPU: built on meta, sharded, then each rank fills
    # its rows of every parameter ([Note: seeded init]); else the whole model on the GPU first
    on_meta = sd.seeded and cfg.num_params() * 4 > torch.cuda.get_device_properties(device).total_memory / 3
    if on_meta:
        from zero_offload.models import GPT
        model = GPT(cfg, device="meta")
        set_checkpointing(model, args.checkpointing)
    else:
        model = _torch_model(args, cfg, device, sd)
    mesh = init_device_mesh("cuda", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    off = CPUOffloadPolicy(pin_memory=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=reshard)
    if on_meta:
        model.to_empty(device="cpu")  # the CPU-offloaded shards (torchtitan's meta path)
        _fill_shards(model, sd, dist.get_rank(), world)
    state = {"fused": True, "fused_error": None}

    def make_opt(fused):
        return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=fused)
    try:
        opt = make_opt(True)
    except (RuntimeError, ValueError) as e:  # recorded: the row says fused did not take effect
        state.update(fused=False, fused_error=_one_line(e))
        opt = make_opt(None)
    first = [True]

    def step(x, y):
        nonlocal opt
        loss = model(x, y)
        loss.backward()
        if first[0] and state["fused"]:
            first[0] = False
            try:
                opt.step()
            except (RuntimeError, ValueError) as e:  # fused refused at its first step: no state yet
                state.update(fused=False, fused_error=_one_line(e))
                opt = make_opt(None)
                opt.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def extra():
        return {"fsdp2_fused_took_effect": state["fused"], "fsdp2_fused_error": state["fused_error"],
                "optimizer_defaults": _jsonable(opt.defaults)}
    return Runner(step=step, extra=extra,
                  config={"fully_shard": "per block + root", "reshard_after_forward": reshard,
                          "mp_policy": repr(mp), "offload_policy": repr(off), "autocast": "off",
                          "optimizer": "torch.optim.AdamW(fused=True) on the CPU shards"},
                  threads={"optimizer": f"torch intra-op ({torch.get_num_threads()})"})


def _fill_shards(model, sd, rank: int, world: int) -> None:
    """Each rank's rows of every fully_shard parameter (dim-0 chunks, ``torch.chunk``'s split,
    as FSDP2 shards) from the full values ([Note: seeded init])."""
    with torch.no_grad():
        for name, p, values in sd.tensors(model):
            local = p.to_local() if hasattr(p, "to_local") else p
            pieces = values.chunk(world, dim=0)
            piece = pieces[rank] if rank < len(pieces) else values[:0]
            if tuple(piece.shape) != tuple(local.shape):
                raise CaseError(f"fsdp2 seeded init: {name}'s shard on rank {rank} is {tuple(local.shape)}, "
                                f"dim-0 chunk {rank} of {world} of {tuple(values.shape)} is {tuple(piece.shape)}; "
                                f"FSDP2 shards differently here: use --init FILE for fsdp2")
            local.copy_(piece)


def ds_config(args, cfg, world, case) -> dict:
    """The DeepSpeed config of a ds-* case (keys checked against deepspeed 0.19.8's
    runtime/zero/config.py and offload_config.py)."""
    h = cfg.d_model
    zero: dict[str, Any] = {"overlap_comm": True, "contiguous_gradients": True}
    if case == "ds-zero2":
        zero.update(stage=2, reduce_bucket_size=int(5e8), allgather_bucket_size=int(5e8),
                    reduce_scatter=True, offload_optimizer={"device": "cpu", "pin_memory": True})
    else:
        sub_default = 1e8 if case == "ds-zero3-ratio" else 1e9
        zero.update(stage=3,
                    reduce_bucket_size=int(float(args.ds_reduce_bucket)) if args.ds_reduce_bucket else h * h,
                    stage3_prefetch_bucket_size=(int(float(args.ds_prefetch_bucket)) if args.ds_prefetch_bucket
                                                 else int(0.9 * h * h)),
                    stage3_param_persistence_threshold=10 * h,
                    sub_group_size=int(float(args.ds_sub_group)) if args.ds_sub_group else int(sub_default),
                    offload_optimizer={"device": "cpu", "pin_memory": True})
        if case == "ds-zero3":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
            if args.ds_nvme == "1":  # ZeRO-Infinity: the optimizer state on NVMe (its docs' settings)
                if not args.nvme_dir:
                    raise CaseError("ds-zero3 with ds-nvme=1 needs a swap directory: give the run --nvme-dir DIR")
                zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_dir, "pin_memory": True,
                                             "buffer_count": 4, "fast_init": False}
        else:
            ratio = float(args.ds_ratio)
            if not 0.0 <= ratio <= 1.0:
                raise CaseError(f"--ds-ratio {args.ds_ratio}: DeepSpeed's offload_optimizer.ratio is the "
                                f"share on the CPU, in [0, 1]")
            zero["offload_optimizer"]["ratio"] = ratio
    conf = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
            "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WD}}}
    if zero["offload_optimizer"]["device"] == "nvme":  # a top-level key; DeepSpeed 0.19.8's defaults
        conf["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                       "single_submit": False, "overlap_events": True}
    return conf


def build_deepspeed(args, cfg, device, world, sd, case):
    import deepspeed
    from zero_offload.models import GPT
    conf = ds_config(args, cfg, world, case)
    rank = dist.get_rank()
    if conf["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=conf):
            model = GPT(cfg)
        # the tied LM head reads wte.weight outside wte's forward (wheels/README.md)
        deepspeed.zero.register_external_parameter(model, model.wte.weight)
        values = sd.tensors(model) if rank == 0 else None  # rank 0 draws or reads, one at a time
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if rank == 0:
                    got, _, v = next(values)
                    if got != name:
                        raise CaseError(f"ds-zero3 init: values for {got} came for {name}")
                    p.data.copy_(v)
    else:
        model = _torch_model(args, cfg, device, sd)
    set_checkpointing(model, args.checkpointing)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)

    step = _engine_step(engine)

    def extra():
        out = {"deepspeed": deepspeed.__version__,
               "ds_optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__}
        split = getattr(engine.optimizer, "subgroup_to_device", None)
        if isinstance(split, dict):
            on_cpu = sum(1 for d in split.values() if d == "cpu")
            out["ds_subgroups_cpu_of_total"] = [on_cpu, len(split)]
        return out
    return Runner(step=step, extra=extra, config={"deepspeed_config": conf},
                  threads={"ds_cpu_adam": f"OpenMP, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"})


def ds_muon_config(args) -> dict:
    """ds-muon's DeepSpeed config: optimizer type Muon (deepspeed 0.19.8: engine.py
    ``_configure_basic_optimizer`` / ``_muon_param_groups``, runtime/zero/muon/), no offload. The
    Muon half takes lr, momentum, weight_decay and ns_method; the AdamW half lr, betas, eps and
    weight_decay (the same lr and decay: no muon_lr / adam_lr). ns_steps (5), Nesterov (on) and the
    lr scale sqrt(max(1, rows/cols)) are fixed in DeepSpeed's ``muon_update`` and equal torch's
    defaults; momentum is torch.optim.Muon's default. ``torch_adam`` makes the AdamW half
    torch.optim.AdamW (foreach) instead of DeepSpeed's FusedAdam, a CUDA op that would JIT-build
    inside the case (the GPU machine's setup builds only cpu_adam)."""
    import inspect
    stage = int(args.ds_stage)
    zero: dict[str, Any] = {"stage": stage}
    if stage == 2:  # ds-zero2's buckets and overlap, without the offload
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=int(5e8),
                    allgather_bucket_size=int(5e8), reduce_scatter=True)
    momentum = inspect.signature(torch.optim.Muon).parameters["momentum"].default
    conf = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
            "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "Muon", "params": {**_rule_kwargs("muon"), "momentum": momentum,
                                                     "ns_method": "standard", "betas": list(BETAS), "eps": EPS,
                                                     "torch_adam": True}}}
    if stage == 1:  # BF16_Optimizer: fp32 grads, fp32 momentum (bf16 grads at stage 1 would be ZeRO-1's)
        conf["data_types"] = {"grad_accum_dtype": "fp32"}
    return conf


def _torch_muon_split(ds_tags: Callable) -> Callable:
    """[Note: ds-muon's split] ``deepspeed.initialize`` tags every param ``use_muon`` by its own
    rule (``set_optimizer_flags``: 2-D and no "embed" / "lm_head" in the name) before it builds the
    optimizer, and its ZeRO optimizers read the tag, not the param groups. Our GPT's tied
    embedding/head is ``wte`` and its position table ``wpe``: DeepSpeed's rule would give both to
    Muon, where torch's recipe (``_hidden``) gives Muon the blocks' matrices only. The returned
    function, put in place of ``deepspeed.set_optimizer_flags`` for the one ``initialize`` call,
    runs DeepSpeed's rule, records the names it tags otherwise (``retagged``) and tags torch's split."""
    def tag(config_class, module):
        ds_tags(config_class, module)
        for name, p in module.named_parameters():
            if bool(getattr(p, "use_muon", False)) != _hidden(name, p):
                tag.retagged.append(name)
            p.use_muon = _hidden(name, p)
    tag.retagged = []
    return tag


def build_ds_muon(args, cfg, device, world, sd):
    import deepspeed
    conf = ds_muon_config(args)
    model = _torch_model(args, cfg, device, sd)
    tag = _torch_muon_split(deepspeed.set_optimizer_flags)
    deepspeed.set_optimizer_flags, ds_tags = tag, deepspeed.set_optimizer_flags  # [Note: ds-muon's split]
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    finally:
        deepspeed.set_optimizer_flags = ds_tags
    muon = getattr(engine.optimizer, "optimizer", engine.optimizer)
    wrong = [n for n, p in model.named_parameters() if getattr(p, "use_muon", None) != _hidden(n, p)]
    if type(muon).__name__ != "MuonWithAuxAdam":
        raise CaseError(f"ds-muon: deepspeed {deepspeed.__version__} built {type(muon).__name__}, not "
                        f"MuonWithAuxAdam, for optimizer type Muon; check ds_muon_config against its engine.py")
    if wrong:
        raise CaseError(f"ds-muon: use_muon off torch's split on {wrong[:3]}: deepspeed {deepspeed.__version__} "
                        f"tags params otherwise than 0.19.8; update _torch_muon_split")
    groups = [{k: v for k, v in g.items() if k != "params"} | {"numel": sum(p.numel() for p in g["params"])}
              for g in muon.param_groups]
    aux = getattr(muon, "aux_optimizer", None)

    def extra():
        return {"deepspeed": deepspeed.__version__, "ds_optimizer": type(muon).__name__,
                "ds_optimizer_wrapper": type(engine.optimizer).__name__,
                "ds_aux_adam": type(aux).__name__ if aux is not None else "MuonWithAuxAdam's inline Adam",
                "ds_param_groups": _jsonable(groups), "ds_muon_retagged": tag.retagged,
                "muon_params": sum(p.numel() for n, p in model.named_parameters() if _hidden(n, p))}
    return Runner(step=_engine_step(engine), extra=extra, config={"deepspeed_config": conf, "opt": "muon"},
                  threads={"optimizer": "n/a (GPU optimizer)"})


BUILDERS = {
    "ddp": build_ddp,
    "ddp-bf16": lambda *a: build_ddp(*a, bf16_params=True),
    "torch-opt": lambda *a: build_ddp(*a, rule=True),
    "engine": build_engine,
    "engine-auto": lambda *a: build_engine(*a, auto=True),
    "offload-adamw": build_offload_adamw,
    "torchao": build_torchao,
    "fsdp2": build_fsdp2,
    "ds-zero2": lambda *a: build_deepspeed(*a, case="ds-zero2"),
    "ds-zero3": lambda *a: build_deepspeed(*a, case="ds-zero3"),
    "ds-zero3-ratio": lambda *a: build_deepspeed(*a, case="ds-zero3-ratio"),
    "ds-muon": build_ds_muon,
}
assert set(BUILDERS) == set(CASES), "fairplan.CASES and case.BUILDERS must name the same cases"


# ------------------------------------------------------------------------------------ facts

def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:400]


def _engine_step(engine) -> Callable:
    """One training step of an engine with DeepSpeed's calling convention (``engine(x, y)`` is the
    loss; ``backward``; ``step``): ours and DeepSpeed's alike."""
    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return step


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def versions(device) -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "zero_offload_commit": os.environ.get("ZO_FAIR_COMMIT", "unknown")}
    import zero_offload
    v["zero_offload"] = f"{zero_offload.__version__} at {os.path.dirname(zero_offload.__file__)}"
    for mod in ("deepspeed", "torchao"):
        if mod in sys.modules:
            v[mod] = getattr(sys.modules[mod], "__version__", "?")
    if device.type == "cuda":
        v["gpu"] = torch.cuda.get_device_name(device)
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
            v["driver"] = lines[0] if lines else None
        except (OSError, subprocess.SubprocessError):
            v["driver"] = None
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    v["cpu"] = cpu
    v["cores"] = os.cpu_count()
    v["mem_total_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return v


def quantiles(times: list) -> dict:
    s = sorted(times)
    if len(s) >= 2:
        q = statistics.quantiles(s, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = s[0]
    return {"median_s": statistics.median(s), "p25_s": p25, "p75_s": p75, "min_s": s[0], "max_s": s[-1]}


# ------------------------------------------------------------------------------------ main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--model", default="1.3b", help="zero_offload.models preset")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--min-steps", type=int, default=5,
                    help="timed steps never cut below this (long steps, --time-budget)")
    ap.add_argument("--threads", type=int, required=True, help="CPU threads per rank (= OMP_NUM_THREADS)")
    ap.add_argument("--init", required=True,
                    help="make_init.py's state dict file, or seeded:SEED (no file: GPT.init_weights' "
                         "values after torch.manual_seed(SEED), drawn in every case)")
    ap.add_argument("--init-std", type=float, default=None,
                    help="seeded: the config's init_std (default the preset's; the CPU tests use a large one)")
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--profile", type=int, default=0,
                    help="N more steps after the timed ones under torch.profiler (not timed): a Chrome "
                         "trace of rank 0 and the last rank beside the JSON, the top ops in the log")
    ap.add_argument("--checkpointing", nargs="?", const="1", default="0", type=checkpoint_fraction,
                    help="activation checkpointing: 1 (the flag alone) every block, a fraction F the "
                         "first round(F x layers) blocks (selective: less recompute where the "
                         "activations of the rest fit), 0 none (the run's flag, or a plan item's ckpt=F knob)")
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data-seed", type=int, default=1234)
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds from process start this case may take (0: no limit): fewer timed "
                         "steps (not below --min-steps) when the warm-up says they would not fit")
    ap.add_argument("--collective-timeout", type=float, default=600.0)
    ap.add_argument("--ds-prefetch-bucket", default=None)
    ap.add_argument("--ds-reduce-bucket", default=None)
    ap.add_argument("--ds-sub-group", default=None)
    ap.add_argument("--ds-ratio", default="0.5")
    ap.add_argument("--ds-nvme", default="0", choices=("0", "1"),
                    help="ds-zero3: 1 puts the optimizer state on NVMe under --nvme-dir (ZeRO-Infinity: "
                         "offload_optimizer device nvme, buffer_count 4, the aio defaults)")
    ap.add_argument("--engine-optimizer", default="cpu", choices=("cpu", "nvme"),
                    help="engine: OffloadConfig.optimizer (nvme: the state in a swap file under --nvme-dir, "
                         "ds-zero3 with ds-nvme=1's placement)")
    ap.add_argument("--ds-stage", default="2", choices=DS_MUON_STAGES,
                    help="ds-muon: the ZeRO stage (2; 1 = ZeRO-1 with fp32 grad accumulation)")
    ap.add_argument("--fsdp-reshard", default="0", choices=("0", "1"))
    ap.add_argument("--overlap-forward", default="1", choices=("0", "1"),
                    help="offload-adamw: OffloadAdamW(overlap_forward=...)")
    ap.add_argument("--opt", default="adamw", choices=("adamw", "sgd", "lion", "adafactor", "muon"),
                    help="the update rule of engine, offload-adamw and torch-opt (issue 25)")
    ap.add_argument("--gpu-cap", type=float, default=0.0,
                    help="engine-auto: hold the process to this many GiB of GPU memory "
                         "(torch.cuda.set_per_process_memory_fraction; \"auto\" plans within it), e.g. "
                         "torchao's footprint; 0: the whole card")
    ap.add_argument("--engine-moments", default="fp32", choices=("fp32", "bf16"),
                    help="engine, engine-auto: OffloadConfig.moments_dtype (bf16: Adam's moments stored "
                         "in bf16 with stochastic rounding, the master fp32: inexact, opt-in; the row's "
                         "recipe says so)")
    ap.add_argument("--engine-params", default="auto", choices=("auto", "gpu"),
                    help="engine-auto: OffloadConfig.params (gpu: with ranks a whole replica of the bf16 "
                         "params on every GPU, gathered once per step after the update: ZeRO-2 style)")
    ap.add_argument("--activation-reserve", type=float, default=0.0,
                    help="engine-auto: OffloadConfig.activation_reserve in GiB (0: \"auto\", half the GPU "
                         "budget until the first step measures)")
    ap.add_argument("--compile", default="0", choices=("0", "1"),
                    help="engine, ddp: 1 compiles each block (block.compile(), inductor) before the case "
                         "wraps the model; the warm-up steps compile (the row: compile_s)")
    args = ap.parse_args(argv)
    return args


def write_json(path: str, row: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(row, f, indent=1, default=str)
    os.replace(tmp, path)


def run(args, row: dict, sampler: MemSampler) -> dict:
    from zero_offload.models import preset
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    info = CASES[args.case]
    row.update(case=args.case, world=world, model=args.model, batch_per_rank=args.batch,
               seq=args.seq, checkpointing=args.checkpointing, device=args.device,
               recipe=recipe(args.case, {"engine-moments": args.engine_moments}))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CaseError("--device cuda but torch sees no GPU; use --device cpu (CPU cases only)")
    if info.gpu_only and args.device != "cuda":
        row["skipped"] = f"needs CUDA: {args.case} runs on GPUs only (run it on the GPU machine)"
        return row
    if info.max_world and world > info.max_world:
        row["skipped"] = f"{args.case} runs on at most {info.max_world} GPU(s)"
        return row
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp != str(args.threads):
        raise CaseError(f"OMP_NUM_THREADS={omp} but --threads {args.threads}: every case must run T "
                        f"threads per rank; launch through benchmarks/fair/run.py or export "
                        f"OMP_NUM_THREADS={args.threads}")
    torch.set_num_threads(args.threads)
    over = {"seq_len": args.seq} if args.seq != preset(args.model).seq_len else {}
    if args.init_std:
        over["init_std"] = args.init_std
    cfg = preset(args.model, **over)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        if args.gpu_cap:  # the whole process held to this many GiB (the allocator refuses beyond)
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap * GiB / total), device)
            row["gpu_cap_gib"] = args.gpu_cap
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.collective_timeout))
    if device.type == "cuda":  # NCCL's communicator now: its first collective allocates on the
        dist.all_reduce(torch.zeros(1, device=device))  # card, which a case may fill (s21: OOM)
    params = cfg.num_params()
    row.update(params=params, threads=args.threads, omp_num_threads=omp,
               torch_threads_at_start=torch.get_num_threads(), data_seed=args.data_seed)
    batches = [batch_for(i, rank, batch=args.batch, seq=args.seq, vocab=cfg.vocab_size, seed=args.data_seed)
               for i in range(args.warmup + args.steps)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]

    sampler.enter_timed()  # [Note: no page-table walk while timing]: initialize is timed too
    t_build = time.perf_counter()
    row["before_init_s"] = time.time() - _T0  # imports, the process group, the batches
    sd = Weights(args.init, cfg, args.threads)
    row.update(init=sd.label, init_fingerprint=sd.fingerprint,
               init_file=None if sd.seeded else os.path.abspath(args.init))
    runner = BUILDERS[args.case](args, cfg, device, world, sd)
    sd.release()
    del sd
    row["init_built_s"] = time.perf_counter() - t_build  # the builder returned (then the device's queue)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        row["gpu_peak_init_alloc_gib_rank0"] = torch.cuda.max_memory_allocated(device) / GiB
        torch.cuda.reset_peak_memory_stats(device)
    row["init_s"] = time.perf_counter() - t_build
    sampler.leave_timed()
    parts = runner.init_parts  # the engine's own breakdown (Engine.init_seconds)
    _say(rank, f"initialized in {row['init_s']:.1f} s ({row['before_init_s']:.1f} s before, "
               f"{row['init_s'] - row['init_built_s']:.1f} s waiting for the device after)"
         + (" = " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) if parts else ""))
    row["init_s_per_billion"] = row["init_s"] / (params / 1e9)
    row["config"] = runner.config
    row["threads_reported"] = {"torch_after_build": torch.get_num_threads(), **runner.threads}
    sampler.mark()
    sampler.enter_timed()  # the warm-up too: PSS again once it is over

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    losses, warm_times = [], []
    for i in range(args.warmup):
        sync()
        t0 = time.perf_counter()
        losses.append(runner.step(*batches[i]))
        sync()
        warm_times.append(time.perf_counter() - t0)
        note = runner.note()
        _say(rank, f"warm-up step {i + 1}: {warm_times[-1]:.2f} s" + (f" ({note})" if note else ""))
    steps, reason = args.steps, None
    est = max(warm_times[-1:] or [0.0])
    if est > LONG_STEP_S and steps > args.min_steps:
        steps = args.min_steps
        reason = f"warm-up step {est:.1f} s > {LONG_STEP_S:.0f} s: {steps} timed steps"
    if args.time_budget > 0 and est > 0:
        room = args.time_budget - (time.time() - _T0) - max(10.0, 3 * est)
        fit = int(room // est)
        if fit < steps:
            steps = max(args.min_steps, fit)
            reason = f"--time-budget {args.time_budget:.0f} s: {steps} of {args.steps} timed steps fit"
    runner.on_timed()
    times = []
    sync()
    sampler.leave_timed()  # (PSS after the warm-up: what the first steps built)
    sampler.enter_timed()
    t_all = time.perf_counter()
    for i in range(args.warmup, args.warmup + steps):
        sync()
        t0 = time.perf_counter()
        losses.append(runner.step(*batches[i]))
        sync()
        times.append(time.perf_counter() - t0)
    runner.finish()  # the engine's own outstanding work is inside the total wall time
    sync()
    total = time.perf_counter() - t_all
    sampler.leave_timed()
    sampler.stop()
    losses = [float(x) for x in losses]

    q = quantiles(times)
    tokens = world * args.batch * args.seq
    gpu = ([torch.cuda.max_memory_allocated(device) / GiB, torch.cuda.max_memory_reserved(device) / GiB]
           if device.type == "cuda" else [0.0, 0.0])
    mine = {"pid": os.getpid(), "pss_peak_gib": sampler.pss_peak * 1024 / GiB,
            "pss_peak_train_gib": sampler.pss_peak_since_mark * 1024 / GiB, "gpu": gpu, "losses": losses,
            "torch_threads": torch.get_num_threads()}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    row.update(runner.extra())
    row.update(
        warmup=args.warmup, steps=steps, steps_requested=args.steps, steps_reason=reason,
        warmup_times=warm_times, step_times=times, **q,
        total_wall_s=total, wall_mean_s=total / steps,
        tokens_per_s=tokens / q["median_s"], tokens_per_s_wall=tokens / (total / steps),
        model_tflops_per_gpu=cfg.flops_per_token(args.seq) * tokens / q["median_s"] / world / 1e12,
        step0_loss=losses[0], step0_loss_rank_mean=sum(r["losses"][0] for r in ranks) / world,
        losses=losses, pids=[r["pid"] for r in ranks],
        torch_threads_per_rank=[r["torch_threads"] for r in ranks],
        pss_peak_per_rank_gib=[r["pss_peak_gib"] for r in ranks],
        pss_peak_train_per_rank_gib=[r["pss_peak_train_gib"] for r in ranks],
        pss_sampler={"period_s": sampler.period, "samples": sampler.samples,
                     "mean_cpu_ms": 1e3 * sampler.read_s / max(1, sampler.samples),
                     "timed": "RSS only (statm) during the build, initialize, the warm-up and the timed steps; PSS between them",
                     "timed_samples": sampler.timed_samples,
                     "timed_mean_cpu_ms": 1e3 * sampler.timed_read_s / max(1, sampler.timed_samples)},
        rss_peak_timed_gib=sampler.rss_peak_timed * 1024 / GiB, vm_hwm_gib=read_vm_hwm_kib() * 1024 / GiB,
        memavail_start_gib=sampler.avail_start * 1024 / GiB, memavail_min_gib=sampler.avail_min * 1024 / GiB,
        gpu_peak_alloc_per_rank_gib=[r["gpu"][0] for r in ranks],
        gpu_peak_reserved_per_rank_gib=[r["gpu"][1] for r in ranks],
        protocol_ok=args.warmup >= 3 and (steps >= 20 or (est > LONG_STEP_S and steps >= 5)),
    )
    row["memavail_drop_gib"] = row["memavail_start_gib"] - row["memavail_min_gib"]
    row["host_bytes_per_param"] = row["memavail_drop_gib"] * GiB / params
    row["versions"] = versions(device)
    if args.profile > 0:
        row["profiled_steps"] = args.profile
        _profile(args, rank, world, runner, batches[args.warmup:args.warmup + steps], sync)
    _say(rank, f"timed steps done ({total:.1f} s); closing")
    t_close = time.perf_counter()
    runner.close()
    row["close_s"] = time.perf_counter() - t_close  # the engine's close() (issue 24 part 4)
    _say(rank, f"closed in {row['close_s']:.1f} s")
    return row


def _profile(args, rank: int, world: int, runner, batches, sync) -> None:
    """``--profile N`` (a plan item's ``profile=N`` knob): N more steps after the timed ones, not
    timed, under ``torch.profiler`` on every rank. Rank 0 and the last rank write a gzipped Chrome
    trace beside the row's JSON (``..._trace_r<rank>.json.gz``, in the call's logs.tar.gz), and
    rank 0's log gets the ops that took the most device time (CPU time without CUDA)."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for i in range(args.profile):
            runner.step(*batches[i % len(batches)])
            sync()
        runner.finish()
    if rank in (0, world - 1) and args.json_out:
        path = f"{os.path.splitext(args.json_out)[0]}_trace_r{rank}.json"
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path)
    if rank == 0:
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=30), flush=True)
        _say(rank, f"profiled {args.profile} steps (not timed)")


def _say(rank: int, text: str) -> None:
    """A progress line in the case's log (rank 0), with the seconds since the process started: a
    case killed by its time budget shows where it was."""
    if rank == 0:
        print(f"[fair case {time.time() - _T0:7.1f}s] {text}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "-1"))
    sampler = globals().get("_SAMPLER") or MemSampler()
    if not sampler.is_alive() and sampler.samples == 0:
        sampler.start()
    sampler.node = rank == 0
    row: dict = {"case": args.case, "rank": rank, "error": None, "started_unix": _T0}
    code = 0
    try:
        if rank < 0 or "WORLD_SIZE" not in os.environ:
            raise CaseError("case.py runs under torchrun (for every N, 1 included): torchrun "
                            "--standalone --nproc-per-node N benchmarks/fair/case.py ... (run.py does)")
        row = run(args, row, sampler)
    except BaseException as e:  # noqa: BLE001 - every failure becomes a one-line row
        if isinstance(e, SystemExit) and not e.code:
            raise
        row["error"] = _one_line(e)
        row["failed_unix"] = time.time()
        if not isinstance(e, CaseError):
            traceback.print_exc()
        print(f"[fair case {args.case} rank {rank}] error: {row['error']}", file=sys.stderr, flush=True)
        code = 1
    row["wall_s"] = time.time() - _T0
    if rank == 0:
        write_json(args.json_out, row)
    elif code:
        write_json(f"{args.json_out}.rank{rank}", row)
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no teardown that could hang on a broken communicator
    if rank == 0:
        print(f"[fair case {args.case} x{row.get('world')}] " + (
            f"skipped: {row['skipped']}" if row.get("skipped") else
            f"{row['median_s']:.3f} s/step [{row['p25_s']:.3f}-{row['p75_s']:.3f}], "
            f"{row['tokens_per_s']:,.0f} tok/s, loss0 {row['step0_loss']:.4f}"), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
