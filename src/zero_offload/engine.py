"""The offload training engine: wraps an ``nn.Module`` and trains it with its parameters,
gradients and Adam state paged between the compute device, pinned host memory and NVMe.

Usage::

    engine = zero_offload.initialize(model, optimizer=zero_offload.AdamW(lr=3e-4),
                                     config=zero_offload.OffloadConfig(params="cpu", dtype="bf16"))
    for batch in loader:
        loss = engine(batch)       # forward: hooks page chunks in and out
        engine.backward(loss)      # grads leave the device chunk by chunk
        engine.step()              # clip / update / advance the lr schedule (every grad_accum calls)

Ownership, outer to inner (docs/internals.md): ``Engine`` owns a ``Partition`` (which parameter
lives where), a ``ChunkStore`` (bytes and tiers), a ``Prefetcher`` for the working params (which
also decides what stays on the device: [Note: holds] there), a ``ParamGuard`` (param_guard.py) and
a ``ChunkGroup`` (updates, over the CPU-Adam worker). It keeps one ``_Chunk`` per chunk and one
``_ModuleRecord`` per module that holds parameters directly or reads other modules' ones
([Note: external parameters]), or per compiled module, which holds its whole subtree's ([Note:
compiled regions] in compiled.py; the modules inside it have none). It writes nothing onto the user's modules or parameters but
``param.data``, the class of a parameter holding its placeholder and its hooks, all undone by
``close``.

The param guard owns what the parameters hold and how their reads are answered: [Note: parameter
data] (a placeholder, guarded, while a chunk is off the device), [Note: external parameters]
(reads outside the module holding the parameter, recorded; the engine's ``_ModuleRecord``s hold
them) and [Note: saved parameter views], all in param_guard.py.

[Note: backward hooks] Per module call with grad enabled, the pre-forward hook wraps the module's
input tensors in ``_PostBackward`` (whose backward runs after the module's backward) and the
post-forward hook puts a multi-grad hook on the outputs (runs before it): the second holds the
module's chunks for backward, the first lets them go. Chunks whose post-backward never runs
(inputs that need no grad, e.g. token ids) are let go when backward ends. A chunk is released in
backward only once every grad it expects this pass has landed (``GroupChunk.awaiting``): the
AccumulateGrad of a parameter may run after its module's post-backward and needs its real data.

Device residency ([Note: holds] in runtime/prefetch.py): the engine only holds a chunk (module
calls, backward, reads of the guard) and lets it go (``_hold``/``_unhold``); the prefetcher decides
when it is mapped (``_materialize``) and let go (``_unmap``): chunks nobody holds stay parked on
the device, and a copy let go in a forward with grad enabled is kept for backward, within
``placement.keep_limit``. ``_release_idle`` (end of backward, before a step's updates, idle) lets
every chunk nobody holds go and drops the kept copies.

[Note: failed calls] torch runs a module's post-forward hook (``always_call``) also when the call
raised before its forward ran: in a user's pre-hook registered before ``initialize`` (it runs
before the engine's), or in the engine's own pre-forward (a fetch failed). A model may catch that
and go on (an optional branch). So the pre-forward pushes the call on ``_call_stack`` before it
holds anything and counts the chunks it holds; the post-forward lets go only those, and does
nothing when the innermost call is not its module's (its pre-forward never ran). Letting go of
chunks never held left a chunk on the device across an update (stale params in the next step).

[Note: lock order] Two threads use the store: the caller's (forward, backward hooks) and the
CPU-Adam worker. The caller takes the engine's lock, then the prefetcher's (holds, then
look-ahead), then the store's; the worker the prefetcher's look-ahead lock, then the store's; the
store's eviction policy queries the prefetcher without its lock (prefetch.py, [Note: lock order]).

[Note: fetch on completion] The params look-ahead stops at the first chunk whose CPU update is
queued or running (its bytes are about to change). Left at that, the next forward would run
right behind the updates and wait for each chunk's copy, issued on demand at its hook. So the
worker calls ``_chunk_ready`` as soon as a chunk has no job left (``on_chunk_idle``), and the
prefetcher (``Prefetcher.chunk_ready``) re-issues its look-ahead from the consumer's position:
the chunk's copy starts the moment its update ends, if it is within the window (``prefetch_depth``
uses ahead, within the GPU budget). The worker takes the prefetcher's lock, then the store's (as
in [Note: lock order]), holding no pipeline lock. On CUDA the copy is queued behind what the
compute stream (``Prefetcher.set_stream`` at each ``forward``) has issued; nothing synchronises
the host.

[Note: exact step] Clipping by the global norm and the fp16 overflow check need every grad before
any update. As grads land, the worker adds up their sums of squares; ``step()`` then decides
(skip, clip coefficient), queues the updates in forward order and returns: they overlap the next
forward, whose fetch of chunk c waits only for chunk c's update. Without clipping and fp16 (and
with ``OffloadConfig.overlap``), each chunk is updated as soon as its grads land, overlapping the
rest of backward. Both orders give ``torch.optim.Adam``/``AdamW``'s results on the same grads.
The chunk group runs both (runtime/chunk_group.py, [Note: the window's decision]).

[Note: data parallel] With a process group (``torchrun``; ``process_group="auto"``) every chunk
is split between the N ranks (runtime/shards.py, [Note: chunk shards]): each rank's store holds its
shard of every payload, placement plans for the shards, and the chunk group updates the rank's
part of each slot (``GroupSlot`` spans cut at the shard boundary). A chunk is used whole:
``_materialize`` fetches the rank's params shard (prefetched as on one GPU) and all-gathers the
chunk into a device buffer; backward accumulates the whole chunk's grads in a device buffer,
which the chunk group reduce-scatters (mean over the ranks, as DDP) into the rank's grads shard,
sent to the host as before ([Note: grad staging] in runtime/chunk_group.py). Clipping and the overflow check all-reduce the shards' sums of squares.
Every collective is issued by the caller's or autograd's thread (never the worker) in an order
all ranks share: the same modules run in the same order, and end-of-backward flushes go in chunk
order. Whole-model reads (``state_dict``, ``gathered``, ``close``, checkpoints) gather chunk by
chunk and are collective. ``params="gpu"`` keeps each chunk's gathered params as a replica on
every GPU (ZeRO-2 with offload), gathered again only after an update changed the shards.
``grad_sync="final"`` with ``grad_accum > 1`` sums a chunk's grads over the window in an fp32
device buffer and reduce-scatters once, at the last micro-batch.

[Note: failed engine] With several ranks, an exception that escapes forward, backward or step on
one rank (a collective that failed because a peer died, raised or timed out; or this rank's own
error, after which its collectives no longer pair with the other ranks') leaves the ranks' states
apart for good. The engine is then *failed* (``_fail``; also after any failed collective): every
later call raises naming the first error, it starts no collective, and ``close`` writes nothing
back (that would run collectives against ranks that are elsewhere: a hang, or the wrong chunk
gathered) but frees everything, leaves the parameters as placeholders and warns in one line what
was lost and what to do. The cause is what the caller saw: clean-up after it (pins of a failed
all-gather or reduce-scatter released where they were taken, ``_reset_holds``, ``close``) never
raises over it. One process alone recovers from an exception in forward/backward
(``_reset_holds``), unless that clean-up itself fails.

[Note: collectives ahead] With NCCL the collectives overlap compute. When a chunk is
materialized, the all-gather of the next chunk of the recorded order (``Prefetcher.peek``: this
pass only, the same answer on every rank) is issued async; its use waits for it device-side. The
decision reads only state every rank shares (the recorded order, held chunks, update versions)
and waits on the host for that chunk's update first (a timing-dependent "is it ready?" would let
ranks disagree). A grads reduce-scatter is issued async and the shard goes to the host from the
comm stream, which waits for it (runtime/shards.py, [Note: comm streams]).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from .compiled import (CompileWatch, check_backward, check_regions, check_regions_fit,
                       compiled_regions, outside_graph)
from .config import PER_RANK_FIELDS, OffloadConfig, OptimizerSpec, load_config
from .mixed_precision import LossScaler, cast_inputs
from .runtime.distributed import (available_cores, bind_to_cores, rank_cores, resolve_group,
                                  start_default_group, threads_per_rank)
from .initial_values import InitialValues, set_values
from .param_guard import PHASES, ParamGuard, Phase
from .runtime.chunk_group import ChunkGroup, GroupChunk, GroupSlot, Staging
from .runtime.partition import ChunkLayout, ParamSlot, Partition, partition_parameters, update_spans
from .runtime.pipeline import PipelinePayloads, StepPipeline
from .runtime.placement import (PARKED_CHUNKS, ChunkNeed, PlacementPlan, PlacementRequest, chunk_payloads,
                                keep_limit, local_ranks, plan_placement, rank_budgets)
from .runtime.prefetch import Consumer, Prefetcher
from .runtime.shards import Gather, Shards
from .runtime.store import ChunkStore, Hop, StoreConfig, Tier
from .runtime.trace import StatsWindow, Trace

__all__ = ["Engine", "EngineStats", "Phase", "initialize"]


def _range(name: str):
    """A profiler range with a stable name (``zero_offload::pre_forward`` ...) while the torch
    profiler records, nothing otherwise: the hooks run a few hundred times per step and an idle
    ``record_function`` still costs microseconds each."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# Records


@dataclass(eq=False)
class _Chunk:
    """Engine-side state of one chunk: the device buffer its params point into. Whether it is on
    the device is the prefetcher's ([Note: holds]); its grads, update, steps and window are the
    chunk group's (``g``; runtime/chunk_group.py)."""

    layout: ChunkLayout
    g: GroupChunk
    gslots: dict
    """ParamSlot -> its GroupSlot in ``g`` (trainable chunks)."""
    buffer: Optional[torch.Tensor] = None
    """The device buffer the params point into while mapped (see [Note: parameter data])."""

    @property
    def cid(self) -> int:
        return self.g.cid

    @property
    def steps(self) -> list:
        """Optimizer step count per slot (torch.optim's state['step'])."""
        return [self.gslots[s].step if s in self.gslots else 0 for s in self.layout.slots]

    def expect(self, slot: ParamSlot) -> None:
        """A grad of ``slot`` will land in this backward (the group counts it)."""
        self.g.expect(self.gslots[slot])

    def expects(self, slot: ParamSlot) -> bool:
        g = self.gslots.get(slot)
        return g is not None and g in self.g.expected

    @property
    def awaiting(self) -> set:
        """Expected grads of this backward still to land (see [Note: backward hooks])."""
        return self.g.awaiting

    @property
    def replica(self) -> Optional[torch.Tensor]:
        return self.g.replica

    @replica.setter
    def replica(self, value: Optional[torch.Tensor]) -> None:
        self.g.replica = value


@dataclass(eq=False)
class _ModuleRecord:
    """A module whose forward uses parameters (its own, or external ones read in its forward;
    see [Note: external parameters]), and the chunks they live in."""

    module: nn.Module
    slots: tuple
    """Slots of the parameters the module holds directly."""
    chunks: tuple
    """Chunks of ``slots`` and ``external``, each once."""
    external: tuple = ()
    """Slots of other modules' parameters this module's forward reads (recorded)."""


_OPEN_ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
"""Every module of a model an open engine manages -> that engine (weakly): initialize refuses
a model, or a model containing or inside one, that an open engine holds."""


@dataclass(eq=False)
class _Call:
    """One running module call: what its pre-forward took ([Note: failed calls])."""

    record: _ModuleRecord
    held: int = 0
    """How many of ``record.chunks`` (in order) it holds: all, unless a fetch raised."""
    token: Optional["_BackwardToken"] = None
    """Grad enabled: the call's backward token."""


@dataclass(eq=False)
class _BackwardToken:
    """One module call with grad enabled: whether its chunks are held for its backward."""

    record: _ModuleRecord
    held: bool = False
    done: bool = False


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs after the module's backward."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


@dataclass
class EngineStats:
    """What ``Engine.stats()`` returns (plain values; ``as_dict`` for logging)."""

    steps: int
    skipped_steps: int
    micro_steps: int
    bytes_held: dict
    """tier -> bytes the store holds now."""
    peak_bytes: dict
    """tier -> peak bytes held since the last ``reset_stats``."""
    bytes_moved: dict
    """hop ("cpu->gpu", ...) -> bytes moved since the last ``reset_stats``."""
    forward_s: float
    backward_s: float
    step_s: float
    fetch_stall_s: float
    """Host time forward/backward waited for params to arrive on the device."""
    update_stall_s: float
    """Host time forward waited for a chunk's CPU update to finish."""
    adam_s: float
    """Seconds the CPU-Adam kernels ran."""
    worker_busy_s: float
    """Worker time on jobs of any kind (waits for grads to land and bookkeeping included)."""
    gpu_stall_share: float
    """(fetch + update stalls) / (forward + backward time): the share of compute time lost."""
    prefetch_hit_rate: float
    """Share of params uses whose copy had landed on the device before the use."""
    prefetch_ahead_rate: float
    """Share of params uses whose copy was fetched ahead (landed or in flight) before the use."""
    loss_scale: Optional[float]
    last_grad_norm: Optional[float]
    lr: float

    def as_dict(self) -> dict:
        return dict(vars(self))


# --------------------------------------------------------------------------------------------
# The engine


def initialize(model: nn.Module, *, optimizer: Optional[OptimizerSpec] = None,
               config: Any = None, lr_scheduler: Optional[Callable] = None,
               device: "str | torch.device | None" = None,
               param_groups: Optional[Sequence[dict]] = None, process_group: Any = "auto",
               init: Optional[Callable[[str, torch.Tensor], None]] = None, weights: Any = None) -> "Engine":
    """Wrap ``model`` for offloaded training.

    Args:
        model: an ``nn.Module`` on the CPU or a GPU (its parameters' storage is taken over and
            freed chunk by chunk), or built on the meta device (no memory; see ``init`` and
            ``weights``): the host then never holds a full copy of the model beside the tiers.
        optimizer: ``zero_offload.Adam(...)`` or ``zero_offload.AdamW(...)`` (a spec; the engine
            builds the state). May be omitted when ``config`` is a DeepSpeed config with an
            ``optimizer`` section.
        config: ``OffloadConfig``, a dict of its fields, a path to a JSON file, or a DeepSpeed
            config (dict/path). None = ``OffloadConfig()``.
        lr_scheduler: a callable taking the engine's optimizer (``engine.optimizer``, a
            ``torch.optim.Optimizer`` holding the hyperparameters) and returning a scheduler,
            e.g. ``lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)``.
            ``engine.step()`` advances it once per optimizer update (not on skipped fp16 steps).
        device: compute device (default: CUDA when available, else the CPU).
        param_groups: groups of parameters with their own hyperparameters, as torch optimizers
            take them: ``[{"params": [...], "weight_decay": 0.0}, ...]``. ``params`` lists
            ``nn.Parameter`` objects of ``model`` or their names; a group may set the spec's
            hyperparameters (Adam/AdamW: ``lr``, ``betas``, ``eps``, ``weight_decay``; the update
            rule's ``hyper_keys``). Every trainable parameter not listed is in the
            default group (group 0: the ``optimizer`` spec's values); ``engine.optimizer``'s
            ``param_groups`` are group 0 followed by these, in order, so an lr scheduler can
            drive each (e.g. ``LambdaLR`` with one function per group).
        process_group: data parallelism (see [Note: data parallel]): "auto" (default) takes
            the default group when ``torch.distributed`` is initialized with several ranks; under
            a launcher (``torchrun``: ``WORLD_SIZE`` > 1) without one, it is started from the
            environment (NCCL on GPUs, gloo on the CPU; one line on rank 0 says so). None trains
            on this process alone, or a ProcessGroup. Every rank must pass the same settings
            (config fields but ``PER_RANK_FIELDS``, optimizer, param groups, model): they are
            compared here, and a difference raises on every rank, naming it.
        init: for a model on the meta device, ``init(name, tensor)`` fills an empty CPU tensor
            for each distinct parameter (first name in ``named_parameters()`` order), in that
            order, e.g. ``GPT.init_param``; None: each module's ``reset_parameters()``.
        weights: a safetensors file, or a directory of them (HF ``save_pretrained`` shards),
            holding every parameter by its ``state_dict`` name: read chunk by chunk straight into
            the tiers (the model's own values, meta or not, are not used).
    """
    return Engine(model, optimizer=optimizer, config=config, lr_scheduler=lr_scheduler, device=device,
                  param_groups=param_groups, process_group=process_group, init=init, weights=weights)


class Engine:
    """See the module docstring and ``initialize``."""

    def __init__(self, model: nn.Module, *, optimizer: Optional[OptimizerSpec] = None, config: Any = None,
                 lr_scheduler: Optional[Callable] = None, device=None,
                 param_groups: Optional[Sequence[dict]] = None, process_group: Any = "auto",
                 init: Optional[Callable[[str, torch.Tensor], None]] = None, weights: Any = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"initialize needs an nn.Module, got {type(model).__name__}")
        _check_not_managed(model)
        cfg, spec = _resolve_config(config, optimizer)
        self.config: OffloadConfig = cfg
        self.spec: OptimizerSpec = spec
        self.rule = spec.rule(cfg)
        """The update rule (runtime/update_rule.py) the spec runs under this config."""
        self.module = model
        if process_group == "auto":  # under a launcher without a group: start it
            _announce(start_default_group("zero_offload.initialize", _rank_device(device, ranked=True),
                                          fix="call torch.distributed.init_process_group() first, or "
                                              "pass process_group=None to train this process alone"))
        pg = resolve_group(process_group, "initialize")
        if pg is not None and not self.rule.elementwise:
            raise ValueError(f"initialize: {self.rule.name} updates whole parameters, and data-parallel "
                             f"shards cut them; train it on one rank (process_group=None)")
        self.device = _rank_device(device, ranked=pg is not None)
        self._failed: Optional[BaseException] = None  # see [Note: failed engine]
        self.shard = Shards(pg, owner="engine", device=self.device, on_failure=self._fail,
                            refuse=self._refuse_if_failed)
        """This rank's place in the data-parallel group (rank 0 of 1 without one) and the
        collectives over it."""
        self._ranked = self.shard.world > 1
        self.dtype: torch.dtype = cfg.torch_dtype
        _check_model(model)
        self.regions = compiled_regions(model)
        """The model's compiled regions, each hooked as one unit (compiled.py, [Note: compiled
        regions])."""
        check_regions(self.regions, owner="zero_offload.initialize")
        self._compile_watch = CompileWatch(model, self.regions)
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise TypeError(
                f"lr_scheduler must be a callable taking the optimizer and returning a scheduler, "
                f"e.g. lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000); got "
                f"{type(lr_scheduler).__name__} (a scheduler built on another optimizer cannot "
                f"drive the engine's CPU optimizer)")

        # Partition and placement (pure; nothing allocated yet).
        chunk_numel = max(1, cfg.chunk_bytes // self.dtype.itemsize)
        self.partition: Partition = partition_parameters(model, chunk_numel=chunk_numel)
        if not any(s.trainable for s in self.partition.slots):
            raise ValueError("the model has no trainable parameter (requires_grad=True); the engine "
                             "trains parameters. Unfreeze some, or run inference without the engine")
        self._group_overrides, self._slot_group = _resolve_groups(param_groups, model, self.partition,
                                                                  spec, self.rule.hyper_keys)
        if self._ranked:  # before anything is allocated: a difference raises on every rank
            self.shard.check_settings(self._rank_settings(), owner="zero_offload.initialize")
        self._values = InitialValues(model, self.partition, init=init, weights=weights)
        self._values.check()  # before anything is allocated
        nvme_dir = cfg.nvme_dir
        if nvme_dir is not None:
            from .runtime.swap_io import free_stale_spaces, prepare_swap_dir
            prepare_swap_dir(nvme_dir, name="OffloadConfig.nvme_dir")  # created 0700 if missing
            if self._ranked:  # each rank its own swap files
                nvme_dir = prepare_swap_dir(os.path.join(nvme_dir, f"rank{self.shard.rank}"),
                                            name="OffloadConfig.nvme_dir")
            free_stale_spaces(nvme_dir)  # dead runs' spaces: before the free space is measured
        # grad_sync="final": the window's fp32 sum of each whole chunk's grads on the device.
        self._final_sync = cfg.grad_accum > 1 and not cfg.host_accum
        # Placement sees the shards this rank holds ([Note: data parallel]) and this rank's
        # share of the node's budgets; the plan refuses what does not fit, before anything is
        # allocated.
        budgets = rank_budgets(
            {Tier.GPU: cfg.gpu_budget, Tier.CPU: cfg.cpu_budget, Tier.NVME: cfg.nvme_budget},
            device=self.device, nvme_dir=nvme_dir, local_ranks=local_ranks() if self._ranked else 1,
            freed_host=_handed_over(self.partition))  # the model's own host copy is freed as chunks fill
        self.plan: PlacementPlan = plan_placement(PlacementRequest(
            chunks=tuple(ChunkNeed(numel=self.shard.span(c.numel)[2], dtype=self.dtype, trainable=c.trainable,
                                   shapes=() if self.rule.elementwise else tuple(s.shape for s in c.slots))
                         for c in self.partition.chunks),  # (a rule that is not elementwise: one rank, whole chunks)
            budgets=budgets, params=cfg.params, optimizer=cfg.optimizer, rule=self.rule,
            accum=cfg.host_accum, nvme_dir=cfg.nvme_dir, prefetch_depth=cfg.prefetch_depth,
            reserve=cfg.activation_reserve, gpu_optimizer=not self._ranked,
            fp32_grads_window=self._final_sync, ranks=self.shard.world,
            replicas=self._ranked and cfg.params == "gpu"))
        check_regions_fit(self.regions, self.partition, self.plan)  # [Note: compiled regions]
        # The swap file is preallocated to the NVMe budget: exactly what the plan needs (each
        # payload's slot rounded up to 4096, as the plan counts it).
        store_budgets = {**budgets.as_dict(), Tier.NVME: self.plan.need[Tier.NVME]}
        self.store = ChunkStore(StoreConfig(device=self.device, budgets=store_budgets,
                                            nvme_dir=nvme_dir, io_threads=cfg.io_threads,
                                            io_block_size=cfg.io_block_size,
                                            io_queue_depth=cfg.io_queue_depth))
        try:
            self._build(lr_scheduler)
        except BaseException:
            if getattr(self, "group", None) is not None:
                self.group.close()
            self.store.close()
            raise
        ref = weakref.ref(self)
        for m in model.modules():
            _OPEN_ENGINES[m] = ref
        self._guard.install()  # from here on every torch call reading a param is checked

    # ---- construction -----------------------------------------------------------------------

    def _rank_settings(self) -> dict:
        """What every rank of the group must pass alike (``check_ranks_agree``): the config but
        its per-rank fields (paths, budgets, threads, I/O tuning), the optimizer, the param groups,
        the device type and the model's parameters. Any of them differing makes the ranks'
        chunks, collectives or updates differ ([Note: data parallel])."""
        out: dict[str, Any] = {f"OffloadConfig.{k}": v for k, v in self.config.to_dict().items()
                               if k not in PER_RANK_FIELDS}
        out["the optimizer"] = self.spec.to_dict()
        out["the device type"] = self.device.type
        out["param_groups' hyperparameters"] = self._group_overrides
        out["param_groups' parameters"] = [(self.partition.slots[i].name, g)
                                           for i, g in sorted(self._slot_group.items())]
        out["the model's parameters (name, shape, trainable)"] = [
            (s.name, tuple(s.shape), s.trainable) for s in self.partition.slots]
        return out

    def _build(self, lr_scheduler) -> None:
        cfg = self.config
        lowp = self.dtype is not torch.float32
        self._lock = threading.RLock()
        self._phase = Phase.IDLE
        self._closed = False
        self._chunks: list[_Chunk] = []
        # Where each param/buffer came from: close() puts the trained values back there.
        # (A model built on the meta device gets its values back on the CPU.)
        self._origins = tuple((_home_of(s.param), s.param.dtype) for s in self.partition.slots)
        self._empty_origins = tuple((p, _home_of(p), p.dtype) for _, p in self.partition.empty)
        self._buffer_origins = tuple((m, name, _home_of(b)) for m in self.module.modules()
                                     for name, b in m._buffers.items() if b is not None)
        self._call_stack: list[_Call] = []  # the running module calls, innermost last
        self._records: dict = {}  # module -> its _ModuleRecord
        self._guard = ParamGuard(  # see param_guard.py; the placeholders exist from here on
            self.module, self.partition, self._chunks, device=self.device, dtype=self.dtype,
            lock=self._lock, phase=lambda: self._phase, hold=self._hold, unhold=self._unhold,
            innermost=lambda: self._call_stack[-1].record.module if self._call_stack else self.module,
            covers=self._covers, regions=[r.module for r in self.regions])
        # The scheduler factory runs before the weights move, so its errors change nothing.
        self.optimizer = _HyperParams(self.spec.hyperparameters(), self._group_overrides)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        if self.lr_scheduler is not None and not callable(getattr(self.lr_scheduler, "step", None)):
            raise TypeError(f"lr_scheduler(optimizer) returned {type(self.lr_scheduler).__name__}, "
                            f"which has no step() method")
        if self._ranked and cfg.bind_cores and self.device.type == "cuda":
            cores = rank_cores()
            if cores is not None:
                bind_to_cores(cores)  # before the CPU-Adam threads start: they inherit it
        payloads = PipelinePayloads(master="master" if lowp else "params",
                                    lowp="params" if lowp else None,
                                    accum="accum" if cfg.host_accum else None)
        self.scaler = LossScaler.from_config(cfg)
        self.group = ChunkGroup(self.store, hyper=self.optimizer, rule=self.rule,
                                payloads=payloads, shards=self.shard, staging=Staging.DEVICE,
                                window=cfg.grad_accum, clip=cfg.grad_clip, scaler=self.scaler,
                                overlap=cfg.overlap and cfg.grad_clip is None and self.scaler is None,
                                replicas=self._ranked and cfg.params == "gpu", owner="engine",
                                prefetch_depth=cfg.prefetch_depth,
                                threads=_adam_threads(cfg, self.device, ranked=self._ranked),
                                on_chunk_idle=self._chunk_ready)
        with torch.no_grad():
            # Chunk by chunk: the model's own weights are freed as their chunk fills, so host
            # memory peaks at the homes plus what is not yet copied, not homes + whole model.
            try:
                for layout, homes in zip(self.partition.chunks, self.plan.homes):
                    chunk = self._add_chunk(layout, homes)
                    self._load_initial(chunk)
                    self._chunks.append(chunk)
            except BaseException:
                self._give_weights_back()
                raise
        for name, p in self.partition.empty:
            set_values(p, torch.empty(p.shape, device=self.device, dtype=self.dtype))
        self._values.buffers()
        for m in self.module.modules():
            for bname, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[bname] = b.to(self.device)

        self.prefetcher = Prefetcher(  # [Note: holds]: it decides what is on the device when
            self.store, depth=cfg.prefetch_depth, hops=[("params", Tier.GPU)],
            ready=lambda cid: not self.group.busy(cid), park=PARKED_CHUNKS,
            keep_limit=keep_limit(self.plan.request),
            consumer=Consumer(map=self._materialize, unmap=self._unmap,
                              busy=lambda cid: self._phase is Phase.BACKWARD and bool(self._chunks[cid].awaiting),
                              reuse=lambda: self._phase is Phase.FORWARD and torch.is_grad_enabled()))


        self.global_step = 0
        self.skipped_steps = 0
        self._tokens: list[_BackwardToken] = []
        self._gathers: dict[int, Gather] = {}  # cid -> its all-gather issued ahead; [Note: collectives ahead]
        self.last_grad_norm: Optional[float] = None
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._window = StatsWindow(self._counters)

        self._hook_handles = []
        regions = {r.module for r in self.regions}
        inside = {m for r in regions for m in r.modules() if m is not r}
        for m in self.module.modules():
            if m in inside:  # traced with its region: the region's hooks hold its params
                continue
            slots = self.partition.module_slots(m, recurse=m in regions)
            if not slots:
                continue
            self._add_record(_ModuleRecord(
                module=m, slots=slots,
                chunks=tuple(dict.fromkeys(self._chunks[s.chunk] for s in slots))))
        for s in self.partition.slots:
            if s.trainable:
                self._hook_handles.append(s.param.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_landed, s)))

    def _add_record(self, rec: _ModuleRecord) -> None:
        self._records[rec.module] = rec
        self._hook_handles.append(rec.module.register_forward_pre_hook(
            outside_graph(functools.partial(self._pre_forward, rec)), with_kwargs=True))
        self._hook_handles.append(rec.module.register_forward_hook(
            outside_graph(functools.partial(self._post_forward, rec)), with_kwargs=True, always_call=True))

    def _add_chunk(self, layout: ChunkLayout, homes) -> _Chunk:
        specs = chunk_payloads(self.plan.request, self.plan.request.chunks[layout.index], homes)
        gslots = {}
        if layout.trainable:  # an elementwise rule's update covers the padding up to the next slot
            spans = update_spans(layout, align_to_params=not self.rule.elementwise)
            gslots = {s: GroupSlot(lo=s.offset, numel=s.numel, end=stop, name=s.name, index=s.index,
                                   group=self._slot_group.get(s.index, 0), shape=tuple(s.shape))
                      for s, (_, stop) in zip(layout.slots, spans)}
        g = self.group.add_chunk(specs, tuple(gslots.values()), whole=layout.numel)
        return _Chunk(layout=layout, g=g, gslots=gslots)

    def _give_weights_back(self) -> None:
        """Put the values of every chunk (the fp32 master, or the params payload for fp32 and
        frozen chunks) back into the model's parameters, on the device and in the dtype each had
        at initialize, chunk by chunk, each chunk's memory freed in every tier as soon as its
        values are out: host memory never holds the model's copy beside all the state (a 13B
        model's 51 GB of fp32 values on top of its pinned state was an OOM kill). Used when
        initialize fails part-way (the chunks loaded so far) and by ``close``: the store is
        closed right after."""
        self.group.drop_buffers()
        for chunk in self._chunks:
            flat = self.group.read_values(chunk.g, take=True)
            for s in chunk.layout.slots:
                device, dtype = self._origins[s.index]
                s.param.data = flat[s.offset:s.end].view(s.shape).to(device=device, dtype=dtype,
                                                                       copy=True)

    def _load_initial(self, chunk: _Chunk) -> None:
        """The chunk's first values (the model's, ``init``'s or the weights file's) written
        straight into its full-precision payload (this rank's shard of it), the working-dtype
        params rounded from it; then the model's own copies are let go."""
        layout = chunk.layout
        self.group.write_values(chunk.g, functools.partial(self._values.fill, layout))
        for s in layout.slots:
            set_values(s.param, self._guard.placeholders[s.index])

    # ---- data parallel ([Note: data parallel]) ----------------------------------------------

    def _refuse_if_failed(self) -> None:
        """Before a collective: a failed engine starts none, it raises why ([Note: failed engine])."""
        if self._failed is not None:
            self._check_open()

    def _fail(self, e: BaseException) -> None:
        """With several ranks, ``e`` escaped a collective or forward/backward/step: see
        [Note: failed engine]. The first error is kept."""
        if self._ranked and self._failed is None:
            self._failed = e

    def _failed_line(self, limit: int = 300) -> str:
        """"rank r of N stopped after an error (its first line, cut at ``limit``)" ("the engine
        ..." alone)."""
        e = self._failed
        text = str(e).splitlines()[0] if str(e) else ""
        if len(text) > limit:
            text = text[:limit - 3] + "..."
        who = f"rank {self.shard.rank} of {self.shard.world}" if self._ranked else "the engine"
        return f"{who} stopped after an error ({type(e).__name__}: {text})"

    def _gather_params(self, chunk: _Chunk, shard: torch.Tensor, *, ahead: bool) -> Gather:
        """The chunk's params on the device from this rank's ``shard`` (``ChunkGroup.params``)."""
        return self.group.params(chunk.g, shard, ahead=ahead)

    def _gather_ahead(self) -> None:
        """See [Note: collectives ahead]: the all-gather of the next chunk of the recorded order,
        issued now so that it runs while this chunk computes."""
        if self._gathers or self.prefetcher.depth == 0:
            return
        for cid in self.prefetcher.peek(1):
            chunk = self._chunks[cid]
            if chunk.buffer is not None or chunk.g.replica_fresh:
                return
            if chunk.layout.trainable:
                self.group.wait(chunk.g)  # the update writing its params shard must finish
            shard = self.prefetcher.use(cid)["params"]
            try:
                self._gathers[cid] = self._gather_params(chunk, shard, ahead=True)
            except BaseException:
                self.prefetcher.release(cid)  # the pin is this call's ([Note: failed engine])
                raise

    def _drop_gathers(self) -> None:
        """Forget the all-gathers issued ahead whose chunk was not used (the pass ended or the
        order changed): the device waits for them, their shards go back to the prefetcher."""
        gathers, self._gathers = self._gathers, {}
        try:
            for gathered in gathers.values():
                if self._failed is None:  # (failed: they may never end)
                    self.shard.finish(gathered)
        finally:  # every pin let go, also after a failed wait ([Note: failed engine])
            for cid in gathers:
                self.prefetcher.release(cid)

    # ---- forward ----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Run the model's forward with chunks paged in by hooks; returns what the model returns.
        Tensors in the inputs move to the compute device; floating-point ones are cast to the
        working dtype."""
        self._check_open()
        self._compile_watch.check()  # [Note: compiled regions]
        if self._phase is Phase.BACKWARD:
            self._finish_backward()
        args, kwargs = cast_inputs((args, kwargs), dtype=self.dtype, device=self.device)
        if self.device.type == "cuda":  # see [Note: fetch on completion]
            self.prefetcher.set_stream(torch.cuda.current_stream(self.device))
        self._drop_gathers()
        self.prefetcher.start_pass()
        self._set_phase(Phase.FORWARD)
        t0 = time.perf_counter()
        try:
            with self._guard.forward(), _range("zero_offload::forward"):
                out = self.module(*args, **kwargs)
            self._add_reads(self._guard.take_reads())
            return out
        except BaseException as e:
            self._fail(e)
            self._clean_up_after(e)
            raise self._guard.explain(e) from e
        finally:
            with self._lock:
                self._guard.end_forward()
            self._set_phase(Phase.IDLE)
            if not torch.is_grad_enabled():
                self._release_idle()  # no backward follows: go idle now
            self._span("forward", t0)

    # ---- external parameters ([Note: external parameters] in param_guard.py) ------------------

    def record_reads(self) -> None:
        """Make the next forward record again which module reads which parameter (the first one
        does by itself). Optional: a read first seen later is fetched anyway and attributed to
        the innermost running module with parameters; a recording forward attributes it to the
        exact module (shorter holds). That forward is slower (every parameter read is checked)."""
        self._check_open()
        self._guard.record_reads()

    def _covers(self, module: nn.Module) -> frozenset:
        """The slots ``module``'s own hooks hold and expect (its own and recorded external)."""
        rec = self._records.get(module)
        return frozenset(rec.slots + rec.external) if rec is not None else frozenset()

    def _add_reads(self, reads: dict) -> None:
        """Give each module whose forward read other modules' parameters (``reads``: module ->
        slots, from the guard) those reads."""
        for module, slots in reads.items():
            rec = self._records.get(module)
            new = rec is None
            if new:
                rec = _ModuleRecord(module=module, slots=(), chunks=())
            ext = tuple(s for s in slots if s not in rec.slots and s not in rec.external)
            rec.external += ext
            rec.chunks = tuple(dict.fromkeys(rec.chunks + tuple(self._chunks[s.chunk] for s in ext)))
            if new:
                self._add_record(rec)

    def _chunk_ready(self, cid: int) -> None:
        """On the CPU-Adam worker: see [Note: fetch on completion]."""
        if not self._closed:
            self.prefetcher.chunk_ready(cid)

    def _pre_forward(self, rec: _ModuleRecord, module, args, kwargs):
        if self._phase is Phase.IDLE:
            raise RuntimeError(
                f"{type(module).__name__} was called outside the engine: its parameters are paged "
                f"by zero_offload, so run the model through the engine (loss = engine(batch)), not "
                f"model(batch); use `with engine.gathered():` to read parameter values")
        with self._lock, _range("zero_offload::pre_forward"):
            call = _Call(record=rec)
            self._call_stack.append(call)  # first: see [Note: failed calls]
            for c in rec.chunks:
                self._hold(c)
                call.held += 1
            if not torch.is_grad_enabled():
                return None
            for s in rec.slots + rec.external:
                if s.trainable:
                    self._chunks[s.chunk].expect(s)
            call.token = token = _BackwardToken(record=rec)
            if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
                flat, spec = list(args), None  # the common case, without pytree's cost
            else:
                flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if not idx:
                return None
            wrapped = _PostBackward.apply(functools.partial(self._post_backward, token),
                                          *(flat[i] for i in idx))
            for i, t in zip(idx, wrapped):
                flat[i] = t
            return (tuple(flat), kwargs) if spec is None else tree_unflatten(flat, spec)

    def _post_forward(self, rec: _ModuleRecord, module, args, kwargs, output):
        if self._phase is Phase.IDLE:
            return None  # the pre-forward hook refused this call (always_call runs us anyway)
        with self._lock, _range("zero_offload::post_forward"):
            if not self._call_stack or self._call_stack[-1].record is not rec:
                return None  # this call's pre-forward never ran: see [Note: failed calls]
            call = self._call_stack.pop()
            for c in rec.chunks[:call.held]:
                self._unhold(c)
            token = call.token
            if token is None or output is None:
                return None
            if isinstance(output, torch.Tensor):
                tensors = [output] if output.requires_grad else []
            else:
                tensors = [t for t in _tensors_in(output) if t.requires_grad]
            if len(tensors) == 1:
                tensors[0].register_hook(functools.partial(self._pre_backward, token))  # cheaper
            elif tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(self._pre_backward, token), mode="any")
            return None

    # ---- chunk residency on the compute device ([Note: holds] in runtime/prefetch.py) -------

    def _hold(self, chunk: _Chunk) -> None:
        if self.prefetcher.hold(chunk.cid) and self._ranked:
            self._gather_ahead()  # [Note: collectives ahead]: when a chunk is materialized

    def _unhold(self, chunk: _Chunk) -> None:
        self.prefetcher.unhold(chunk.cid)

    def _maybe_release(self, chunk: _Chunk) -> None:
        """The chunk may go once nobody holds it: see [Note: backward hooks]."""
        self.prefetcher.settle(chunk.cid)

    def _release_idle(self) -> None:
        """Release every materialized chunk nobody holds (parked ones included), and drop the
        copies kept after forward: at the end of a backward, before updates may rewrite the
        params, and when the engine goes idle."""
        self._drop_gathers()
        self.prefetcher.release_idle()

    def _materialize(self, cid: int) -> None:
        """The prefetcher maps a chunk ([Note: holds]): its params on the device, the model's
        parameters pointing into them."""
        chunk = self._chunks[cid]
        t0 = time.perf_counter()
        gathered = self._gathers.pop(chunk.cid, None)
        pinned = gathered is not None  # (the gather issued ahead pinned the shard)
        try:
            if gathered is None:
                if chunk.layout.trainable:
                    self.group.wait(chunk.g)  # the update writing these params must finish
                shard = self.prefetcher.use(cid)["params"]
                pinned = True
                gathered = self._gather_params(chunk, shard, ahead=False)
            buf = self.shard.finish(gathered)  # issued ahead: this stream waits for it (device-side)
        except BaseException:
            if pinned:  # the chunk is not materialized: nothing else lets this pin go
                chunk.replica = None
                self.prefetcher.release(cid)
            raise
        self._guard.show(chunk, buf)
        chunk.buffer = buf
        if self.group.trace is not None:
            self.group.trace.span("use", t0, time.perf_counter(), cid=cid)

    def _unmap(self, cid: int) -> None:
        """The prefetcher lets a chunk go: the parameters hold their placeholders again."""
        chunk = self._chunks[cid]
        self._guard.hide(chunk)
        chunk.buffer = None

    def _clean_up_after(self, e: BaseException) -> None:
        """``_reset_holds`` after ``e`` escaped forward/backward; a failure of it is noted on
        ``e`` and fails the engine (its state is unknown), never raised over ``e``."""
        try:
            self._reset_holds()
        except Exception as cleanup:  # noqa: BLE001 - noted on the cause, which is raised
            if self._failed is None:
                self._failed = e
            e.add_note(f"zero_offload: the clean-up after this error failed too "
                       f"({type(cleanup).__name__}: {cleanup}); the engine takes no further calls")

    def _reset_holds(self) -> None:
        """After an exception in forward/backward: let every chunk go, forget pending calls."""
        with self._lock:
            self._call_stack.clear()
            self._tokens.clear()
            self._guard.reset()
            self.prefetcher.forget_holds()
            self.group.drop_backward()
            self._release_idle()

    # ---- backward ---------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the engine's bookkeeping (fp16: the loss is scaled first).
        Grads are not left in ``param.grad``: they go to the chunks' grad buffers."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward needs the scalar loss tensor, got "
                             f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}; "
                             f"reduce it first (e.g. loss.mean())")
        if self._phase is not Phase.IDLE:
            raise RuntimeError(f"engine.backward called during {self._phase.value}; call it after "
                               f"engine(...) has returned")
        check_backward()
        self._set_phase(Phase.BACKWARD)
        t0 = time.perf_counter()
        try:
            with _range("zero_offload::backward"):
                (loss * self.scaler.scale if self.scaler is not None else loss).backward()
        except BaseException as e:
            self._fail(e)
            self._clean_up_after(e)
            self._set_phase(Phase.IDLE)
            raise self._guard.explain(e) from e
        self._finish_backward()
        self._span("backward", t0)

    def _pre_backward(self, token: _BackwardToken, grad) -> None:
        with self._lock, _range("zero_offload::pre_backward"):
            if self._phase is Phase.IDLE:
                self._set_phase(Phase.BACKWARD)  # loss.backward() called directly
            if token.held or token.done:
                return
            token.held = True
            self._tokens.append(token)
            for c in token.record.chunks:
                self._hold(c)

    def _post_backward(self, token: _BackwardToken) -> None:
        with self._lock, _range("zero_offload::post_backward"):
            if not token.held:
                return
            token.held = False
            token.done = True
            for c in token.record.chunks:
                self._unhold(c)

    def _grad_landed(self, slot: ParamSlot, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        with self._lock, _range("zero_offload::grad_landed"):
            if self._phase is Phase.IDLE:
                self._set_phase(Phase.BACKWARD)
            chunk = self._chunks[slot.chunk]
            self.group.grad(chunk.gslots[slot], grad)  # staged, reduced and sent on when complete
            self._maybe_release(chunk)

    def _finish_backward(self) -> None:
        """End of backward: release what the hooks still hold, send incomplete grads down."""
        if self._phase is not Phase.BACKWARD:
            return
        try:
            self._finish_backward_locked()
        except BaseException as e:
            self._fail(e)
            raise

    def _finish_backward_locked(self) -> None:
        with self._lock, _range("zero_offload::finish_backward"):
            for token in self._tokens:
                if token.held:
                    self._post_backward(token)
            self._tokens.clear()
            self._guard.end_backward()
            self.group.end_backward()  # some expected grads never came (unused outputs)
            self._set_phase(Phase.IDLE)
            self._release_idle()

    # ---- step -------------------------------------------------------------------------------

    def step(self) -> bool:
        """End of a micro-batch. Every ``grad_accum``-th call ends the accumulation window:
        clip (exact global norm), update (fp16: skipped on inf/NaN, as GradScaler), advance the
        lr scheduler. Returns True when the parameters were updated by this window."""
        self._check_open()
        if self._phase is Phase.FORWARD:
            raise RuntimeError("engine.step called during forward")
        self._finish_backward()
        t0 = time.perf_counter()
        try:
            self._release_idle()  # updates rewrite params: nothing may keep pointing at old bytes
            with _range("zero_offload::step"):
                return self._step()
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._span("step", t0)

    def _step(self) -> bool:
        if not self.group.end_micro_batch():
            return False
        decision = self.group.end_window()  # [Note: exact step]
        if decision.norm is not None:
            self.last_grad_norm = decision.norm
        self.skipped_steps += decision.skipped
        if decision.updated:
            self._commit()
        return decision.updated

    def _commit(self) -> None:
        self.global_step += 1
        self.optimizer.note_update()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    # ---- inspection -------------------------------------------------------------------------

    @property
    def trace(self) -> Optional[Trace]:
        """A ``Trace`` recording the spans of every step (worker jobs, kernel calls, waits,
        phases), or None (the default: nothing recorded). Set one, run steps, ``write`` it."""
        return self.group.trace

    @trace.setter
    def trace(self, trace: Optional[Trace]) -> None:
        self.group.trace = trace

    @property
    def pipeline(self) -> StepPipeline:
        """The CPU-Adam worker (the chunk group's)."""
        return self.group.pipeline

    def _span(self, phase: str, t0: float) -> None:
        t1 = time.perf_counter()
        self._times[phase] += t1 - t0
        if self.group.trace is not None:
            self.group.trace.span(phase, t0, t1)

    def synchronize(self) -> None:
        """Wait until every queued update has run and every move has landed."""
        self._check_open()
        self.group.drain()
        self.store.synchronize()

    def _slot_values(self) -> Iterator[tuple]:
        """(slot, fp32 CPU tensor) for every slot, chunk by chunk."""
        self.synchronize()
        for chunk in self._chunks:
            flat = self.group.read_values(chunk.g).float()
            for s in chunk.layout.slots:
                yield s, flat[s.offset:s.end].view(s.shape)

    def state_dict(self, *, rank0_only: bool = False) -> dict:
        """The model's state dict with fp32 CPU tensors (tied parameters under each of their
        names, buffers included), loadable into a fresh copy of the model with
        ``load_state_dict``. Frozen parameters carry the working-dtype values (no master).
        Collective with several ranks; ``rank0_only``: the other ranks take part in the gathers
        but keep nothing and get ``{}`` (one copy of the model on the node, not one per rank;
        ``save_weights`` holds none)."""
        self._require_idle("state_dict")
        keep = not rank0_only or self.shard.rank == 0
        values = {s.index: v.clone() for s, v in self._slot_values() if keep}  # (every gather runs)
        if not keep:
            return {}
        out = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            slot = self.partition.slot_of(t)
            if slot is not None:
                out[key] = values[slot.index]
            elif isinstance(t, torch.Tensor):
                out[key] = t.detach().to("cpu", copy=True)
            else:
                out[key] = t
        return out

    def save_weights(self, path, *, dtype: Optional[torch.dtype] = None, shard_size="5GB") -> list:
        """Write the model's weights (fp32, or ``dtype``: torch.bfloat16 / torch.float16; buffers
        included) to directory ``path`` as safetensors shards of at most ``shard_size`` in the
        Hugging Face layout, chunk by chunk: host memory holds one shard and one chunk, not the
        model (``state_dict()`` holds it all). ``path`` must be new or an empty directory; the
        files appear there only when whole (see weights.py). Loads back with
        ``initialize(model, weights=path)``. Collective with several ranks (rank 0 writes).
        Returns the files written (rank 0; [] on the others)."""
        from .weights import ShardedWriter
        self._require_idle("save_weights")
        writer = refused = None
        try:
            writer = ShardedWriter(path, dtype=dtype, shard_size=shard_size, write=self.shard.rank == 0)
        except (ValueError, ImportError, OSError) as e:  # rank 0 checks the path: all ranks stop
            refused = e
        if not self.agree(refused is None):
            if refused is not None:
                raise refused
            raise RuntimeError(f"save_weights: rank 0 refused {path} (its error says why); nothing was written")
        try:
            for s, value in self._slot_values():  # every rank takes part in every gather
                writer.add(s.name, value)
            for key, t in self.module.state_dict(keep_vars=True).items():
                if isinstance(t, torch.Tensor) and self.partition.slot_of(t) is None:
                    writer.add(key, t)
            for file, attr in (("config.json", "config"), ("generation_config.json", "generation_config")):
                hf = getattr(self.module, attr, None)  # a Hugging Face model: from_pretrained reads these
                if callable(getattr(hf, "to_json_string", None)):
                    writer.add_text(file, hf.to_json_string())
        except BaseException:
            writer.abort()
            raise
        if not self.agree(writer.error is None) and writer.error is None:
            writer.abort()
            raise RuntimeError(f"save_weights: rank 0 could not write {path} (its error says why)")
        return writer.close()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[nn.Module]:
        """``with engine.gathered() as model:`` the parameters hold their current fp32 values on
        the CPU (read-only: changes are not written back). Outside forward/backward only."""
        self._require_idle("gathered")
        values = list(self._slot_values())
        with self._guard.lend(values):
            yield self.module

    def stats(self) -> EngineStats:
        """Counters since initialize (or ``reset_stats``); see ``EngineStats``."""
        w = {**self._window.read(), **self.group.counters()}
        fwd, bwd = self._times["forward"], self._times["backward"]
        fetch_stall, update_stall = w["stall_s"], w["wait_chunk_s"]
        compute = fwd + bwd
        uses = w["uses"]
        return EngineStats(
            steps=self.global_step, skipped_steps=self.skipped_steps, micro_steps=self.group.micro,
            bytes_held={t.value: self.store.bytes(t) for t in Tier},
            peak_bytes={t.value: self.store.peak_bytes(t) for t in Tier},
            bytes_moved={h.value: w[h] for h in Hop},
            forward_s=fwd, backward_s=bwd, step_s=self._times["step"],
            fetch_stall_s=fetch_stall, update_stall_s=update_stall,
            adam_s=w["adam_s"], worker_busy_s=w["busy_s"],
            gpu_stall_share=(fetch_stall + update_stall) / compute if compute > 0 else 0.0,
            prefetch_hit_rate=w["hits"] / uses if uses else 0.0,
            prefetch_ahead_rate=w["ahead"] / uses if uses else 0.0,
            loss_scale=self.scaler.scale if self.scaler is not None else None,
            last_grad_norm=self.last_grad_norm,
            lr=float(self.optimizer.param_groups[0]["lr"]))

    def reset_stats(self) -> None:
        """Restart the time and byte counters and the peaks (e.g. after warm-up steps)."""
        self.store.reset_peak()
        self._window.reset()
        self.group.reset_counters()
        self._times = {k: 0.0 for k in self._times}

    def _counters(self) -> dict:
        """The prefetcher's counters ``stats()`` reads through its window (the pipeline's and the
        store's come through the chunk group's)."""
        pf = self.prefetcher.stats
        return {"stall_s": pf.stall_s, "uses": pf.uses, "hits": pf.hits, "ahead": pf.ahead}

    # ---- state interface (checkpoint.py) --------------------------------------------------

    @property
    def micro_step(self) -> int:
        """Micro-batches done in the current accumulation window."""
        return self.group.micro

    @property
    def state_keys(self) -> tuple:
        """The keys ``chunk_state`` gives for a trainable chunk: "master" and the update rule's
        state ("exp_avg", "exp_avg_sq" for Adam)."""
        return tuple(self.group.state_names)

    def chunk_state(self, layout: ChunkLayout) -> dict:
        """CPU copies of one chunk's state: ``state_keys`` (fp32; bf16 moments widened) for a
        trainable chunk, "frozen" (working dtype) otherwise, and "steps" (one per slot).
        Collective with several ranks."""
        chunk = self._chunks[layout.index]
        if not layout.trainable:
            return {"frozen": self.group.read_values(chunk.g), "steps": chunk.steps}
        return self.group.state(chunk.g)  # (its slots are the layout's, in order)

    def load_chunk_state(self, layout: ChunkLayout, fill: Callable[[str, torch.Tensor], None],
                         steps: Sequence[int]) -> None:
        """Overwrite one chunk's state: ``fill(key, buf)`` writes the values of ``key`` (as
        ``chunk_state`` names them) into a zeroed flat buffer. bf16/fp16 working params become
        the master rounded, as the kernel writes them."""
        chunk = self._chunks[layout.index]
        if layout.trainable:
            self.group.load_state(chunk.g, fill, steps)
        else:
            self.group.write_values(chunk.g, functools.partial(fill, "frozen"))

    def agree(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (an all-reduce; ``ok`` itself without a group)."""
        return self.shard.agree(ok)

    def load_progress(self, *, global_step: int, skipped_steps: int) -> None:
        """Set the step counters (from a checkpoint); any accumulation window is dropped."""
        self.group.drop_window()
        self.global_step = int(global_step)
        self.skipped_steps = int(skipped_steps)

    # ---- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, path, *, client_state: Optional[dict] = None) -> None:
        """Write the whole training state to directory ``path`` atomically, with a manifest of
        every file's size and CRC-32 (see checkpoint.py). A full disk raises one
        ``CheckpointError`` naming the file and the free space; the previous checkpoint at
        ``path`` stays whole. ``client_state``: a JSON-serializable dict of your own (progress,
        settings) stored with it; ``zero_offload.runtime.checkpoint.read_client_state(path)``
        returns it without loading the checkpoint."""
        from .runtime.checkpoint import save_checkpoint
        self._require_idle("save_checkpoint")
        save_checkpoint(self, path, client_state=client_state)

    def load_checkpoint(self, path) -> None:
        """Restore the state written by ``save_checkpoint`` (the model must be the same
        architecture; the offload config may differ). Everything is checked first (files against
        the manifest, model, groups, scheduler): on ``CheckpointError`` (``CheckpointCorrupt``
        for a damaged file) the engine is unchanged."""
        from .runtime.checkpoint import load_checkpoint
        self._require_idle("load_checkpoint")
        load_checkpoint(self, path)

    # ---- misc -------------------------------------------------------------------------------

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    def close(self, *, write_back: bool = True) -> None:
        """Write the trained values back into the model's parameters (fp32 master, or the
        params payload for fp32 and frozen ones; on the device and in the dtype each parameter
        had at initialize, chunk by chunk; buffers back to their devices), then remove the hooks,
        stop the worker and free the store. The model then trains or runs as a plain module, or
        can be handed to ``initialize`` again. If the values cannot be read (a failed update or
        I/O), the parameters are left as zero-byte placeholders that raise on use, and close
        raises saying why (with ``with``: a warning, so the original error stays). Idempotent.
        With several ranks, after an error escaped forward, backward or step (or a collective
        failed) on this rank, nothing is written back (it needs every rank): everything is freed,
        the parameters stay placeholders, and close warns (never raises over that error); see
        [Note: failed engine].

        ``write_back=False``: everything is freed and nothing is written back; the parameters
        stay placeholders that raise on use. For a model whose values were saved already
        (``save_weights``, a checkpoint) and whose fp32 copy the host need not hold (with N
        ranks, every rank would get one)."""
        if not isinstance(write_back, bool):
            raise TypeError(f"engine.close(write_back=...) takes True or False, got {write_back!r}")
        self._close(write_back=write_back, quiet=False)

    def _close(self, *, write_back: bool, quiet: bool) -> None:
        if getattr(self, "_closed", True):
            return
        failure, failed, written = None, self._failed, False
        if write_back and failed is None:  # (failed: see [Note: failed engine])
            try:
                with torch.no_grad():
                    if self._phase is not Phase.IDLE:
                        self._reset_holds()
                        self._phase = Phase.IDLE
                    self._release_idle()
                    self.group.drain()
                    self._give_weights_back()
                    for p, device, dtype in self._empty_origins:
                        p.data = p.data.to(device=device, dtype=dtype)
                    for m, name, device in self._buffer_origins:
                        b = m._buffers.get(name)
                        if isinstance(b, torch.Tensor):
                            m._buffers[name] = b.to(device)
            except Exception as e:  # noqa: BLE001 - reported below, after the cleanup
                failure = e
            else:
                written = True
        self._guard.close(values_back=written, conceal=write_back)
        self._closed = True
        self.group.drop_buffers()
        for m in self.module.modules():
            ref = _OPEN_ENGINES.get(m)
            if ref is not None and ref() is self:
                del _OPEN_ENGINES[m]
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()
        try:
            self.group.close()
        finally:
            # After a failure, what the store's last moves raise is its consequence: not raised
            # over the error the caller saw (the store frees everything either way).
            with contextlib.suppress(Exception) if failed is not None else contextlib.nullcontext():
                self.store.close()
        if failed is not None and write_back:
            why = ("that needs every rank; stop every rank and restart" if self._ranked
                   else "restore them")
            warnings.warn(f"engine.close: {self._failed_line(100)}, so the trained values were not "
                          f"written back into the model: its parameters are left as zero-byte "
                          f"placeholders that raise on use ({why} from the last checkpoint)",
                          RuntimeWarning, stacklevel=3)
        if failure is not None:
            msg = (f"engine.close could not write the trained values back into the model "
                   f"({type(failure).__name__}: {failure}); its parameters are left as zero-byte "
                   f"placeholders that raise on use. Restore them from your last checkpoint "
                   f"(engine.save_checkpoint / state_dict taken before the failure)")
            if quiet:
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
            else:
                raise RuntimeError(msg) from failure

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # With an exception in flight a failed write-back only warns: the original error stays.
        self._close(write_back=True, quiet=exc_type is not None)

    def __del__(self):
        # Just release (maybe at interpreter shutdown): no write-back; see close().
        try:
            self._close(write_back=False, quiet=True)
        except Exception:
            pass

    def _set_phase(self, phase: Phase) -> None:
        if phase is self._phase:
            return
        if phase not in PHASES[self._phase]:
            raise RuntimeError(f"illegal engine transition {self._phase.value} -> {phase.value}")
        self._phase = phase

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed; build a new one with zero_offload.initialize")
        if self._failed is not None:  # see [Note: failed engine]
            why = ("the ranks' training states no longer match. Stop every rank and restart"
                   if self._ranked else "its state is unknown. Close it and restart")
            raise RuntimeError(f"engine: {self._failed_line()}, so it takes no further calls: {why} "
                               f"from the last checkpoint") from self._failed

    def _require_idle(self, what: str) -> None:
        self._check_open()
        if self._phase is Phase.BACKWARD:
            self._finish_backward()
        if self._phase is not Phase.IDLE:
            raise RuntimeError(f"engine.{what} cannot run during {self._phase.value}")


# --------------------------------------------------------------------------------------------
# helpers


class _HyperParams(torch.optim.Optimizer):
    """The optimizer handle an lr scheduler drives: one param group per engine param group (group 0:
    the defaults), holding the hyperparameters of the update rule (its ``hyper_keys``; Adam: lr,
    betas, eps, weight_decay) that every update reads when it is queued. Each group holds one
    empty placeholder tensor, not the model's parameters (their values live in the engine's
    chunks); it cannot step by itself (``engine.step()`` does)."""

    def __init__(self, defaults: dict, overrides: Sequence[dict] = ()):
        super().__init__([{"params": [torch.zeros(0)]}]
                         + [{"params": [torch.zeros(0)], **o} for o in overrides], defaults)

    def step(self, closure=None):
        raise RuntimeError("engine.optimizer holds hyperparameters only; call engine.step()")

    def note_update(self) -> None:
        """An update used these hyperparameters. torch's LRScheduler looks for this flag to tell
        a scheduler stepped after the optimizer from one stepped before it (and warns)."""
        self._opt_called = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine consumes grads itself


def _resolve_config(config, optimizer) -> tuple:
    if config is None:
        cfg, ds_spec = OffloadConfig(), None
    else:
        cfg, ds_spec = load_config(config)
    spec = optimizer if optimizer is not None else ds_spec
    if spec is None:
        raise ValueError("initialize needs an optimizer spec: optimizer=zero_offload.AdamW(lr=...) "
                         "(or zero_offload.Adam), or a DeepSpeed config with an 'optimizer' section")
    if not isinstance(spec, OptimizerSpec):
        raise TypeError(f"optimizer must be zero_offload.Adam(...) or zero_offload.AdamW(...), got "
                        f"{type(spec).__name__}; a torch.optim optimizer cannot be used (the engine "
                        f"builds the optimizer state itself, where the config places it)")
    return cfg, spec


def _resolve_groups(groups, model: nn.Module, partition: Partition, spec: OptimizerSpec,
                    keys: Sequence[str]) -> tuple:
    """Check ``initialize(param_groups=...)`` (before anything changes) and return
    (hyperparameter overrides per listed group, {slot index: group index}); group 0 is the
    default group of every trainable param not listed."""
    if groups is None:
        return [], {}
    if isinstance(groups, dict) or not isinstance(groups, (list, tuple)):
        raise TypeError(f"param_groups must be a list of dicts like [{{'params': [...], "
                        f"'weight_decay': 0.0}}], got {type(groups).__name__}")
    by_param = {id(s.param): s for s in partition.slots}
    by_name = {name: by_param[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    overrides, slot_group = [], {}
    for gi, group in enumerate(groups, start=1):
        where = f"param_groups[{gi - 1}]"
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"{where} must be a dict with a 'params' list (and optional "
                            f"{', '.join(keys)})")
        unknown = sorted(set(group) - {"params", *keys})
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; a group may set only "
                             f"{', '.join(keys)} (the optimizer kind comes from the spec)")
        override = {k: group[k] for k in keys if k in group}
        checked = dataclasses.replace(spec, **override)  # validates; the error names the field
        overrides.append({k: getattr(checked, k) for k in override})
        params = group["params"]
        if isinstance(params, (torch.Tensor, str)):
            params = [params]
        for p in params:
            if isinstance(p, str):
                slot = by_name.get(p)
                what = f"parameter name {p!r}"
            elif isinstance(p, torch.Tensor):
                slot = by_param.get(id(p))
                what = f"a parameter of shape {tuple(p.shape)}"
            else:
                raise TypeError(f"{where}['params'] holds {type(p).__name__}; list nn.Parameter "
                                f"objects of the model or their names")
            if slot is None:
                raise ValueError(f"{where}: {what} is not a parameter of the model; list "
                                 f"model.parameters() (or model.named_parameters() names)")
            if slot.index in slot_group and slot_group[slot.index] != gi:
                raise ValueError(f"{where}: parameter {slot.name!r} is already in "
                                 f"param_groups[{slot_group[slot.index] - 1}]; a parameter "
                                 f"belongs to one group")
            slot_group[slot.index] = gi
    return overrides, slot_group


def _adam_threads(cfg: OffloadConfig, device: torch.device, *, ranked: bool) -> Optional[int]:
    """CPU-Adam threads: ``OffloadConfig.threads``; with several ranks this rank's share of the
    node's cores (``threads_per_rank``); else by default every core this process may use minus
    two when a GPU is driven (the Python thread issuing kernels and the autograd/copy threads
    must not be preempted by the kernel's workers, or the GPU starves)."""
    if cfg.threads is not None:
        return cfg.threads
    if ranked:
        return threads_per_rank(device.type == "cuda")
    if device.type != "cuda":
        return None
    return max(1, available_cores() - 2)


def _rank_device(device, *, ranked: bool) -> torch.device:
    """The compute device: ``device``; by default CUDA when available (with several ranks GPU
    ``LOCAL_RANK``, as torchrun numbers them), else the CPU."""
    if device is None and ranked and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return _resolve_device(device)


def _announce(backend: "str | None") -> None:
    """One line on rank 0 when ``initialize`` started the default process group."""
    if backend is None:
        return
    import torch.distributed as dist
    if dist.get_rank() == 0:
        print(f"zero_offload.initialize: WORLD_SIZE={dist.get_world_size()} and no process group: "
              f"started the default one from the environment ({backend}); call "
              f"torch.distributed.init_process_group() before initialize to set it up yourself",
              file=sys.stderr, flush=True)


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported; use a CUDA device or 'cpu'")
    return dev


def _check_not_managed(model: nn.Module) -> None:
    """Refuse a model that an open engine manages (or that contains or is inside one)."""
    for m in model.modules():
        ref = _OPEN_ENGINES.get(m)
        engine = ref() if ref is not None else None
        if engine is not None and not engine._closed:
            what = "this model" if m is model else f"its submodule {type(m).__name__}"
            raise ValueError(f"{what} is already managed by an open zero_offload engine; call "
                             f"engine.close() first (it writes the trained values back into the "
                             f"model), then initialize again")


def _handed_over(partition: Partition) -> int:
    """Host bytes of the model's parameters that ``initialize`` frees (CPU tensors nothing but
    the parameter holds: a storage the caller also references stays resident and is not
    counted), so an "auto" host budget counts what is resident after the hand-over."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # pragma: no cover - a torch without it: count nothing
        return 0
    total = 0
    for s in partition.slots:
        p = s.param
        if p.device.type == "cpu":
            # The param holds its storage once; the temporary storage object once more.
            if use_count(p.untyped_storage()._cdata) <= 2:
                total += p.untyped_storage().nbytes()
    return total


def _home_of(t: torch.Tensor) -> torch.device:
    """Where ``close`` puts a tensor's values back: its device, the CPU for a meta tensor."""
    return torch.device("cpu") if t.is_meta else t.device


def _check_model(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; the engine trains "
                            f"floating-point parameters only")
        if p.grad is not None:
            raise ValueError(f"parameter {name!r} already has a .grad; call model.zero_grad("
                             f"set_to_none=True) before initialize")


def _tensors_in(obj) -> list:
    """Tensors in a module output (tensors, tuples/lists, dicts, dataclass-like outputs)."""
    flat, _ = tree_flatten(obj)
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif hasattr(x, "items") and callable(x.items):  # mappings pytree does not know
            out.extend(_tensors_in(dict(x.items())))
    return out
