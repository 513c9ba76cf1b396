"""OffloadAdam / OffloadAdamW: optimizer-only offload for scripts that keep their own loop.

The model stays where it is (on the GPU, in fp32 or bf16/fp16); the optimizer state — an fp32
master copy of every param, exp_avg and exp_avg_sq, 12 bytes per param — lives in host RAM
(``state="cpu"``) or in NVMe swap files (``state="nvme"``). Params are packed into chunks of
about ``chunk_mb`` MiB of fp32 state (per param group and dtype); each chunk is a set of payloads
in a ``ChunkStore`` and is updated by the shared ``StepPipeline`` (pipeline.py), as in the
engine. Per chunk, the store holds "grads" (working dtype, host RAM, pinned with CUDA),
"master"/"exp_avg"/"exp_avg_sq" (fp32, home per ``state``) and, for bf16/fp16 chunks, "params"
(working dtype, host RAM: CPU-Adam writes the rounded updated params there). Per step:

1. backward: a post-accumulate-grad hook on each param copies its finished grad, on a side CUDA
   stream, into the chunk's "grads" host buffer;
2. when the last grad of a chunk has been queued, the chunk goes to the pipeline's worker thread,
   which waits for those copies only, runs the native CPU-Adam over the chunk (GIL released;
   NVMe state read ahead and written behind by the pipeline) and calls ``_write_back``, which
   copies the updated params into the model's tensors on another side stream — all while the
   GPU keeps running the rest of backward;
3. ``step()`` hands over what is left, waits for every chunk's update and makes the current CUDA
   stream wait for the param copies (device-side events; no device synchronisation). With
   ``overlap_forward=True`` it returns at once instead: see [Note: forward overlap].

With ``overlap=False`` nothing happens in backward: ``step()`` reads ``p.grad`` and runs the
same per-chunk pipeline (grad copies, CPU-Adam and param copies of different chunks still
overlap each other). Without CUDA every path runs with plain copies: the "GPU" is the CPU.

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
removes itself once every chunk is synced. The rule that follows: **params are waited for by the
module that owns them**. A model that reads a submodule's parameter functionally before calling
that submodule, or any host-side read or write of params after ``step()`` (an EMA, a
``model.state_dict()``, a checkpoint, ``load_state_dict`` into the model), must call
``synchronize()`` first (DeepSpeed ZeRO-3 has the same rule for external parameters). Chunks the
next forward does not use are synced by the next backward (before their grads are staged) or by
``synchronize()``, ``state_dict()``, ``load_state_dict()`` and ``close()``. With
``overlap=False`` the grads ``step()`` copies stay the caller's (``p.grad``), so ``step()`` makes
the current stream wait for those copies before anything else may write to them: the next
forward then starts once every grad has left the device.

[Note: copy-back source] The updated params reach the model's tensors by copies out of a host
buffer of the store ("params" for bf16/fp16 chunks, "master" for fp32 chunks), issued on the
worker right after the update (``ChunkGroup.copy_back``; with CUDA asynchronous on the store's
H2D stream, after the grads copy of that update, which came after the compute stream's last use
of the params). The store records them as readers of that host copy, so both hazards are the
store's: the chunk's next update, which takes the buffer for writing, waits for them (overwrite),
and with ``state="nvme"`` the host "master" the pipeline evicts after writing it home keeps its
memory until they finish (lifetime). ``ChunkGroup.wait`` makes the caller's stream wait for them.

[Note: GPU share of OffloadAdam] With ``state="auto", gpu_budget=G`` the chunks are placed in
param order by the runtime's planner (runtime/placement.py, [Note: GPU share placement]; each
group's chunks within what the groups before left): each chunk's fp32 master, moments and a flat
buffer for its grads are homed on the params' device while they fit ``G`` (the first chunks: the
first layers, which the next forward needs first; once one does not fit, the rest go to the
host), then in host RAM, and, with ``nvme_dir``, on NVMe once ``cpu_budget`` less the host
buffers of every chunk and room to stage (``prefetch_depth`` + 1) chunks runs out (the swap
space is sized to exactly those chunks). A chunk of the share never meets the worker: its grads
are copied into the device buffer on the caller's stream as they come, and when the chunk's last
grad is in, ``ChunkGroup.device_submit`` runs torch's fused Adam(W) on the same segments and
hyperparameters CPU-Adam gets, on that stream, and the params are written from the master
(rounded for bf16/fp16 params, as CPU-Adam rounds them). The caller's stream orders it all:
nothing to wait for in ``step()``, ``overlap_forward`` or the data-parallel all-gathers. The
state dict and ``load_state_dict`` go through host copies as for the other homes, so a state
moves between placements.

[Note: data parallel] With several ranks (DDP scripts; ``process_group``), each rank's store
holds only its shard of every chunk (distributed.py, [Note: chunk shards]): fp32 master,
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
updates.

[Note: params changed outside the optimizer] The fp32 master is the truth for the update. If a
param is modified in place by anyone else (``load_state_dict`` into the model, ``p.copy_()``
under no_grad), its ``_version`` counter moves; the optimizer notices before the next update of
that param and re-reads the master from the param. (Our own copies go through ``.data``, which
does not move the counter.) For low-precision params the master is then the low-precision
value, exactly as a fresh optimizer would start.
"""
from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .config import as_budget, as_float, as_int, parse_bytes
from .distributed import (all_gather, check_ranks_agree, collective, is_dtensor, local, resolve_group,
                          shard_of, threads_per_rank)
from .runtime.chunk_group import ChunkGroup, ChunkPhase, GroupChunk, GroupSlot
from .runtime.partition import Packed, pack
from .runtime.pipeline import PipelinePayloads
from .runtime.placement import (Budgets, ChunkNeed, PlacementPlan, PlacementRequest, local_ranks,
                                plan_placement, rank_budgets)
from .runtime.store import ChunkStore, Handle, Hop, StoreConfig, Tier
from .runtime.swap_io import prepare_swap_dir, swap_dir_problem
from .runtime.trace import Trace
from .runtime.update_rule import AdamRule
from .runtime.vocab import ALIGNMENT, Placement

__all__ = ["OffloadAdam", "OffloadAdamW", "OffloadStats"]

_LOWP = (torch.bfloat16, torch.float16)

_STATE = ("master", *AdamRule.state_keys)
"""Store payloads of the optimizer state (home per ``state``): the fp32 master and the rule's."""
_PAYLOADS = PipelinePayloads(grads="grads", master="master", lowp="params", accum=None)
"""Every chunk has "grads" and the state; bf16/fp16 chunks also "params" (see module docstring)."""


@dataclass(eq=False)
class _Slot(GroupSlot):
    """One param inside a chunk (a ``GroupSlot`` with this front end's fields)."""

    param: torch.Tensor = None
    index: int = 0
    """Position in the optimizer's param order (the key in ``state_dict()["state"]``)."""
    start: int = 0
    """First element of the param (its local tensor, flattened) this slot holds: 0 unless the
    chunk is split between ranks (a shard boundary may cut a param; see distributed.py)."""
    version: int = 0
    """``param._version`` when the master last matched the param (see [Note: params changed
    outside the optimizer])."""
    hooks: int = 0
    """Grad hooks fired in the current step (for ``grad_accum``)."""
    landed: bool = False
    """Its grad for the current step is staged in the chunk."""


@dataclass
class OffloadStats:
    """Counters since construction (or ``reset_stats``)."""

    steps: int = 0
    d2h_bytes: int = 0
    """Grad bytes copied device -> host."""
    h2d_bytes: int = 0
    """Param bytes copied host -> device."""
    adam_s: float = 0.0
    """Seconds the CPU-Adam kernels ran (the pipeline's ``adam_s``)."""
    worker_s: float = 0.0
    """Seconds the pipeline's worker spent on jobs: waits for grad copies, NVMe reads and kernels,
    bookkeeping, the copies back (the pipeline's ``busy_s``)."""
    step_wait_s: float = 0.0
    """Seconds the caller's thread waited for updates (in ``step()``, and with
    ``overlap_forward`` in the forward hooks): what overlap did not hide."""


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"OffloadAdam: {name} must be True or False, got {value!r}")
    return value


def _weak(method: Callable) -> Callable:
    """``method`` called through a weak reference to its object (a no-op once it is gone), so a
    worker thread or a global hook does not keep the optimizer alive."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


class OffloadAdam(torch.optim.Optimizer):
    """Adam with state in host RAM or on NVMe, stepped by CPU-Adam during backward.

    ``torch.optim.Adam`` semantics (``weight_decay`` as an L2 penalty); ``OffloadAdamW`` has
    ``torch.optim.AdamW``'s decoupled decay. Read the module docstring, in particular
    [Note: overlap semantics] and [Note: forward overlap].

    Args:
        params: iterable of params or of param-group dicts (as any torch optimizer); groups may
            set their own ``lr``, ``betas``, ``eps``, ``weight_decay``.
        lr, betas, eps, weight_decay: defaults, as torch.optim.Adam(W).
        state: "cpu" (host RAM, pinned when CUDA), "nvme" (swap files under ``nvme_dir``,
            read ahead and written behind per chunk) or "auto": the GPU share first (see
            [Note: GPU share of OffloadAdam]), then host RAM, then, with ``nvme_dir``, NVMe
            for what does not fit ``cpu_budget``.
        nvme_dir: directory on a fast disk; required with ``state="nvme"``.
        chunk_mb: MiB of fp32 master per chunk (the unit of transfer and of CPU-Adam jobs).
        threads: CPU-Adam threads (None: every core this process may use).
        overlap: step each chunk during backward (True) or everything in ``step()`` (False).
        overlap_forward: ``step()`` returns without waiting for the updates; each module's
            forward waits for its own params (see [Note: forward overlap]; call
            ``synchronize()`` before reading params outside a forward).
        grad_accum: backward passes per ``step()`` (``overlap=True`` only needs to know).
        prefetch_depth: NVMe chunks read ahead of the update being run.
        cpu_budget: bytes (or "auto") of pinned host memory the optimizer may use ("cpu" state
            must fit whole; "nvme" state stages through it). "auto": the free memory less a
            reserve; with several ranks on the node, this rank's share ([Note: rank budgets] in
            runtime/placement.py), as the NVMe space is.
        gpu_budget: with ``state="auto"`` (and only then; required): bytes of the params'
            device the optimizer's GPU share may take (fp32 master, moments and a flat grads
            buffer: 12 + the param's item size bytes per element with fp32 moments).
        process_group: data parallelism (see [Note: data parallel]). "auto" (default): the
            default group when ``torch.distributed`` is initialized with several ranks; None:
            every rank keeps the whole state; or a ProcessGroup.
        moments_dtype: "fp32" (default, exact: torch's results) or "bf16": the moments stored in
            bf16 with stochastic rounding, an opt-in INEXACT mode (8 instead of 12 bytes of state
            per param; as ``OffloadConfig.moments_dtype``). ``state_dict`` gives fp32 moments.
    """

    _adamw = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, state: str = "cpu",
                 nvme_dir=None, chunk_mb: float = 64.0, threads: int | None = None,
                 overlap: bool = True, overlap_forward: bool = False, grad_accum: int = 1,
                 prefetch_depth: int = 2, cpu_budget: int | str = "auto", process_group="auto",
                 moments_dtype: str = "fp32", gpu_budget: int | str | None = None):
        name = type(self).__name__
        if moments_dtype not in ("fp32", "bf16"):
            raise ValueError(f"{name}: moments_dtype={moments_dtype!r} is invalid: use 'fp32' (exact, "
                             f"the default) or 'bf16' (stochastically rounded, inexact)")
        self._moments = torch.bfloat16 if moments_dtype == "bf16" else torch.float32
        self._rule = AdamRule(adamw=self._adamw, moments_dtype=self._moments)  # the update (runtime/)
        h = self._rule.check(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), owner=name)
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
        self._overlap = _check_flag("overlap", overlap)
        self._overlap_forward = _check_flag("overlap_forward", overlap_forward)
        params = _read_once(params)
        groups = _groups_of(params)
        # See [Note: data parallel]: FSDP2's params are sharded already (each rank its own).
        fsdp2 = any(is_dtensor(t) for g in groups for t in g)
        self._pg = None if fsdp2 else resolve_group(process_group, name)
        self._shard = shard_of(self._pg)
        if fsdp2 and self._overlap_forward:
            raise ValueError(f"{name}: overlap_forward=True does not work with FSDP2 params: FSDP2 "
                             f"all-gathers a whole fully_shard unit before its modules' hooks could "
                             f"wait for their updates; drop overlap_forward (the update still "
                             f"overlaps backward)")
        if fsdp2 and self._threads is None:
            self._threads = threads_per_rank(cuda=True)  # the node's cores split between the ranks
        if self._pg is not None:
            self._overlap = False  # DDP's grad hooks fire before its all-reduce: stage in step()
            self._chunk_numel *= self._shard.world  # each rank's shard of a chunk: about chunk_mb
            if self._threads is None:
                self._threads = threads_per_rank(cuda=True)
        self._grad_accum = as_int(name, "grad_accum", grad_accum, minimum=1)
        self._depth = as_int(name, "prefetch_depth", prefetch_depth, minimum=0)
        self._cpu_budget = as_budget(name, "cpu_budget", cpu_budget)
        if self._pg is not None:  # before anything changes: a difference raises on every rank
            check_ranks_agree(name, self._rank_settings(params, groups, h, chunk_mb, state),
                              self._pg, device=next((t.device for g in groups for t in g), None))
        # Last check before params get hooks: the swap directory exists (0700) and is writable.
        self._nvme_dir = None if nvme_dir is None else prepare_swap_dir(nvme_dir, name=f"{name} nvme_dir")
        # Placement (runtime/placement.py): this rank's share of the node's "auto" budgets,
        # resolved once; each group's chunks are planned, in order, within what the groups
        # before it left ([Note: GPU share of OffloadAdam]).
        budgets = rank_budgets({Tier.GPU: self._gpu_budget, Tier.CPU: self._cpu_budget, Tier.NVME: "auto"},
                               nvme_dir=self._nvme_dir,
                               local_ranks=local_ranks() if self._pg is not None or fsdp2 else 1)
        self._request = PlacementRequest(budgets=budgets, params=None, optimizer=Placement(state.lower()),
                                         rule=self._rule, nvme_dir=self._nvme_dir,
                                         prefetch_depth=self._depth, gpu_optimizer=True, owner=name,
                                         state_option="state")
        self._rest = budgets  # what the groups added so far left to the next

        # Filled by add_param_group (called by Optimizer.__init__ below).
        self._group: ChunkGroup | None = None   # the chunks, their updates and state (runtime/)
        self._store: ChunkStore | None = None
        self._slots: list[_Slot] = []            # in param order (state_dict indices)
        self._chunk_of: dict[torch.Tensor, GroupChunk] = {}  # trainable param -> its chunk (forward hook)
        self._landed: dict[int, int] = {}        # chunk id -> slots whose grad is staged this step
        self._ready: dict[int, Handle] = {}      # chunk id -> handle of its last staged grad copy
        self._device_grads: dict[int, torch.Tensor] = {}  # GPU share: chunk id -> its grads buffer
        self._members: dict[int, tuple] = {}     # chunk id -> ([(param, chunk offset)], shard size)
        self._gathers: list[GroupChunk] = []     # updated, not all-gathered yet ([Note: data parallel])
        self._jobs: dict[int, tuple] = {}        # chunk id -> (slots, grads handle) of its last update
        self._frozen: list[torch.Tensor] = []    # params without grad: no state, no chunk
        self._hook_handles: list = []
        self._forward_hook = None                # see [Note: forward overlap]
        self._submitted: list[int] = []          # chunk ids in this step's hand-over order
        self._priority: dict[int, int] = {}      # chunk id -> rank in the next forward (guess)
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
                "state": state.lower(), "moments_dtype": self._moments, "grad_accum": self._grad_accum,
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
        """Hyperparameters of a group (with defaults filled in), as torch.optim.Adam checks them."""
        self._rule.check(group, owner=type(self).__name__)

    def _check_params(self, params) -> None:
        name = type(self).__name__
        device = self._device
        for p in params:
            if not isinstance(p, torch.Tensor):
                continue  # torch's add_param_group names the problem
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

    def _plan(self, params, budgets: Budgets) -> tuple[list[Packed], PlacementPlan]:
        """A group's trainable params packed into chunks (by dtype, in order; each rank's shard
        about ``chunk_mb``) and their homes, planned within ``budgets``."""
        packed = pack([p for p in params if p.requires_grad and local(p).numel() > 0],
                      chunk_numel=self._chunk_numel, size=lambda p: local(p).numel(),
                      key=lambda p: p.dtype, align=1)
        chunks = tuple(ChunkNeed(numel=self._shard.span(c.numel)[2], dtype=c.key) for c in packed)
        return packed, plan_placement(dataclasses.replace(self._request, budgets=budgets, chunks=chunks))

    def _build_group(self, group: dict, packed: list[Packed], plan: PlacementPlan) -> None:
        params = group["params"]
        self._frozen.extend(p for p in params if not p.requires_grad)
        if self._device is None and params:
            self._device = params[0].device  # one device for all params (_check_params)
        if self._group is None and packed:
            self._open()
        gi = len(self.param_groups) - 1
        index0 = sum(len(g["params"]) for g in self.param_groups[:-1])
        position = {id(p): index0 + i for i, p in enumerate(params)}
        for i, c in enumerate(packed):
            members = c.members  # (param, offset) without padding
            lo, hi, k = self._shard.span(c.numel)  # this rank's elements; see [Note: data parallel]
            payloads = plan.payloads(i)
            slots = []
            for p, o in members:
                a, b = max(o, lo), min(o + local(p).numel(), hi)
                if a < b:
                    slots.append(_Slot(offset=a - lo, stop=b - lo, group=gi, param=p, start=a - o,
                                       index=position[id(p)], version=local(p)._version))
            chunk = self._group.add_chunk(payloads, slots)
            self._members[chunk.cid] = (members, k)
            for p, _ in members:
                self._chunk_of[p] = chunk  # every rank knows every param's chunk (gathers)
            self._landed[chunk.cid] = 0
            self._init_state(chunk)
            self._slots.extend(slots)
            for slot in slots:
                if self._overlap:
                    self._hook_handles.append(slot.param.register_post_accumulate_grad_hook(
                        _GradHook(self, chunk, slot)))
        self._slots.sort(key=lambda s: s.index)

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
                                 owner=type(self).__name__, prefetch_depth=self._depth,
                                 threads=self._threads, on_update_done=_weak(self._write_back),
                                 seed=self._shard.rank)

    @torch.no_grad()
    def _init_state(self, chunk: GroupChunk) -> None:
        """Master = the params (fp32), moments = 0; written home (NVMe: then dropped from RAM)."""
        with self._group.hold(chunk, _STATE, fresh=True) as (master, _, _):
            for slot in chunk.slots:
                master[slot.offset:slot.stop].copy_(_piece(slot, slot.param))

    # ------------------------------------------------------------------------------------
    # backward side (caller's thread, or autograd's)

    def _on_grad(self, chunk: GroupChunk, slot: _Slot) -> None:
        """Post-accumulate-grad hook of ``slot.param`` (overlap=True)."""
        self._group.check()
        slot.hooks += 1
        if slot.hooks < self._grad_accum:
            return
        if slot.hooks > self._grad_accum or slot.landed:
            raise RuntimeError(
                f"{type(self).__name__}(overlap=True) got more backward passes than grad_accum="
                f"{self._grad_accum} before step(): each chunk is stepped during the last backward. "
                f"Call step() after every {self._grad_accum} backward pass(es), pass grad_accum=N "
                f"for N backwards per step, or use overlap=False")
        self._stage(chunk, slot, consume=True)
        if self._landed[chunk.cid] == len(chunk.slots):
            self._submit(chunk)

    @torch.no_grad()
    def _stage(self, chunk: GroupChunk, slot: _Slot, *, consume: bool) -> None:
        """Queue the copy of ``slot``'s grad into the chunk's "grads" host buffer."""
        p = slot.param
        grad = local(p.grad)
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if grad.shape != local(p).shape:
            raise RuntimeError(f"grad of shape {tuple(grad.shape)} for a param of shape {tuple(local(p).shape)}")
        on_device = self._group.on_device(chunk)
        if chunk.phase is not ChunkPhase.FILLING:  # the chunk's first grad in this step
            # its last update read "grads": it finishes first
            self._group.open_grads(chunk, host=not on_device)
            if on_device:
                self._device_grads[chunk.cid] = self._group.device_grads(chunk)
            self._remove_forward_hook_if_synced()
        if local(p)._version != slot.version:
            self._resync_master(chunk, slot)
        if on_device:  # on the caller's stream, as the update that reads it
            self._device_grads[chunk.cid][slot.offset:slot.stop].copy_(_piece(slot, grad))
        else:
            self._ready[chunk.cid] = self._group.stage(chunk, [(slot.offset, _piece(slot, grad))])
        if consume:
            p.grad = None
        slot.landed = True
        self._landed[chunk.cid] += 1

    def _resync_master(self, chunk: GroupChunk, slot: _Slot) -> None:
        """See [Note: params changed outside the optimizer]. Rare: synchronous."""
        with self._group.hold(chunk, ["master"], write=True) as (master,):
            master[slot.offset:slot.stop].copy_(_piece(slot, slot.param))
        slot.version = local(slot.param)._version

    def _submit(self, chunk: GroupChunk) -> None:
        """Hand a chunk whose staged grads are complete to the pipeline, its update behind; a
        chunk of the GPU share is updated now and its params written from its master."""
        slots = tuple(s for s in chunk.slots if s.landed)
        if self._group.on_device(chunk):
            del self._device_grads[chunk.cid]
            self._group.device_submit(chunk, slots, update=True)
            master = self._store.get(chunk.cid, "master", Tier.GPU)
            for s in slots:
                _piece(s, local(s.param).data.view(-1)).copy_(master[s.offset:s.stop])
            return
        self._store.mark_dirty(chunk.cid, "grads", Tier.CPU)
        ready = self._ready[chunk.cid]
        self._jobs[chunk.cid] = (slots, ready)
        self._submitted.append(chunk.cid)
        self._group.submit(chunk, slots, ready=ready, update=True,
                           priority=self._priority.get(chunk.cid, len(self._group.chunks) + chunk.cid))

    # ------------------------------------------------------------------------------------
    # worker thread

    def _write_back(self, cid: int) -> None:
        """The pipeline's ``on_update_done``: updated params into the model's tensors (CUDA:
        async on the store's H2D stream). See [Note: copy-back source]."""
        chunk = self._group.chunks[cid]
        slots, ready = self._jobs[cid]
        name = "params" if chunk.slots[0].param.dtype in _LOWP else "master"
        self._group.copy_back(chunk, name, [(s.offset, _piece(s, local(s.param).data.view(-1)))
                                            for s in slots], after=ready)

    # ------------------------------------------------------------------------------------
    # step and synchronisation

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Finish this step: stage grads not yet streamed (all of them with ``overlap=False``)
        and hand their chunks over; then wait for every chunk's CPU-Adam and order the param
        copies before the current CUDA stream's next work, or, with ``overlap_forward=True``,
        return at once (see [Note: forward overlap]). Returns the closure's loss, if any."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._group is not None:
            self._group.check()
        if self._gathers:  # chunks the last forward did not use: in chunk order on every rank
            self._gather_params(list(self._gathers))
        for p in self._frozen:
            if p.grad is not None:
                raise RuntimeError(
                    f"{type(self).__name__}: a param that had requires_grad=False when the optimizer was "
                    f"built now has a grad; build the optimizer after unfreezing, or add the param "
                    f"in a new param group (add_param_group)")
        # Params whose grad did not come through the hooks (overlap=False, grads set by hand,
        # fewer backwards than grad_accum): stage them now, in chunk order.
        staged = False
        for chunk in self._group.chunks if self._group is not None else ():
            for slot in chunk.slots:
                if not slot.landed and slot.param.grad is not None:
                    self._stage(chunk, slot, consume=False)
                    staged = True
            if chunk.phase is ChunkPhase.FILLING:
                self._submit(chunk)
        if staged:
            # p.grad stays the caller's: later work on it (zero_grad(set_to_none=False), the next
            # backward accumulating into it) must come after our copies read it.
            self._store.wait_copies_in()
        for slot in self._slots:
            slot.hooks = 0
            slot.landed = False
        for cid in self._landed:
            self._landed[cid] = 0
        # [Note: update order] The worker runs queued updates in priority order, and the next
        # forward needs the chunks in forward order: the reverse of the order in which backward
        # finished them (the last chunk handed over is the first one the forward uses). Param
        # order (chunk index) is only the first step's guess: with param groups (decay / no
        # decay) it is group by group, not the model's order.
        if self._submitted and self._overlap:  # else handed over in param order: keep that
            last = len(self._submitted) - 1
            self._priority = {cid: last - i for i, cid in enumerate(self._submitted)}
            self._submitted = []
        self._steps += 1
        if self._pg is not None:
            self._gathers = list(self._chunks)  # see [Note: data parallel]
        if not self._overlap_forward:
            self._sync_all()
        elif self._forward_hook is None and (self._queued() or self._gathers):
            self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                _weak(self._pre_forward))
        return loss

    def _gather_params(self, chunks) -> None:
        """See [Note: data parallel]: every rank's updated shard of each of ``chunks`` into every
        rank's params, in the order given (the same on every rank; the gather of one chunk
        overlaps the updates of the next ones)."""
        pending = None
        for chunk in chunks:
            self._gathers.remove(chunk)
        for chunk in chunks:
            self._group.wait(chunk)  # its update and its copy into this rank's params
            members, k = self._members[chunk.cid]
            first = local(members[0][0])
            send = torch.zeros(k, dtype=first.dtype, device=first.device)
            for s in chunk.slots:  # this rank's elements: its slots
                send[s.offset:s.stop] = _piece(s, s.param)
            full = torch.empty(k * self._shard.world, dtype=send.dtype, device=send.device)
            with self._collective("the all-gather of the updated params"):
                work = all_gather(full, send, self._pg, async_op=True)
            if pending is not None:
                self._scatter(*pending)
            pending = (work, full, members)
        if pending is not None:
            self._scatter(*pending)

    def _scatter(self, work, full: torch.Tensor, members) -> None:
        """The end of one chunk's all-gather: the chunk's params take their elements of ``full``."""
        with self._collective("the all-gather of the updated params"):
            work.wait()
        for p, o in members:
            lp = local(p)
            lp.data.view(-1).copy_(full[o:o + lp.numel()])

    def _collective(self, what: str):
        return collective(type(self).__name__, what, self._pg)

    def synchronize(self) -> None:
        """Wait for every update handed over and order the param copies before the current CUDA
        stream's next work: the params are final. Needed with ``overlap_forward=True`` before
        reading params outside a forward (see [Note: forward overlap]); a no-op otherwise."""
        self._check_open()
        self._sync_all()

    def _queued(self) -> bool:
        return any(c.phase is ChunkPhase.QUEUED for c in self._group.chunks)

    def _sync_all(self) -> None:
        if self._gathers:
            self._gather_params(list(self._gathers))
        if self._group is not None:
            self._group.drain()
        self._remove_forward_hook()

    def _pre_forward(self, module: torch.nn.Module, args) -> None:
        """The global module forward pre-hook of [Note: forward overlap]."""
        for p in module._parameters.values():
            chunk = self._chunk_of.get(p) if p is not None else None
            if chunk is None:
                continue
            if chunk in self._gathers:  # the same modules run in the same order on every rank
                self._gather_params([chunk])
            elif chunk.phase is ChunkPhase.QUEUED:
                self._group.wait(chunk)
            else:
                continue
            self._remove_forward_hook_if_synced()

    def _remove_forward_hook_if_synced(self) -> None:
        if self._forward_hook is not None and not self._queued() and not self._gathers:
            self._remove_forward_hook()

    def _remove_forward_hook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; build a new optimizer")

    # ------------------------------------------------------------------------------------
    # state dict: torch.optim.Adam(W)'s format

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s format: ``state[i] = {"step", "exp_avg", "exp_avg_sq"}`` (fp32 CPU
        tensors shaped like the param) for every param stepped at least once, plus ``"master"``
        (fp32) for bf16/fp16 params; ``param_groups`` with torch's keys (``fused=True``: a
        ``torch.optim.AdamW`` loading it runs fused, as ours does; [Note: groups record
        fused=True] in ops/cpu_adam.py). Waits for the updates in flight (``synchronize``)."""
        self._check_open()
        if any(s.landed or s.hooks for s in self._slots):
            raise RuntimeError(f"{type(self).__name__}.state_dict() in the middle of a step: call step() first")
        self._sync_all()
        steps = {s.index: s.step for s in self._slots}
        if self._pg is not None:  # a param cut by a shard boundary is stepped by each of its ranks
            import torch.distributed as dist
            gathered = [None] * self._shard.world
            with self._collective("the all-gather of the optimizer state"):
                dist.all_gather_object(gathered, steps, group=self._pg)
            steps = {i: max(d.get(i, 0) for d in gathered) for i in set().union(*gathered)}
        index_of = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state = {}
        for chunk in self._chunks:
            stepped = [(p, o, index_of[id(p)]) for p, o in self._members[chunk.cid][0]
                       if steps.get(index_of[id(p)], 0) > 0]
            if not stepped:  # (the same answer on every rank: ``steps`` is gathered)
                continue
            master, exp_avg, exp_avg_sq = self._whole_state(chunk)
            for p, o, i in stepped:
                sl, shape = slice(o, o + local(p).numel()), local(p).shape
                state[i] = {"step": torch.tensor(float(steps[i])),
                            "exp_avg": exp_avg[sl].clone().view(shape),
                            "exp_avg_sq": exp_avg_sq[sl].clone().view(shape)}
                if p.dtype in _LOWP:
                    state[i]["master"] = master[sl].clone().view(shape)
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _whole_state(self, chunk: GroupChunk) -> torch.Tensor:
        """The chunk's master and moments, fp32 on the CPU, shape (3, elements): several ranks
        all-gather their shards (host memory: one chunk's state at a time beside the result)."""
        with self._group.hold(chunk, _STATE) as bufs:
            mine = torch.stack([b.float() for b in bufs])
        if self._pg is None:
            return mine.cpu()
        import torch.distributed as dist
        world, k = self._shard.world, mine.shape[1]
        dev = self._device if dist.get_backend(self._pg) == "nccl" else torch.device("cpu")
        full = torch.empty(world * 3, k, device=dev)
        with self._collective("the all-gather of the optimizer state"):
            all_gather(full, mine.to(dev), self._pg)
        return full.view(world, 3, k).transpose(0, 1).reshape(3, world * k).cpu()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.Adam``/``AdamW`` (any device or
        dtype). Hyperparameters of the groups are taken from it, as torch does. Without a
        ``"master"`` entry, the master of a low-precision param is its current value. torch's
        implementation options (``foreach``, ``fused``) stay ours (the rule's
        ``implementation_options``)."""
        self._check_open()
        name = type(self).__name__
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
        for key, entry in state_dict["state"].items():
            key = int(key) if isinstance(key, str) and key.isdigit() else key
            if key not in id_map:
                raise ValueError(f"loaded state dict has state for param id {key!r}, which no group lists")
            idx = id_map[key]
            param = by_index[idx]
            if not param.requires_grad or local(param).numel() == 0:
                continue  # a frozen param here: no state kept (as it gets no grads)
            for k in ("step", "exp_avg", "exp_avg_sq"):
                if k not in entry:
                    raise ValueError(f"loaded state for param {key} lacks {k!r}; is it an Adam/AdamW state dict?")
            if "max_exp_avg_sq" in entry:
                raise ValueError(f"loaded state for param {key} is from amsgrad=True, which {name} does not support")
            for k in ("exp_avg", "exp_avg_sq", "master"):
                if k in entry and local(entry[k]).numel() != local(param).numel():
                    raise ValueError(f"loaded {k!r} for param {key} has {local(entry[k]).numel()} elements, "
                                     f"the param has {local(param).numel()}")
            entries[idx] = entry
        # all checks passed: change state
        self._sync_all()
        for g, sg in zip(self.param_groups, saved_groups):
            for k, v in sg.items():
                if k != "params" and k not in self._rule.implementation_options:
                    g[k] = v
        for chunk in self._chunks:
            with self._group.hold(chunk, _STATE, fresh=True) as (master, exp_avg, exp_avg_sq):
                for s in chunk.slots:
                    sl = slice(s.offset, s.stop)
                    entry = entries.get(s.index)
                    master_src = entry.get("master") if entry is not None else None
                    master[sl].copy_(_piece(s, s.param if master_src is None else master_src))
                    if entry is None:
                        exp_avg[sl].zero_()
                        exp_avg_sq[sl].zero_()
                        s.step = 0
                    else:
                        exp_avg[sl].copy_(_piece(s, entry["exp_avg"]))
                        exp_avg_sq[sl].copy_(_piece(s, entry["exp_avg_sq"]))
                        step = entry["step"]
                        s.step = int(step.item() if isinstance(step, torch.Tensor) else step)
                    s.version = local(s.param)._version

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
        if gather and self._gathers:
            try:
                self._gather_params(list(self._gathers))
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


class OffloadAdamW(OffloadAdam):
    """``OffloadAdam`` with ``torch.optim.AdamW``'s decoupled weight decay (default 1e-2)."""

    _adamw = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, state: str = "cpu",
                 nvme_dir=None, chunk_mb: float = 64.0, threads: int | None = None,
                 overlap: bool = True, overlap_forward: bool = False, grad_accum: int = 1,
                 prefetch_depth: int = 2, cpu_budget: int | str = "auto", process_group="auto",
                 moments_dtype: str = "fp32", gpu_budget: int | str | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, state=state, nvme_dir=nvme_dir,
                         chunk_mb=chunk_mb, threads=threads, overlap=overlap,
                         overlap_forward=overlap_forward, grad_accum=grad_accum,
                         prefetch_depth=prefetch_depth, cpu_budget=cpu_budget,
                         process_group=process_group, moments_dtype=moments_dtype,
                         gpu_budget=gpu_budget)


class _GradHook:
    """The post-accumulate-grad hook of one param (a callable record, not a closure over a
    loop variable). Installed only with ``overlap=True``."""

    __slots__ = ("opt", "chunk", "slot")

    def __init__(self, opt: OffloadAdam, chunk: GroupChunk, slot: _Slot):
        self.opt, self.chunk, self.slot = opt, chunk, slot

    def __call__(self, param: torch.Tensor) -> None:
        self.opt._on_grad(self.chunk, self.slot)


def _read_once(params):
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


def _piece(slot: _Slot, t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` (a param, its grad or its data; local shard for DTensors) that
    ``slot`` holds, flat."""
    return local(t).detach().reshape(-1)[slot.start:slot.start + slot.stop - slot.offset]


def _groups_of(params) -> list:
    """The tensors of each group of the constructor's ``params`` (as read by ``_read_once``;
    anything else is left for torch's ``add_param_group`` to name)."""
    if isinstance(params, torch.Tensor):
        return []
    groups = [g.get("params") for g in params] if params and all(isinstance(g, dict) for g in params) \
        else [params]
    return [[t for t in ([ps] if isinstance(ps, torch.Tensor) else (ps or ())) if isinstance(t, torch.Tensor)]
            for ps in groups]
