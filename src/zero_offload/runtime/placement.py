"""Where each chunk's payloads live (home tiers), and whether that fits the budgets.

Payloads of a chunk (all flat, one element per parameter element, padding included):

=============  ======================  ==========================================================
payload        dtype                   home
=============  ======================  ==========================================================
params         working (config.dtype)  ``OffloadConfig.params`` (auto: GPU, then CPU, then NVMe)
grads          working                 CPU (written on the GPU in backward, flushed down; the
                                       GPU for the GPU share, which updates it there)
master         fp32                    ``OffloadConfig.optimizer``; only when dtype is not fp32
                                       (in fp32 training ``params`` is the master copy)
the rule's     the rule's (Adam:       ``OffloadConfig.optimizer`` (auto: the GPU share when the
state          exp_avg, exp_avg_sq:    front end updates on the device, then CPU, then NVMe)
               fp32, or bf16 with
               ``moments_dtype="bf16"``)
accum          fp32                    CPU (the GPU for the GPU share); only when ``grad_accum > 1``
                                       and ``grad_sync="every"``
=============  ======================  ==========================================================

The update rule (runtime/update_rule.py) declares its state payloads, their sizes and dtypes
(``UpdateRule.payloads``); the rest are the runtime's own.

Frozen chunks (no trainable parameter) carry ``params`` only.

[Note: working window] Besides the home copies, the compute device must hold, at the worst
moment of backward, a few chunks in use at once with their grads buffers: a chunk is held from
its first grad until its last one lands, so the one backward is in and the one it straddles into
stay, and so does the chunk of a tied embedding (its grad completes only at the very end); plus
the look-ahead, and the chunks parked on the device after use (prefetch.py, [Note: holds]).
``window_bytes`` sizes that as (prefetch_depth + 3 + PARKED_CHUNKS) params chunks plus three
grads chunks of the largest size; initialize refuses a GPU budget below homes + window, with
the numbers. When optimizer state or params live on NVMe, host memory needs a staging window
of (prefetch_depth + 1) chunks of what is read ahead.
"""
from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass

import torch

from .partition import ChunkLayout, Partition
from .store import Tier
from .update_rule import StateSpec, UpdateRule
from .vocab import ALIGNMENT, Placement, round_up

__all__ = ["ChunkHomes", "PlacementPlan", "plan_placement", "FitError", "keep_limit", "PARKED_CHUNKS"]

PARKED_CHUNKS = 2
"""Chunks kept on the device after their last user let go (prefetch.py, [Note: holds]); part of
the working window."""

KEEP_SHARE = 0.5
"""Share of the GPU budget up to which params copies are kept from forward to backward; the
rest is left to activations, which the store does not see (as for "auto" params homes)."""


class FitError(ValueError):
    """The configuration cannot fit the budgets; the message has the numbers and the fix."""


@dataclass(frozen=True)
class ChunkHomes:
    """Home tier of each payload of one chunk."""

    params: Tier
    optimizer: "Tier | None"
    """Home of master and the rule's state (None for frozen chunks)."""


@dataclass(frozen=True)
class PlacementPlan:
    homes: tuple
    """One ChunkHomes per chunk of the partition."""
    need: dict
    """Tier -> bytes the homes and working windows need."""

    def count(self, *, params: "Tier | None" = None, optimizer: "Tier | None" = None) -> int:
        return sum(1 for h in self.homes
                   if (params is None or h.params is params)
                   and (optimizer is None or h.optimizer is optimizer))


def payload_specs(chunk: ChunkLayout, config: OffloadConfig, rule: "UpdateRule | None") -> dict:
    """name -> ``StateSpec`` (elements, dtype) of the payloads a chunk of ``chunk.numel``
    elements carries (see the table above). ``rule``: the update rule, for its state (None: the
    runtime's own payloads only)."""
    work = config.torch_dtype
    n = chunk.numel
    if not chunk.trainable:
        return {"params": StateSpec(n, work)}
    out = {"params": StateSpec(n, work), "grads": StateSpec(n, work)}
    if work is not torch.float32:
        out["master"] = StateSpec(n, torch.float32)
    if rule is not None:
        out.update(rule.payloads(n, tuple(tuple(s.shape) for s in chunk.slots)))
    if config.host_accum:
        out["accum"] = StateSpec(n, torch.float32)
    return out


def optimizer_payloads(config: OffloadConfig, rule: UpdateRule) -> tuple:
    """Payloads homed by ``OffloadConfig.optimizer``: the master and the rule's state (fp32
    training: the params are the master copy and stay where ``OffloadConfig.params`` puts them)."""
    if config.torch_dtype is torch.float32:
        return tuple(rule.state_keys)
    return ("master", *rule.state_keys)


def chunk_bytes(chunk: ChunkLayout, config: OffloadConfig, names,
                rule: "UpdateRule | None" = None) -> int:
    """Bytes of the payloads ``names`` of a chunk, each padded as the store holds it (a name the
    chunk does not carry counts 0; the rule's state counts only when ``rule`` is given)."""
    specs = payload_specs(chunk, config, rule)
    return sum(round_up(specs[n].numel * specs[n].dtype.itemsize, ALIGNMENT) for n in names if n in specs)


def window_bytes(partition: Partition, config: OffloadConfig) -> int:
    """GPU bytes beyond the homes that training needs; see [Note: working window]."""
    big_params = max(chunk_bytes(c, config, ("params",)) for c in partition.chunks)
    trainable = [c for c in partition.chunks if c.trainable]
    big_grads = max((chunk_bytes(c, config, ("grads",)) for c in trainable), default=0)
    return (config.prefetch_depth + 3 + PARKED_CHUNKS) * big_params + 3 * big_grads


def keep_limit(partition: Partition, config: OffloadConfig, gpu_budget: int) -> int:
    """GPU-tier bytes held by the store up to which the engine keeps a chunk's params copy on the
    device after its forward use, for the backward (prefetch.py, [Note: holds]): at most
    ``KEEP_SHARE`` of the budget, and never eating into the working window (a budget that only
    fits homes + window gives 0: copies are released after use, as without keeping)."""
    return max(0, min(int(KEEP_SHARE * gpu_budget), gpu_budget - window_bytes(partition, config)))


def plan_placement(partition: Partition, config: OffloadConfig, budgets: dict, *, rule: UpdateRule,
                   has_nvme: bool, gpu_optimizer: bool = False,
                   gpu_extra: int = 0) -> PlacementPlan:
    """Home tiers per chunk for ``config`` within ``budgets`` (Tier -> bytes, resolved), or a
    ``FitError`` naming the budget, the numbers and what to change.

    "auto" params fill the GPU first, up to its budget less ``config.activation_reserve`` (left
    to activations, which the store does not see; "auto": half the budget), then host memory,
    then NVMe; "auto" optimizer state fills host memory first, then NVMe. With ``gpu_optimizer`` (the front end updates
    such chunks on the device: [Note: GPU share]) "auto" optimizer state of chunks whose params
    live on the GPU fills the GPU first, in chunk order (the first layers, which the next
    forward needs first), within the same share: their state, accumulation buffer and the grads
    the device keeps until the step. ``gpu_extra``: device bytes the front end holds beside the
    homes and the working window (``grad_sync="final"``'s fp32 window), counted first. ``rule``:
    the update rule, whose state is homed with the master.
    """
    if not partition.chunks:
        raise FitError("the model has no parameters to train or page; nothing to offload")
    opt_names = optimizer_payloads(config, rule)
    gpu_window = window_bytes(partition, config)
    # Host memory every placement needs: grads (and accum) homes of trainable chunks.
    host_fixed = sum(chunk_bytes(c, config, ("grads", "accum")) for c in partition.chunks if c.trainable)
    staging_unit = max(chunk_bytes(c, config, ("params",) + opt_names, rule) for c in partition.chunks)
    staging = (config.prefetch_depth + 1) * staging_unit
    need = {Tier.GPU: gpu_window + gpu_extra, Tier.CPU: host_fixed, Tier.NVME: 0}
    reserve = config.activation_reserve
    gpu_auto = budgets[Tier.GPU] - (budgets[Tier.GPU] // 2 if reserve == "auto" else reserve)

    def host_room(extra: int) -> bool:
        return need[Tier.CPU] + extra + (staging if has_nvme else 0) <= budgets[Tier.CPU]

    homes = []
    # Explicit GPU params of the chunks not placed yet: the optimizer's GPU share must leave them room.
    params_ahead = (sum(chunk_bytes(c, config, ("params",)) for c in partition.chunks)
                    if config.params is Placement.GPU else 0)
    for c in partition.chunks:
        pbytes = chunk_bytes(c, config, ("params",))
        if config.params is Placement.GPU:
            params_ahead -= pbytes
        if config.params is Placement.AUTO:
            if need[Tier.GPU] + pbytes <= gpu_auto:
                ptier = Tier.GPU
            elif host_room(pbytes) or not has_nvme:
                ptier = Tier.CPU
            else:
                ptier = Tier.NVME
        else:
            ptier = Tier(config.params.value)
        need[ptier] += pbytes
        otier = None
        if c.trainable:
            obytes = chunk_bytes(c, config, opt_names, rule)
            fixed = chunk_bytes(c, config, ("grads", "accum"))
            if config.optimizer is Placement.AUTO and gpu_optimizer and ptier is Tier.GPU \
                    and need[Tier.GPU] + params_ahead + obytes + fixed <= gpu_auto:
                otier, obytes = Tier.GPU, obytes + fixed
                need[Tier.CPU] -= fixed  # its grads (and accum) home there too
            elif config.optimizer is Placement.AUTO:
                otier = Tier.CPU if (host_room(obytes) or not has_nvme) else Tier.NVME
            else:
                otier = Tier(config.optimizer.value)
            need[otier] += obytes
        homes.append(ChunkHomes(params=ptier, optimizer=otier))

    uses_nvme = any(h.params is Tier.NVME or h.optimizer is Tier.NVME for h in homes)
    if uses_nvme:
        need[Tier.CPU] += staging
    _check_fits(partition, config, budgets, need, gpu_window=gpu_window, gpu_extra=gpu_extra,
                staging=staging if uses_nvme else 0)
    return PlacementPlan(homes=tuple(homes), need=need)


def _check_fits(partition, config, budgets, need, *, gpu_window, gpu_extra, staging) -> None:
    big = max(partition.chunks, key=lambda c: c.numel)
    big_bytes = chunk_bytes(big, config, ("params",))
    if need[Tier.GPU] > budgets[Tier.GPU]:
        home = need[Tier.GPU] - gpu_window - gpu_extra
        raise FitError(
            f"gpu_budget={budgets[Tier.GPU]} bytes cannot hold the working set: {home} bytes of "
            f"params homed on the compute device + "
            + (f"{gpu_extra} bytes of fp32 grads window (grad_sync='final'; 'every' keeps it in host "
               f"memory) + " if gpu_extra else "")
            + f"a working window of {gpu_window} bytes "
            f"((prefetch_depth {config.prefetch_depth} + {3 + PARKED_CHUNKS}) params chunks + 3 grads chunks; the "
            f"largest chunk holds {big_bytes} bytes of params) = {need[Tier.GPU]} bytes. Raise gpu_budget to at "
            f"least {need[Tier.GPU]}, or lower chunk_mb (now {config.chunk_mb}) or prefetch_depth"
            + (", or place params on 'cpu'" if home else ""))
    if need[Tier.CPU] > budgets[Tier.CPU]:
        raise FitError(
            f"cpu_budget={budgets[Tier.CPU]} bytes is too small: the host-memory homes (grads"
            f"{', accumulation buffers' if config.host_accum else ''}, params and optimizer "
            f"state placed on 'cpu') plus {staging} bytes of NVMe staging need {need[Tier.CPU]} "
            f"bytes. Raise cpu_budget, or place optimizer state (optimizer='nvme') or params "
            f"(params='nvme') on NVMe with nvme_dir set, or lower chunk_mb / prefetch_depth")
    if need[Tier.NVME] > budgets[Tier.NVME]:
        from .swap_io import NVME_AUTO_RESERVE, disk_holders
        free, holders = "", ""
        if config.nvme_dir is not None:
            with contextlib.suppress(OSError):
                free = f"; {shutil.disk_usage(config.nvme_dir).free} bytes are free there"
            holders = disk_holders(config.nvme_dir)
        raise FitError(
            f"the NVMe directory {config.nvme_dir!r} is too small: the state placed there needs "
            f"{need[Tier.NVME]} bytes ({need[Tier.NVME] / 2**30:.2f} GiB) but its budget is "
            f"{budgets[Tier.NVME]} bytes (nvme_budget={config.nvme_budget!r}; 'auto' = free space "
            f"less a reserve of at most {NVME_AUTO_RESERVE >> 30} GiB){free}{holders}. Free space there, point nvme_dir at a "
            f"larger disk, raise nvme_budget, or keep more state in host memory (optimizer='cpu' or 'auto')")
