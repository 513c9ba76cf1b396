"""OffloadAdam / OffloadAdamW: optimizer-only offload for scripts that keep their own loop.

The model stays where it is (on the GPU, in fp32 or bf16/fp16); the optimizer state — an fp32
master copy of every param, exp_avg and exp_avg_sq, 12 bytes per param — lives in host RAM
(``state="cpu"``) or in NVMe swap files (``state="nvme"``). Per step:

1. backward: a post-accumulate-grad hook on each param copies its finished grad, on a side CUDA
   stream, into a pinned staging buffer of its chunk (params are packed into chunks of about
   ``chunk_mb`` MiB of fp32 state, per param group and dtype);
2. when the last grad of a chunk has been queued, the chunk goes to a worker thread, which
   waits for those copies, runs the native CPU-Adam over the chunk (GIL released), and copies
   the updated params back to the GPU on another side stream — all while the GPU keeps running
   the rest of backward;
3. ``step()`` finishes the chunks still in flight and makes the current CUDA stream wait for the
   param copies (device-side events; no device synchronisation).

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

[Note: params changed outside the optimizer] The fp32 master is the truth for the update. If a
param is modified in place by anyone else (``load_state_dict`` into the model, ``p.copy_()``
under no_grad), its ``_version`` counter moves; the optimizer notices before the next update of
that param and re-reads the master from the param. (Our own copies go through ``.data``, which
does not move the counter.) For low-precision params the master is then the low-precision
value, exactly as a fresh optimizer would start.
"""
from __future__ import annotations

import concurrent.futures
import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

import torch

from .config import Adam as _AdamSpec
from .config import Placement, _as_float, _as_int
from .pinned_pool import PinnedPool, PoolBuffer
from .store import ChunkStore, PayloadSpec, StoreConfig, Tier
from .swap_io import round_up

__all__ = ["OffloadAdam", "OffloadAdamW", "OffloadStats"]

_STATE = "state"
"""Store payload name: one fp32 buffer per chunk, ``[master | exp_avg | exp_avg_sq]``, so each
chunk moves in one transfer to and from NVMe."""

_LOWP = (torch.bfloat16, torch.float16)


class _Phase(enum.Enum):
    """Where a chunk is in the current step. See ``_PHASE_LEGAL``."""

    IDLE = "idle"          # no grad staged in this step yet
    FILLING = "filling"    # some grads staged; waiting for the rest
    QUEUED = "queued"      # handed to the worker thread (CPU-Adam, copy back)
    DONE = "done"          # updated; params written back (CUDA: copies enqueued)


_PHASE_LEGAL = {
    _Phase.IDLE: frozenset({_Phase.FILLING}),
    _Phase.FILLING: frozenset({_Phase.QUEUED}),
    _Phase.QUEUED: frozenset({_Phase.DONE, _Phase.IDLE}),  # IDLE: the worker's job failed
    _Phase.DONE: frozenset({_Phase.IDLE}),
}


class _Deferred(NamedTuple):
    """A release that must wait for a chunk's param copies (see [Note: deferred release])."""

    chunk: "_Chunk"
    event: Any
    """The CUDA event after the copies that read the buffer."""
    action: Callable[[], None]


class _Hyper(NamedTuple):
    """A param group's hyperparameters, read when its chunk is handed to the worker."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


class _Streams(NamedTuple):
    """The optimizer's CUDA streams (both created on the params' device)."""

    d2h: "torch.cuda.Stream"  # grads GPU -> pinned staging, issued by the grad hooks / step()
    h2d: "torch.cuda.Stream"  # updated params pinned -> GPU, issued by the worker after CPU-Adam


@dataclass(eq=False)
class _Slot:
    """One param inside a chunk."""

    param: torch.Tensor
    index: int
    """Position in the optimizer's param order (the key in ``state_dict()["state"]``)."""
    offset: int
    """First element of this param in the chunk's flat buffers."""
    numel: int
    step: int = 0
    """Adam steps taken by this param (torch keeps a step per param, too)."""
    version: int = 0
    """``param._version`` when the master last matched the param (see [Note: params changed
    outside the optimizer])."""
    hooks: int = 0
    """Grad hooks fired in the current step (for ``grad_accum``)."""
    landed: bool = False
    """Its grad for the current step is staged in the chunk."""


@dataclass(eq=False)
class _Chunk:
    """Consecutive params of one param group and one dtype, and their state in the store."""

    cid: int
    """The store's chunk id (payload ``_STATE``)."""
    group: dict
    """The param group (read at hand-off time for hyperparameters)."""
    dtype: torch.dtype
    """Working dtype of its params (and grads)."""
    slots: list[_Slot]
    numel: int
    phase: _Phase = _Phase.IDLE
    landed: int = 0
    """Slots whose grad is staged in the current step."""
    grads: PoolBuffer | None = None
    """Staging buffer for the grads (pinned with CUDA), from the pool; released after the update."""
    d2h_done: Any = None
    """CUDA event after the last grad copy of this chunk."""
    h2d_done: Any = None
    """CUDA event after the param copies of its last update (the next update waits on it before
    overwriting the pinned source)."""
    job: concurrent.futures.Future | None = None

    def to(self, phase: _Phase) -> None:
        if phase not in _PHASE_LEGAL[self.phase]:
            raise RuntimeError(f"OffloadAdam internal error: chunk {self.cid} cannot go from "
                               f"{self.phase.name} to {phase.name}; please report this")
        self.phase = phase


@dataclass
class OffloadStats:
    """Counters since construction (or ``reset_stats``)."""

    steps: int = 0
    d2h_bytes: int = 0
    """Grad bytes copied device -> host."""
    h2d_bytes: int = 0
    """Param bytes copied host -> device."""
    adam_s: float = 0.0
    """Worker seconds inside CPU-Adam."""
    worker_s: float = 0.0
    """Worker seconds per chunk job in total (waits for copies / NVMe reads + CPU-Adam + copy back)."""
    step_wait_s: float = 0.0
    """Seconds ``step()`` waited for the pipeline to finish (what overlap did not hide)."""


def _check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"OffloadAdam: {name} must be True or False, got {value!r}")
    return value


class OffloadAdam(torch.optim.Optimizer):
    """Adam with state in host RAM or on NVMe, stepped by CPU-Adam during backward.

    ``torch.optim.Adam`` semantics (``weight_decay`` as an L2 penalty); ``OffloadAdamW`` has
    ``torch.optim.AdamW``'s decoupled decay. Read the module docstring, in particular
    [Note: overlap semantics].

    Args:
        params: iterable of params or of param-group dicts (as any torch optimizer); groups may
            set their own ``lr``, ``betas``, ``eps``, ``weight_decay``.
        lr, betas, eps, weight_decay: defaults, as torch.optim.Adam(W).
        state: "cpu" (host RAM, pinned when CUDA) or "nvme" (swap files under ``nvme_dir``,
            read ahead and written behind per chunk).
        nvme_dir: directory on a fast disk; required with ``state="nvme"``.
        chunk_mb: MiB of fp32 master per chunk (the unit of transfer and of CPU-Adam jobs).
        threads: CPU-Adam threads (None: every core this process may use).
        overlap: step each chunk during backward (True) or everything in ``step()`` (False).
        grad_accum: backward passes per ``step()`` (``overlap=True`` only needs to know).
        prefetch_depth: NVMe chunks read ahead of the one being filled.
        cpu_budget: bytes (or "auto") of pinned host memory the state may use ("cpu" state
            must fit whole; "nvme" state stages through it).
    """

    _adamw = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, state: str = "cpu",
                 nvme_dir=None, chunk_mb: float = 64.0, threads: int | None = None,
                 overlap: bool = True, grad_accum: int = 1, prefetch_depth: int = 2,
                 cpu_budget: int | str = "auto"):
        name = type(self).__name__
        spec = _AdamSpec(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)  # validates
        home = {"cpu": Tier.CPU, "nvme": Tier.NVME}.get(state.lower() if isinstance(state, str) else state)
        if home is None:
            raise ValueError(f"{name}: state={state!r} is invalid: use 'cpu' (host RAM) or 'nvme' "
                             f"(swap files; also pass nvme_dir)")
        if home is Tier.NVME and nvme_dir is None:
            raise ValueError(f"{name}: state='nvme' needs nvme_dir='/path/on/a/fast/disk'")
        self._chunk_numel = max(1, round(_as_float(name, "chunk_mb", chunk_mb, minimum=0.0,
                                                   min_inclusive=False) * 2**20 / 4))
        self._threads = None if threads is None else _as_int(name, "threads", threads, minimum=1)
        self._overlap = _check_flag("overlap", overlap)
        self._grad_accum = _as_int(name, "grad_accum", grad_accum, minimum=1)
        self._depth = _as_int(name, "prefetch_depth", prefetch_depth, minimum=0)
        from .config import _as_budget
        self._cpu_budget = _as_budget(name, "cpu_budget", cpu_budget)
        self._home = home
        self._nvme_dir = nvme_dir

        # Filled by add_param_group (called by Optimizer.__init__ below).
        self._chunks: list[_Chunk] = []
        self._slots: list[_Slot] = []            # in param order (state_dict indices)
        self._frozen: list[torch.Tensor] = []    # params without grad: no state, no chunk
        self._hook_handles: list = []
        self._device: torch.device | None = None
        self._store: ChunkStore | None = None
        self._pool: PinnedPool | None = None
        self._streams: _Streams | None = None
        self._order: list[_Chunk] = []           # chunks in the order they filled last step
        self._filling: list[_Chunk] = []         # this step's fill order
        self._deferred: list[_Deferred] = []     # see [Note: deferred release]
        self._lock = threading.Lock()            # guards _deferred (worker and main thread)
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                             thread_name_prefix="zero_offload-adam")
        self._failure: BaseException | None = None
        self._closed = False
        self.stats = OffloadStats()

        defaults = dict(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                        amsgrad=False, maximize=False, foreach=None, capturable=False,
                        differentiable=False, fused=None, decoupled_weight_decay=self._adamw)
        super().__init__(params, defaults)

    # ------------------------------------------------------------------------------------
    # building

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as torch); its params get chunks (and hooks) at once."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        param_group = dict(param_group)
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
        self._build_group(self.param_groups[-1])

    def _check_group(self, group: dict) -> None:
        """Hyperparameters of a group (with defaults filled in), as torch.optim.Adam checks them."""
        name = type(self).__name__
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(key):
                raise ValueError(f"{name}: {key}=True is not supported; remove it from the param group")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"{name}: lr must be a number (or a one-element tensor), got {lr!r}")
            lr = lr.item()
        _AdamSpec(lr=lr, betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])

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

    def _build_group(self, group: dict) -> None:
        params = group["params"]
        if self._device is None and params:
            self._device = params[0].device
        if self._store is None and params:
            self._open_store(params)
        # Pack consecutive trainable params of one dtype into chunks of about chunk_numel.
        runs: list[list[torch.Tensor]] = []
        for p in params:
            if not p.requires_grad:
                self._frozen.append(p)
                continue
            last = runs[-1] if runs else None
            if last and last[0].dtype == p.dtype and \
                    sum(q.numel() for q in last) + p.numel() <= self._chunk_numel:
                last.append(p)
            else:
                runs.append([p])
        index0 = sum(len(g["params"]) for g in self.param_groups[:-1])
        position = {id(p): index0 + i for i, p in enumerate(params)}
        new = []
        for run in runs:
            numel = sum(p.numel() for p in run)
            cid = self._store.add_chunk({_STATE: PayloadSpec(3 * numel, torch.float32, self._home)})
            slots, offset = [], 0
            for p in run:
                slots.append(_Slot(param=p, index=position[id(p)], offset=offset, numel=p.numel(),
                                   version=p._version))
                offset += p.numel()
            chunk = _Chunk(cid=cid, group=group, dtype=run[0].dtype, slots=slots, numel=numel)
            self._init_state(chunk)
            new.append(chunk)
        self._chunks.extend(new)
        self._slots.extend(s for c in new for s in c.slots)
        self._slots.sort(key=lambda s: s.index)
        self._order = list(reversed(self._chunks))  # first guess: backward runs in reverse
        for chunk in new if self._overlap else ():
            for slot in chunk.slots:
                self._hook_handles.append(slot.param.register_post_accumulate_grad_hook(
                    _GradHook(self, chunk, slot)))

    def _open_store(self, params) -> None:
        total = sum(3 * p.numel() * 4 + 4096 for p in params if p.requires_grad)
        cuda = self._device.type == "cuda"
        budgets = {Tier.CPU: self._cpu_budget}
        if self._home is Tier.NVME:
            # Exact: the swap file is preallocated; add_param_group later adds to a new space.
            budgets[Tier.NVME] = max(4096, round_up(total))
        self._store = ChunkStore(StoreConfig(device=self._device if cuda else "cpu", budgets=budgets,
                                             nvme_dir=self._nvme_dir))
        self._pool = self._store.pool
        if cuda:
            with torch.cuda.device(self._device):
                self._streams = _Streams(d2h=torch.cuda.Stream(), h2d=torch.cuda.Stream())

    @torch.no_grad()
    def _init_state(self, chunk: _Chunk) -> None:
        """Master = the params (fp32), moments = 0; written home (NVMe: then dropped from RAM)."""
        n = chunk.numel
        if self._home is Tier.CPU:
            buf = self._store.get(chunk.cid, _STATE, Tier.CPU, write=True)
        else:
            buf = self._store.allocate(chunk.cid, _STATE, Tier.CPU)
        for slot in chunk.slots:
            buf[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
        buf[n:].zero_()
        self._store.mark_dirty(chunk.cid, _STATE, Tier.CPU)
        if self._home is Tier.NVME:
            self._store.flush(chunk.cid, _STATE)
            self._store.evict(chunk.cid, _STATE, Tier.CPU)

    # ------------------------------------------------------------------------------------
    # backward side (main thread)

    def _on_grad(self, chunk: _Chunk, slot: _Slot) -> None:
        """Post-accumulate-grad hook of ``slot.param`` (overlap=True)."""
        if self._failure is not None:
            self._raise_failure()
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
        if chunk.landed == len(chunk.slots):
            self._submit(chunk)

    @torch.no_grad()
    def _stage(self, chunk: _Chunk, slot: _Slot, *, consume: bool) -> None:
        """Queue the copy of ``slot``'s grad into the chunk's staging buffer."""
        p = slot.param
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if grad.shape != p.shape:
            raise RuntimeError(f"grad of shape {tuple(grad.shape)} for a param of shape {tuple(p.shape)}")
        if p._version != slot.version:
            self._resync_master(chunk, slot)
        if chunk.phase is _Phase.IDLE:
            chunk.to(_Phase.FILLING)
            chunk.grads = self._pool.acquire(chunk.numel * chunk.dtype.itemsize)
            self._filling.append(chunk)
            self._read_ahead(chunk)
        dst = chunk.grads.view(chunk.dtype, chunk.numel)[slot.offset:slot.offset + slot.numel]
        if self._streams is not None:
            d2h = self._streams.d2h
            d2h.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(d2h):
                dst.copy_(grad.reshape(-1), non_blocking=True)
            grad.record_stream(d2h)
        else:
            dst.copy_(grad.reshape(-1))
        self.stats.d2h_bytes += slot.numel * chunk.dtype.itemsize
        if consume:
            p.grad = None
        slot.landed = True
        chunk.landed += 1

    def _resync_master(self, chunk: _Chunk, slot: _Slot) -> None:
        """See [Note: params changed outside the optimizer]. Rare: synchronous."""
        self._wait_job(chunk)
        self._run_deferred(chunk)
        with self._store.use(chunk.cid, _STATE, Tier.CPU, write=True) as buf:
            buf[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
            self._store.mark_dirty(chunk.cid, _STATE, Tier.CPU)
        if self._home is Tier.NVME:
            self._store.flush(chunk.cid, _STATE)
            self._store.evict(chunk.cid, _STATE, Tier.CPU)
        slot.version = slot.param._version

    def _read_ahead(self, chunk: _Chunk) -> None:
        """NVMe: start reading this chunk's state and the next ``prefetch_depth`` ones in last
        step's fill order (idempotent: the store keeps one move per copy)."""
        if self._home is not Tier.NVME:
            return
        order = self._order
        try:
            i = order.index(chunk)
        except ValueError:
            i = -1
        for c in [chunk] + order[i + 1:i + 1 + self._depth]:
            if c.phase in (_Phase.IDLE, _Phase.FILLING):
                self._store.fetch(c.cid, _STATE, Tier.CPU)

    def _submit(self, chunk: _Chunk) -> None:
        """Hand a chunk whose staged grads are complete to the worker."""
        if self._streams is not None:
            chunk.d2h_done = torch.cuda.Event()
            chunk.d2h_done.record(self._streams.d2h)
        group = chunk.group
        lr = group["lr"]
        hyper = _Hyper(lr=float(lr.item() if isinstance(lr, torch.Tensor) else lr),
                       betas=(float(group["betas"][0]), float(group["betas"][1])),
                       eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))
        chunk.to(_Phase.QUEUED)
        chunk.job = self._worker.submit(self._update, chunk, hyper)

    # ------------------------------------------------------------------------------------
    # worker thread

    def _update(self, chunk: _Chunk, hyper: _Hyper) -> None:
        """CPU-Adam over one chunk, then its params back to the device. Runs on the worker."""
        from .cpu_adam import adam_step

        t0 = time.perf_counter()
        try:
            if chunk.d2h_done is not None:
                chunk.d2h_done.synchronize()
            self._run_deferred(chunk)  # last step's copies read the pinned source: release it
            n = chunk.numel
            grads = chunk.grads.view(chunk.dtype, n)
            out = None
            if chunk.dtype in _LOWP:
                out_buf = self._pool.acquire(n * chunk.dtype.itemsize)
                out = out_buf.view(chunk.dtype, n)
            store, cid = self._store, chunk.cid
            store.fetch(cid, _STATE, Tier.CPU)  # NVMe: usually read ahead already
            store.pin(cid, _STATE, Tier.CPU)
            try:
                state = store.get(cid, _STATE, Tier.CPU, write=True)
                master, exp_avg, exp_avg_sq = state[:n], state[n:2 * n], state[2 * n:]
                ta = time.perf_counter()
                for lo, hi, step in _runs(chunk.slots):
                    adam_step(master[lo:hi], grads[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi],
                              step=step, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps,
                              weight_decay=hyper.weight_decay, adamw=self._adamw,
                              out_lowp=None if out is None else out[lo:hi], threads=self._threads)
                self.stats.adam_s += time.perf_counter() - ta
                for slot in chunk.slots:
                    if slot.landed:
                        slot.step += 1
                store.mark_dirty(cid, _STATE, Tier.CPU)
                if self._home is Tier.NVME:
                    store.flush(cid, _STATE)  # write-behind, reading beside the param copies
                self._pool.release(chunk.grads)
                chunk.grads = None
                self._write_back(chunk, master if out is None else out)
            except BaseException:
                store.unpin(cid, _STATE, Tier.CPU)
                raise
            # The param copies read `out` (low precision) or the pinned master: release after them.
            if out is not None:
                self._after_h2d(chunk, lambda: self._pool.release(out_buf))
            self._after_h2d(chunk, self._release_state_action(chunk))
            chunk.to(_Phase.DONE)
        finally:
            self.stats.worker_s += time.perf_counter() - t0

    def _release_state_action(self, chunk: _Chunk) -> Callable[[], None]:
        store, cid = self._store, chunk.cid

        def release():
            store.unpin(cid, _STATE, Tier.CPU)
            if self._home is Tier.NVME:
                store.evict(cid, _STATE, Tier.CPU)  # freed once the write-behind has read it
        return release

    @torch.no_grad()
    def _write_back(self, chunk: _Chunk, src: torch.Tensor) -> None:
        """Updated params into the model's tensors (CUDA: async on the H2D stream)."""
        landed = [s for s in chunk.slots if s.landed]
        if self._streams is not None:
            h2d = self._streams.h2d
            with torch.cuda.stream(h2d):
                h2d.wait_event(chunk.d2h_done)  # after the compute stream's last use: see Note
                for s in landed:
                    s.param.data.view(-1).copy_(src[s.offset:s.offset + s.numel], non_blocking=True)
                chunk.h2d_done = torch.cuda.Event()
                chunk.h2d_done.record(h2d)
        else:
            for s in landed:
                s.param.data.view(-1).copy_(src[s.offset:s.offset + s.numel])
        self.stats.h2d_bytes += sum(s.numel for s in landed) * chunk.dtype.itemsize

    def _after_h2d(self, chunk: _Chunk, action: Callable[[], None]) -> None:
        """Run ``action`` once the chunk's param copies are done (at once without CUDA).

        [Note: deferred release] The copies back to the GPU read a pinned buffer (the master, or
        the low-precision staging buffer), so that buffer is unpinned / evicted / returned to the
        pool only after their event. The release runs at the latest before the *same chunk's*
        next update (``_run_deferred`` at the top of ``_update``), which re-pins the buffer; so
        a release never meets a pin taken after it. ``step()`` runs the releases whose copies
        have finished, without waiting; ``_drain`` runs them all."""
        if chunk.h2d_done is None:
            action()
            return
        with self._lock:
            self._deferred.append(_Deferred(chunk, chunk.h2d_done, action))

    def _run_deferred(self, chunk: _Chunk | None = None, *, block: bool = True) -> None:
        """Run the deferred releases of ``chunk`` (all chunks: None), waiting for their copies
        (``block``) or only those already finished."""
        with self._lock:
            ready, keep = [], []
            for d in self._deferred:
                mine = chunk is None or d.chunk is chunk
                (ready if mine and (block or d.event.query()) else keep).append(d)
            self._deferred = keep
        for d in ready:
            d.event.synchronize()
            d.action()

    # ------------------------------------------------------------------------------------
    # step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Finish this step: stage grads not yet streamed (all of them with ``overlap=False``),
        wait for every chunk's CPU-Adam, and order the param copies before the current CUDA
        stream's next work. Returns the closure's loss, if a closure is given."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._failure is not None:
            self._raise_failure()
        for p in self._frozen:
            if p.grad is not None:
                raise RuntimeError(
                    f"{type(self).__name__}: a param that had requires_grad=False when the optimizer was "
                    f"built now has a grad; build the optimizer after unfreezing, or add the param "
                    f"in a new param group (add_param_group)")
        # Params whose grad did not come through the hooks (overlap=False, grads set by hand,
        # fewer backwards than grad_accum): stage them now, in last step's fill order.
        for chunk in self._order:
            if chunk.phase in (_Phase.IDLE, _Phase.FILLING):
                for slot in chunk.slots:
                    if not slot.landed and slot.param.grad is not None:
                        self._stage(chunk, slot, consume=False)
                if chunk.phase is _Phase.FILLING:
                    self._submit(chunk)
        t0 = time.perf_counter()
        errors = []
        for chunk in self._filling:
            try:
                self._wait_job(chunk)
            except BaseException as e:  # keep draining: no job may outlive the step
                errors.append(e)
        self.stats.step_wait_s += time.perf_counter() - t0
        if errors:
            self._failure = errors[0]
            self._raise_failure()
        if self._streams is not None:
            current = torch.cuda.current_stream(self._device)
            for chunk in self._filling:
                if chunk.h2d_done is not None:
                    current.wait_event(chunk.h2d_done)
        self._run_deferred(block=False)
        self._end_step()
        self.stats.steps += 1
        return loss

    def _wait_job(self, chunk: _Chunk) -> None:
        if chunk.job is not None:
            job, chunk.job = chunk.job, None
            job.result()

    def _end_step(self) -> None:
        if self._filling:
            self._order = list(self._filling) + [c for c in self._order if c not in self._filling]
        for chunk in self._filling:
            chunk.to(_Phase.IDLE)
            chunk.landed = 0
        self._filling = []
        for slot in self._slots:
            slot.hooks = 0
            slot.landed = False

    def _raise_failure(self):
        raise RuntimeError(f"{type(self).__name__}: a CPU-Adam job failed; the optimizer state is no "
                           f"longer consistent with the model (rebuild it or load a state_dict)") \
            from self._failure

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; build a new optimizer")

    def _drain(self) -> None:
        """Wait for every job in flight (state_dict, close)."""
        for chunk in self._chunks:
            self._wait_job(chunk)
        self._run_deferred()

    # ------------------------------------------------------------------------------------
    # state dict: torch.optim.Adam(W)'s format

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s format: ``state[i] = {"step", "exp_avg", "exp_avg_sq"}`` (fp32 CPU
        tensors shaped like the param) for every param stepped at least once, plus ``"master"``
        (fp32) for bf16/fp16 params; ``param_groups`` with torch's keys."""
        self._check_open()
        if any(c.phase is not _Phase.IDLE for c in self._chunks):
            raise RuntimeError(f"{type(self).__name__}.state_dict() in the middle of a step: call step() first")
        self._drain()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for chunk in self._chunks:
            stepped = [s for s in chunk.slots if s.step > 0]
            if not stepped:
                continue
            n = chunk.numel
            with self._store.use(chunk.cid, _STATE, Tier.CPU) as buf:
                for s in stepped:
                    sl = slice(s.offset, s.offset + s.numel)
                    entry = {"step": torch.tensor(float(s.step)),
                             "exp_avg": buf[n:][sl].clone().view(s.param.shape),
                             "exp_avg_sq": buf[2 * n:][sl].clone().view(s.param.shape)}
                    if chunk.dtype in _LOWP:
                        entry["master"] = buf[sl].clone().view(s.param.shape)
                    state[s.index] = entry
            if self._home is Tier.NVME:
                self._store.evict(chunk.cid, _STATE, Tier.CPU)
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.Adam``/``AdamW`` (any device or
        dtype). Hyperparameters of the groups are taken from it, as torch does. Without a
        ``"master"`` entry, the master of a low-precision param is its current value."""
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
        by_index = {s.index: s for s in self._slots}
        entries: dict[int, dict] = {}
        for key, entry in state_dict["state"].items():
            key = int(key) if isinstance(key, str) and key.isdigit() else key
            if key not in id_map:
                raise ValueError(f"loaded state dict has state for param id {key!r}, which no group lists")
            idx = id_map[key]
            slot = by_index.get(idx)
            if slot is None:
                continue  # a frozen param here: no state kept (as it gets no grads)
            for k in ("step", "exp_avg", "exp_avg_sq"):
                if k not in entry:
                    raise ValueError(f"loaded state for param {key} lacks {k!r}; is it an Adam/AdamW state dict?")
            if "max_exp_avg_sq" in entry:
                raise ValueError(f"loaded state for param {key} is from amsgrad=True, which {name} does not support")
            for k in ("exp_avg", "exp_avg_sq", "master"):
                if k in entry and entry[k].numel() != slot.numel:
                    raise ValueError(f"loaded {k!r} for param {key} has {entry[k].numel()} elements, the "
                                     f"param has {slot.numel}")
            entries[idx] = entry
        # all checks passed: change state
        self._drain()
        for g, sg in zip(self.param_groups, saved_groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        for chunk in self._chunks:
            n = chunk.numel
            with self._store.use(chunk.cid, _STATE, Tier.CPU, write=True) as buf:
                for s in chunk.slots:
                    sl = slice(s.offset, s.offset + s.numel)
                    entry = entries.get(s.index)
                    master_src = entry.get("master") if entry is not None else None
                    if master_src is None:
                        master_src = s.param.detach()
                    buf[sl].copy_(master_src.reshape(-1))
                    if entry is None:
                        buf[n:][sl].zero_()
                        buf[2 * n:][sl].zero_()
                        s.step = 0
                    else:
                        buf[n:][sl].copy_(entry["exp_avg"].reshape(-1))
                        buf[2 * n:][sl].copy_(entry["exp_avg_sq"].reshape(-1))
                        step = entry["step"]
                        s.step = int(step.item() if isinstance(step, torch.Tensor) else step)
                    s.version = s.param._version
                self._store.mark_dirty(chunk.cid, _STATE, Tier.CPU)
            if self._home is Tier.NVME:
                self._store.flush(chunk.cid, _STATE)
                self._store.evict(chunk.cid, _STATE, Tier.CPU)

    # ------------------------------------------------------------------------------------
    # misc

    def reset_stats(self) -> None:
        self.stats = OffloadStats()
        if self._store is not None:
            self._store.stats.bytes_moved = {h: 0 for h in self._store.stats.bytes_moved}

    def nvme_bytes(self) -> tuple[int, int]:
        """(bytes read from, bytes written to) NVMe since construction, from the store."""
        if self._store is None:
            return 0, 0
        moved = self._store.stats.as_dict()["bytes_moved"]
        return moved["nvme->cpu"], moved["cpu->nvme"]

    def host_state_bytes(self) -> int:
        """Host bytes the optimizer holds now (state copies in RAM + staging buffers)."""
        if self._store is None:
            return 0
        return self._store.bytes(Tier.CPU) + self._pool.reserved_bytes

    def close(self) -> None:
        """Finish jobs, remove the hooks and free the state (and swap files). Idempotent."""
        if self._closed:
            return
        try:
            try:
                self._drain()
            finally:
                self._worker.shutdown(wait=True)
                for h in self._hook_handles:
                    h.remove()
                self._hook_handles.clear()
        finally:
            self._closed = True
            if self._store is not None:
                self._store.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        n = sum(c.numel for c in self._chunks)
        return (f"{type(self).__name__}(params={n}, chunks={len(self._chunks)}, "
                f"state={self._home.value!r}, overlap={self._overlap}, groups={len(self.param_groups)})")


class OffloadAdamW(OffloadAdam):
    """``OffloadAdam`` with ``torch.optim.AdamW``'s decoupled weight decay (default 1e-2)."""

    _adamw = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, state: str = "cpu",
                 nvme_dir=None, chunk_mb: float = 64.0, threads: int | None = None,
                 overlap: bool = True, grad_accum: int = 1, prefetch_depth: int = 2,
                 cpu_budget: int | str = "auto"):
        super().__init__(params, lr, betas, eps, weight_decay, state=state, nvme_dir=nvme_dir,
                         chunk_mb=chunk_mb, threads=threads, overlap=overlap, grad_accum=grad_accum,
                         prefetch_depth=prefetch_depth, cpu_budget=cpu_budget)


class _GradHook:
    """The post-accumulate-grad hook of one param (a callable record, not a closure over a
    loop variable). Installed only with ``overlap=True``."""

    __slots__ = ("opt", "chunk", "slot")

    def __init__(self, opt: OffloadAdam, chunk: _Chunk, slot: _Slot):
        self.opt, self.chunk, self.slot = opt, chunk, slot

    def __call__(self, param: torch.Tensor) -> None:
        self.opt._on_grad(self.chunk, self.slot)


def _runs(slots: list[_Slot]):
    """Maximal ranges ``(lo, hi, step)`` of consecutive landed slots with equal step counts: one
    CPU-Adam call each (normally one per chunk)."""
    lo = hi = None
    step = None
    for s in slots:
        if s.landed and lo is not None and s.step + 1 == step and s.offset == hi:
            hi = s.offset + s.numel
            continue
        if lo is not None:
            yield lo, hi, step
            lo = None
        if s.landed:
            lo, hi, step = s.offset, s.offset + s.numel, s.step + 1
    if lo is not None:
        yield lo, hi, step
