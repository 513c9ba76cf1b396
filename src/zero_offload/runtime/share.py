"""The ranks' placement, carried out: the plan every rank reaches from the same inputs, the store
it opens, and the GPU share grown after a measured step. placement.py decides (pure functions of
a ``PlacementRequest``); this module runs the decisions against a ``ChunkStore`` and over the
ranks (``Shards``), so a front end never calls the store or a collective for them ([Note: ranks
agree on placement] in placement.py, [Note: ranks raise together] in shards.py, [Note: measured
share] in placement.py). Its inputs are neutral (budgets, requests, callables for the front end's
own checks): no front end or config is imported here.

- ``place``: each rank alone up to its budgets, then all plan from the same inputs and open the
  store; a failure on any rank raises on every rank.
- ``measure_step``: after the first step, the device's measurement for ``grow``.
- ``grow``: the GPU share grown by a measured step, then NVMe state brought into the host memory
  that leaves free; a move that fails falls back at the same chunk on every rank.
- ``evict``: chunks of the share moved to host memory for a step before the first measurement
  that needs the room ([Note: unmeasured share] in placement.py), agreed over the ranks;
  ``MeasuredShare`` does it around a front end's forward and backward, measures the step and
  grows the share by it.
- ``abandon``: clean-up of a front end whose construction failed.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from .chunk_group import ChunkGroup
from .placement import (ChunkNeed, DeviceMemory, FitError, Measured, PlacementPlan, PlacementRequest,
                        chunk_payloads, common_budgets, common_reserve, device_memory, grow_share, host_room,
                        largest_need, local_ranks, margin_of, plan_placement, promote_state, rank_budgets,
                        share_bytes, shrink_share, tightest)
from .shards import Shards
from .store import BudgetError, ChunkStore, StoreConfig, Tier
from .vocab import Placement

__all__ = ["ALL_OF_THE_SHARE", "MeasuredShare", "abandon", "evict", "grow", "measure_step", "place"]


def place(shards: Shards, *, device: torch.device, budgets: Mapping, reserve: Any,
          nvme_dir: Optional[str], prepare: Callable[[], int],
          request: Callable[..., PlacementRequest], needs: Callable[[int], Sequence[ChunkNeed]],
          check: Callable[[PlacementPlan], None], io: Mapping[str, int],
          owner: str = "zero_offload.initialize") -> tuple[PlacementPlan, ChunkStore]:
    """The plan and the store, before anything else is allocated. Each rank alone up to its
    budgets, then all plan from the same inputs, and a failure on any rank raises on every rank
    ([Note: ranks agree on placement] in placement.py, [Note: ranks raise together] in
    shards.py).

    Args:
        budgets: the asked budget per tier (bytes or "auto"); ``reserve``: the activation reserve.
        nvme_dir: the swap directory asked for (None: no NVMe tier); with several ranks each
            rank's swap files go in its own ``rank{r}`` directory under it.
        prepare: the front end's own checks of this rank (its initial values), run first;
            returns the host bytes the model's own copy frees as the chunks fill.
        request: ``request(chunks=, budgets=, reserve=)``, the ``PlacementRequest`` (this rank's
            chunk needs; with several ranks the largest of each chunk over the ranks replaces them).
        needs: ``needs(rank)``: every chunk's ``ChunkNeed`` for that rank's shard.
        check: the front end's check of the plan (raises what does not fit).
        io: the store's I/O settings (``StoreConfig`` fields: io_threads, io_block_size, ...).
    """
    ranked = shards.world > 1
    failure = own = None
    try:
        freed = prepare()
        if nvme_dir is not None:
            from .swap_io import free_stale_spaces, prepare_swap_dir
            prepare_swap_dir(nvme_dir, name="OffloadConfig.nvme_dir")  # created 0700 if missing
            if ranked:  # each rank its own swap files
                nvme_dir = prepare_swap_dir(os.path.join(nvme_dir, f"rank{shards.rank}"),
                                            name="OffloadConfig.nvme_dir")
            free_stale_spaces(nvme_dir)  # dead runs' spaces: before the free space is measured
        # This rank's share of the node's budgets ([Note: rank budgets]).
        own = rank_budgets(dict(budgets), device=device, nvme_dir=nvme_dir,
                           local_ranks=local_ranks() if ranked else 1,
                           freed_host=freed)  # the model's own host copy is freed as chunks fill
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange
        failure = e
    asked = shards.exchange((own, reserve), error=failure,
                            doing="prepare its shard (its weights, swap directory and budgets)",
                            what="the exchange of the ranks' budgets", owner=owner)
    common = common_budgets(b for b, _ in asked)
    reserve = common_reserve((r for _, r in asked), common.gpu)
    # Placement sees the shards of the chunks ([Note: data parallel] in engine.py); the plan
    # refuses what does not fit, before anything is allocated.
    failure = store = plan = None
    try:
        req = request(chunks=tuple(needs(shards.rank)), budgets=common, reserve=reserve)
        if ranked:  # every rank's needs are known here: plan the largest of each chunk
            per_rank = [tuple(needs(r)) for r in range(shards.world)]
            req = dataclasses.replace(req, chunks=tuple(
                largest_need(list(chunk), req) for chunk in zip(*per_rank)))
        plan = plan_placement(req)
        check(plan)
        # The swap file is preallocated to the NVMe budget: exactly what the plan needs (each
        # payload's slot rounded up to 4096, as the plan counts it).
        store_budgets = {**common.as_dict(), Tier.NVME: plan.need[Tier.NVME]}
        store = ChunkStore(StoreConfig(device=device, budgets=store_budgets, nvme_dir=nvme_dir,
                                       window_slots=plan.grads_window, **io))
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange
        failure = e
        whose = _whose_budgets(asked, shards.rank) if isinstance(e, FitError) else ""
        if whose:  # (the budget the message names may be another rank's)
            failure = FitError(f"{e} ({whose})").with_traceback(e.__traceback__)
    try:
        homes = shards.exchange(plan.homes if failure is None else None, error=failure,
                                doing="place its shard", what="the exchange of the ranks' placements",
                                owner=owner)
        if any(h != homes[0] for h in homes):  # (cannot happen: the safety net of the Note)
            raise RuntimeError(
                f"{owner}: the ranks planned different homes for their shards "
                f"(rank {shards.rank}: {plan.count(optimizer=Tier.GPU)} chunks' state on "
                f"the device); this is a bug of zero_offload, please report it with the config")
    except BaseException:
        if store is not None:
            store.close()
        raise
    return plan, store


def _whose_budgets(asked: list, rank: int) -> str:
    """Which of the ranks' budgets (``asked``: per rank its ``Budgets`` and activation reserve)
    every rank planned with where they are not ``rank``'s own, in words ("" when all are): [Note:
    ranks agree on placement] in placement.py."""
    own, reserve = asked[rank]
    parts = []
    for tier in Tier:
        least = min(b[tier] for b, _ in asked)
        if least < own[tier]:
            r = next(r for r, (b, _) in enumerate(asked) if b[tier] == least)
            parts.append(f"{tier.value}_budget {least} bytes is rank {r}'s")
    gpu = min(b[Tier.GPU] for b, _ in asked)
    bytes_of = [gpu // 2 if res == "auto" else res for _, res in asked]
    if max(bytes_of) > bytes_of[rank]:
        parts.append(f"activation_reserve {max(bytes_of)} bytes is rank {bytes_of.index(max(bytes_of))}'s")
    if not parts:
        return ""
    return (f"every one of the {len(asked)} ranks plans with the least budgets and the largest reserve "
            f"of them all: {', '.join(parts)}")


def measure_step(group: ChunkGroup, memory: DeviceMemory, *, floor: int = 0) -> Measured:
    """The device measured after a step, for ``grow`` ([Note: measured share]); its peak at least
    ``floor`` ([Note: unmeasured share])."""
    return memory.measure(store_peak=group.store.peak_bytes(Tier.GPU), floor=floor)


ALL_OF_THE_SHARE = 1 << 62
"""``evict``'s bytes for the whole share."""


def evict(group: ChunkGroup, plan: PlacementPlan, nbytes: int, need: Callable[[int], ChunkNeed], *,
          owner: str = "zero_offload") -> PlacementPlan:
    """Chunks of the GPU share, the last first, moved to host memory until ``nbytes`` of the
    device are free of them (``ALL_OF_THE_SHARE``: every chunk), for a step before the first
    measurement ([Note: unmeasured share] in placement.py); between windows. Returns the new plan
    (its ``evicted``; unchanged when nothing moves). Collective with several ranks: each passes its
    own ``nbytes``, every rank evicts for the largest, and a move that fails on any rank stops every
    rank at the same chunk (the ones before it stay in the share). ``need(i)``: chunk i's
    ``ChunkNeed`` (this rank's shard)."""
    shards = group.shards
    if shards.world > 1:
        nbytes = max(shards.exchange(int(nbytes), doing="measure the room its step needs",
                                     what="the exchange of the ranks' room on the device", owner=owner))
    if nbytes <= 0:
        return plan
    shrunk = shrink_share(plan, nbytes)
    chunks = shrunk.evicted[len(plan.evicted):]
    moved, failed, error = _moves(shards, chunks, lambda i: _rehome_as_planned(group, shrunk, i, need(i)),
                                  memory=_HOST_ERRORS, owner=owner,
                                  doing="move its optimizer state out of the GPU share")
    if error is not None:
        back = chunks[failed:moved]  # moved here, not on the failing rank: back into the share
        shrunk = shrink_share(plan, nbytes, limit=failed)
        shrunk = dataclasses.replace(shrunk, why=f"{shrunk.why}; chunk {chunks[failed]}'s move to host "
                                                 f"memory failed ({type(error).__name__}: "
                                                 f"{(str(error).splitlines() or [''])[0][:200]})")
        for i in back:
            _rehome_as_planned(group, shrunk, i, need(i))
    return shrunk


def grow(group: ChunkGroup, plan: PlacementPlan, measured: Measured, need: Callable[[int], ChunkNeed], *,
         owner: str = "zero_offload") -> PlacementPlan:
    """Grow the GPU share of the optimizer by what ``measured`` leaves free, then bring state on
    NVMe into the host memory that frees ([Note: measured share] in placement.py); between
    windows. A chunk whose move fails stays where it was with the ones after it (``plan.report()``
    says so). Returns the new plan. Collective with several
    ranks: each passes its own ``measured``, and every rank ends with the same share ([Note: ranks
    agree on placement]). ``need(i)``: chunk i's ``ChunkNeed`` (this rank's shard)."""
    shards = group.shards
    ranked = shards.world > 1
    if ranked:
        measured = tightest(shards.exchange(measured, doing="measure its device",
                                            what="the exchange of the ranks' measured steps", owner=owner))
    plan = grow_share(plan, measured)
    moved, failed, error = _moves(shards, plan.grown, lambda i: _rehome_as_planned(group, plan, i, need(i)),
                                  memory=(torch.OutOfMemoryError, BudgetError), owner=owner,
                                  doing="move its optimizer state into the GPU share")
    if error is not None:
        plan = plan.fall_back(plan.grown[failed], error)
        for i in plan.fell_back[:moved - failed]:  # moved here, not on the failing rank: back
            _rehome_as_planned(group, plan, i, need(i))
    if plan.replicas_added:  # [Note: replicas when all fits]: gathered at the next use, then kept
        group.replicas = True
    return _promote(group, plan, need, owner=owner)


class MeasuredShare:
    """A front end's GPU share around its first step, on CUDA ([Note: unmeasured share] and
    [Note: measured share] in placement.py): ``forward`` runs a forward that ran out of memory
    again with the share on the host (one process), ``before_backward`` gives backward the room
    its forward says it needs (collective with ranks), ``measure`` reads the step and ``grow``
    grows the share by a measurement. ``plan``/``set_plan`` read and replace the front end's
    plan; ``on_failure`` is told of a move that failed. ``memory``: the device's allocator (None
    off CUDA: nothing happens; a test sets its own)."""

    def __init__(self, group: ChunkGroup, device: torch.device, *, plan: Callable[[], PlacementPlan],
                 set_plan: Callable[[PlacementPlan], None], need: Callable[[int], ChunkNeed],
                 on_failure: Callable[[BaseException], None], owner: str):
        self.group, self.device, self.owner = group, torch.device(device), owner
        self._plan, self._set_plan, self._need, self._on_failure = plan, set_plan, need, on_failure
        self.memory: Optional[DeviceMemory] = device_memory(device)
        self.start: Optional[int] = None
        """Bytes allocated when the forward began (None: no forward of such a step pending)."""
        self.floor = 0
        """The measured step's peak is at least this."""

    def active(self) -> bool:
        """A micro-batch opening the first window, before the measurement, with an "auto" share."""
        plan = self._plan()
        return (self.memory is not None and plan.measured is None and self.group.micro == 0
                and plan.request.optimizer is Placement.AUTO and plan.request.gpu_optimizer)

    def forward(self, run: Callable[[], Any]) -> Any:
        """``run()`` (one forward pass, its holds let go after an error); one that ran out of
        memory runs once more with the whole share on the host, the random-number generators put
        back (one process only: with ranks the others wait in the forward's collectives)."""
        first = self.active()
        rng = _rng_states(self.device) if first and self.group.shards.world == 1 else None
        if first:
            self.memory.restart_peaks()  # (the step's own peak, not the process's so far)
        self.start = self.memory.allocated() if first else None
        try:
            return run()
        except torch.OutOfMemoryError as e:
            # (the host budget taking none of the share: raised as it is)
            if rng is None or self._plan().count(optimizer=Tier.GPU) == 0 \
                    or not self._evict(ALL_OF_THE_SHARE, floor=0, release=False):
                raise
            line = (str(e).splitlines() or [""])[0][:160]
        # Out of the except block: the error's frames, and the activations they held, are gone.
        self.memory.release()
        warnings.warn(f"zero_offload: the first forward ran out of CUDA memory beside the GPU share of the "
                      f"optimizer ({line}); {len(self._plan().evicted)} chunks' state moved to host memory "
                      f"and the forward ran again (the measured step grows the share back)", stacklevel=3)
        _set_rng_states(self.device, rng)
        self.start = self.memory.allocated()
        return run()

    def before_backward(self) -> None:
        """The share gives back what the device lacks for backward: what the forward reached
        above its start, and the margin, beyond the free room. Collective with several ranks."""
        start, self.start = self.start, None
        if start is None or not self.active():
            return
        mem = self.memory
        limit, allocated = mem.limit(), mem.allocated()
        short = max(0, mem.peak_allocated() - start) + margin_of(limit) - (limit - allocated)
        if short > 0 or self.group.shards.world > 1:  # (every rank takes part in the exchange)
            self._evict(max(0, short), floor=mem.peak_reserved())

    def _evict(self, nbytes: int, *, floor: int, release: bool = True) -> bool:
        """``evict``; then (``release``) the allocator's cache and peaks restart; the measured
        peak is at least ``floor`` less the bytes that left. Whether a chunk left."""
        plan = self._plan()
        try:
            new = evict(self.group, plan, nbytes, self._need, owner=self.owner)
        except BaseException as e:
            self._on_failure(e)
            raise
        self._set_plan(new)
        if len(new.evicted) == len(plan.evicted):
            return False
        if release:
            self.memory.release()
        self.floor = max(0, floor - share_bytes(new, new.evicted[len(plan.evicted):]))
        return True

    def grow(self, measured: Measured, *, owner: str) -> PlacementPlan:
        """``grow`` of the front end's plan by ``measured``; returns the new plan."""
        try:
            plan = grow(self.group, self._plan(), measured, self._need, owner=owner)
        except BaseException as e:
            self._on_failure(e)  # (several ranks: their shares may differ now; one rank: nothing)
            raise
        self._set_plan(plan)
        return plan

    def measure(self) -> Optional[Measured]:
        """The first window's measurement for ``grow`` (None: measured already, or no CUDA)."""
        if self.memory is None or self._plan().measured is not None:
            return None
        return measure_step(self.group, self.memory, floor=self.floor)


def _rng_states(device: torch.device) -> tuple:
    """The CPU's and ``device``'s random-number generator states."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_states(device: torch.device, states: tuple) -> None:
    cpu, dev = states
    torch.set_rng_state(cpu)
    if dev is not None:
        torch.cuda.set_rng_state(dev, device)


_HOST_ERRORS = (MemoryError, OSError, torch.OutOfMemoryError)
"""A move into host memory that fails for want of memory or of a transfer (``BudgetError`` is a
MemoryError; pinning raises RuntimeError and is not among them: a bug or a broken driver)."""


def _promote(group: ChunkGroup, plan: PlacementPlan, need: Callable[[int], ChunkNeed], *,
             owner: str) -> PlacementPlan:
    """``grow``'s second part: NVMe state brought into the host memory left free ([Note:
    measured share] in placement.py), the ranks agreeing on the room (the least of theirs) and
    on the first chunk whose move failed, from which on the chunks stay on NVMe."""
    if not any(h.optimizer is Tier.NVME for h in plan.homes):
        return plan
    shards = group.shards
    ranked = shards.world > 1
    room = None
    if Tier.CPU in plan.budgets.auto:
        room = host_room(local_ranks() if ranked else 1)
        if ranked:
            room = min(shards.exchange(room, doing="measure its host memory",
                                       what="the exchange of the ranks' free host memory", owner=owner))
    plan = promote_state(plan, room)
    moved, failed, error = _moves(shards, plan.promoted, lambda i: _rehome_as_planned(group, plan, i, need(i)),
                                  memory=_HOST_ERRORS, owner=owner,
                                  doing="move its optimizer state from NVMe into host memory")
    if error is not None:
        back = plan.promoted[failed:moved]  # moved here, not on the failing rank: back to NVMe
        plan = plan.stop_promotion(plan.promoted[failed], error)
        for i in back:
            _rehome_as_planned(group, plan, i, need(i))
    return plan


def _moves(shards: Shards, chunks: Sequence[int], move: Callable[[int], None], *, memory: tuple,
           owner: str, doing: str) -> tuple:
    """``move(i)`` for each of ``chunks`` in order, until one fails: ``(moved, failed, error)``,
    the moves done here, the first failed one over the ranks (``_agree_fall_back``) and its error
    (None: all moved). A failure for want of memory (``memory``: exception types) is the error;
    any other raises (one rank), or on every rank (several)."""
    ranked = shards.world > 1
    moved, error, fatal = len(chunks), None, None
    for k, i in enumerate(chunks):
        try:
            move(i)
        except memory as e:
            moved, error = k, e
            break
        except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange
            if not ranked:
                raise
            moved, fatal = k, e
            break
    failed = moved
    if ranked:
        failed, error = _agree_fall_back(shards, moved, error, fatal, owner=owner, doing=doing)
    return moved, failed, error


def _agree_fall_back(shards: Shards, moved: int, error: Optional[BaseException],
                     fatal: Optional[BaseException], *, owner: str, doing: str) -> tuple:
    """Several ranks: the first of the grown chunks whose move failed on any rank (this
    rank's: ``moved``, its ``error``) and that error (another rank's: named), so every rank
    falls back at the same chunk ([Note: ranks agree on placement] in placement.py).
    ``fatal``: a move failed otherwise than for memory: every rank raises ([Note: ranks raise
    together] in shards.py). ``doing``: the moves, for the messages."""
    line = "" if error is None else (str(error).splitlines() or [""])[0][:200]
    got = shards.exchange((moved, f"{type(error).__name__}: {line}"), error=fatal, doing=doing,
                          what=f"the exchange of the ranks' moves ({doing})", owner=owner)
    first = min(range(len(got)), key=lambda r: got[r][0])  # (the lowest rank of the least)
    failed = got[first][0]
    if failed == moved:  # (none failed anywhere, or this rank's own error)
        return failed, error
    return failed, RuntimeError(f"rank {first} of {shards.world} could not move it ({got[first][1]})")


def _rehome_as_planned(group: ChunkGroup, plan: PlacementPlan, index: int, need: ChunkNeed) -> None:
    """Chunk ``index``'s payloads to the homes ``plan`` gives them, transient where it says so
    (the GPU share grown, a fall-back from it, state promoted from NVMe); all or nothing."""
    specs = chunk_payloads(plan.request, need, plan.homes[index])
    names = [n for n, spec in specs.items() if spec.source is None]
    group.rehome_payloads(group.chunks[index], {n: specs[n].home for n in names},
                          {n: specs[n].transient for n in names})


def abandon(store: ChunkStore, group: Optional[ChunkGroup] = None) -> None:
    """A front end's construction failed after ``place``: close the group (its worker and the
    store) or, not built yet, the store."""
    if group is not None:
        group.close(store=True)
    else:
        store.close()
