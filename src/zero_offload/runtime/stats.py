"""What ``Engine.stats()`` reports: ``EngineStats`` (plain values), and ``PhaseStats``, which
keeps the front end's phase times and reads the lower layers' counters through one window (the
prefetcher's stalls and hits, the chunk group's worker and store moves, the store's bytes held
and peaks), so a front end neither reads the store nor keeps counters of its own."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .store import Hop, Tier
from .trace import StatsWindow

if TYPE_CHECKING:
    from .chunk_group import ChunkGroup
    from .prefetch import Prefetcher
    from .store import ChunkStore

__all__ = ["EngineStats", "PhaseStats"]


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
    grads_window_wait_s: float = 0.0
    """Host time backward waited for a slot of the grads window (``host_grads="window"``: host
    updates falling behind backward; part of ``update_stall_s``)."""
    placement: dict = dataclasses.field(default_factory=dict)
    """This rank's placement and why (``PlacementPlan.report``: bytes per tier and payload kind,
    the GPU share, the step measurement it was grown by, why it ends where it does)."""

    def as_dict(self) -> dict:
        return dict(vars(self))


class PhaseStats:
    """Seconds per phase (forward, backward, step) and the counters ``EngineStats`` derives its
    rates from, since construction or ``reset``."""

    PHASES = ("forward", "backward", "step")

    def __init__(self, store: "ChunkStore", group: "ChunkGroup", prefetcher: "Prefetcher"):
        self._store, self._group, self._prefetcher = store, group, prefetcher
        self._times = dict.fromkeys(self.PHASES, 0.0)
        self._window = StatsWindow(self._counters)

    def span(self, phase: str, t0: float) -> None:
        """``phase`` ran from ``t0`` (``time.perf_counter()``) until now (recorded in the group's
        trace too, when one is set)."""
        t1 = time.perf_counter()
        self._times[phase] += t1 - t0
        if self._group.trace is not None:
            self._group.trace.span(phase, t0, t1)

    def reset(self) -> None:
        """Restart the time and byte counters and the store's peaks."""
        self._store.reset_peak()
        self._window.reset()
        self._group.reset_counters()
        self._times = dict.fromkeys(self.PHASES, 0.0)

    def _counters(self) -> dict:
        """The prefetcher's counters, read through the window (the pipeline's and the store's
        come through the chunk group's)."""
        pf = self._prefetcher.stats
        return {"stall_s": pf.stall_s, "uses": pf.uses, "hits": pf.hits, "ahead": pf.ahead}

    def read(self, *, steps: int, skipped_steps: int, loss_scale: Optional[float],
             last_grad_norm: Optional[float], lr: float, placement: Optional[dict] = None) -> EngineStats:
        """The counters now, with the front end's own values (its step counts, loss scale, last
        grad norm and lr)."""
        w = {**self._window.read(), **self._group.counters()}
        fwd, bwd = self._times["forward"], self._times["backward"]
        fetch_stall, update_stall = w["stall_s"], w["wait_chunk_s"]
        compute = fwd + bwd
        uses = w["uses"]
        return EngineStats(
            steps=steps, skipped_steps=skipped_steps, micro_steps=self._group.micro,
            bytes_held={t.value: self._store.bytes(t) for t in Tier},
            peak_bytes={t.value: self._store.peak_bytes(t) for t in Tier},
            bytes_moved={h.value: w[h] for h in Hop},
            forward_s=fwd, backward_s=bwd, step_s=self._times["step"],
            fetch_stall_s=fetch_stall, update_stall_s=update_stall,
            adam_s=w["adam_s"], worker_busy_s=w["busy_s"],
            gpu_stall_share=(fetch_stall + update_stall) / compute if compute > 0 else 0.0,
            prefetch_hit_rate=w["hits"] / uses if uses else 0.0,
            prefetch_ahead_rate=w["ahead"] / uses if uses else 0.0,
            loss_scale=loss_scale, last_grad_norm=last_grad_norm, lr=lr,
            grads_window_wait_s=w["window_wait_s"], placement=dict(placement or {}))
