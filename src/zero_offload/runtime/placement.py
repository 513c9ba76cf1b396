"""Where each chunk's payloads live (home tiers), and whether that fits the budgets: one planner
for both front ends. A front end says what it needs in a ``PlacementRequest`` (its chunks, this
rank's budgets from ``rank_budgets``, where it wants params and optimizer state); nothing of its
config is read here. ``plan_placement`` gives a ``PlacementPlan``: a home per payload of every
chunk (``PlacementPlan.payloads``: the store's ``PayloadSpec`` of each), or a ``FitError``.

Payloads of a chunk (all flat; the runtime's own have ``ChunkNeed.numel`` elements, this rank's
shard, padding included; the rule's state has the sizes the rule gives):

=============  ======================  ==========================================================
payload        dtype                   home
=============  ======================  ==========================================================
params         the chunk's dtype       ``PlacementRequest.params`` (auto: GPU, then CPU, then
                                       NVMe); on the CPU with its master there too and
                                       ``host_params="from-master"`` made from the master on
                                       the way to the device, no host bytes ([Note: params from
                                       the master]). A front end that keeps the params in its own
                                       tensors (``params=None``: OffloadAdam) has one only in
                                       bf16/fp16 chunks updated on the host: host memory the
                                       host update writes the rounded params to, for the front
                                       end to copy out; none with the GPU share
grads          the chunk's dtype       where the update runs: CPU (written on the device in
                                       backward, flushed down), the GPU for the GPU share; on
                                       the CPU transient with ``host_grads="window"`` ([Note:
                                       grads window])
master         fp32                    ``PlacementRequest.optimizer``; not when the params
                                       payload is the master copy itself (fp32 params the store
                                       pages)
the rule's     the rule's (Adam:       ``PlacementRequest.optimizer`` (auto: the GPU share, then
state          exp_avg, exp_avg_sq,    CPU, then NVMe)
               fp32 or bf16: its
               ``moments_dtype``)
accum          fp32                    where the update runs; only with ``accum`` (the engine:
                                       ``grad_accum > 1`` with ``grad_sync="every"``)
=============  ======================  ==========================================================

The update rule (``PlacementRequest.rule``, runtime/update_rule.py) declares its state payloads,
their sizes and dtypes (``UpdateRule.payloads``: sized by the chunk's elements, or by its
params' shapes, ``ChunkNeed.shapes``, for a rule that is not elementwise); the rest are the
runtime's own. Nothing here names an optimizer.

Chunks that are not trainable carry ``params`` only.

[Note: GPU share placement] With ``gpu_optimizer`` (the front end updates chunks whose state is
on the device there: [Note: GPU share] in chunk_group.py), "auto" optimizer state of chunks whose
params live on the device (a front end's own params do) fills the device first, in chunk order,
with the chunk's accumulation buffer beside it (its grads only in flight: [Note: share grads] at
``_share_grads_held``), within the budget less ``reserve``:
a prefix of the chunks (the first layers, which the next forward needs first). Once a chunk does
not fit, the rest go to host memory, then NVMe. "auto" params of every chunk are placed on the
device before any of the share (``params_ahead``): a resident params chunk saves its fetch in
every forward and backward, the share's state only the update's traffic. With several ranks the
share is each rank's shard of each chunk (its state, grads shard and accumulation buffer), updated
on the device after the grads' reduce-scatter; nothing the ranks do together depends on it.

Why a prefix: backward produces the last chunks' grads first, so the host updates them while
backward still runs over the first chunks, whose updates, on the device, take a few ms when their
grads land; with clipping (updates after backward) the next forward uses the first chunks first,
and the host works through the rest meanwhile. Either way the host's part starts earliest and the
two finish together when the host's part takes no longer than the GPU time it hides behind
(``PlacementPlan.report``: the measured balance). A larger share only shortens the host's part,
so the share is as large as memory allows.

[Note: measured share] The first plan cannot know the activations: it leaves ``reserve`` ("auto":
half the GPU budget, less where the host cannot hold the rest: [Note: auto reserve]) to them, a
conservative share. After the first step the front end measures
the device (``Measured``: the allocator's peak over the step and the bytes it may reach) and
``grow_share`` extends the share by what the peak leaves free, less a margin for fragmentation
and step-to-step variation, within ``gpu_budget``: the step's other allocations stay as they
were, so its new peak is the old one plus the bytes added. A chunk whose move then fails (out of
memory after all) stays on the host, and so do the ones after it (``PlacementPlan.fall_back``:
the report says so); the training goes on.
The share grows over chunks whose state is on NVMe too (the first plan's host budget could not
hold it all), through host memory (``ChunkStore.rehome``). Each host chunk that joined it freed
its state's host memory: ``promote_state`` then brings the NVMe state left into that room, in
chunk order, within the host budget less the plan's need and the host memory free now (less the
"auto" reserve, divided by the node's ranks; the least over the ranks), so every promoted chunk's
update reads and writes host memory instead of the disk, each step. A failed move leaves that
chunk and the ones after it on NVMe (``PlacementPlan.stop_promotion``).

[Note: unmeasured share] Until the first step is measured the share holds what the guessed
reserve left, and a step whose activations need more would end in a CUDA out-of-memory. The
front end gives that room back instead ("auto" state only; ``shrink_share``, share.py's
``evict``): the chunks of the share, the last first, move to host memory (within the host
budget: the NVMe file is sized at ``initialize`` and does not grow) until the step has the
bytes it needs, and the measured step grows the share back by what its peak leaves free:
- before backward (every rank count, collective): what the forward reached above its start is
  taken as what backward may add to the bytes held when it begins (backward frees the
  activations it passes, and recomputes a checkpointed block at a time, which the forward held
  once too), so the free room must hold that plus the measurement's margin; the ranks evict for
  the largest shortfall of them all. A rule of thumb, not a bound: a backward that needs more
  than its forward did (grads of activations wider than the activations) can still run out;
- a forward that ran out of memory (one process only: with ranks the others would wait in the
  forward's collectives): the whole share leaves and the forward runs once more, with the
  random-number generators where they were before it. A model whose forward has side effects
  (BatchNorm's running statistics) sees that forward twice.
The allocator's peaks restart when that first forward begins (``DeviceMemory.restart_peaks``):
the measurement and the forward's reach are the step's own, not what the process held before it
(an earlier model, another test's allocation: session 20's GPU tests evicted the share for a
peak left by an earlier test, and then never grew it back). The measurement must see the step
with the smaller share: the allocator's cached blocks go back to the device and its peaks
restart after an eviction (``DeviceMemory.release``), and the forward's peak, less the bytes that
left, is a floor of the measured one. Only in the first
micro-batch of the first window (later ones hold accumulated grads that a move would carry); a
backward that still runs out of memory raises ``unmeasured_oom``'s error.

[Note: rank budgets] Several ranks on one node (``local_ranks``: torchrun's
``LOCAL_WORLD_SIZE``) share its host memory and disk. An "auto" budget is this rank's share: the
free memory (or disk) less the reserve, divided by the node's ranks, so the ranks together stay
within what the node has. A CUDA device is each rank's own and is not divided; with no CUDA the
"gpu" tier is host memory and is. ``rank_budgets`` is the one place this is written: both front
ends plan against it (the engine against the least over its ranks: [Note: ranks agree on
placement]).

[Note: ranks agree on placement] With several ranks every rank must reach the same homes and the
same GPU share: the plan sizes what each rank keeps on its device and in its host memory, and a
front end's choices there must never make one rank's collectives differ from another's (a hang).
So the plan is a pure function of inputs every rank holds alike:
- budgets: each rank resolves its own (``rank_budgets``: "auto" from its own free memory and disk,
  explicit ones per rank), then all plan against the least of each tier over the ranks
  (``common_budgets``), which every rank can hold;
- the reserve left to activations (a per-rank setting too): the largest of the ranks'
  (``common_reserve``);
- chunks: each rank's shard has the same ``numel`` (padding included: [Note: chunk shards] in
  shards.py), so params, grads, master and accumulation buffers take the same bytes on every rank.
  Only a rule sized by whole params' shapes (Adafactor) gives ranks different state bytes: the plan
  takes, per chunk, the rank's need of the most bytes (``largest_need``; each rank computes every
  rank's from the shared partition), and each rank allocates its own, never more (its
  ``PlacementPlan.report`` counts the planned bytes);
- the measured step: every rank grows the share by the measurement of least headroom
  (``tightest``), and a move into the share that fails on one rank falls back at the same chunk
  on every rank (the front end agrees the first failing one).
Identical inputs give identical homes; with identical homes each rank's bytes per tier are at most
the planned ones, so the plan fits every rank. A failure on some ranks only raises on every rank
([Note: ranks raise together] in shards.py).

[Note: working window] Besides the home copies, a front end that pages params through the device
(the engine) must hold there, at the worst moment of backward, a few chunks in use at once with
their grads buffers: a chunk is held from its first grad until its last one lands, so the one
backward is in and the one it straddles into stay, and so does the chunk of a tied embedding (its
grad completes only at the very end); plus the look-ahead, and the chunks parked on the device
after use (prefetch.py, [Note: holds]). ``window_bytes`` sizes that as (prefetch_depth + 3
+ PARKED_CHUNKS) params chunks plus three grads chunks of the largest size, of whole chunks with
several ranks (a chunk in use is all-gathered, its grads summed whole before the reduce-scatter);
the plan refuses a GPU budget below homes + window, with the numbers. When optimizer state or params live on NVMe,
host memory needs a staging window of (prefetch_depth + 1) chunks of what is read ahead.

[Note: grads window] The grads of a chunk updated on the host are 2 bytes per param (bf16) of
host memory for the whole run in the persistent layout, though they live only from their copy
down to the update that consumes them. ``host_grads="window"`` makes them transient (store.py,
[Note: transient payloads]): they pass through ``window_slots`` slots of one chunk's grads each
(chunk_group.py, [Note: grads window]), a fixed number of bytes (``host_window``) counted in
``need`` and ``working`` instead of a grads buffer per chunk. What it costs: no PCIe bytes and no
CPU time (the same copy lands in a slot instead of a home buffer), but backward waits for a slot
while every slot holds grads the host has not consumed yet, i.e. where the host updates fall
more than ``window_slots`` chunks behind backward (``window_wait_s`` counts it); and the next
forward then finds fewer updates left to overlap with. With ``grads_wait`` (the updates read the
grads after a decision over the window: clipping or fp16 without an accumulation payload, or
updates after backward) every chunk's grads are held at once: the window gets a slot per chunk,
the persistent layout's bytes. "auto" takes the window only where it pays in memory: where the
persistent plan puts state on NVMe that the window's keeps in host memory, or does not fit at
all; never with ``grads_wait``. The plan's request says what was chosen.

[Note: params from the master] A trainable bf16/fp16 chunk whose params are homed in host memory
keeps there, in the copy layout, both its fp32 master (4 bytes per param) and its working copy (2
bytes per param: the home the device fetches, the buffer the CPU update writes the rounded
params to). The working copy is the master rounded to nearest even, so it can be made on the way
to the device instead: with ``host_params="from-master"`` the chunk's "params" payload is derived
from "master" (store.py, [Note: derived payloads]; ``ChunkHomes.from_master``): no host bytes, a
fetch sends the fp32 master up into a staging buffer on the device and one cast kernel writes the
working copy (with ranks each rank casts its shard, and the all-gather moves the working dtype as
before), and the CPU update writes no copy-out. What it costs: 4 bytes per param over PCIe per
fetch instead of 2 (a chunk is fetched for forward, and again for backward unless kept: +2 to +4
B/param per step of host-to-device traffic), a cast on the device per fetch, and
``DERIVE_STAGING`` fp32 shards of the largest chunk of device memory (counted in ``need``); the
CPU update saves its 2 B/param copy-out writes. Only where the master lives in host memory:
chunks whose state is on NVMe or the GPU, fp32 chunks (the params are the master) and frozen ones
keep the copy (``PlacementPlan.params_why``, in the report). "auto" takes it only where it pays in
memory, as the grads window: where the copy's plan puts state on NVMe that this one keeps in
host memory, or does not fit at all; of the two savings the window (no PCIe bytes) is tried
first. Results are identical bit for bit: the CPU kernels' copy-out and torch's cast on the
device round alike (tests/test_engine_host_params.py checks both against each other), NaN aside
(its bit pattern may differ; it stays NaN).

[Note: host bytes] Host memory per param of the engine's plan, bf16 working params, fp32 state
on the host, one rank (N ranks: each holds 1/N of every payload; the node the same per param),
``need[Tier.CPU]`` per param, and what lives outside the store:

=============================  =======  =======  =========================================
host bytes per param            params   params   notes
                                gpu/     cpu
                                auto
=============================  =======  =======  =========================================
master (fp32)                   4        4        home; ``optimizer="cpu"``
exp_avg, exp_avg_sq (fp32)      8        8        home (bf16 moments: 4, inexact, opt-in)
params (bf16), copy             0        2        home of the working copy the GPU fetches;
                                                  the CPU update writes it
params, ``host_params=          0        0        made from the master on the way: 4 B/param
"from-master"``                                   over PCIe per fetch instead of 2, a cast on
                                                  the device, no copy-out written by the CPU
grads (bf16), persistent        2        2        home: the D2H copy lands here, CPU-Adam
                                                  reads it
grads, ``host_grads="window"``  0        0        + the window: ``window_slots`` x one
                                                  chunk's grads (4 x 64 MiB by default),
                                                  fixed
accum (fp32)                    (4)      (4)      only ``grad_accum > 1`` with
                                                  ``grad_sync="every"``
copy-out of the update          0        0        params on the GPU: the update rounds into
                                                  a pool buffer (one to a few chunks, fixed),
                                                  sent to the GPU home and freed
NVMe staging                    0        0        (prefetch_depth + 1) chunks of state, fixed,
                                                  only when state or params are on NVMe
plan ``need[CPU]``, persistent  14       16       (params from the master: 14)
plan ``need[CPU]``, window      12 + w   14 + w   w: the window, fixed (0.2 B/param at 1.31B);
                                                  params from the master: 12 + w
=============================  =======  =======  =========================================

Outside the store, not per param: the CUDA context and torch's libraries (about 1-3 GiB), the
C++ kernels (no buffers of their own: they run on the store's), the store's pinned pool (the
copy-out and staging buffers above) and window, the model's own host copy before the hand-over
(none for a meta-built model; a model built on the CPU in fp32 holds 4 B/param until each chunk
takes its values and frees them: initial_values.py) and whatever the script maps (the fair
harness's memory-mapped init file is 4 B/param of page cache while mapped). The 19.7 B/param
measured in issue 13 (params on the GPU, one H100 host, ``bench_train.py``'s 1.31B case) is the
14 above plus those. ``benchmarks/bench_host_bytes.py`` measures them, from the start of the
script, with both grads layouts, and with params on the host the copy against params from the
master: with the window and params on the GPU, 13.79 B/param at 1.31B and 12.45 at 6.58B (an
H100 host, sessions 12 and 15), the fixed GiB of torch and CUDA spread over more params.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Mapping

import torch

from .store import PayloadSpec, StoreConfig, Tier, cuda_room, resolve_budgets
from .swap_io import NVME_AUTO_RESERVE, auto_nvme_budget, disk_holders
from .update_rule import StateSpec, UpdateRule
from .vocab import ALIGNMENT, Placement, round_up

__all__ = ["Budgets", "ChunkHomes", "ChunkNeed", "DeviceMemory", "FitError", "Measured", "PARKED_CHUNKS",
           "PlacementPlan", "PlacementRequest", "common_budgets", "common_reserve", "device_memory", "grow_share",
           "host_room", "host_window", "keep_limit", "largest_need", "local_ranks", "margin_of", "measure_device",
           "plan_placement", "promote_state", "rank_budgets", "share_bytes", "shrink_share", "tightest",
           "window_bytes"]

PARKED_CHUNKS = 2
"""Chunks kept on the device after their last user let go (prefetch.py, [Note: holds]); part of
the working window."""

KEEP_SHARE = 0.5
"""Share of the GPU budget up to which params copies are kept from forward to backward; the
rest is left to activations, which the store does not see (as for "auto" params homes)."""


class FitError(ValueError):
    """The configuration cannot fit the budgets; the message has the numbers and the fix."""


# --------------------------------------------------------------------------------------------
# Budgets: this rank's share of the node


def local_ranks() -> int:
    """Processes sharing this node's memory and disk: ``LOCAL_WORLD_SIZE`` (torchrun sets it),
    1 without it. See [Note: rank budgets]."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "") or "1"
    if not value.strip().isdigit():
        raise ValueError(f"LOCAL_WORLD_SIZE={value!r} is not a number of processes; launch with "
                         f"`torchrun --nproc-per-node N` (it sets it), or unset it")
    return max(1, int(value))


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """This rank's bytes per tier (``rank_budgets``; ``budgets[Tier.CPU]`` reads one)."""

    gpu: int
    cpu: int
    nvme: int = 0
    auto: frozenset = frozenset()
    """Tiers whose budget was "auto" (resolved from free memory or disk); messages say so."""

    def __post_init__(self):
        for tier in Tier:
            value = self[tier]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Budgets.{tier.value} must be bytes as an int >= 0, got {value!r}")
        object.__setattr__(self, "auto", frozenset(Tier.of(t) for t in self.auto))

    def __getitem__(self, tier: Tier) -> int:
        return getattr(self, Tier.of(tier).value)

    def as_dict(self) -> dict:
        return {t: self[t] for t in Tier}


def rank_budgets(asked: Mapping, *, device=None, nvme_dir=None, local_ranks: int = 1,
                 freed_host: int = 0) -> Budgets:
    """This rank's budgets from what was asked (tier -> bytes or "auto"; a tier left out has 0):
    see [Note: rank budgets]. "auto" GPU and CPU budgets are the free memory less the store's
    reserve (``StoreConfig.auto_reserve_fraction``); an "auto" NVMe budget is the free disk space
    of ``nvme_dir`` less a small reserve (``swap_io.auto_nvme_budget``), not capped (the swap file
    is sized to the plan, not to the budget). ``device``: the compute device (its free memory for
    an "auto" GPU budget). ``nvme_dir``: this rank's swap directory (None: no NVMe tier, 0).
    ``freed_host``: host bytes the front end frees as its chunks fill (the engine hands the
    model's own host copy over), added to an "auto" host budget."""
    asked = {Tier.of(t): v for t, v in asked.items()}
    auto = frozenset(t for t, v in asked.items() if v == "auto")
    if isinstance(local_ranks, bool) or not isinstance(local_ranks, int) or local_ranks < 1:
        raise ValueError(f"rank_budgets: local_ranks must be an int >= 1, got {local_ranks!r}")
    memory = StoreConfig(device=device if Tier.GPU in auto else "cpu",
                         budgets={Tier.GPU: asked.get(Tier.GPU, 0), Tier.CPU: asked.get(Tier.CPU, 0),
                                  Tier.NVME: 0})
    out = resolve_budgets(memory)
    if nvme_dir is None:
        out[Tier.NVME] = 0
    elif Tier.NVME in auto:
        out[Tier.NVME] = auto_nvme_budget(nvme_dir)
    else:
        out[Tier.NVME] = asked.get(Tier.NVME, 0)
    for tier in auto:
        if not (tier is Tier.GPU and memory.cuda):  # a CUDA device is each rank's own
            out[tier] //= local_ranks
    if Tier.CPU in auto:
        out[Tier.CPU] += freed_host
    return Budgets(gpu=out[Tier.GPU], cpu=out[Tier.CPU], nvme=out[Tier.NVME], auto=auto)


def common_budgets(per_rank) -> Budgets:
    """The budgets every rank plans against: per tier the least of the ranks' ``per_rank`` (rank
    order; [Note: ranks agree on placement]); "auto" where any rank's was. One rank: its own."""
    per_rank = list(per_rank)
    if len(per_rank) == 1:
        return per_rank[0]
    return Budgets(**{t.value: min(b[t] for b in per_rank) for t in Tier},
                   auto=frozenset().union(*(b.auto for b in per_rank)))


def common_reserve(per_rank, gpu: int) -> "int | str":
    """The GPU bytes every rank's plan leaves to activations (``PlacementRequest.reserve``) from
    the ranks' own (rank order): "auto" when every rank's is, else the largest in bytes, an
    "auto" one being half the common ``gpu`` budget ([Note: ranks agree on placement])."""
    per_rank = list(per_rank)
    if all(r == "auto" for r in per_rank):
        return "auto"
    return max(_half_reserve(gpu) if r == "auto" else r for r in per_rank)


def _half_reserve(gpu: int) -> int:
    """An "auto" reserve as the first plan tries it: half the GPU budget ``gpu`` (less only where
    the host cannot hold the rest: [Note: auto reserve])."""
    return gpu // 2


MARGIN_SHARE = 0.04
"""Share of the bytes the allocator may reach that the grown GPU share leaves free beyond the
measured peak (fragmentation, step-to-step variation); at least ``MARGIN_MIN``."""
MARGIN_MIN = 1 << 30


def margin_of(limit: int) -> int:
    """The bytes left free beyond a step's peak on a device whose allocator may reach ``limit``:
    ``MARGIN_SHARE`` of it, at least ``MARGIN_MIN``."""
    return max(MARGIN_MIN, int(MARGIN_SHARE * limit))


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What a training step showed on the device ([Note: measured share]); ``measure_device``
    reads it from CUDA, a test gives its own numbers."""

    device_limit: int
    """Bytes this process's allocator may hold on the device: what it holds now plus what the
    device has free."""
    device_peak: int
    """The allocator's peak of bytes held over the measured step (activations, temporaries, the
    store's copies, the collectives' buffers, fragmentation)."""
    store_peak: int = 0
    """The store's GPU-tier peak over the step; ``device_peak`` less it is the activation peak
    (the report's; the share is sized from ``device_peak`` alone)."""
    margin: "int | None" = None
    """Bytes left free beyond the peak; None: ``MARGIN_SHARE`` of ``device_limit``, at least
    ``MARGIN_MIN``."""

    def __post_init__(self):
        for name in ("device_limit", "device_peak", "store_peak"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Measured.{name} must be bytes as an int >= 0, got {value!r}")
        if self.margin is not None and (isinstance(self.margin, bool) or not isinstance(self.margin, int)
                                        or self.margin < 0):
            raise ValueError(f"Measured.margin must be bytes >= 0 or None, got {self.margin!r}")

    @property
    def margin_bytes(self) -> int:
        return self.margin if self.margin is not None else margin_of(self.device_limit)

    @property
    def headroom(self) -> int:
        """Bytes the share may add: the limit less the peak and the margin."""
        return max(0, self.device_limit - self.device_peak - self.margin_bytes)

    @property
    def activation_peak(self) -> int:
        return max(0, self.device_peak - self.store_peak)


def tightest(per_rank) -> Measured:
    """Of the ranks' measurements (rank order), the one leaving the least headroom (the first
    such): every rank grows its share by it ([Note: ranks agree on placement])."""
    per_rank = list(per_rank)
    return min(per_rank, key=lambda m: m.headroom)


def measure_device(device, *, store_peak: int = 0) -> "Measured | None":
    """The CUDA allocator's peak since ``torch.cuda.reset_peak_memory_stats`` and what it may
    reach now (None on a device that is not CUDA: nothing to measure)."""
    memory = device_memory(device)
    return None if memory is None else memory.measure(store_peak=store_peak)


class DeviceMemory:
    """The CUDA allocator as a front end reads it around a step before the first measurement
    ([Note: unmeasured share], [Note: measured share]); ``device_memory`` gives one for a CUDA
    device, None elsewhere (nothing to measure). A test passes its own."""

    def __init__(self, device):
        self.device = torch.device(device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_allocated(self) -> int:
        """The allocator's peak of allocated bytes since its peaks last restarted."""
        return int(torch.cuda.max_memory_allocated(self.device))

    def peak_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def limit(self) -> int:
        """Bytes this process's allocator may hold: what it holds plus what the device has free
        (held to the script's per-process memory fraction)."""
        free, _ = cuda_room(self.device)
        return int(free + torch.cuda.memory_reserved(self.device))

    def restart_peaks(self) -> None:
        """The allocator's peaks restart here: the first step's measurement is that step's, not
        what the process held before (an earlier model, a test's blocker)."""
        torch.cuda.reset_peak_memory_stats(self.device)

    def release(self) -> None:
        """After the share gave memory back: the allocator's cached blocks go back to the device
        and its peaks restart, so the measured step sees the step with the smaller share."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.restart_peaks()

    def measure(self, *, store_peak: int = 0, floor: int = 0) -> Measured:
        """The limit and the reserved peak now, the peak at least ``floor`` (an earlier part of
        the step's, less the bytes that left the device since)."""
        return Measured(device_limit=self.limit(), device_peak=max(self.peak_reserved(), int(floor)),
                        store_peak=int(store_peak))


def device_memory(device) -> "DeviceMemory | None":
    """A ``DeviceMemory`` of a CUDA ``device``; None for another."""
    return DeviceMemory(device) if torch.device(device).type == "cuda" else None


# --------------------------------------------------------------------------------------------
# The request and the plan


@dataclass(frozen=True, kw_only=True)
class ChunkNeed:
    """One chunk as placement sees it."""

    numel: int
    """Elements of each of its payloads on this rank (its shard of the chunk, padding included)."""
    dtype: torch.dtype
    """Dtype of its params and grads."""
    trainable: bool = True
    """False: it carries params only (no grads, no optimizer state)."""
    shapes: "tuple | None" = None
    """Shapes of the whole params it holds (on this rank), in order, for an update rule that is
    not elementwise (its state may be sized by them: Adafactor's row and column factors); () when
    this rank holds none of them. An elementwise rule's state is sized by ``numel`` and a front
    end may leave this None."""
    rule: "UpdateRule | None" = None
    """Its update rule when not the request's (several rules in one model: param groups)."""

    def __post_init__(self):
        if self.shapes is not None:
            object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        if self.rule is not None and not isinstance(self.rule, UpdateRule):
            raise TypeError(f"ChunkNeed.rule must be an UpdateRule or None, got {type(self.rule).__name__}")


@dataclass(frozen=True, kw_only=True)
class PlacementRequest:
    """What a front end asks of placement; built by each front end from its own settings."""

    chunks: tuple = ()
    """``ChunkNeed`` of every chunk, in order (the order "auto" fills the fastest tier in)."""
    budgets: Budgets
    """This rank's bytes per tier (``rank_budgets``)."""
    params: "Placement | None"
    """Home of the params payload; None: the front end keeps the params in its own tensors."""
    optimizer: Placement
    """Home of the optimizer state (the master and the rule's state)."""
    rule: UpdateRule
    """The update rule: its state payloads, their sizes and dtypes (``UpdateRule.payloads``)."""
    accum: bool = False
    """Trainable chunks have an fp32 accumulation buffer."""
    nvme_dir: "str | os.PathLike | None" = None
    """The swap directory (None: no NVMe tier); messages name it and its free space."""
    prefetch_depth: int = 2
    """Chunks read ahead (the working window on the device, the NVMe staging in host memory)."""
    reserve: "int | str" = 0
    """GPU bytes "auto" placements leave to what the store does not see (activations): bytes, or
    "auto" (half the GPU budget, or less: [Note: auto reserve])."""
    gpu_optimizer: bool = False
    """The front end updates chunks whose state is homed on the device there: "auto" optimizer
    state may take the GPU share ([Note: GPU share placement])."""
    fp32_grads_window: bool = False
    """The front end sums every trainable chunk's whole grads in fp32 on the device over the
    accumulation window (the engine's ``grad_sync="final"``), beside the homes."""
    ranks: int = 1
    """Ranks each chunk is split between (``ChunkNeed.numel`` is one rank's shard)."""
    replicas: "bool | str" = False
    """Every rank keeps a whole replica of the params on its device beside its shards (the
    engine's params="gpu" with several ranks), or "auto": where the replicas fit with every
    chunk's params and optimizer state on the device ([Note: replicas when all fits]). The plan's
    request has it resolved (one rank: never; "gpu" params: always); ``replicas_later`` says whether
    the measured step may add them."""
    replicas_later: bool = False
    """Set by the plan (never asked): "auto" replicas that did not fit the first plan beside the
    whole state; ``grow_share`` adds them when the measured step leaves them room."""
    auto_reserve: "int | None" = None
    """Set by the plan (never asked): the bytes an "auto" ``reserve`` resolved to, half the GPU
    budget or less where the host cannot hold what half leaves it ([Note: auto reserve])."""
    owner: str = ""
    """Who asks, for messages (none: the message starts with the problem)."""
    state_option: str = "optimizer"
    """How the front end's user names the optimizer state's placement, for messages."""
    host_grads: str = "persistent"
    """How grads of the chunks updated on the host live in host memory ([Note: grads window]):
    "persistent" (a grads buffer per chunk, its home), "window" (a bounded window of
    ``window_slots`` chunk-sized slots they pass through) or "auto" (the window only where it
    keeps state out of NVMe or makes the plan fit at all). The plan's request has it resolved."""
    window_slots: int = 4
    """Slots of the grads window (``host_grads="window"``)."""
    grads_wait: bool = False
    """A chunk's update reads its grads only after a decision over the whole window (clipping,
    fp16 overflow, or updates after backward) and there is no accumulation buffer they were
    summed into: the grads window must then hold every host-updated chunk's grads at once."""
    host_params: str = "copy"
    """How the working params of chunks whose params are homed in host memory live there ([Note:
    params from the master]): "copy" (a host buffer of the working dtype, the home the device
    fetches and the host update writes), "from-master" (none where the chunk's fp32 master is in
    host memory: the fetch casts the master on the device) or "auto" (from the master only where
    the copy's plan puts state on NVMe or does not fit). The plan's request has it resolved."""

    def __post_init__(self):
        object.__setattr__(self, "chunks", tuple(self.chunks))
        if not all(isinstance(c, ChunkNeed) for c in self.chunks):
            raise TypeError("PlacementRequest.chunks must be ChunkNeed records")
        if not isinstance(self.budgets, Budgets):
            raise TypeError(f"PlacementRequest.budgets must be Budgets (rank_budgets), got {self.budgets!r}")
        if self.params is not None and not isinstance(self.params, Placement):
            raise TypeError(f"PlacementRequest.params must be a Placement or None, got {self.params!r}")
        if not isinstance(self.optimizer, Placement):
            raise TypeError(f"PlacementRequest.optimizer must be a Placement, got {self.optimizer!r}")
        if not isinstance(self.rule, UpdateRule):
            raise TypeError(f"PlacementRequest.rule must be an UpdateRule (runtime/update_rule.py), "
                            f"got {type(self.rule).__name__}")
        for c in self.chunks:
            rule = self.rule_of(c)
            if c.trainable and not rule.elementwise and c.shapes is None:
                raise ValueError(f"{self._prefix}{rule.name} is not elementwise: its state is sized by "
                                 f"whole params, so every trainable ChunkNeed must carry their shapes")
        if self.nvme_dir is None and Placement.NVME in (self.params, self.optimizer):
            raise ValueError(f"{self._prefix}placing state on NVMe needs a swap directory (nvme_dir)")
        if not (self.reserve == "auto" or (isinstance(self.reserve, int) and self.reserve >= 0)):
            raise ValueError(f"PlacementRequest.reserve must be bytes >= 0 or 'auto', got {self.reserve!r}")
        for name in ("prefetch_depth", "ranks", "window_slots"):
            value = getattr(self, name)
            least = int(name != "prefetch_depth")
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"PlacementRequest.{name} must be an int >= {least}, got {value!r}")
        if self.host_grads not in ("persistent", "window", "auto"):
            raise ValueError(f"PlacementRequest.host_grads must be 'persistent', 'window' or 'auto', got "
                             f"{self.host_grads!r}")
        if self.host_grads == "window" and self.params is None:
            raise ValueError(f"{self._prefix}host_grads='window' serves a front end that pages the params "
                             f"(the engine): grads copied in piece by piece (params=None) need their "
                             f"persistent host buffer")
        if self.host_params not in ("copy", "from-master", "auto"):
            raise ValueError(f"PlacementRequest.host_params must be 'copy', 'from-master' or 'auto', got "
                             f"{self.host_params!r}")
        if self.host_params == "from-master" and self.params is None:
            raise ValueError(f"{self._prefix}host_params='from-master' serves a front end that pages the "
                             f"params (the engine); a front end keeping its own params has none to make")

    @property
    def _prefix(self) -> str:
        return f"{self.owner}: " if self.owner else ""

    def rule_of(self, chunk: ChunkNeed) -> UpdateRule:
        """The update rule of ``chunk``: its own, or the request's."""
        return chunk.rule if chunk.rule is not None else self.rule


@dataclass(frozen=True)
class ChunkHomes:
    """Home tier of each payload of one chunk."""

    params: "Tier | None"
    """Home of the params (None when the front end keeps them)."""
    optimizer: "Tier | None"
    """Home of master and the rule's state (None for frozen chunks)."""
    from_master: bool = False
    """The params (homed on the CPU, as the master) are made from the master on the way to the
    device, with no host copy of their own ([Note: params from the master])."""


@dataclass(frozen=True)
class PlacementPlan:
    request: PlacementRequest
    homes: tuple
    """One ChunkHomes per chunk of the request."""
    need: dict
    """Tier -> bytes the homes and working windows need."""
    working: dict
    """Tier -> the bytes of ``need`` that are working windows and staging, not homes."""
    share_ended: bool = False
    """A trainable chunk did not fit the GPU share ([Note: GPU share placement])."""
    why: str = ""
    """Why the GPU share ends where it does (or why there is none), for the report."""
    measured: "Measured | None" = None
    """The step measurement the share was grown by ([Note: measured share]); None: not yet."""
    grown: tuple = ()
    """Chunks ``grow_share`` moved into the share (the front end rehomes them)."""
    grown_from: tuple = ()
    """The tier each chunk of ``grown`` came from (host memory or NVMe)."""
    fell_back: tuple = ()
    """Chunks whose move into the share failed and that stayed on the host (``fall_back``)."""
    replicas_added: bool = False
    """``grow_share`` added the params replicas the first plan had no room for ([Note: replicas
    when all fits]); the front end keeps them from the next forward on."""
    promoted: tuple = ()
    """Chunks whose NVMe state ``promote_state`` brought into host memory (the front end rehomes
    them)."""
    nvme_why: str = ""
    """Why state stays on NVMe after ``promote_state`` ("" where none was there), for the report."""
    evicted: tuple = ()
    """Chunks of the share whose state ``shrink_share`` moved to host memory for a step before the
    first measurement ([Note: unmeasured share]; the front end rehomes them)."""
    grads_window: int = 0
    """Slots of the host grads window ([Note: grads window]); 0: the persistent layout."""
    params_why: str = ""
    """With ``host_params="from-master"``: why some chunks' params on the host keep their copy
    (their master is not in host memory, fp32 or frozen chunks), for the report; "" if none."""

    @property
    def budgets(self) -> Budgets:
        return self.request.budgets

    def count(self, *, params: "Tier | None" = None, optimizer: "Tier | None" = None) -> int:
        return sum(1 for h in self.homes
                   if (params is None or h.params is params)
                   and (optimizer is None or h.optimizer is optimizer))

    def payloads(self, index: int) -> dict:
        """name -> ``PayloadSpec`` of chunk ``index``'s payloads (the table above)."""
        return chunk_payloads(self.request, self.request.chunks[index], self.homes[index])

    def fall_back(self, index: int, error: BaseException) -> "PlacementPlan":
        """This plan with the grown chunks from ``index`` on back where they came from (host
        memory or NVMe: their move into the share failed with ``error``: [Note: measured
        share])."""
        back = tuple((i, t) for i, t in zip(self.grown, self.grown_from) if i >= index)
        homes, need = list(self.homes), dict(self.need)
        for i, tier in back:
            homes[i] = dataclasses.replace(homes[i], optimizer=tier)
            _leave(need, self.request.chunks[i], self.request, tier, -1)
        kept = [(i, t) for i, t in zip(self.grown, self.grown_from) if i < index]
        line = str(error).splitlines()[0] if str(error) else ""
        request = self.request
        if self.replicas_added:  # (the share is no longer whole: the replicas wait, as before)
            request = dataclasses.replace(request, replicas=False, replicas_later=True)
        return dataclasses.replace(
            self, request=request, replicas_added=False, homes=tuple(homes), need=need, share_ended=True,
            grown=tuple(i for i, _ in kept), grown_from=tuple(t for _, t in kept),
            fell_back=tuple(i for i, _ in back),
            why=f"fell back at chunk {index} ({type(error).__name__}: {line[:200]}); "
                f"{len(back)} chunk(s) stay where they were (host memory or NVMe)")

    def unmeasured_oom(self, error: BaseException) -> BaseException:
        """``error`` (a CUDA out-of-memory error of a step before the first was measured: [Note:
        measured share]) as one naming the cause and the fix: the activations needed more than
        the reserve the first plan left them. Other errors, or after the measurement: ``error``."""
        if not isinstance(error, torch.OutOfMemoryError) or self.measured is not None:
            return error
        request = self.request
        reserve, lowered = reserve_bytes(request), _reserve_lowered(request)
        homes = self.need[Tier.GPU] - self.working[Tier.GPU]
        line = (str(error).splitlines() or [""])[0][:160]
        if self.evicted:  # [Note: unmeasured share]: the share gave its room back, not enough
            return torch.OutOfMemoryError(
                f"{request._prefix}CUDA out of memory in a step before the first was measured ({line}), "
                f"after {len(self.evicted)} chunks' optimizer state left the device for host memory "
                f"({self.count(optimizer=Tier.GPU)} chunks' state and {homes / 2**30:.1f} GiB of homes "
                f"stay there: {self.why}). The step's activations do not fit beside the params: "
                f"checkpoint more blocks, or lower the batch")
        fix = ("the host has no room for more of the state ([Note: auto reserve]): checkpoint more "
               "blocks, lower the batch, or give the state more room (nvme_dir, moments_dtype='bf16')"
               if lowered else "Pass a larger activation_reserve (the share grows back after the first "
               "step measures), or checkpoint more blocks")
        return torch.OutOfMemoryError(
            f"{request._prefix}CUDA out of memory in a step before the first was measured ({line}): the "
            f"first plan left activation_reserve={reserve} bytes ({reserve / 2**30:.1f} GiB"
            + (', "auto", lowered from half of gpu_budget so that host memory holds the rest of the '
               'state' if lowered else ', "auto": half of gpu_budget' if request.reserve == "auto" else "")
            + f") to the activations beside {homes / 2**30:.1f} GiB of homes on the device "
            f"({self.count(optimizer=Tier.GPU)} chunks' optimizer state), and this step's activations "
            f"need more. {fix}")

    def stop_promotion(self, index: int, error: BaseException) -> "PlacementPlan":
        """This plan with the promoted chunks from ``index`` on back on NVMe (their move into host
        memory failed with ``error``: [Note: measured share])."""
        back = tuple(i for i in self.promoted if i >= index)
        homes, need = list(self.homes), dict(self.need)
        for i in back:
            moved = _state_bytes(self.request.chunks[i], self.request)
            homes[i] = dataclasses.replace(homes[i], optimizer=Tier.NVME)
            need[Tier.CPU] -= moved
            need[Tier.NVME] += moved
        line = str(error).splitlines()[0] if str(error) else ""
        return dataclasses.replace(
            self, homes=tuple(homes), need=need, promoted=tuple(i for i in self.promoted if i < index),
            nvme_why=f"chunk {index}'s move into host memory failed ({type(error).__name__}: {line[:200]}); "
                     f"{len(back)} chunk(s) stay on NVMe")

    def report(self) -> dict:
        """Where this rank's bytes are and why (plain values, for ``stats`` and logs): per tier
        the homes by payload kind, the working window and the budget; the GPU share in chunks,
        elements and bytes; the measurement it was sized by; why it ends where it does."""
        request = self.request
        tiers = {t.value: {"params": 0, "optimizer": 0, "grads": 0, "other": 0} for t in Tier}
        share = {"chunks": 0, "elements": 0, "host_chunks": 0, "host_elements": 0, "nvme_chunks": 0}
        for i, (c, h) in enumerate(zip(request.chunks, self.homes)):
            state = optimizer_payloads(c, request)
            for name, spec in self.payloads(i).items():
                if spec.source is not None or spec.transient:
                    continue  # made from the master, or held only in flight (the working bytes)
                kind = ("params" if name == "params" else "optimizer" if name in state
                        else "grads" if name == "grads" else "other")
                tiers[spec.home.value][kind] += round_up(spec.numel * spec.dtype.itemsize, ALIGNMENT)
            if c.trainable:
                key = {Tier.GPU: "", Tier.CPU: "host_", Tier.NVME: "nvme_"}[h.optimizer]
                share[f"{key}chunks"] += 1
                if h.optimizer is not Tier.NVME:
                    share[f"{key}elements"] += c.numel
        for t in Tier:
            row = tiers[t.value]
            row["homes"] = sum(row.values())
            row["working"] = self.working[t]
            row["need"] = self.need[t]
            row["budget"] = self.budgets[t]
        m = self.measured
        return {"ranks": request.ranks, "tiers": tiers, "share": share,
                "measured": None if m is None else {
                    "device_limit": m.device_limit, "device_peak": m.device_peak,
                    "activation_peak": m.activation_peak, "margin": m.margin_bytes,
                    "headroom": m.headroom},
                "reserve": reserve_bytes(request), "reserve_lowered": _reserve_lowered(request),
                "grown": len(self.grown), "fell_back": len(self.fell_back), "evicted": len(self.evicted),
                "why": self.why,
                "replicas": request.replicas is True, "replicas_bytes": _replica_bytes(request),
                "replicas_added": self.replicas_added,
                "promoted": len(self.promoted), "nvme_why": self.nvme_why,
                "host_grads": request.host_grads, "grads_window": self.grads_window,
                "host_params": request.host_params,
                "params_from_master": sum(1 for h in self.homes if h.from_master),
                "params_copy_why": self.params_why}

    def rest(self) -> Budgets:
        """What a plan of chunks added later may take: the budgets less this plan's homes
        (working windows and staging are shared: a later plan counts them itself), and no GPU
        share once this one's ended (the share is a prefix of the chunks)."""
        b = self.budgets
        left = {t: max(0, b[t] - (self.need[t] - self.working[t])) for t in Tier}
        return dataclasses.replace(b, gpu=0 if self.share_ended else left[Tier.GPU],
                                   cpu=left[Tier.CPU], nvme=left[Tier.NVME])


_RUNTIME_PAYLOADS = ("params", "grads", "master", "accum")
"""Payloads the runtime keeps for every rule; a rule's state takes other names."""


def optimizer_payloads(chunk: ChunkNeed, request: PlacementRequest) -> tuple:
    """Payloads homed by ``PlacementRequest.optimizer``: the fp32 master and the rule's state
    (fp32 params that the store pages are the master copy themselves and stay where
    ``PlacementRequest.params`` puts them)."""
    keys = tuple(request.rule_of(chunk).state_keys)
    if request.params is not None and chunk.dtype is torch.float32:
        return keys
    return ("master", *keys)


def payload_specs(chunk: ChunkNeed, request: PlacementRequest) -> dict:
    """name -> ``StateSpec`` (elements, dtype) of the payloads a chunk carries (see the table
    above): the runtime's own, ``chunk.numel`` elements each, and the rule's state as
    ``rule.payloads`` declares it."""
    work, n = chunk.dtype, chunk.numel
    out = {"params": StateSpec(n, work)} if request.params is not None else {}
    if not chunk.trainable:
        return out
    out["grads"] = StateSpec(n, work)
    keys = optimizer_payloads(chunk, request)
    if "master" in keys:
        out["master"] = StateSpec(n, torch.float32)
    out.update(_rule_payloads(chunk, request.rule_of(chunk)))
    if request.accum:
        out["accum"] = StateSpec(n, torch.float32)
    if request.params is None and work is not torch.float32:
        out["params"] = StateSpec(n, work)  # the host update's rounded params, copied out by the front end
    return out


def _rule_payloads(chunk: ChunkNeed, rule: UpdateRule) -> dict:
    """``rule.payloads`` of ``chunk``, checked: exactly its ``state_keys``, none named as a
    payload of the runtime, each a ``StateSpec`` of a size >= 0."""
    specs = dict(rule.payloads(chunk.numel, chunk.shapes or ()))
    keys = tuple(rule.state_keys)
    clash = [k for k in keys if k in _RUNTIME_PAYLOADS]
    if set(specs) != set(keys) or clash or len(set(keys)) != len(keys):
        raise ValueError(f"update rule {rule.name}: its payloads {sorted(specs)} must be its state_keys "
                         f"{list(keys)}, distinct and none of {list(_RUNTIME_PAYLOADS)} (the runtime's "
                         f"own); fix the rule's payloads()")
    for k, spec in specs.items():
        if not (isinstance(spec, StateSpec) and isinstance(spec.numel, int) and spec.numel >= 0
                and isinstance(spec.dtype, torch.dtype)):
            raise ValueError(f"update rule {rule.name}: payload {k!r} must be a StateSpec(numel >= 0, "
                             f"torch.dtype), got {spec!r}; fix the rule's payloads()")
    return specs


def payload_dtypes(chunk: ChunkNeed, request: PlacementRequest) -> dict:
    """name -> dtype of the payloads a chunk carries (``payload_specs`` without the sizes)."""
    return {name: spec.dtype for name, spec in payload_specs(chunk, request).items()}


def chunk_payloads(request: PlacementRequest, chunk: ChunkNeed, homes: ChunkHomes) -> dict:
    """name -> ``PayloadSpec`` of one chunk's payloads with ``homes`` (the table above)."""
    state = optimizer_payloads(chunk, request)
    on_device = homes.optimizer is Tier.GPU  # the GPU share: the update runs on the device
    out = {}
    for name, spec in payload_specs(chunk, request).items():
        if name == "params" and request.params is not None:
            home = homes.params
        elif name in state:
            home = homes.optimizer
        elif name == "params":  # the host update's copy out: none when the device updates
            if on_device:
                continue
            home = Tier.CPU
        else:  # grads, accum: where the update runs
            home = Tier.GPU if on_device else Tier.CPU
        # (a state payload of no elements, e.g. Adafactor's "variance" of a chunk of matrices: one
        # element, as the store holds no empty buffer)
        transient = name == "grads" and (on_device or request.host_grads == "window")  # [Note: share grads]
        out[name] = PayloadSpec(numel=max(1, spec.numel), dtype=spec.dtype, home=home, transient=transient,
                                source="master" if name == "params" and homes.from_master else None)
    return out


def chunk_bytes(chunk: ChunkNeed, request: PlacementRequest, names) -> int:
    """Bytes of the named payloads of ``chunk`` (those it has), each rounded up to 4 KiB as the
    store holds it."""
    specs = payload_specs(chunk, request)
    return sum(round_up(max(1, specs[n].numel) * specs[n].dtype.itemsize, ALIGNMENT) for n in names if n in specs)


def _params_bytes(chunk: ChunkNeed, request: PlacementRequest) -> int:
    """Bytes of the params payload the store pages (0 when the front end keeps the params)."""
    return chunk_bytes(chunk, request, ("params",)) if request.params is not None else 0


def _copy_out_bytes(chunk: ChunkNeed, request: PlacementRequest) -> int:
    """Bytes of the host update's rounded params (a front end that keeps its params)."""
    return chunk_bytes(chunk, request, ("params",)) if request.params is None else 0


def window_bytes(request: PlacementRequest, *, whole: bool = False) -> int:
    """GPU bytes beyond the homes that paging params needs; see [Note: working window] (0 when
    the front end keeps the params: nothing is paged). ``whole``: of whole chunks (every rank's
    shards: with several ranks a chunk in use is all-gathered on the device)."""
    if request.params is None or not request.chunks:
        return 0
    chunks = request.chunks
    if whole and request.ranks > 1:
        chunks = [dataclasses.replace(c, numel=c.numel * request.ranks) for c in chunks]
    big_params = max(chunk_bytes(c, request, ("params",)) for c in chunks)
    big_grads = max((chunk_bytes(c, request, ("grads",)) for c in chunks if c.trainable), default=0)
    if request.replicas is True and request.ranks > 1:
        big_params = 0  # a chunk in use is its replica (counted with the replicas)
    return (request.prefetch_depth + 3 + PARKED_CHUNKS) * big_params + 3 * big_grads


def keep_limit(request: PlacementRequest) -> int:
    """GPU-tier bytes held by the store up to which the engine keeps a chunk's params copy on the
    device after its forward use, for the backward (prefetch.py, [Note: holds]): at most
    ``KEEP_SHARE`` of the budget, and never eating into the working window of whole chunks (a
    budget that only fits homes + window gives 0: copies are released after use, as without
    keeping)."""
    gpu = request.budgets.gpu
    return max(0, min(int(KEEP_SHARE * gpu), gpu - window_bytes(request, whole=True)))


def _grads_window_bytes(request: PlacementRequest) -> int:
    """Device bytes of ``fp32_grads_window``: 4 per element of every whole trainable chunk."""
    if not request.fp32_grads_window:
        return 0
    return 4 * sum(c.numel * request.ranks for c in request.chunks if c.trainable)


def plan_placement(request: PlacementRequest) -> PlacementPlan:
    """Home tiers per chunk for ``request`` within its budgets, or a ``FitError`` naming the
    budget, the numbers and what to change.

    "auto" params fill the GPU first, up to its budget less ``reserve`` (left to activations,
    which the store does not see), then host memory, then NVMe; "auto" optimizer state (the
    master and the rule's state) takes the GPU share ([Note: GPU share placement]), then fills
    host memory, then NVMe. Explicit homes are taken as they are. Device bytes the front end
    holds beside the homes (the working window, ``fp32_grads_window``, ``replicas``) are counted
    first. ``host_grads="auto"`` is resolved here ([Note: grads window]): the plan's request
    says "persistent" or "window".
    """
    if request.replicas == "auto":
        return _plan_replicas(request)
    if request.reserve != "auto" or request.auto_reserve is not None:
        return _plan_layouts(request)
    half = _half_reserve(request.budgets.gpu)
    try:
        return _plan_layouts(dataclasses.replace(request, auto_reserve=half))
    except FitError as error:
        if request.replicas is True or not _reserve_places(request):
            raise
        return _lowered_reserve_plan(request, half, error)


AUTO_RESERVE_FLOOR = 8
"""An "auto" reserve lowered so that the host can hold the state goes no lower than the GPU
budget / this ([Note: auto reserve])."""
AUTO_RESERVE_STEPS = 512
"""The search for the largest "auto" reserve that fits stops within the GPU budget / this of it
(250 MiB of an H200's 125 GiB "auto" budget; at most 8 plans past the floor)."""


def _reserve_places(request: PlacementRequest) -> bool:
    """The reserve changes what the plan places: "auto" params, or an "auto" GPU share."""
    return request.params is Placement.AUTO or (request.optimizer is Placement.AUTO and request.gpu_optimizer)


def _lowered_reserve_plan(request: PlacementRequest, half: int, error: FitError) -> "PlacementPlan":
    """[Note: auto reserve] The first plan of an "auto" reserve leaves half the GPU budget to the
    activations, a guess the measured step corrects ([Note: measured share]). Where that plan
    does not fit (the host cannot hold the state the device does not take: 27.65B on 2x H200 +
    251 GiB, 51.82B on 4x H200 + 503 GiB, sessions 22-23, which ran with a reserve set by hand),
    refusing would leave the user to guess a reserve. The plan is the one with the largest
    reserve that fits instead, found by bisection (within ``gpu // AUTO_RESERVE_STEPS``), down to
    ``gpu // AUTO_RESERVE_FLOOR``: the device takes more of the state and the host less. The
    first step then measures; if its activations need more than the lowered reserve, the share
    cannot give its room back (the host is full), and the out-of-memory error says so
    (``unmeasured_oom``). The search plans against the host budget less ``_staging_bytes``, so
    that the plan does not fill the host to its last byte: the store's transient copies
    (``initialize`` hands each chunk's first values over through one) need room beside the homes.
    Below the floor it refuses, with the reserve that would fit named: a
    reserve that small is the user's call (``activation_reserve``). Every rank plans the same
    request with the common budgets, so the ranks find the same reserve. Only where half does not
    fit at all: a plan that spills state to NVMe keeps half (the measured step grows the share and
    brings NVMe state back into host memory), and the replicas' trial plan never lowers it."""
    budgets = request.budgets
    slack = dataclasses.replace(budgets, cpu=max(0, budgets.cpu - _staging_bytes(request)))

    def fits(reserve: int) -> bool:
        try:
            _plan_layouts(dataclasses.replace(request, auto_reserve=reserve, budgets=slack))
        except FitError:
            return False
        return True

    def largest(lo: int, hi: int) -> int:  # fits(lo) and not fits(hi): the largest that fits, within a step
        step = max(1, budgets.gpu // AUTO_RESERVE_STEPS)
        while hi - lo > step:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    floor = budgets.gpu // AUTO_RESERVE_FLOOR
    if not fits(floor):
        if not fits(0):
            raise error
        most = largest(0, floor)
        raise FitError(f"{error} It would fit with at most {most} bytes ({most / 2**30:.2f} GiB) left to "
                       f"the activations, less than gpu_budget/{AUTO_RESERVE_FLOOR}, the least \"auto\" "
                       f"leaves them: if the step's activations fit in that, pass activation_reserve={most}; "
                       f"else give the state more room") from None
    return _plan_layouts(dataclasses.replace(request, auto_reserve=largest(floor, half)))  # (fit with less)


def _staging_bytes(request: PlacementRequest) -> int:
    """Host bytes of ``prefetch_depth + 1`` copies of the largest chunk's params and optimizer
    state: the NVMe staging window, and the slack a lowered reserve leaves the host ([Note: auto
    reserve])."""
    return (request.prefetch_depth + 1) * max(
        (_params_bytes(c, request) + chunk_bytes(c, request, optimizer_payloads(c, request)) for c in request.chunks),
        default=0)


def reserve_bytes(request: PlacementRequest) -> int:
    """The GPU bytes ``request``'s plan leaves to the activations: its ``reserve``, an "auto" one
    as the plan resolved it (``auto_reserve``; half the GPU budget before)."""
    if request.reserve != "auto":
        return request.reserve
    return _half_reserve(request.budgets.gpu) if request.auto_reserve is None else request.auto_reserve


def _reserve_lowered(request: PlacementRequest) -> bool:
    """An "auto" reserve the plan lowered below half the GPU budget ([Note: auto reserve])."""
    return request.reserve == "auto" and reserve_bytes(request) < _half_reserve(request.budgets.gpu)


def _plan_layouts(request: PlacementRequest) -> PlacementPlan:
    """``plan_placement`` of a request whose reserve is decided: each host layout in turn."""
    grads = ("persistent", "window") if request.host_grads == "auto" else (request.host_grads,)
    params = ("copy", "from-master") if request.host_params == "auto" else (request.host_params,)
    if request.grads_wait:
        grads = grads[:1]  # a window holding every chunk's grads saves nothing ([Note: grads window])
    # In the order of what each layout costs in step time: none, waits for the grads window
    # (only where host updates fall behind), PCIe bytes on every fetch ([Note: params from the
    # master]). The first one that keeps state out of NVMe, else the one spilling least.
    best, error = None, None
    for host_params in params:
        for host_grads in grads:
            try:
                plan = _plan(dataclasses.replace(request, host_grads=host_grads, host_params=host_params))
            except FitError as e:
                error = e  # (the last one's message: the layout needing the least host memory)
                continue
            if not plan.need[Tier.NVME]:
                return plan
            if best is None or plan.need[Tier.NVME] < best.need[Tier.NVME]:
                best = plan
    if best is None:
        raise error
    return best


def _plan_replicas(request: PlacementRequest) -> PlacementPlan:
    """[Note: replicas when all fits] "auto" replicas: with several ranks, params="gpu" keeps
    them always (``_check_replicas`` refuses a budget that cannot hold them); "auto" params keep them
    where the plan with them homes every chunk's params and every trainable chunk's
    optimizer state on the device. Then a step's collectives are one reduce-scatter of the
    grads and one all-gather of the updated params, both during backward ([Note: gathers after
    the update] in chunk_group.py), where without replicas the params are gathered again at each
    use, in forward and in backward. Where they do not fit beside the whole state, they would
    take device memory from the GPU share, whose updates save more (PCIe bytes and host work per
    chunk) than a replica saves (one all-gather per step): the plan goes without, and the
    measured step adds them where it leaves room after the share has grown (``grow_share``:
    the first plan's reserve is a guess, half the GPU, that a 6.58B model on 4 H100s with every
    block checkpointed left mostly unused)."""
    if request.ranks > 1 and request.params is Placement.GPU:  # always: refused where they do not fit
        return plan_placement(dataclasses.replace(request, replicas=True))
    if request.ranks > 1 and request.params is Placement.AUTO:
        try:
            plan = plan_placement(dataclasses.replace(request, replicas=True))
        except FitError:
            plan = None
        if plan is not None and _all_on_device(plan):
            return plan
        return plan_placement(dataclasses.replace(request, replicas=False, replicas_later=True))
    return plan_placement(dataclasses.replace(request, replicas=False))


def _all_on_device(plan: PlacementPlan) -> bool:
    """Every chunk's params and every trainable chunk's optimizer state homed on the device."""
    return all(h.params is Tier.GPU and (not c.trainable or h.optimizer is Tier.GPU)
               for h, c in zip(plan.homes, plan.request.chunks))


def host_window(request: PlacementRequest) -> tuple:
    """``(slots, bytes)`` of the host grads window of ``request`` ([Note: grads window]):
    ``window_slots`` slots (every trainable chunk's with ``grads_wait``), each as large as the
    largest chunk's grads; ``(0, 0)`` for the persistent layout."""
    trainable = [c for c in request.chunks if c.trainable]
    if request.host_grads != "window" or not trainable:
        return 0, 0
    slots = len(trainable) if request.grads_wait else min(request.window_slots, len(trainable))
    return slots, slots * max(chunk_bytes(c, request, ("grads",)) for c in trainable)


def _windowed_grads(chunk: ChunkNeed, request: PlacementRequest) -> int:
    """Bytes of the chunk's grads that pass through the host window (not homed in host memory)."""
    return chunk_bytes(chunk, request, ("grads",)) if request.host_grads == "window" else 0


DERIVE_STAGING = 2
"""fp32 staging buffers on the device the plan counts for making params from the master (one per
move in flight: the store's moves run on its H2D stream, at most two at once in practice)."""


def _derive_staging(request: PlacementRequest) -> int:
    """Device bytes of the fp32 staging of params made from the master ([Note: params from the
    master]): ``DERIVE_STAGING`` shards of the largest trainable bf16/fp16 chunk, when any chunk's
    params may be homed on the host."""
    if request.host_params != "from-master" or request.params in (None, Placement.GPU, Placement.NVME):
        return 0
    sizes = [round_up(c.numel * 4, ALIGNMENT) for c in request.chunks
             if c.trainable and c.dtype is not torch.float32]
    return DERIVE_STAGING * max(sizes, default=0)


def _copy_why(chunk: ChunkNeed, homes: ChunkHomes) -> str:
    """Why a chunk whose params are homed on the host keeps their copy under "from-master" ("":
    they are made from its master)."""
    if not chunk.trainable:
        return "frozen chunks have no master"
    if chunk.dtype is torch.float32:
        return "fp32 params are the master themselves"
    if homes.optimizer is not Tier.CPU:
        return f"the master is on {homes.optimizer.value} (from the master needs it in host memory)"
    return ""


def _host_freed(chunk: ChunkNeed, request: PlacementRequest) -> int:
    """Host bytes a chunk's joining the GPU share frees: its state, grads (homed on the host:
    not the window's) and accumulation buffer, and the host update's copy out."""
    return (chunk_bytes(chunk, request, (*optimizer_payloads(chunk, request), "grads", "accum"))
            + _copy_out_bytes(chunk, request) - _windowed_grads(chunk, request))


def _plan(request: PlacementRequest) -> PlacementPlan:
    """``plan_placement`` of a request whose ``host_grads`` is decided."""
    chunks, budgets, has_nvme = request.chunks, request.budgets, request.nvme_dir is not None
    gpu_window = window_bytes(request, whole=True)  # gathers hold whole chunks ([Note: working window])
    gpu_extra = _grads_window_bytes(request) + _derive_staging(request)
    slots, grads_window = host_window(request)
    from_master = request.host_params == "from-master"
    # Host memory every placement needs: what the host update reads and writes beside the state
    # (grads, accum, a copy out) of the trainable chunks; the GPU share takes it back. Grads
    # through the window count as the window's bytes instead.
    host_fixed = grads_window + sum(chunk_bytes(c, request, ("grads", "accum")) + _copy_out_bytes(c, request)
                                    - _windowed_grads(c, request) for c in chunks if c.trainable)
    staging = _staging_bytes(request)
    need = {Tier.GPU: gpu_window + gpu_extra, Tier.CPU: host_fixed, Tier.NVME: 0}
    reserve = reserve_bytes(request)
    gpu_auto = budgets.gpu - reserve

    def host_room(extra: int) -> bool:
        return need[Tier.CPU] + extra + (staging if has_nvme else 0) <= budgets.cpu

    homes = []
    # "auto" params on the device first, every chunk's before any of the GPU share.
    auto_gpu, used = set(), need[Tier.GPU]
    if request.params is Placement.AUTO:
        for i, c in enumerate(chunks):
            if used + _params_bytes(c, request) <= gpu_auto:
                auto_gpu.add(i)
                used += _params_bytes(c, request)
    # GPU params of the chunks not placed yet: the optimizer's GPU share must leave them room.
    params_ahead = (sum(_params_bytes(c, request) for c in chunks) if request.params is Placement.GPU
                    else sum(_params_bytes(chunks[i], request) for i in auto_gpu))
    replicas = _replica_bytes(request)  # beside the homes: the share leaves them room
    share = request.optimizer is Placement.AUTO and request.gpu_optimizer
    share_ended, why, copy_why = False, "", []
    for i, c in enumerate(chunks):
        pbytes = _params_bytes(c, request)
        obytes = chunk_bytes(c, request, optimizer_payloads(c, request)) if c.trainable else 0
        # From the master: params on the host cost no host bytes where the master is there too.
        derivable = (from_master and c.trainable and c.dtype is not torch.float32
                     and request.optimizer in (Placement.CPU, Placement.AUTO))
        if request.params is None:
            ptier = None  # the front end's own tensors (on its device)
        elif request.params is Placement.AUTO:
            if i in auto_gpu:
                ptier = Tier.GPU
            elif host_room(pbytes) or not has_nvme or (derivable and host_room(obytes)):
                ptier = Tier.CPU
            else:
                ptier = Tier.NVME
        else:
            ptier = Tier(request.params.value)
        if ptier is Tier.GPU and request.params is not None:
            params_ahead -= pbytes
        deferred = derivable and ptier is Tier.CPU  # counted once the master's home is known
        if ptier is not None and not deferred:
            need[ptier] += pbytes
        otier = None
        if c.trainable:
            moves = chunk_bytes(c, request, ("grads", "accum"))  # leave the host with the update
            if share and ptier in (None, Tier.GPU):
                on_gpu = _share_bytes(c, request)  # ([Note: share grads])
                if need[Tier.GPU] + params_ahead + replicas + on_gpu <= gpu_auto:
                    otier, obytes = Tier.GPU, on_gpu
                    need[Tier.CPU] -= moves + _copy_out_bytes(c, request) - _windowed_grads(c, request)
                else:
                    share, share_ended = False, True
                    why = (f"chunk {i}'s state ({on_gpu} bytes on the device) does not fit the GPU "
                           f"budget {budgets.gpu} less the reserve {reserve} left to activations"
                           + (" (\"auto\", lowered from half the budget so that host memory holds the rest)"
                              if _reserve_lowered(request) else "")
                           + (" until the first step is measured" if request.reserve == "auto" else ""))
            elif share:
                share, share_ended = False, True
                why = f"chunk {i}'s params are not on the device (the share needs them there)"
            if otier is None and request.optimizer is Placement.AUTO:
                otier = Tier.CPU if (host_room(obytes) or not has_nvme) else Tier.NVME
            elif otier is None:
                otier = Tier(request.optimizer.value)
            need[otier] += obytes
        derived = deferred and otier is Tier.CPU
        if deferred and not derived:  # the master went to NVMe: the params keep their copy
            if request.params is Placement.AUTO and not (host_room(pbytes) or not has_nvme):
                ptier = Tier.NVME
            need[ptier] += pbytes
        if from_master and ptier is Tier.CPU and not derived:
            copy_why.append(f"chunk {i}: {_copy_why(c, ChunkHomes(params=ptier, optimizer=otier)) or 'kept'}")
        homes.append(ChunkHomes(params=ptier, optimizer=otier, from_master=derived))

    uses_nvme = any(h.params is Tier.NVME or h.optimizer is Tier.NVME for h in homes)
    working = {Tier.GPU: gpu_window + gpu_extra, Tier.CPU: (staging if uses_nvme else 0) + grads_window,
               Tier.NVME: 0}
    need[Tier.CPU] += working[Tier.CPU] - grads_window  # (the window is in host_fixed already)
    _check_fits(request, need, gpu_window=gpu_window, gpu_extra=gpu_extra,
                staging=working[Tier.CPU] - grads_window, grads_window=grads_window)
    if not why:
        why = ("every trainable chunk's state is on the device" if share and homes else
               "optimizer state is not 'auto'" if request.optimizer is not Placement.AUTO else
               "the front end updates on the host only" if not request.gpu_optimizer else "")
    plan = PlacementPlan(request=request, homes=tuple(homes), need=need, working=working,
                         share_ended=share_ended, why=why, grads_window=slots,
                         params_why=_summary(copy_why))
    if request.replicas:
        _check_replicas(plan)
    return plan


def _summary(lines: list, limit: int = 3) -> str:
    """The first ``limit`` of ``lines`` joined, and how many more."""
    more = f"; and {len(lines) - limit} more" if len(lines) > limit else ""
    return "; ".join(lines[:limit]) + more


def largest_need(needs, request: PlacementRequest) -> ChunkNeed:
    """Of one chunk's needs on every rank (rank order), the one whose payloads take the most bytes
    under ``request`` (the first such): what the plan counts for the chunk on every rank ([Note:
    ranks agree on placement]). The ranks' needs differ in the rule's state only, which all has
    one home, so no rank's bytes in any tier exceed the planned ones."""
    needs = list(needs)
    if len(needs) == 1:
        return needs[0]
    return max(needs, key=lambda c: chunk_bytes(c, request, payload_specs(c, request)))


def _share_bytes(chunk: ChunkNeed, request: PlacementRequest) -> int:
    """Device bytes a chunk of the GPU share takes: its optimizer payloads and accumulation
    buffer, and its grads where they are counted per chunk ([Note: share grads])."""
    names = (*optimizer_payloads(chunk, request), "accum") + (("grads",) if _share_grads_held(request) else ())
    return chunk_bytes(chunk, request, names)


def _share_grads_held(request: PlacementRequest) -> bool:
    """[Note: share grads] The grads of a chunk of the GPU share are transient (chunk_group.py,
    [Note: GPU share]): device memory from their staging until the update or the accumulation
    consumes them. The plan counts them per chunk only where many can be held at once: with
    ``grads_wait`` (every chunk's grads wait for the window's decision), and for a front end that
    pages no params (``params`` None: OffloadAdam, whose grads land param by param in any
    order). Otherwise the few in flight are among the working window's grads chunks ([Note:
    working window]), and the step's measured peak holds them ([Note: measured share])."""
    return request.grads_wait or request.params is None


def grow_share(plan: PlacementPlan, measured: Measured) -> PlacementPlan:
    """``plan`` with its GPU share grown by what ``measured`` leaves free ([Note: measured
    share]): the trainable chunks after the share whose params are on the device (state in host
    memory or on NVMe) join it in order, while their bytes fit both the measured headroom and the
    GPU budget less the plan's needs. Pure: the front end moves the chunks in ``grown``."""
    request = plan.request
    if not (request.optimizer is Placement.AUTO and request.gpu_optimizer):
        return dataclasses.replace(plan, measured=measured, grown=())
    budget_room = plan.budgets.gpu - plan.need[Tier.GPU] - _replica_bytes(request)
    room = max(0, min(measured.headroom, budget_room))
    homes, need, grown, why = list(plan.homes), dict(plan.need), [], ""
    for i, (c, h) in enumerate(zip(request.chunks, homes)):
        if not c.trainable or h.optimizer is Tier.GPU:
            continue
        if h.params not in (None, Tier.GPU):
            why = f"chunk {i}'s params are not on the device (the share needs them there)"
            break
        delta = _share_bytes(c, request)
        if delta > room:
            bound = ("gpu_budget" if budget_room < measured.headroom else
                     "the measured headroom (device limit - step peak - margin)")
            why = (f"chunk {i}'s state ({delta} bytes on the device) does not fit the {room} bytes left by "
                   f"{bound}")
            break
        room -= delta
        _leave(need, c, request, h.optimizer, +1)
        homes[i] = dataclasses.replace(h, optimizer=Tier.GPU)
        grown.append((i, h.optimizer))
    if not why:
        why = "every trainable chunk's state is on the device"
    grown_plan = dataclasses.replace(plan, homes=tuple(homes), need=need, share_ended=bool(why) and
                                     any(c.trainable and h.optimizer is not Tier.GPU
                                         for c, h in zip(request.chunks, homes)),
                                     why=why, measured=measured, grown=tuple(i for i, _ in grown),
                                     grown_from=tuple(t for _, t in grown))
    if request.replicas_later and _all_on_device(grown_plan) \
            and _replica_bytes(dataclasses.replace(request, replicas=True)) <= room:
        # [Note: replicas when all fits]: the room the share left takes the replicas
        grown_plan = dataclasses.replace(grown_plan, replicas_added=True, request=dataclasses.replace(
            request, replicas=True, replicas_later=False))
    return grown_plan


def _leave(need: dict, chunk: ChunkNeed, request: PlacementRequest, tier: Tier, sign: int) -> None:
    """``need`` with a chunk's state leaving ``tier`` (host memory or NVMe) for the GPU share
    (``sign`` +1), or coming back (-1): its state, grads and accumulation buffer on the device; off
    the host its grads, accumulation buffer and copy out, and its state off ``tier``."""
    state = _state_bytes(chunk, request)
    need[Tier.GPU] += sign * _share_bytes(chunk, request)
    need[Tier.CPU] -= sign * (_host_freed(chunk, request) - state)
    need[tier] -= sign * state


def shrink_share(plan: PlacementPlan, nbytes: int, *, limit: "int | None" = None) -> PlacementPlan:
    """``plan`` with chunks of its GPU share, the last first, moved to host memory until their
    device bytes reach ``nbytes`` ([Note: unmeasured share]); at most ``limit`` chunks (None: any
    number). A chunk whose move the host budget cannot take stays, with the ones before it.
    Pure: the front end moves the chunks in ``evicted``."""
    request = plan.request
    homes, need = list(plan.homes), dict(plan.need)
    share = [i for i, (c, h) in enumerate(zip(request.chunks, homes)) if c.trainable and h.optimizer is Tier.GPU]
    evicted, freed, stop = [], 0, ""
    for i in reversed(share):
        if freed >= nbytes or (limit is not None and len(evicted) >= limit):
            break
        c = request.chunks[i]
        trial = dict(need)
        _leave(trial, c, request, Tier.CPU, -1)
        if trial[Tier.CPU] > plan.budgets.cpu:
            stop = (f"; chunk {i}'s state does not fit the host budget {plan.budgets.cpu}, so it and the "
                    f"chunks before it stay")
            break
        need = trial
        homes[i] = dataclasses.replace(homes[i], optimizer=Tier.CPU)
        evicted.append(i)
        freed += _share_bytes(c, request)
    if not evicted:
        return dataclasses.replace(plan, why=plan.why + stop if stop and stop not in plan.why else plan.why)
    return dataclasses.replace(
        plan, homes=tuple(homes), need=need, share_ended=True, evicted=plan.evicted + tuple(evicted),
        why=f"{len(plan.evicted) + len(evicted)} chunk(s) of the share moved to host memory for the first "
            f"step, which needed the room ([Note: unmeasured share]){stop}")


def share_bytes(plan: PlacementPlan, indices) -> int:
    """Device bytes the share's chunks ``indices`` take under ``plan`` (``_share_bytes``)."""
    return sum(_share_bytes(plan.request.chunks[i], plan.request) for i in indices)


def _state_bytes(chunk: ChunkNeed, request: PlacementRequest) -> int:
    """Bytes of a chunk's optimizer payloads (the master and the rule's state)."""
    return chunk_bytes(chunk, request, optimizer_payloads(chunk, request))


def promote_state(plan: PlacementPlan, host_room: "int | None" = None) -> PlacementPlan:
    """``plan`` with the trainable chunks whose optimizer state is on NVMe brought into host
    memory, in order, while their state fits what the host budget leaves (less the plan's need,
    which the GPU share grown before has lowered) and ``host_room`` (bytes free in host memory
    now for this rank, None: the budget alone) ([Note: measured share]). Only "auto" state. Pure:
    the front end moves the chunks in ``promoted``."""
    request = plan.request
    if request.optimizer is not Placement.AUTO:
        return dataclasses.replace(plan, promoted=(), nvme_why="")
    room = plan.budgets.cpu - plan.need[Tier.CPU]
    bound = "cpu_budget less the plan's host memory"
    if host_room is not None and host_room < room:
        room, bound = host_room, "the host memory free now (less the auto reserve)"
    room = max(0, room)
    homes, need, promoted, why = list(plan.homes), dict(plan.need), [], ""
    for i, (c, h) in enumerate(zip(request.chunks, homes)):
        if not c.trainable or h.optimizer is not Tier.NVME:
            continue
        moved = _state_bytes(c, request)
        if moved > room:
            why = f"chunk {i}'s state ({moved} bytes) does not fit the {room} bytes left by {bound}"
            break
        room -= moved
        need[Tier.CPU] += moved
        need[Tier.NVME] -= moved
        homes[i] = dataclasses.replace(h, optimizer=Tier.CPU)
        promoted.append(i)
    return dataclasses.replace(plan, homes=tuple(homes), need=need, promoted=tuple(promoted), nvme_why=why)


def host_room(local_ranks: int = 1) -> int:
    """Bytes of host memory free now for one of ``local_ranks`` ranks, less the store's "auto"
    reserve: what an "auto" host budget resolved now would be ([Note: rank budgets])."""
    return rank_budgets({Tier.CPU: "auto"}, local_ranks=local_ranks).cpu


def _check_fits(request: PlacementRequest, need: dict, *, gpu_window: int, gpu_extra: int,
                staging: int, grads_window: int = 0) -> None:
    budgets, prefix = request.budgets, request._prefix
    if need[Tier.GPU] > budgets.gpu:
        big_bytes = max(_params_bytes(c, request) for c in request.chunks)
        home = need[Tier.GPU] - gpu_window - gpu_extra
        derive = _derive_staging(request)
        grads = gpu_extra - derive
        raise FitError(
            f"{prefix}gpu_budget={budgets.gpu} bytes cannot hold the working set: {home} bytes of "
            f"params homed on the compute device + "
            + (f"{grads} bytes of fp32 grads window (grad_sync='final'; 'every' keeps it in host "
               f"memory) + " if grads else "")
            + (f"{derive} bytes of fp32 staging for params made from the master (host_params="
               f"'from-master') + " if derive else "")
            + f"a working window of {gpu_window} bytes "
            f"((prefetch_depth {request.prefetch_depth} + {3 + PARKED_CHUNKS}) params chunks + 3 grads "
            f"chunks; the largest chunk holds {big_bytes} bytes of params) = {need[Tier.GPU]} bytes. "
            f"Raise gpu_budget to at least {need[Tier.GPU]}, or lower chunk_mb or prefetch_depth"
            + (", or place params on 'cpu'" if home and request.params is not None else ""))
    if need[Tier.CPU] > budgets.cpu:
        params = request.params is not None
        window = request.host_grads == "window"
        raise FitError(
            f"{prefix}cpu_budget={budgets.cpu} bytes is too small: the host-memory homes ("
            f"{'' if window else 'grads, '}{'accumulation buffers, ' if request.accum else ''}"
            f"{'params and ' if params else ''}optimizer state placed on 'cpu') plus {staging} bytes of "
            f"NVMe staging" + (f" and {grads_window} bytes of the grads window" if window else "")
            + f" need {need[Tier.CPU]} bytes. Raise cpu_budget, or place optimizer state "
            f"({request.state_option}='nvme')" + (" or params (params='nvme')" if params else "")
            + " on NVMe with nvme_dir set, or lower chunk_mb / prefetch_depth")
    if need[Tier.NVME] > budgets.nvme:
        free, holders = "", ""
        if request.nvme_dir is not None:
            with contextlib.suppress(OSError):
                free = f"; {shutil.disk_usage(request.nvme_dir).free} bytes are free there"
            holders = disk_holders(request.nvme_dir)
        auto = Tier.NVME in budgets.auto
        what = ("'auto': free space less a reserve of at most "
                f"{NVME_AUTO_RESERVE >> 30} GiB" if auto else f"nvme_budget={budgets.nvme}")
        raise FitError(
            f"{prefix}the NVMe directory {os.fspath(request.nvme_dir)!r} is too small: the state "
            f"placed there needs {need[Tier.NVME]} bytes ({need[Tier.NVME] / 2**30:.2f} GiB) but its "
            f"budget is {budgets.nvme} bytes ({what}){free}{holders}. Free space there, point "
            f"nvme_dir at a larger disk, {'' if auto else 'raise nvme_budget, '}or keep more state "
            f"in host memory ({request.state_option}='cpu' or 'auto')")


def _replica_bytes(request: PlacementRequest) -> int:
    """Device bytes of the whole params replicas beside the homes (``PlacementRequest.replicas``)."""
    if not request.replicas:
        return 0
    return sum(c.numel * request.ranks * c.dtype.itemsize for c in request.chunks)


def _check_replicas(plan: PlacementPlan) -> None:
    """params="gpu" with several ranks keeps a full replica of every chunk's params on each GPU
    beside the rank's shards (engine.py, [Note: data parallel]): refuse before anything is
    allocated when the budget cannot hold both."""
    request, gpu = plan.request, plan.budgets.gpu
    world = request.ranks
    replicas = _replica_bytes(request)
    need = plan.need[Tier.GPU] + replicas
    if need > gpu:
        raise FitError(
            f"{request._prefix}params='gpu' with {world} ranks keeps a full replica of the params on "
            f"every GPU ({replicas / 2**30:.2f} GiB) beside this rank's shards and working window "
            f"({plan.need[Tier.GPU] / 2**30:.2f} GiB): {need / 2**30:.2f} GiB > gpu_budget "
            f"{gpu / 2**30:.2f} GiB. Use params='auto' or 'cpu' (each GPU then holds 1/{world} "
            f"of the params and gathers a chunk while it is used), or raise gpu_budget")
