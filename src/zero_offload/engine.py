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
lives where), a ``ChunkStore`` (bytes and tiers; placed over the ranks, and its GPU share grown
after a measured step, by runtime/share.py), a ``Prefetcher`` for the working params (which
also decides what stays on the device: [Note: holds] there), a ``ParamGuard`` (param_guard.py) and
a ``ChunkGroup`` (updates, over the CPU-Adam worker), whose ``GroupChunk`` is the one record of a
chunk (its layout and device buffer included), and ``ModuleHooks`` (module_hooks.py: one
``ModuleRecord`` per module that holds parameters directly or reads other modules' ones, [Note:
external parameters], or per compiled module, which holds its whole subtree's, [Note: compiled
regions] in compiled.py; [Note: backward hooks], [Note: failed calls]). It writes nothing onto the
user's modules or parameters but ``param.data``, the class of a parameter holding its
placeholder and its hooks, all undone by ``close``. The model's values go into the chunks and
back by ``Handover`` (initial_values.py, [Note: hand-over]); ``stats()`` reads
runtime/stats.py's ``PhaseStats``, checkpoints are runtime/checkpoint.py's.

The param guard owns what the parameters hold and how their reads are answered: [Note: parameter
data] (a placeholder, guarded, while a chunk is off the device), [Note: external parameters]
(reads outside the module holding the parameter, recorded; the hooks' ``ModuleRecord``s hold
them) and [Note: saved parameter views], all in param_guard.py.

Device residency ([Note: holds] in runtime/prefetch.py): the engine only holds a chunk (module
calls, backward, reads of the guard) and lets it go (``_hold``/``_unhold``); the prefetcher decides
when it is mapped (``_materialize``) and let go (``_unmap``): chunks nobody holds stay parked on
the device, and a copy let go in a forward with grad enabled is kept for backward, within
``placement.keep_limit``. ``_release_idle`` (end of backward, before a step's updates, idle) lets
every chunk nobody holds go and drops the kept copies.

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
shard of every payload, placement plans for the shards (alike on every rank: [Note: ranks agree
on placement] in runtime/placement.py), and the chunk group updates the rank's
part of each slot (``GroupSlot`` spans cut at the shard boundary). A chunk is used whole:
``_materialize`` fetches the rank's params shard (prefetched as on one GPU) and all-gathers the
chunk into a device buffer; backward accumulates the whole chunk's grads in a device buffer,
which the chunk group reduce-scatters (mean over the ranks, as DDP) into the rank's grads shard,
sent to the host as before ([Note: grad staging] in runtime/chunk_group.py). Clipping and the overflow check all-reduce the shards' sums of squares.
Every collective is issued by the caller's or autograd's thread (never the worker) in an order
all ranks share: the same modules run in the same order, and end-of-backward flushes go in chunk
order. Whole-model reads (``state_dict``, ``gathered``, ``close``, checkpoints) gather chunk by
chunk and are collective. ``params="gpu"`` keeps each chunk's gathered params as a replica on
every GPU (ZeRO-2 with offload), gathered again only after an update changed the shards, and
"auto" does where the whole state fits beside the replicas ([Note: replicas when all fits] in
runtime/placement.py); a chunk updated on the device is gathered right after its update
([Note: gathers after the update] in runtime/chunk_group.py).
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
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from .compiled import CompileWatch, check_backward, check_regions, check_regions_fit, compiled_regions
from .config import PER_RANK_FIELDS, OffloadConfig, OptimizerSpec, load_config
from .mixed_precision import LossScaler, cast_inputs
from .runtime.distributed import (announce_default_group, available_cores, bind_to_cores, cpu_threads,
                                  rank_cores, rank_device, resolve_group, start_default_group)
from .hyperparams import HyperParams
from .initial_values import Handover, InitialValues, handed_over_bytes
from .module_hooks import ModuleHooks
from .param_guard import PHASES, ParamGuard, Phase
from .runtime.chunk_group import ChunkGroup, GroupChunk, GroupSlot, Staging
from .runtime.parking import ParkReport, Parking
from .runtime.partition import ChunkLayout, Partition, partition_parameters, update_spans
from .runtime.pipeline import PipelinePayloads, StepPipeline
from .runtime.placement import (PARKED_CHUNKS, ChunkNeed, Measured, PlacementPlan, PlacementRequest,
                                chunk_payloads, keep_limit)
from .runtime.prefetch import Consumer, Prefetcher
from .runtime.shards import Gather, Shards
from .runtime.share import MeasuredShare, abandon, place
from .runtime.store import ChunkStore, Tier
from .runtime.stats import EngineStats, PhaseStats
from .runtime.trace import Trace, profile_range

__all__ = ["Engine", "EngineStats", "Phase", "initialize"]


# --------------------------------------------------------------------------------------------
# Records


_OPEN_ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
"""Every module of a model an open engine manages -> that engine (weakly): initialize refuses
a model, or a model containing or inside one, that an open engine holds."""


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
        optimizer: ``zero_offload.AdamW(...)``, ``Adam``, ``SGD``, ``Lion``, ``Adafactor`` or
            ``Muon`` (a spec; the engine builds the state). May be omitted when ``config`` is a
            DeepSpeed config with an ``optimizer`` section.
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
            drive each (e.g. ``LambdaLR`` with one function per group). A group may name its own
            optimizer, ``{"params": [...], "optimizer": zo.AdamW(...)}`` (its keys are then that
            spec's): torch's Muon recipe, Muon on the matrices and AdamW on the rest.
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
            announce_default_group(
                start_default_group("zero_offload.initialize", rank_device(device, ranked=True),
                                    fix="call torch.distributed.init_process_group() first, or "
                                        "pass process_group=None to train this process alone"),
                owner="zero_offload.initialize", before="initialize")
        pg = resolve_group(process_group, "initialize")
        self.device = rank_device(device, ranked=pg is not None)
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
        self._group_overrides, self._slot_group, rules = _resolve_groups(param_groups, model, self.partition,
                                                                         spec, cfg)
        # Chunks by update rule (param groups may name their own optimizer); a rule that is not
        # elementwise gets shards cut at parameter boundaries ([Note: whole parameters]).
        rule_of = {s.index: rules[self._slot_group.get(s.index, 0)] for s in self.partition.slots}
        _check_shapes(self.partition, rule_of)
        self.partition = partition_parameters(
            model, chunk_numel=chunk_numel, key=lambda name, p: rule_of[self.partition.slot_of(p).index],
            world=self.shard.world, whole=lambda rule: not rule.elementwise)
        if self._ranked:  # before anything is allocated: a difference raises on every rank
            self.shard.check_settings(self._rank_settings(), owner="zero_offload.initialize")
        # grad_sync="final": the window's fp32 sum of each whole chunk's grads on the device.
        self._final_sync = cfg.grad_accum > 1 and not cfg.host_accum
        self.init_seconds: dict[str, float] = {}
        """Where ``initialize`` spent its time, in seconds: "plan" (the values checked, the budgets,
        the plan, the store), "homes" (the homes allocated: host memory touched and pinned, NVMe
        slots; the wait for the thread making the host homes ahead: its own seconds are "homes_touch"
        and "homes_pin"), "values" (the first values drawn or read and written into the chunks),
        "rest" (the hooks, the prefetcher, buffers); "total" from the start."""
        t_place = time.perf_counter()
        self.store = self._place(init=init, weights=weights)  # and self._values, self.plan
        self.init_seconds["plan"] = time.perf_counter() - t_place
        try:
            self._build(lr_scheduler)
        except BaseException:
            abandon(self.store, getattr(self, "group", None))  # (the group, or the store alone)
            raise
        ref = weakref.ref(self)
        for m in model.modules():
            _OPEN_ENGINES[m] = ref
        self._guard.install()  # from here on every torch call reading a param is checked
        self.init_seconds["total"] = time.perf_counter() - t_place
        self.init_seconds["rest"] = self.init_seconds["total"] - sum(
            self.init_seconds.get(k, 0.0) for k in ("plan", "homes", "values"))

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

    @staticmethod
    def _overlaps(cfg: OffloadConfig) -> bool:
        """Each chunk is updated as its grads land ([Note: exact step]): no clipping, no fp16 loss
        scaling (a scaler exists exactly for fp16), ``overlap`` on."""
        return cfg.overlap and cfg.grad_clip is None and cfg.torch_dtype is not torch.float16

    def _place(self, *, init, weights) -> ChunkStore:
        """The initial values checked (``self._values``), the budgets, the plan (``self.plan``) and
        the store, before anything is allocated: runtime/share.py's ``place`` ([Note: ranks agree
        on placement] in runtime/placement.py, [Note: ranks raise together] in runtime/shards.py)."""
        cfg = self.config

        def prepare() -> int:
            self._values = InitialValues(self.module, self.partition, init=init, weights=weights)
            self._values.check()  # before anything is allocated
            return handed_over_bytes(self.partition)

        def request(**kw) -> PlacementRequest:
            return PlacementRequest(
                **kw, params=cfg.params, optimizer=cfg.optimizer, rule=self.rule,
                accum=cfg.host_accum, nvme_dir=cfg.nvme_dir, prefetch_depth=cfg.prefetch_depth,
                gpu_optimizer=True, fp32_grads_window=self._final_sync, ranks=self.shard.world,
                replicas="auto", host_grads=cfg.host_grads,  # (params="gpu" with ranks: always)
                window_slots=cfg.grads_window, host_params=cfg.host_params,
                # the updates wait for the window's decision and read the grads themselves
                grads_wait=not self._overlaps(cfg) and not cfg.host_accum)

        self.plan, store = place(
            self.shard, device=self.device, reserve=cfg.activation_reserve, nvme_dir=cfg.nvme_dir,
            budgets={Tier.GPU: cfg.gpu_budget, Tier.CPU: cfg.cpu_budget, Tier.NVME: cfg.nvme_budget},
            prepare=prepare, request=request,
            needs=lambda r: [self._need(c, r) for c in self.partition.chunks],
            check=lambda plan: check_regions_fit(self.regions, self.partition, plan),  # [Note: compiled regions]
            io=dict(io_threads=cfg.io_threads, io_block_size=cfg.io_block_size,
                    io_queue_depth=cfg.io_queue_depth))
        return store

    def _need(self, layout: ChunkLayout, rank: Optional[int] = None) -> ChunkNeed:
        """What placement must know of a chunk: a rank's shard of it (``rank``: default this one),
        and for a rule that is not elementwise the shapes of the params that rank holds (its state
        may be sized by them)."""
        rank = self.shard.rank if rank is None else rank
        k = self.shard.span(layout.numel)[2]
        if not layout.trainable:
            return ChunkNeed(numel=k, dtype=self.dtype, trainable=False)
        rule = layout.key
        mine = None if rule.elementwise else tuple(
            tuple(s.shape) for s in layout.slots if s.offset // k == rank)
        return ChunkNeed(numel=k, dtype=self.dtype, shapes=mine, rule=rule)

    def _build(self, lr_scheduler) -> None:
        cfg = self.config
        lowp = self.dtype is not torch.float32
        self._lock = threading.RLock()
        self._phase = Phase.IDLE
        self._closed = False
        # The scheduler factory runs before the weights move, so its errors change nothing.
        self.optimizer = HyperParams(self.spec.hyperparameters(), self._group_overrides)
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
                                overlap=self._overlaps(cfg),
                                replicas=self.plan.request.replicas is True, owner="engine",
                                prefetch_depth=cfg.prefetch_depth,
                                threads=cpu_threads(cfg.threads, self.device, ranked=self._ranked),
                                on_chunk_idle=self._chunk_ready)
        self._share = MeasuredShare(self.group, self.device, plan=lambda: self.plan, owner="engine",
                                    set_plan=functools.partial(setattr, self, "plan"), on_failure=self._fail,
                                    need=lambda i: self._need(self.partition.chunks[i]))
        self._hooks = ModuleHooks(  # module_hooks.py; installed once the chunks are built
            self.module, self.partition, self.group.chunks, lock=self._lock, phase=lambda: self._phase,
            to_backward=self._to_backward, hold=self._hold, unhold=self._unhold,
            resident=lambda chunk: self.prefetcher.resident(chunk.cid),
            regions=[r.module for r in self.regions])
        self._guard = ParamGuard(  # see param_guard.py; the placeholders exist from here on
            self.module, self.partition, self.group.chunks, device=self.device, dtype=self.dtype,
            lock=self._lock, phase=lambda: self._phase, hold=self._hold, unhold=self._unhold,
            innermost=self._hooks.innermost, covers=self._hooks.covers, regions=self._hooks.regions)
        # The model's values go into the chunks (initial_values.py, [Note: hand-over]).
        self._handover = Handover(self.module, self.partition, self._values, self._guard.placeholders)
        with torch.no_grad(), self.shard.reusing_scratch(), \
                self._values.drawing(cpu_threads(cfg.threads, self.device, ranked=self._ranked) or available_cores(),
                                     ranked=self._ranked):
            spent = {"homes": 0.0, "values": 0.0}
            # The host homes come from another thread, ahead of the chunk being filled ([Note:
            # homes ahead] in runtime/pinned_pool.py). This rank's own payloads: at most what
            # the plan counted ([Note: ranks agree on placement]).
            specs = [chunk_payloads(self.plan.request, self._need(layout), homes)
                     for layout, homes in zip(self.partition.chunks, self.plan.homes)]
            try:
                with self.group.homes_ahead(specs) as ahead:
                    for layout, payloads in zip(self.partition.chunks, specs):
                        t0 = time.perf_counter()
                        chunk = self._add_chunk(layout, payloads)
                        t1 = time.perf_counter()
                        self._handover.take(self.group, chunk)
                        spent["homes"] += t1 - t0
                        spent["values"] += time.perf_counter() - t1
            except BaseException:
                self._handover.give_back(self.group)
                raise
        self.init_seconds.update(spent, homes_touch=ahead.clock["touch"], homes_pin=ahead.clock["pin"])
        self._handover.take_rest(self.device, self.dtype)

        self.prefetcher = Prefetcher(  # [Note: holds]: it decides what is on the device when
            self.store, depth=cfg.prefetch_depth, hops=[("params", Tier.GPU)],
            ready=lambda cid: not self.group.busy(cid), park=PARKED_CHUNKS,
            keep_limit=keep_limit(self.plan.request),
            consumer=Consumer(map=self._materialize, unmap=self._unmap,
                              busy=lambda cid: self._phase is Phase.BACKWARD and bool(self.group.chunks[cid].awaiting),
                              reuse=lambda: self._phase is Phase.FORWARD and torch.is_grad_enabled(),
                              resident=self.group.params_resident))
        self._parking = Parking(self.store, self.group, self.prefetcher, self.shard, owner="engine")

        self.global_step = 0
        self.skipped_steps = 0
        self._ahead: Optional[tuple[GroupChunk, Gather]] = None  # [Note: collectives ahead]
        """The chunk whose all-gather was issued ahead (one at a time), and that gather."""
        self.last_grad_norm: Optional[float] = None
        self._stats = PhaseStats(self.store, self.group, self.prefetcher)

        self._hooks.install()
        self._grad_hooks = []
        for s in self.partition.slots:
            if s.trainable:
                self._grad_hooks.append(s.param.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_landed, self.group.chunks[s.chunk].slot(s.index))))

    def _add_chunk(self, layout: ChunkLayout, specs) -> GroupChunk:
        gslots = []
        rule = layout.key if layout.trainable else None
        if layout.trainable:  # an elementwise rule's update covers the padding up to the next slot
            spans = update_spans(layout, align_to_params=not rule.elementwise)
            gslots = [GroupSlot(lo=s.offset, numel=s.numel, end=stop, name=s.name, index=s.index,
                                group=self._slot_group.get(s.index, 0), shape=tuple(s.shape))
                      for s, (_, stop) in zip(layout.slots, spans)]
        return self.group.add_chunk(specs, gslots, whole=layout.numel, layout=layout, rule=rule)

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

    def _gather_ahead(self) -> None:
        """See [Note: collectives ahead]: the all-gather of the next chunk of the recorded order,
        issued now so that it runs while this chunk computes."""
        if self._ahead is not None or self.prefetcher.depth == 0:
            return
        for cid in self.prefetcher.peek(1):
            chunk = self.group.chunks[cid]
            if chunk.buffer is not None or chunk.replica_fresh:
                return
            if chunk.layout.trainable:
                self.group.wait(chunk)  # the update writing its params shard must finish
            shard = self.prefetcher.use(cid)["params"]
            try:
                self._ahead = (chunk, self.group.params(chunk, shard, ahead=True))
            except BaseException:
                self.prefetcher.release(cid)  # the pin is this call's ([Note: failed engine])
                raise

    def _drop_gathers(self) -> None:
        """Forget the all-gather issued ahead if its chunk was not used (the pass ended or the
        order changed): the device waits for it, its shard goes back to the prefetcher."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        try:
            if self._failed is None:  # (failed: it may never end)
                self.shard.finish(ahead[1])
        finally:  # the pin let go, also after a failed wait ([Note: failed engine])
            self.prefetcher.release(ahead[0].cid)

    # ---- forward ----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Run the model's forward with chunks paged in by hooks; returns what the model returns.
        Tensors in the inputs move to the compute device; floating-point ones are cast to the
        working dtype."""
        self._check_open()
        self._parking.check("forward")
        self._compile_watch.check()  # [Note: compiled regions]
        if self._phase is Phase.BACKWARD:
            self._finish_backward()
        args, kwargs = cast_inputs((args, kwargs), dtype=self.dtype, device=self.device)
        try:  # a first forward out of memory runs again with the share on the host ([Note: unmeasured share])
            return self._share.forward(lambda: self._forward(args, kwargs))
        except BaseException as e:
            raise self.plan.unmeasured_oom(self._guard.explain(e)) from e

    def _forward(self, args, kwargs):
        if self.device.type == "cuda":  # see [Note: fetch on completion]
            self.prefetcher.set_stream(torch.cuda.current_stream(self.device))
        self._drop_gathers()
        self.prefetcher.start_pass()
        self._set_phase(Phase.FORWARD)
        t0 = time.perf_counter()
        try:
            views = not all(self.group.params_resident(c.cid) for c in self.group.chunks)
            with self._guard.forward(views=views), profile_range("zero_offload::forward"):
                out = self.module(*args, **kwargs)
            if torch.is_grad_enabled():
                self._hooks.watch_output(out)
            self._hooks.add_reads(self._guard.take_reads())
            return out
        except BaseException as e:
            self._fail(e)
            self._clean_up_after(e)
            raise
        finally:
            with self._lock:
                self._guard.end_forward()
            self._set_phase(Phase.IDLE)
            if not torch.is_grad_enabled():
                self._release_idle()  # no backward follows: go idle now
            self._stats.span("forward", t0)

    # ---- external parameters ([Note: external parameters] in param_guard.py) ------------------

    def record_reads(self) -> None:
        """Make the next forward record again which module reads which parameter (the first one
        does by itself). Optional: a read first seen later is fetched anyway and attributed to
        the innermost running module with parameters; a recording forward attributes it to the
        exact module (shorter holds). That forward is slower (every parameter read is checked)."""
        self._check_open()
        self._guard.record_reads()

    def _chunk_ready(self, cid: int) -> None:
        """On the CPU-Adam worker: see [Note: fetch on completion]."""
        if not self._closed:
            self.prefetcher.chunk_ready(cid)

    # ---- chunk residency on the compute device ([Note: holds] in runtime/prefetch.py) -------

    def _hold(self, chunk: GroupChunk) -> None:
        if self.prefetcher.hold(chunk.cid) and self._ranked:
            self._gather_ahead()  # [Note: collectives ahead]: when a chunk is materialized

    def _unhold(self, chunk: GroupChunk) -> None:
        self.prefetcher.unhold(chunk.cid)

    def _maybe_release(self, chunk: GroupChunk) -> None:
        """The chunk may go once nobody holds it: see [Note: backward hooks] in module_hooks.py."""
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
        chunk = self.group.chunks[cid]
        t0 = time.perf_counter()
        gathered = None
        if self._ahead is not None and self._ahead[0] is chunk:
            gathered, self._ahead = self._ahead[1], None
        pinned = gathered is not None  # (the gather issued ahead pinned the shard)
        try:
            if gathered is None:
                if chunk.layout.trainable:
                    self.group.wait(chunk)  # the update writing these params must finish
                shard = self.prefetcher.use(cid)["params"]
                pinned = True
                gathered = self.group.params(chunk, shard, ahead=False)
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
        chunk = self.group.chunks[cid]
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
            self._hooks.reset()
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
        self._parking.check("backward")
        if self._phase is not Phase.IDLE:
            raise RuntimeError(f"engine.backward called during {self._phase.value}; call it after "
                               f"engine(...) has returned")
        check_backward()
        self._share.before_backward()  # the room backward needs ([Note: unmeasured share])
        self._set_phase(Phase.BACKWARD)
        t0 = time.perf_counter()
        try:
            with profile_range("zero_offload::backward"):
                (loss * self.scaler.scale if self.scaler is not None else loss).backward()
        except BaseException as e:
            self._fail(e)
            self._clean_up_after(e)
            self._set_phase(Phase.IDLE)
            raise self.plan.unmeasured_oom(self._guard.explain(e)) from e
        self._finish_backward()
        self._stats.span("backward", t0)

    def _to_backward(self) -> None:
        """A backward hook ran: enter backward if idle (``loss.backward()`` called directly)."""
        if self._phase is Phase.IDLE:
            self._set_phase(Phase.BACKWARD)

    def _grad_landed(self, slot: GroupSlot, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        with self._lock, profile_range("zero_offload::grad_landed"):
            self._to_backward()
            self.group.grad(slot, grad)  # staged, reduced and sent on when complete
            chunk = self.group.chunks[slot.cid]
            if not chunk.awaiting:  # (busy while grads are awaited: nothing to settle before)
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
        with self._lock, profile_range("zero_offload::finish_backward"):
            self._hooks.end_backward()
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
        self._parking.check("step")
        if self._phase is Phase.FORWARD:
            raise RuntimeError("engine.step called during forward")
        self._finish_backward()
        t0 = time.perf_counter()
        try:
            self._release_idle()  # updates rewrite params: nothing may keep pointing at old bytes
            with profile_range("zero_offload::step"):
                return self._step()
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._stats.span("step", t0)

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
        if (measured := self._share.measure()) is not None:  # [Note: measured share]: once, on CUDA
            self.grow_share(measured)

    def grow_share(self, measured: Measured) -> PlacementPlan:
        """Grow the GPU share of the optimizer by what ``measured`` leaves free (placement.py,
        [Note: measured share]; the first step does this on CUDA), between windows. A chunk whose
        move fails stays on the host with the ones after it (``plan.report()`` says so). Returns
        the new plan. Collective with ranks: each passes its own ``measured``, every rank ends with
        the same share ([Note: ranks agree on placement]). runtime/share.py's ``grow`` does it."""
        self._check_open()
        self._require_idle("grow_share")
        if self.group.micro:
            raise RuntimeError("grow_share: call it between accumulation windows (after step())")
        return self._share.grow(measured, owner="engine.grow_share")

    # ---- park and resume ([Note: parking] in runtime/parking.py) -----------------------------

    @property
    def parked(self) -> Optional[str]:
        """Where ``park`` moved the device state ("cpu" or "nvme"); None when not parked."""
        return self._parking.where

    def park(self, target: str = "auto") -> ParkReport:
        """Move every byte the engine keeps on the compute device (params placed there, the
        optimizer's GPU share with its grads, params copies paged in or fetched ahead, replicas,
        the model's buffers) to host memory or NVMe, and give the memory back to the driver
        (``torch.cuda.empty_cache()``): e.g. to lend the GPU to an inference engine between RL
        updates. ``resume()`` brings it back; the next step equals one without the round trip.
        ``target``: "cpu", "nvme" (a parking file in ``OffloadConfig.nvme_dir``) or "auto" (host
        memory when it holds the state, else NVMe when configured). Between steps only: refused,
        nothing changed, during forward/backward, while an accumulation window is open, or when
        parked already. While parked, forward/backward/step raise and parameters read outside
        the engine raise as always; ``gathered()``, ``state_dict()``, ``save_weights``,
        checkpoints (save and load) and ``close()`` work. Collective with several ranks."""
        self._check_open()
        refusal = self.group.open_window()
        if self._phase is not Phase.IDLE:
            refusal = f"called during {self._phase.value}; park between steps (after engine.step())"
        elif refusal is not None:
            refusal += "; park after the engine.step() that ends the window"
        return self._parking.park(target, refusal=refusal, quiesce=self._quiesce, tensors=[
            b for m in self.module.modules() for b in m._buffers.values() if isinstance(b, torch.Tensor)])

    def resume(self, *, keep_host_memory: bool = False) -> ParkReport:
        """Bring back what ``park`` moved, where it was (the chunks homed on the device and the
        GPU share, the replicas, the model's buffers, and the look-ahead of the next forward).
        Raises, still parked, when the device has less free memory than the state needs (free
        it first: e.g. put the inference engine to sleep). ``keep_host_memory``: the pinned host
        memory of a park on "cpu" stays reserved for the next park, which then only copies
        (pinning fresh memory is most of a park's time; the host holds it meanwhile: freed by a
        ``resume()`` without it, a park on "nvme", or ``close()``). Collective with several
        ranks."""
        self._check_open()
        return self._parking.resume(keep_host_memory=keep_host_memory)

    def _quiesce(self) -> None:
        """Before a park: every update done, every chunk let go of on the device."""
        self.group.drain()
        self._release_idle()

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

    def synchronize(self) -> None:
        """Wait until every queued update has run and every move has landed."""
        self._check_open()
        self.group.synchronize()

    def _slot_values(self) -> Iterator[tuple]:
        """(slot, fp32 CPU tensor) for every slot, chunk by chunk."""
        self.synchronize()
        for chunk in self.group.chunks:
            flat = self.group.read_values(chunk).float()
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
        if not self.shard.agree(refused is None):
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
        if not self.shard.agree(writer.error is None) and writer.error is None:
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
        return self._stats.read(steps=self.global_step, skipped_steps=self.skipped_steps,
                                loss_scale=self.scaler.scale if self.scaler is not None else None,
                                last_grad_norm=self.last_grad_norm,
                                lr=float(self.optimizer.param_groups[0]["lr"]),
                                placement={"rank": self.shard.rank, **self.plan.report()})

    def reset_stats(self) -> None:
        """Restart the time and byte counters and the peaks (e.g. after warm-up steps)."""
        self._stats.reset()

    # ---- state interface (checkpoint.py: chunk_state/load_chunk_state read the group) --------

    @property
    def micro_step(self) -> int:
        """Micro-batches done in the current accumulation window."""
        return self.group.micro

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
                    self._handover.give_back(self.group)
                    self._handover.give_rest_back()
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
        self._hooks.remove()
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()
        # After a failure, what the store's last moves raise is its consequence: not raised over
        # the error the caller saw ([Note: failed engine]).
        self.group.close(store=True, quiet=failed is not None)
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
        raise TypeError(f"optimizer must be zero_offload.Adam(...) or zero_offload.AdamW(...) (or SGD, Lion, "
                        f"Adafactor, Muon: a spec), got "
                        f"{type(spec).__name__}; a torch.optim optimizer cannot be used (the engine "
                        f"builds the optimizer state itself, where the config places it)")
    return cfg, spec


def _resolve_groups(groups, model: nn.Module, partition: Partition, spec: OptimizerSpec,
                    config: OffloadConfig) -> tuple:
    """Check ``initialize(param_groups=...)`` (before anything changes) and return
    (hyperparameters per listed group, {slot index: group index}, the update rule of each group,
    group 0 first); group 0 is the default group of every trainable param not listed. A group may
    name its own optimizer spec (``"optimizer": zo.AdamW(...)``): its hyperparameters are that
    spec's, with the group's overrides."""
    rules = [spec.rule(config)]
    if groups is None:
        return [], {}, rules
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
                            f"{', '.join(rules[0].hyper_keys)}, or 'optimizer': a spec of its own)")
        own = group.get("optimizer", spec)
        if not isinstance(own, OptimizerSpec):
            raise TypeError(f"{where}['optimizer'] must be a zero_offload optimizer spec (e.g. "
                            f"zo.AdamW(lr=3e-4)), got {type(own).__name__}")
        keys = own.rule(config).hyper_keys
        unknown = sorted(set(group) - {"params", "optimizer", *keys})
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; a group may set only "
                             f"{', '.join(keys)} (the optimizer kind comes from the spec, or from the "
                             f"group's 'optimizer')")
        override = {k: group[k] for k in keys if k in group}
        checked = dataclasses.replace(own, **override)  # validates; the error names the field
        rules.append(checked.rule(config))
        overrides.append({k: getattr(checked, k) for k in override} if own is spec
                         else {**checked.hyperparameters(), "optimizer": checked.to_dict()["type"]})
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
    return overrides, slot_group, rules


def _check_shapes(partition: Partition, rule_of: dict) -> None:
    """Every trainable param's rule can update its shape (Muon: 2-D only), else one error naming
    the param and the way out."""
    from .runtime.update_rule import shape_problem
    for s in partition.slots:
        problem = shape_problem(rule_of[s.index], tuple(s.shape)) if s.trainable else None
        if problem is not None:
            raise ValueError(f"initialize: parameter {s.name!r} of shape {tuple(s.shape)} is in a "
                             f"{rule_of[s.index].name} group, but {problem}; put it in a param group "
                             f"with another optimizer: param_groups=[{{'params': [...], 'optimizer': "
                             f"zo.AdamW(...)}}] (torch's Muon recipe: AdamW for embeddings, norms, "
                             f"biases and the head)")


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


def _check_model(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; the engine trains "
                            f"floating-point parameters only")
        if p.grad is not None:
            raise ValueError(f"parameter {name!r} already has a .grad; call model.zero_grad("
                             f"set_to_none=True) before initialize")
