"""The torch.optim front end of the runtime, written once: ``OffloadOptimizer`` runs any update
rule (runtime/update_rule.py, runtime/rules.py) as a ``torch.optim.Optimizer`` whose state lives
in host RAM, on NVMe or in a GPU share, stepped during backward. offload_optim.py has one thin
class per rule (``OffloadAdamW``, ``OffloadSGD``, ``OffloadMuon``, ...): its constructor's
signature, its defaults and how torch names its state.

The model stays where it is (on the GPU, in fp32 or bf16/fp16); the optimizer state (an fp32
master copy of every param and the rule's state: Adam's exp_avg and exp_avg_sq, 12 bytes per
param) lives in host RAM (``state="cpu"``) or in NVMe swap files (``state="nvme"``). Params are
packed into chunks of about ``chunk_mb`` MiB of fp32 state (per param group and dtype); each
chunk is a set of payloads in a ``ChunkStore`` and is updated by the shared ``StepPipeline``
(pipeline.py), as in the engine. Per chunk, the store holds "grads" (working dtype, host RAM,
pinned with CUDA), "master" and the rule's state (fp32, home per ``state``) and, for bf16/fp16
chunks, "params" (working dtype, host RAM: the update writes the rounded updated params there).
Per step:

1. backward: a post-accumulate-grad hook on each param copies its finished grad, on a side CUDA
   stream, into the chunk's "grads" host buffer;
2. when the last grad of a chunk has been queued, the chunk goes to the pipeline's worker thread,
   which waits for those copies only, runs the rule's CPU job over the chunk (CPU-Adam: GIL
   released; NVMe state read ahead and written behind by the pipeline) and copies the updated
   params into the model's tensors on another side stream (the group's TENSORS sink) — all while
   the GPU keeps running the rest of backward;
3. ``step()`` hands over what is left, waits for every chunk's update and makes the current CUDA
   stream wait for the param copies (device-side events; no device synchronisation). With
   ``overlap_forward=True`` it returns at once instead: see [Note: forward overlap].

With ``overlap=False`` nothing happens in backward: ``step()`` reads ``p.grad`` and runs the
same per-chunk pipeline (grad copies, updates and param copies of different chunks still
overlap each other). Without CUDA every path runs with plain copies: the "GPU" is the CPU.
A rule that is not elementwise (Adafactor, Muon) gets whole params: chunks never split one,
and with several ranks the shards are cut at parameter boundaries.

[Note: overlap semantics] With ``overlap=True`` the update *is* part of backward (as torch's
optimizer-in-backward): each chunk is stepped once its params' grads are final for the step,
with its param group's hyperparameters *as they are at that moment*. Consequences:
- lr schedulers work in the usual order (``backward(); step(); scheduler.step()``): the lr a
  scheduler sets after step k is in the group when backward k+1 runs, which is the lr torch's
  ``step()`` k+1 would read. Change hyperparameters *before* backward, not between backward and
  ``step()``.
- grads are consumed: after backward, ``p.grad`` is None for every param whose chunk was
  stepped, so grads cannot be clipped or inspected between backward and ``step()``. Use
  ``overlap=False`` for that (e.g. with ``torch.nn.utils.clip_grad_norm_``): then ``step()``
  sees exactly what torch's optimizers see.
- gradient accumulation: pass ``grad_accum=N``; the first N-1 backwards accumulate in
  ``p.grad`` on the GPU as usual, and the N-th one streams and steps. Another backward before
  ``step()`` raises.
- call ``step()`` before the next forward (as with any optimizer): it orders the param copies
  before the next use.

[Note: in-backward update safety] A chunk is updated only after *every* param in it has its
final grad for this backward. Autograd reads a weight only inside the node that computes that
weight's grad (or earlier, in checkpoint recomputation), and a tied weight's hook fires after
its last contribution, so nothing later in the same backward reads a stepped param. The copy
back to the GPU is ordered after the compute stream's work up to that param's hook (through the
grad-copy event). A model that reads a param again after its grad is complete (outside
autograd, e.g. in a backward hook) needs ``overlap=False``.

[Note: forward overlap] With ``overlap_forward=True``, ``step()`` hands over what is left and
returns without waiting: the updates still queued (the chunks whose grads came last in backward,
i.e. the first layers) overlap the next forward. The worker runs them in chunk order (the order
params were given, which is forward order for usual models), and while a chunk of the last step
is not yet synced a global module forward pre-hook is installed: before a module runs, each of
its *own* parameters (``module._parameters``) whose chunk is not synced is waited for (the host
waits for that chunk's update only; the current stream waits for its param copies). The hook
removes itself once every chunk is synced. A compiled region (``block.compile()``; [Note:
compiled regions] in compiled.py) is waited for as a whole at its own call, every param of its
subtree; the modules its graph inlines wait for nothing. The rule that follows: **params are
waited for by the module that owns them** (or the compiled region holding it). A model that reads a submodule's parameter functionally before calling
that submodule, or any host-side read or write of params after ``step()`` (an EMA, a
``model.state_dict()``, a checkpoint, ``load_state_dict`` into the model), must call
``synchronize()`` first (DeepSpeed ZeRO-3 has the same rule for external parameters). Chunks the
next forward does not use are synced by the next backward (before their grads are staged) or by
``synchronize()``, ``state_dict()``, ``load_state_dict()`` and ``close()``. With
``overlap=False`` the grads ``step()`` copies stay the caller's (``p.grad``), so ``step()`` makes
the current stream wait for those copies before anything else may write to them: the next
forward then starts once every grad has left the device.

[Note: copy-back source] The updated params reach the model's tensors through the chunk
group's TENSORS sink (runtime/chunk_group.py, [Note: param sinks]): copies out of a host buffer of
the store ("params" for bf16/fp16 chunks, "master" for fp32 chunks) on the store's H2D stream,
after the grads copy of that update; the store orders the chunk's next update and the eviction
of an NVMe master after them, and ``ChunkGroup.wait`` the caller's stream.

[Note: GPU share of the optimizer] With ``state="auto", gpu_budget=G`` the chunks are placed in
param order by the runtime's planner (runtime/placement.py, [Note: GPU share placement]; each
group's chunks within what the groups before left): each chunk's fp32 master, moments and a flat
buffer for its grads are homed on the params' device while they fit ``G`` (the first chunks: the
first layers, which the next forward needs first; once one does not fit, the rest go to the
host), then in host RAM, and, with ``nvme_dir``, on NVMe once ``cpu_budget`` less the host
buffers of every chunk and room to stage (``prefetch_depth`` + 1) chunks runs out (the swap
space is sized to exactly those chunks). A chunk of the share never meets the worker: its grads
are copied into the device buffer on the caller's stream as they come, and when the chunk's last
grad is in, the chunk group runs the rule's device step (Adam: torch's fused Adam(W)) on the
same segments and hyperparameters the CPU job gets, on that stream, and the params are written
from the master (rounded for bf16/fp16 params, as the CPU job rounds them). The caller's stream orders it all:
nothing to wait for in ``step()``, ``overlap_forward`` or the data-parallel all-gathers. The
state dict and ``load_state_dict`` go through host copies as for the other homes, so a state
moves between placements.

[Note: data parallel] With several ranks (DDP scripts; ``process_group``), each rank's store
holds only its shard of every chunk (runtime/shards.py, [Note: chunk shards]): fp32 master,
moments and grads of 1/N of the elements, so the node's host memory holds the 12 bytes per param
of state once, not N times, and each rank's CPU-Adam updates 1/N of the params (on
``cores / LOCAL_WORLD_SIZE`` threads). DDP averages the grads with its all-reduce during
backward, but its grad hooks fire before that, so ``overlap`` is off: ``step()`` copies this
rank's elements of each averaged ``p.grad`` to the host, CPU-Adam updates the shard, the updated
elements are copied into this rank's params, and every chunk's shards are all-gathered into
every rank's params: by ``step()`` in chunk order (one chunk's gather overlaps the next chunks'
updates), or with ``overlap_forward=True`` by the forward pre-hook of the first module that
owns one of the chunk's params (the same modules run in the same order on every rank, so the
collectives match), which lets the updates overlap the next forward as on one GPU; chunks the
forward did not use are gathered in chunk order by the next ``step()``, ``synchronize()``,
``state_dict()`` or ``close()``. ``state_dict()`` is then collective (every rank must call it):
each chunk's shards are all-gathered and every rank gets the whole state in torch's format;
``load_state_dict`` takes each rank's part of such a dict (or of torch's). A failed collective (a
rank died, raised or timed out) raises one error naming the rank and the way out.
FSDP2's (``fully_shard``) params are DTensors: FSDP2 shards them and reduce-scatters (averages)
their grads before the grad hooks fire, so each rank treats its local shards as its params (no
collective of ours; ``overlap`` works; ``state_dict()`` holds the local shards).
``overlap_forward`` is refused there: FSDP2 all-gathers a whole ``fully_shard`` unit (the root's
params at the root's forward) before the hooks of the modules owning them could wait for their
updates; so is a rule that is not elementwise (Adafactor, Muon): FSDP2's shards cut every param.

[Note: params changed outside the optimizer] The fp32 master is the truth for the update. If a
param is modified in place by anyone else (``load_state_dict`` into the model, ``p.copy_()``
under no_grad), its ``_version`` counter moves; the chunk group notices before the param's next
grad is staged and re-reads the master from the param ([Note: param sinks] in
runtime/chunk_group.py). (Our own copies go through ``.data``, which
does not move the counter.) For low-precision params the master is then the low-precision
value, exactly as a fresh optimizer would start.
"""
from __future__ import annotations

import dataclasses
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .compiled import global_pre_hook, is_region
from .config import as_budget, as_float, as_int, parse_bytes
from .runtime.chunk_group import ChunkGroup, ChunkPhase, GroupChunk, GroupSlot, ParamSink, Staging
from .runtime.distributed import is_dtensor, local, resolve_group, threads_per_rank
from .runtime.partition import align_shards, pack
from .runtime.pipeline import PipelinePayloads
from .runtime.placement import (Budgets, ChunkNeed, PlacementPlan, PlacementRequest, local_ranks,
                                plan_placement, rank_budgets)
from .runtime.shards import Shards
from .runtime.store import ChunkStore, Hop, StoreConfig, Tier
from .runtime.swap_io import prepare_swap_dir, swap_dir_problem
from .runtime.trace import Trace
from .runtime.update_rule import UpdateRule, shape_problem
from .runtime.vocab import ALIGNMENT, Placement

__all__ = ["OffloadOptimizer", "OffloadStats", "read_once"]

_LOWP = (torch.bfloat16, torch.float16)

_PAYLOADS = PipelinePayloads(grads="grads", master="master", lowp="params", accum=None)
"""Every chunk has "grads" and the state; bf16/fp16 chunks also "params" (see module docstring)."""


@dataclass
class OffloadStats:
    """Counters since construction (or ``reset_stats``)."""

    steps: int = 0
    d2h_bytes: int = 0
    """Grad bytes copied device -> host."""
    h2d_bytes: int = 0
    """Param bytes copied host -> device."""
    adam_s: float = 0.0
    """Seconds the update kernels ran (the pipeline's ``adam_s``: CPU-Adam, or the rule's CPU job)."""
    worker_s: float = 0.0
    """Seconds the pipeline's worker spent on jobs: waits for grad copies, NVMe reads and kernels,
    bookkeeping, the copies back (the pipeline's ``busy_s``)."""
    step_wait_s: float = 0.0
    """Seconds the caller's thread waited for updates (in ``step()``, and with
    ``overlap_forward`` in the forward hooks): what overlap did not hide."""


def _check_flag(owner: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")
    return value


def _weak(method: Callable) -> Callable:
    """``method`` called through a weak reference to its object (a no-op once it is gone), so a
    worker thread or a global hook does not keep the optimizer alive."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


class OffloadOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` running ``rule`` with its state offloaded (see the module
    docstring, in particular [Note: overlap semantics] and [Note: forward overlap]). Built by
    the classes of offload_optim.py, which document the arguments.

    Args:
        params: iterable of params or of param-group dicts (as any torch optimizer).
        defaults: the rule's hyperparameters (torch's names), checked by ``rule.check``.
        rule: the update rule, with torch's face (``check``, ``group_options``,
            ``implementation_options``, ``state_shape``; [Note: update rules]).
        state, nvme_dir, chunk_mb, threads, overlap, overlap_forward, grad_accum, prefetch_depth,
            cpu_budget, gpu_budget, process_group: where the state lives and how the step runs
            (``OffloadAdamW``'s docstring).
    """

    def __init__(self, params: Iterable, defaults: dict, *, rule: UpdateRule, state: str = "cpu",
                 nvme_dir=None, chunk_mb: float = 64.0, threads: int | None = None,
                 overlap: bool = True, overlap_forward: bool = False, grad_accum: int = 1,
                 prefetch_depth: int = 2, cpu_budget: int | str = "auto", process_group="auto",
                 gpu_budget: int | str | None = None):
        name = type(self).__name__
        self._rule = rule  # the update (runtime/update_rule.py, runtime/rules.py)
        h = rule.check(defaults, owner=name)
        home = {"cpu": Tier.CPU, "nvme": Tier.NVME, "auto": Tier.GPU}.get(
            state.lower() if isinstance(state, str) else state)
        if home is None:
            raise ValueError(f"{name}: state={state!r} is invalid: use 'cpu' (host RAM), 'nvme' "
                             f"(swap files; also pass nvme_dir) or 'auto' (GPU share first; also pass "
                             f"gpu_budget)")
        if home is Tier.NVME and nvme_dir is None:
            raise ValueError(f"{name}: state='nvme' needs nvme_dir='/path/on/a/fast/disk'")
        auto = home is Tier.GPU
        if auto != (gpu_budget is not None):
            raise ValueError(f"{name}: " + (
                "state='auto' needs gpu_budget=<bytes the optimizer state may take on the params' "
                "device, e.g. '8GiB'>; or use state='cpu'" if auto else
                f"gpu_budget={gpu_budget!r} applies to state='auto' only; pass state='auto' for a "
                f"GPU share of the optimizer, or drop gpu_budget"))
        self._gpu_budget = (parse_bytes(gpu_budget, name=f"{name}.gpu_budget")
                            if auto and gpu_budget != 0 else 0)
        if home is Tier.CPU or (auto and nvme_dir is None):
            nvme_dir = None  # no state lives on NVMe: the directory is never touched nor created
        else:
            if not isinstance(nvme_dir, (str, os.PathLike)) or not os.fspath(nvme_dir):
                raise TypeError(f"{name}: nvme_dir must be a directory path (str or os.PathLike), "
                                f"got {nvme_dir!r}")
            problem = swap_dir_problem(nvme_dir)
            if problem is not None:
                raise ValueError(f"{name}: nvme_dir={os.fspath(nvme_dir)!r} {problem}; pass a directory "
                                 f"path as nvme_dir (it is created 0700 if missing), or move that file away")
        self._chunk_numel = max(1, round(as_float(name, "chunk_mb", chunk_mb, above=0.0) * 2**20 / 4))
        self._threads = None if threads is None else as_int(name, "threads", threads, minimum=1)
        self._overlap = _check_flag(name, "overlap", overlap)
        self._overlap_forward = _check_flag(name, "overlap_forward", overlap_forward)
        params = read_once(params)
        groups = _groups_of(params)
        # See [Note: data parallel]: FSDP2's params are sharded already (each rank its own).
        fsdp2 = any(is_dtensor(t) for g in groups for t in g)
        self._shard = Shards(None if fsdp2 else resolve_group(process_group, name), owner=name,
                             device=next((t.device for g in groups for t in g), None))
        if fsdp2 and not rule.elementwise:
            raise ValueError(f"{name}: {rule.name} updates whole params, and FSDP2 shards them (each rank "
                             f"holds a piece of every param); use DDP, or one process")
        if fsdp2 and self._overlap_forward:
            raise ValueError(f"{name}: overlap_forward=True does not work with FSDP2 params: FSDP2 "
                             f"all-gathers a whole fully_shard unit before its modules' hooks could "
                             f"wait for their updates; drop overlap_forward (the update still "
                             f"overlaps backward)")
        if fsdp2 and self._threads is None:
            self._threads = threads_per_rank(cuda=True)  # the node's cores split between the ranks
        if self._shard.world > 1:
            self._overlap = False  # DDP's grad hooks fire before its all-reduce: stage in step()
            self._chunk_numel *= self._shard.world  # each rank's shard of a chunk: about chunk_mb
            if self._threads is None:
                self._threads = threads_per_rank(cuda=True)
        self._grad_accum = as_int(name, "grad_accum", grad_accum, minimum=1)
        self._depth = as_int(name, "prefetch_depth", prefetch_depth, minimum=0)
        self._cpu_budget = as_budget(name, "cpu_budget", cpu_budget)
        # before anything changes: a difference raises on every rank
        self._shard.check_settings(self._rank_settings(params, groups, h, chunk_mb, state))
        # Last check before params get hooks: the swap directory exists (0700) and is writable.
        self._nvme_dir = None if nvme_dir is None else prepare_swap_dir(nvme_dir, name=f"{name} nvme_dir")
        # Placement (runtime/placement.py): this rank's share of the node's "auto" budgets,
        # resolved once; each group's chunks are planned, in order, within what the groups
        # before it left ([Note: GPU share of the optimizer]).
        budgets = rank_budgets({Tier.GPU: self._gpu_budget, Tier.CPU: self._cpu_budget, Tier.NVME: "auto"},
                               nvme_dir=self._nvme_dir,
                               local_ranks=local_ranks() if self._shard.world > 1 or fsdp2 else 1)
        self._request = PlacementRequest(budgets=budgets, params=None, optimizer=Placement(state.lower()),
                                         rule=self._rule, nvme_dir=self._nvme_dir,
                                         prefetch_depth=self._depth, gpu_optimizer=True, owner=name,
                                         state_option="state")
        self._rest = budgets  # what the groups added so far left to the next

        # Filled by add_param_group (called by Optimizer.__init__ below).
        self._group: ChunkGroup | None = None   # the chunks, their updates and state (runtime/)
        self._store: ChunkStore | None = None
        self._chunk_of: dict[torch.Tensor, GroupChunk] = {}  # trainable param -> its chunk (forward hook)
        self._frozen: list[torch.Tensor] = []    # params without grad: no state, no chunk
        self._grad_hooks: list[_GradHook] = []   # overlap=True: one per param this rank holds
        self._hook_handles: list = []
        self._forward_hook = None                # see [Note: forward overlap]
        self._device: torch.device | None = None
        self._closed = False
        self._steps = self._steps0 = 0

        # The swap space is preallocated: sized for every group's chunks, planned here as
        # add_param_group will plan them (a plan that does not fit raises before any change).
        rest, self._nvme_need = budgets, 0
        for g in groups:
            plan = self._plan(g, rest)[1]
            rest, self._nvme_need = plan.rest(), self._nvme_need + plan.need[Tier.NVME]
        defaults = dict(h, **self._rule.group_options)
        super().__init__(params, defaults)

    # ------------------------------------------------------------------------------------
    # building

    def _rank_settings(self, params, groups, h: dict, chunk_mb, state) -> dict:
        """What every rank must pass alike (``check_ranks_agree``; [Note: data parallel]): the
        chunks (``chunk_mb``, the params' groups, shapes and dtypes) decide the collectives, the
        rest the updates. Not compared: paths, budgets, threads, ``prefetch_depth`` (this rank's
        own) and ``overlap`` (off with several ranks)."""
        return {"the optimizer": type(self).__name__, "chunk_mb": float(chunk_mb),
                "state": state.lower(), "the update rule": repr(self._rule), "grad_accum": self._grad_accum,
                "overlap_forward": self._overlap_forward,
                ", ".join(h): tuple(x for v in h.values() for x in (v if isinstance(v, tuple) else (v,))),
                "the param groups' options": [{k: v for k, v in g.items() if k != "params"}
                                              for g in ([] if isinstance(params, torch.Tensor) else params)
                                              if isinstance(g, dict)],
                "the params (group, shape, dtype, requires_grad)": [
                    (i, tuple(t.shape), t.dtype, t.requires_grad) for i, g in enumerate(groups) for t in g]}

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as torch); its params get chunks (and hooks) at once."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        # [Note: groups record fused=True] (ops/cpu_adam.py)
        param_group = dict(param_group, **self._rule.implementation_options)
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            param_group["params"] = [params]
        elif params is not None and not isinstance(params, set):
            param_group["params"] = list(params)  # a generator is read once, here
        self._check_group({**self.defaults, **param_group})
        self._check_params(param_group.get("params") or [])
        n_before = len(self.param_groups)
        super().add_param_group(param_group)  # torch's checks: sets, duplicates, leaf tensors
        if len(self.param_groups) == n_before:
            return
        group = self.param_groups[-1]
        try:
            packed, plan = self._plan(group["params"], self._rest)
            need = plan.need[Tier.NVME]
            if self._store is not None and need:
                free = self._store.budgets[Tier.NVME] - self._store.bytes(Tier.NVME)
                if need > free:
                    raise ValueError(
                        f"{type(self).__name__}(state='nvme'): the swap space was sized for the params "
                        f"given to the constructor and has {free} bytes left, this group needs {need}; "
                        f"pass every param group to the constructor")
        except BaseException:
            self.param_groups.pop()  # nothing changed
            raise
        self._rest = plan.rest()
        if self._group is not None:
            self._group.drain()  # new chunks are written while no job runs
        self._build_group(group, packed, plan)

    def _check_group(self, group: dict) -> None:
        """Hyperparameters of a group (with defaults filled in), as torch's optimizer checks them."""
        self._rule.check(group, owner=type(self).__name__)

    def _check_params(self, params) -> None:
        name = type(self).__name__
        device = self._device
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                continue  # torch's add_param_group names the problem
            problem = shape_problem(self._rule, tuple(local(p).shape)) if p.requires_grad else None
            if problem is not None:
                raise ValueError(f"{name}: param {i} of the group (shape {tuple(p.shape)}): {problem}; give "
                                 f"such params another optimizer (torch's Muon recipe: AdamW for "
                                 f"embeddings, norms, biases and the head)")
            if p.is_sparse:
                raise ValueError(f"{name} does not support sparse params")
            if p.dtype not in (torch.float32, *_LOWP):
                raise TypeError(f"{name}: params must be fp32, bf16 or fp16, got {p.dtype}; keep such "
                                f"params out of this optimizer")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name}: params on {p.device.type} are not supported (CUDA or CPU)")
            device = device or p.device
            if p.device != device:
                raise ValueError(f"{name}: all params must be on one device; got {device} and "
                                 f"{p.device}. Use one optimizer per device")

    def _plan(self, params, budgets: Budgets) -> tuple[list, PlacementPlan]:
        """A group's trainable params packed into chunks (by dtype, in order; each rank's shard
        about ``chunk_mb``): ``(dtype, [(param, offset)], whole)`` each, laid out for the ranks at
        parameter boundaries for a rule that is not elementwise ([Note: whole parameters] in
        runtime/partition.py); and their homes, planned within ``budgets``."""
        rule, world = self._rule, self._shard.world
        chunks, needs = [], []
        for c in pack([p for p in params if p.requires_grad and local(p).numel() > 0],
                      chunk_numel=self._chunk_numel, size=lambda p: local(p).numel(),
                      key=lambda p: p.dtype, align=1):
            members, offsets, whole = [p for p, _ in c.members], [o for _, o in c.members], c.numel
            if not rule.elementwise and world > 1:
                offsets, whole = align_shards(offsets, whole, world, align=1)
            k = self._shard.span(whole)[2]
            mine = None if rule.elementwise else tuple(
                tuple(local(p).shape) for p, o in zip(members, offsets) if o // k == self._shard.rank)
            chunks.append((c.key, list(zip(members, offsets)), whole))
            needs.append(ChunkNeed(numel=k, dtype=c.key, shapes=mine))
        return chunks, plan_placement(dataclasses.replace(self._request, budgets=budgets, chunks=tuple(needs)))

    def _build_group(self, group: dict, packed: list, plan: PlacementPlan) -> None:
        params = group["params"]
        self._frozen.extend(p for p in params if not p.requires_grad)
        if self._device is None and params:
            self._device = params[0].device  # one device for all params (_check_params)
        if self._group is None and packed:
            self._open()
        gi = len(self.param_groups) - 1
        index0 = sum(len(g["params"]) for g in self.param_groups[:-1])
        position = {id(p): index0 + i for i, p in enumerate(params)}
        for i, (_, members, whole) in enumerate(packed):
            # slots by their place in the whole chunk (members: (param, offset), no padding);
            # the group cuts this rank's shard ([Note: data parallel])
            slots = [GroupSlot(lo=o, numel=local(p).numel(), group=gi, index=position[id(p)], param=p,
                               shape=tuple(local(p).shape)) for p, o in members]
            chunk = self._group.add_chunk(plan.payloads(i), slots, whole=whole)
            for p, _ in members:
                self._chunk_of[p] = chunk  # every rank knows every param's chunk (gathers)
            self._group.load_state(chunk, _initial_state(chunk))  # master = the params, moments = 0
            for slot in chunk.slots:
                if self._overlap and slot.held:
                    hook = _GradHook(self, slot)
                    self._grad_hooks.append(hook)
                    self._hook_handles.append(slot.param.register_post_accumulate_grad_hook(hook))

    def _open(self) -> None:
        """The store and the chunk group (with the first trainable param)."""
        device = self._device
        budgets = {Tier.CPU: self._request.budgets.cpu}
        if self._request.optimizer is Placement.AUTO:
            budgets[Tier.GPU] = self._gpu_budget
        if self._nvme_dir is not None:  # swap files are preallocated: exactly what the plan needs
            budgets[Tier.NVME] = max(ALIGNMENT, self._nvme_need) if self._nvme_need else 0
        self._store = ChunkStore(StoreConfig(device=device if device.type == "cuda" else "cpu",
                                             budgets=budgets, nvme_dir=self._nvme_dir))
        self._group = ChunkGroup(self._store, hyper=self, rule=self._rule, payloads=_PAYLOADS,
                                 shards=self._shard, staging=Staging.DIRECT, sink=ParamSink.TENSORS,
                                 learn_order=self._overlap, owner=type(self).__name__,
                                 prefetch_depth=self._depth, threads=self._threads)

    # ------------------------------------------------------------------------------------
    # backward side (caller's thread, or autograd's)

    def _on_grad(self, hook: _GradHook) -> None:
        """Post-accumulate-grad hook of ``hook.slot.param`` (overlap=True)."""
        self._group.check()
        hook.fired += 1
        if hook.fired < self._grad_accum:
            return
        if hook.fired > self._grad_accum:
            raise RuntimeError(
                f"{type(self).__name__}(overlap=True) got more backward passes than grad_accum="
                f"{self._grad_accum} before step(): each chunk is stepped during the last backward. "
                f"Call step() after every {self._grad_accum} backward pass(es), pass grad_accum=N "
                f"for N backwards per step, or use overlap=False")
        param = hook.slot.param
        self._group.grad(hook.slot, self._grad_of(param))  # the chunk is stepped once complete
        param.grad = None
        self._remove_forward_hook_if_synced()

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor:
        grad = local(p.grad)
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if grad.shape != local(p).shape:
            raise RuntimeError(f"grad of shape {tuple(grad.shape)} for a param of shape {tuple(local(p).shape)}")
        return grad

    # ------------------------------------------------------------------------------------
    # step and synchronisation

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Finish this step: stage grads not yet streamed (all of them with ``overlap=False``)
        and hand their chunks over; then wait for every chunk's update and order the param
        copies before the current CUDA stream's next work, or, with ``overlap_forward=True``,
        return at once (see [Note: forward overlap]). Returns the closure's loss, if any."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self._group
        if group is not None:
            group.check()
            group.gather_updates()  # chunks the last forward did not use: in chunk order on every rank
        for p in self._frozen:
            if p.grad is not None:
                raise RuntimeError(
                    f"{type(self).__name__}: a param that had requires_grad=False when the optimizer was "
                    f"built now has a grad; build the optimizer after unfreezing, or add the param "
                    f"in a new param group (add_param_group)")
        # Params whose grad did not come through the hooks (overlap=False, grads set by hand,
        # fewer backwards than grad_accum): staged now, in chunk order; p.grad stays the
        # caller's (keep: the caller's stream is ordered after our copies of it).
        if group is not None:
            for chunk in group.chunks:
                for slot in chunk.slots:
                    if slot.param.grad is not None and not group.has_grad(slot):
                        group.grad(slot, self._grad_of(slot.param), keep=True)
            group.end_backward()
            group.end_micro_batch()
            group.end_window()  # see [Note: update order] in runtime/chunk_group.py
        for hook in self._grad_hooks:
            hook.fired = 0
        self._steps += 1
        if not self._overlap_forward:
            self._sync_all()
        elif self._forward_hook is None and group is not None and group.pending():
            self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                global_pre_hook(_weak(self._pre_forward)))
        return loss

    def synchronize(self) -> None:
        """Wait for every update handed over and order the param copies before the current CUDA
        stream's next work: the params are final. Needed with ``overlap_forward=True`` before
        reading params outside a forward (see [Note: forward overlap]); a no-op otherwise."""
        self._check_open()
        self._sync_all()

    def _sync_all(self) -> None:
        if self._group is not None:
            self._group.gather_updates()
            self._group.drain()
        self._remove_forward_hook()

    def _pre_forward(self, module: torch.nn.Module) -> None:
        """The global module forward pre-hook of [Note: forward overlap]: a module's own params,
        a compiled region's whole subtree ([Note: compiled regions] in compiled.py)."""
        for p in (module.parameters() if is_region(module) else module._parameters.values()):
            chunk = self._chunk_of.get(p) if p is not None else None
            if chunk is None:
                continue
            if chunk.ungathered:  # the same modules run in the same order on every rank
                self._group.gather_updates([chunk])
            elif chunk.phase is ChunkPhase.QUEUED:
                self._group.wait(chunk)
            else:
                continue
            self._remove_forward_hook_if_synced()

    def _remove_forward_hook_if_synced(self) -> None:
        if self._forward_hook is not None and not self._group.pending():
            self._remove_forward_hook()

    def _remove_forward_hook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; build a new optimizer")

    # ------------------------------------------------------------------------------------
    # state dict: torch's format

    _step_in_state = True
    """torch's optimizer records ``state["step"]`` (Adam, Adafactor; not SGD, Lion, Muon)."""
    _required_state: "tuple | None" = None
    """The rule's state keys a loaded param state must have (None: every one its shape has)."""
    _state_hints: dict = {}
    """Keys of other optimizers' state -> the option that makes them (for the error)."""

    def _keeps(self, key: str, group: dict) -> bool:
        """Whether torch's optimizer keeps state ``key`` for a param of ``group``."""
        return True

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """torch's format (e.g. ``torch.optim.AdamW``'s: ``state[i] = {"step", "exp_avg",
        "exp_avg_sq"}``; the rule's state keys, fp32 CPU tensors shaped as torch shapes them) for
        every param stepped at least once, plus ``"master"`` (fp32) for bf16/fp16 params;
        ``param_groups`` with torch's keys (Adam: ``fused=True``, so a ``torch.optim.AdamW``
        loading it runs fused, as ours does; [Note: groups record fused=True] in
        ops/cpu_adam.py). Waits for the updates in flight (``synchronize``)."""
        self._check_open()
        if (self._group is not None and self._group.staged()) or any(h.fired for h in self._grad_hooks):
            raise RuntimeError(f"{type(self).__name__}.state_dict() in the middle of a step: call step() first")
        self._sync_all()
        state = {}
        for chunk in self._chunks:  # every rank gathers every chunk (collective)
            whole = self._group.state(chunk)
            for s, step in zip(chunk.slots, whole["steps"]):
                if step == 0:
                    continue
                shape, group = local(s.param).shape, self.param_groups[s.group]
                entry = {"step": torch.tensor(float(step))} if self._step_in_state else {}
                for key in chunk.rule.state_keys:
                    torch_shape = self._rule.state_shape(key, tuple(shape))
                    if torch_shape is not None and self._keeps(key, group):
                        lo, hi = whole["spans"][key][s.pos]
                        entry[key] = whole[key][lo:hi].clone().view(torch_shape)
                if s.param.dtype in _LOWP:
                    entry["master"] = whole["master"][s.lo:s.lo + s.numel].clone().view(shape)
                if entry:  # (torch's SGD without momentum keeps no state)
                    state[s.index] = entry
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of its torch optimizer (any device or dtype).
        Hyperparameters of the groups are taken from it, as torch does. Without a ``"master"``
        entry, the master of a low-precision param is its current value. torch's implementation
        options (``foreach``, ``fused``) stay ours (the rule's ``implementation_options``)."""
        self._check_open()
        name, rule = type(self).__name__, self._rule
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(f"{name}.load_state_dict needs a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer "
                             f"has {len(self.param_groups)}")
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"loaded state dict's group {i} has {len(sg['params'])} params, this "
                                 f"optimizer's has {len(g['params'])}")
            self._check_group({**g, **{k: v for k, v in sg.items() if k != "params"}})
        # saved id -> our param position
        id_map = {}
        start = 0
        for g, sg in zip(self.param_groups, saved_groups):
            for j, saved_id in enumerate(sg["params"]):
                id_map[saved_id] = start + j
            start += len(g["params"])
        by_index = dict(enumerate(p for g in self.param_groups for p in g["params"]))
        entries: dict[int, dict] = {}
        known = {"step", "master", *rule.state_keys}
        for key, entry in state_dict["state"].items():
            key = int(key) if isinstance(key, str) and key.isdigit() else key
            if key not in id_map:
                raise ValueError(f"loaded state dict has state for param id {key!r}, which no group lists")
            idx = id_map[key]
            param = by_index[idx]
            if not param.requires_grad or local(param).numel() == 0:
                continue  # a frozen param here: no state kept (as it gets no grads)
            shape = tuple(local(param).shape)
            shapes = {k: rule.state_shape(k, shape) for k in rule.state_keys}
            required = [k for k in (self._required_state if self._required_state is not None else shapes)
                        if shapes[k] is not None]
            for k in (["step"] if self._step_in_state else []) + required:
                if k not in entry:
                    raise ValueError(f"loaded state for param {key} lacks {k!r}; is it a {rule.name} "
                                     f"state dict?")
            for k in entry:
                if k not in known:
                    hint = self._state_hints.get(k)
                    raise ValueError(f"loaded state for param {key} has {k!r}, which {name} does not keep"
                                     + (f" (it is from {hint}, which {name} does not support)" if hint else ""))
            for k in [*shapes, "master"]:
                want = local(param).numel() if k == "master" else math.prod(shapes[k] or (0,))
                if k in entry and local(entry[k]).numel() != want:
                    raise ValueError(f"loaded {k!r} for param {key} has {local(entry[k]).numel()} elements, "
                                     f"the param's needs {want}")
            entries[idx] = entry
        # all checks passed: change state
        self._sync_all()
        for g, sg in zip(self.param_groups, saved_groups):
            for k, v in sg.items():
                if k != "params" and k not in rule.implementation_options:
                    g[k] = v
        for chunk in self._chunks:
            steps = [_step_of(entries.get(s.index), rule.state_keys) for s in chunk.slots]
            self._group.load_state(chunk, _loaded_state(chunk, entries), steps)

    # ------------------------------------------------------------------------------------
    # misc

    @property
    def stats(self) -> OffloadStats:
        """Counters since construction or ``reset_stats`` (the worker's from the pipeline)."""
        w = self._group.counters() if self._group is not None else {}
        return OffloadStats(steps=self._steps - self._steps0, d2h_bytes=w.get(Hop.GPU_TO_CPU, 0),
                            h2d_bytes=w.get(Hop.CPU_TO_GPU, 0), adam_s=w.get("adam_s", 0.0),
                            worker_s=w.get("busy_s", 0.0), step_wait_s=w.get("wait_s", 0.0))

    def reset_stats(self) -> None:
        self._steps0 = self._steps
        if self._group is not None:
            self._group.reset_counters()

    @property
    def trace(self) -> Trace | None:
        """A ``Trace`` recording the worker's spans (jobs, kernel calls, waits), or None (the
        default: nothing recorded). Set one, run steps, ``write`` it."""
        return None if self._group is None else self._group.trace

    @trace.setter
    def trace(self, trace: Trace | None) -> None:
        if self._group is None:
            raise RuntimeError(f"{type(self).__name__} has no trainable params: nothing to trace")
        self._group.trace = trace

    def nvme_bytes(self) -> tuple[int, int]:
        """(bytes read from, bytes written to) NVMe since construction or ``reset_stats``."""
        w = self._group.counters() if self._group is not None else {}
        return w.get(Hop.NVME_TO_CPU, 0), w.get(Hop.CPU_TO_NVME, 0)

    @property
    def _chunks(self) -> list[GroupChunk]:
        return self._group.chunks if self._group is not None else []

    def close(self) -> None:
        """Finish the queued jobs (data parallel: and the pending all-gathers, so every rank's
        params are final), remove the hooks and free the state (and swap files). Idempotent.
        Does not raise the worker's errors (``step``/``synchronize`` do)."""
        self._close(gather=True)

    def _close(self, *, gather: bool) -> None:
        if self._closed:
            return
        failure = None
        if gather and self._group is not None:
            try:
                self._group.gather_updates()
            except Exception as e:  # noqa: BLE001 - raised after the cleanup
                failure = e
        self._closed = True
        try:
            if self._group is not None:
                self._group.close()
        finally:
            self._remove_forward_hook()
            for h in self._hook_handles:
                h.remove()
            self._hook_handles.clear()
            if self._store is not None:
                self._store.close()  # waits for copies still reading or writing host buffers
        if failure is not None:
            raise failure

    def __del__(self):
        try:
            self._close(gather=False)  # never a collective from the garbage collector
        except Exception:
            pass

    def __repr__(self):
        n = sum(c.numel for c in self._chunks)
        return (f"{type(self).__name__}(params={n}, chunks={len(self._chunks)}, "
                f"state={self._request.optimizer.value!r}, overlap={self._overlap}, "
                f"overlap_forward={self._overlap_forward}, groups={len(self.param_groups)})")


class _GradHook:
    """The post-accumulate-grad hook of one param (a callable record, not a closure over a
    loop variable). Installed only with ``overlap=True``."""

    __slots__ = ("opt", "slot", "fired")

    def __init__(self, opt: OffloadOptimizer, slot: GroupSlot):
        self.opt, self.slot = opt, slot
        self.fired = 0
        """Times it fired in the current step (``grad_accum`` backwards per step)."""

    def __call__(self, param: torch.Tensor) -> None:
        self.opt._on_grad(self)


def read_once(params):
    """The constructor's ``params`` with generators (of params or of a group's params) read into
    lists: they are walked twice (swap-space sizing, then torch's ``add_param_group``)."""
    if isinstance(params, torch.Tensor):
        return params  # torch names the mistake
    out = []
    for g in params:
        if isinstance(g, dict) and g.get("params") is not None and \
                not isinstance(g["params"], (torch.Tensor, list, tuple, set)):
            g = {**g, "params": list(g["params"])}
        out.append(g)
    return out


def _initial_state(chunk: GroupChunk) -> Callable:
    """``ChunkGroup.load_state``'s ``fill`` of a new chunk: master = the params, the rule's state 0."""
    def fill(key: str, buf: torch.Tensor, spans: tuple) -> None:
        if key == "master":
            for s in chunk.slots:
                buf[s.lo:s.lo + s.numel].copy_(local(s.param).detach().reshape(-1))
    return fill


def _loaded_state(chunk: GroupChunk, entries: dict) -> Callable:
    """``ChunkGroup.load_state``'s ``fill`` from a state dict's ``entries`` (param index -> its
    state): a param without one starts afresh, one without a "master" takes its own value."""
    def fill(key: str, buf: torch.Tensor, spans: tuple) -> None:
        for s, (lo, hi) in zip(chunk.slots, spans):
            entry = entries.get(s.index)
            if key == "master":
                src = entry["master"] if entry is not None and "master" in entry else s.param
            elif entry is None or key not in entry:
                continue
            else:
                src = entry[key]
            buf[lo:hi].copy_(local(src).detach().reshape(-1))
    return fill


def _step_of(entry, keys) -> int:
    """A loaded param's step count: its "step", else 1 when it has state (torch's SGD, Lion and
    Muon count no steps; only SGD's first step differs, and state means it was taken)."""
    if entry is None:
        return 0
    step = entry.get("step")
    if step is None:
        return int(any(k in entry for k in keys))
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def _groups_of(params) -> list:
    """The tensors of each group of the constructor's ``params`` (as read by ``_read_once``;
    anything else is left for torch's ``add_param_group`` to name)."""
    if isinstance(params, torch.Tensor):
        return []
    groups = [g.get("params") for g in params] if params and all(isinstance(g, dict) for g in params) \
        else [params]
    return [[t for t in ([ps] if isinstance(ps, torch.Tensor) else (ps or ())) if isinstance(t, torch.Tensor)]
            for ps in groups]
