"""Park and resume: every byte a front end keeps on the compute device goes to host memory or NVMe
and comes back, so the device can be lent out between training steps (RL colocation, as verl
runs it: an inference engine generates rollouts on the GPU between policy updates, and the
trainer's state must leave the device meanwhile and come back for the next update).

[Note: parking] ``Parking.park(target)`` empties the device of the front end's state and
``resume`` restores it; the next step equals one without the round trip, bit for bit (bytes are
copied, never recomputed or re-rounded).

- What moves: the store's GPU tier (runtime/store.py, [Note: parking] there): the payloads homed
  there (params placed on the GPU, the optimizer's GPU share with its grads and accumulation
  buffers) are re-homed to host memory or NVMe, and the caches there (params copies paged in,
  look-ahead copies, staging) are dropped, written home first when newest. The front end's own
  device tensors (the engine: the model's buffers) go to host memory (small; also for NVMe). The
  replicas (several ranks, params on the GPU) are dropped: they are every rank's shards
  gathered, and an all-gather over the devices' links brings them back faster than two trips
  over PCIe, with no host memory; ``resume`` gathers again the ones that held the latest params.
- What does not: the pinned pool and the host tiers (host memory already), the process group's
  own buffers (NCCL's), the CUDA context, and the caching allocator's memory of other tensors;
  ``park`` ends with ``torch.cuda.empty_cache()``, so the freed memory goes back to the driver
  (another process can take it: ``torch.cuda.mem_get_info`` shows it).
- Where: ``target="cpu"`` (host memory), ``"nvme"`` (a parking swap space in
  ``OffloadConfig.nvme_dir``, made for the park and removed at ``resume``), or ``"auto"``: host
  memory when what is available (less ``HOST_RESERVE`` of the total) holds it, else NVMe when a
  directory is configured and its disk holds it, else a refusal naming the numbers.
- When: between steps only. ``park`` refuses, before changing anything, while the front end is
  in forward or backward, while an accumulation window is open (grads staged or summed: they
  would be the one thing that is neither params nor state), when it is parked already, closed or
  failed; ``resume`` refuses when not parked, and when the device has less free memory than the
  parked bytes (another process still holds it). While parked, training calls refuse; reading
  the state works (``state_dict``, ``gathered``, checkpoints: from the parked homes), and so do
  ``load_checkpoint`` (it writes the parked homes) and ``close``.
- Several ranks: both calls are collective. Each rank checks what it can locally, then the
  ranks agree (``Shards.agree``); a refusal on one rank is a refusal on all, nothing changed.
  Then each rank moves its own shards, and the ranks agree again: if any failed (a full disk, an
  out-of-memory), the others undo their move, and every rank raises with its state as before the
  call. Replicas are dropped on every rank first thing, so their state stays alike.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import psutil
import torch

from .chunk_group import ChunkGroup
from .prefetch import Prefetcher
from .shards import Shards
from .store import ChunkStore, Tier
from .vocab import human_bytes

__all__ = ["HOST_RESERVE", "PARK_TARGETS", "ParkReport", "Parking"]

PARK_TARGETS = ("auto", "cpu", "nvme")
"""What ``park(target=...)`` takes."""

HOST_RESERVE = 0.1
"""Share of the host's total memory ``target="auto"`` leaves free when it parks there."""


@dataclass(frozen=True)
class ParkReport:
    """What ``park`` / ``resume`` did."""

    where: str
    """"cpu" or "nvme": where the device's bytes went (park) or came from (resume)."""
    nbytes: int
    """Bytes moved off (park) or back onto (resume) the device."""
    seconds: float
    """Wall time of the call."""


class Parking:
    """One front end's park and resume; see [Note: parking].

    Args:
        store, group, prefetcher, shards: the front end's (the group's chunks over the store,
            the prefetcher of its params, its data-parallel group).
        owner: the front end's name in errors ("engine").
    """

    def __init__(self, store: ChunkStore, group: ChunkGroup, prefetcher: Prefetcher, shards: Shards,
                 *, owner: str = "engine"):
        self.store = store
        self.group = group
        self.prefetcher = prefetcher
        self.shards = shards
        self.owner = owner
        self._tensors: list = []  # (tensor, its device) moved to the host by the park
        self._fresh: list = []  # chunks whose replica held the latest params at the park

    @property
    def where(self) -> Optional[str]:
        """"cpu" or "nvme" while parked, else None."""
        tier = self.store.parked
        return tier.value if tier is not None else None

    def check(self, what: str) -> None:
        """Refuse ``what`` (a training call) while parked."""
        if self.store.parked is not None:
            raise RuntimeError(f"{self.owner}.{what}: the {self.owner} is parked ({self.owner}.park() moved "
                               f"its device state to {self.where}); call {self.owner}.resume() first")

    # ---- park -------------------------------------------------------------------------------

    def park(self, target: str = "auto", *, refusal: Optional[str] = None,
             quiesce: Callable[[], None] = lambda: None, tensors: Sequence[torch.Tensor] = ()) -> ParkReport:
        """Move the device state to ``target`` ("auto", "cpu", "nvme"). ``refusal``: why the front
        end cannot park now (its state), or None. ``quiesce``: called once the ranks agreed,
        before anything moves (the front end waits for its updates and lets go of what it holds
        on the device). ``tensors``: the front end's own tensors to move to host memory (their
        ``.data``: the tensor objects stay). Collective with several ranks."""
        t0 = time.perf_counter()
        tensors = [t for t in dict.fromkeys(tensors) if t.device.type != "cpu"]
        problem, tier = self._park_problem(target, refusal, tensors)
        if not self.shards.agree(problem is None, what="the all-reduce of the park's vote"):
            raise problem or RuntimeError(f"{self.owner}.park: another rank cannot park (its error says "
                                          f"why); nothing was parked")
        error = None
        try:
            self._fresh = self.group.drop_replicas()  # first: see [Note: parking], several ranks
            quiesce()
            nbytes = self.store.park(tier)
            nbytes += self._move_tensors(tensors)
        except BaseException as e:  # noqa: BLE001 - raised below, after the ranks agree
            error = e
            self._undo(e, self._unpark_locally)
        if not self.shards.agree(error is None, what="the all-reduce of the park's outcome"):
            if error is None:
                self._undo(None, self._unpark_locally)
                error = RuntimeError(f"{self.owner}.park: another rank failed to park (its error says why); "
                                     f"every rank moved its state back, nothing is parked")
            raise error
        _release_device_memory(self.store.device)
        return ParkReport(where=tier.value, nbytes=nbytes, seconds=time.perf_counter() - t0)

    def _park_problem(self, target, refusal: Optional[str], tensors) -> tuple:
        """(the exception the park would raise here, or None; the tier it would park on)."""
        if target not in PARK_TARGETS:
            return ValueError(f"{self.owner}.park(target={target!r}): give one of {', '.join(map(repr, PARK_TARGETS))} "
                              f"(where the device's state goes)"), None
        if self.store.parked is not None:
            return RuntimeError(f"{self.owner}.park: the {self.owner} is parked already (on {self.where}); "
                                f"call {self.owner}.resume() first"), None
        if refusal is not None:
            return RuntimeError(f"{self.owner}.park: {refusal}"), None
        need = self.store.gpu_home_bytes() + sum(t.untyped_storage().nbytes() for t in tensors)
        kept = self.store.spare_bytes()  # host memory a kept park holds already
        nvme_dir = self.store.config.nvme_dir
        vm = psutil.virtual_memory()
        if target == "nvme" or (target == "auto" and vm.available + kept - HOST_RESERVE * vm.total < need
                                and nvme_dir is not None):
            if nvme_dir is None:
                return ValueError(f"{self.owner}.park(target='nvme'): this {self.owner} has no NVMe tier; set "
                                  f"OffloadConfig.nvme_dir to a directory on a fast disk, or park on 'cpu'"), None
            free = psutil.disk_usage(nvme_dir).free
            if free < need:
                return OSError(f"{self.owner}.park: the device holds {human_bytes(need)}, and the disk of "
                               f"{nvme_dir} has {human_bytes(free)} free; free disk space or park on 'cpu'"), None
            return None, Tier.NVME
        room = vm.available + kept - (HOST_RESERVE * vm.total if target == "auto" else 0)
        if room < need:
            fix = ("set OffloadConfig.nvme_dir to park on NVMe, or free host memory" if target == "auto"
                   else "park on 'nvme' (OffloadConfig.nvme_dir), or free host memory")
            return MemoryError(f"{self.owner}.park: the device holds {human_bytes(need)}, and host memory has "
                               f"{human_bytes(vm.available)} available"
                               f"{f' ({HOST_RESERVE:.0%} of it left free)' if target == 'auto' else ''}; "
                               f"{fix}"), None
        return None, Tier.CPU

    def _move_tensors(self, tensors) -> int:
        nbytes = 0
        for t in tensors:
            device = t.device
            t.data = t.data.to("cpu")
            self._tensors.append((t, device))
            nbytes += t.untyped_storage().nbytes()
        return nbytes

    def _unpark_locally(self) -> None:
        """Undo a park on this rank (no collective): the store's and the tensors' bytes back."""
        if self.store.parked is not None:
            self.store.unpark()
        tensors, self._tensors = self._tensors, []
        for t, device in tensors:
            t.data = t.data.to(device)

    # ---- resume -----------------------------------------------------------------------------

    def resume(self, *, keep_host_memory: bool = False) -> ParkReport:
        """Bring the device state back where it was (collective with several ranks).
        ``keep_host_memory``: see ``ChunkStore.unpark(keep=)``."""
        t0 = time.perf_counter()
        where = self.where
        problem = self._resume_problem()
        if not self.shards.agree(problem is None, what="the all-reduce of the resume's vote"):
            raise problem or RuntimeError(f"{self.owner}.resume: another rank cannot resume (its error "
                                          f"says why); every rank stays parked")
        tier, error, nbytes = self.store.parked, None, 0
        tensors = list(self._tensors)
        try:
            nbytes = self.store.unpark(keep=keep_host_memory)
            self._tensors = []
            for t, device in tensors:
                t.data = t.data.to(device)
                nbytes += t.untyped_storage().nbytes()
        except BaseException as e:  # noqa: BLE001 - raised below, after the ranks agree
            error = e
            self._undo(e, self._park_locally, tier, tensors)
        if not self.shards.agree(error is None, what="the all-reduce of the resume's outcome"):
            if error is None:
                self._undo(None, self._park_locally, tier, tensors)
                error = RuntimeError(f"{self.owner}.resume: another rank failed to resume (its error says "
                                     f"why); every rank stays parked")
            raise error
        fresh, self._fresh = self._fresh, []
        self.group.regather(fresh)  # collective, chunk order on every rank
        self.prefetcher.lookahead()
        self.store.synchronize()
        return ParkReport(where=where, nbytes=nbytes, seconds=time.perf_counter() - t0)

    def _resume_problem(self) -> Optional[BaseException]:
        if self.store.parked is None:
            return RuntimeError(f"{self.owner}.resume: the {self.owner} is not parked (call {self.owner}.park() "
                                f"first)")
        device = self.store.device
        if device.type != "cuda":
            return None
        need = self.store.gpu_home_bytes() + sum(t.untyped_storage().nbytes() for t, _ in self._tensors)
        free, _ = torch.cuda.mem_get_info(device)
        reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if free + reusable < need:
            return MemoryError(f"{self.owner}.resume: the state needs {human_bytes(need)} of GPU memory, and "
                               f"{device} has {human_bytes(free)} free (another process holds the rest: free "
                               f"it first, e.g. put the inference engine to sleep); still parked")
        return None

    def _park_locally(self, tier: Tier, tensors) -> None:
        """Undo a resume on this rank (no collective)."""
        if self.store.parked is None:
            self.store.park(tier)
        self._tensors = []
        self._move_tensors([t for t, _ in tensors])
        _release_device_memory(self.store.device)

    def _undo(self, error: Optional[BaseException], undo: Callable, *args) -> None:
        """Run ``undo``; a failure of it is noted on ``error`` (never raised over it), or raised
        when there is no error to note it on."""
        try:
            undo(*args)
        except BaseException as again:
            if error is None:
                raise
            error.add_note(f"zero_offload: undoing it failed too ({type(again).__name__}: {again}); the "
                           f"{self.owner}'s state is unknown: close it and restart from a checkpoint")


def _release_device_memory(device: torch.device) -> None:
    """What the caching allocator holds free goes back to the driver (after every stream's work:
    blocks freed while a copy stream still read them are released only then)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
