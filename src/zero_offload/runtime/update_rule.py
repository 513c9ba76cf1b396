"""Update rules: what the optimizer does to a chunk, apart from where its bytes live and when the
update runs. The runtime (the chunk group, the step pipeline, placement) calls a rule; it never
names an optimizer itself.

[Note: update rules] A rule is a small stateless object (``UpdateRule``) that declares:

- ``state_keys`` and ``payloads(numel, shapes)``: its optimizer state, as store payloads named
  after torch.optim's state keys ("exp_avg", "exp_avg_sq" for Adam), each with its size and
  dtype. Placement decides where they live, the store moves them; the rule only says what they
  are. A payload is laid out like the params (a param's state at its own elements' offsets:
  Adam's moments, SGD's and Muon's momentum) or, sized by the params' shapes (Adafactor's row
  and column factors), packed param after param: then its ``StateSpec.spans`` say where each
  param's part is, and each ``Segment`` carries its param's part (``Segment.spans``). The runtime keeps the payloads every rule shares: the fp32 "master" the update writes,
  the "grads" it reads (or the fp32 accumulation buffer), the working-dtype copy of the params.
- ``hyper_keys`` and ``args(group, grad_scale=)``: which keys of a torch-style param group it
  reads and the per-step arguments it makes of them, read when an update is queued (an lr
  scheduler may have changed the group since the last one). The update must apply
  ``grad / grad_scale`` (the loss scale divided by the clip coefficient).
- ``cpu_job(bufs, segments, threads=)``: the update of a chunk's host buffers, on the step
  pipeline's worker. It may queue native kernels and return their tickets (CPU-Adam does: see
  [Note: two jobs in flight] in pipeline.py) or run at once and return ``Done`` tickets.
- ``device_step(bufs, segments)``: the same update on the compute device, on the caller's
  stream, for the chunks of the GPU share ([Note: GPU share] in chunk_group.py).
- ``elementwise``: whether each element's update depends on that element alone. If so the
  runtime merges touching parameters into one segment (one kernel call per chunk) and may cut a
  parameter between data-parallel ranks. If not (Muon's matrices, Adafactor's row and column
  factors), every segment is exactly one whole parameter, with its ``shape``, and rank shards
  are cut at parameter boundaries ([Note: whole parameters] in partition.py).

Both paths get the same ``Segment``s (element ranges of the chunk's flat payloads, each with
its step count and arguments) and the same ``StepBuffers``; the buffers are flat views of the
chunk (this rank's shard of it). When ``bufs.lowp`` is given, the rule writes the updated params
into it, rounded to its dtype (round to nearest even, as a ``copy_`` does). ``bufs.device`` is
the compute device when it is a GPU: a CPU job may run part of its update there (MuonRule's
Newton-Schulz iterations).

A rule that a torch.optim-style front end runs also has torch's face: ``check(group, owner=)``
(a group's hyperparameters checked as torch checks them), ``group_options`` (torch's other
param-group keys, with the values the rule runs) and ``state_shape(key, shape)`` (the shape
torch gives state ``key`` of a param of ``shape``; None: that param has none).

``AdamRule`` is Adam and AdamW: the native CPU-Adam kernel on the host, torch's fused Adam(W)
on the device, moments in fp32 or in bf16 with stochastic rounding. runtime/rules.py has SGD,
Lion, Adafactor and Muon.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from ..ops.rounding import round_moments_bf16_into, update_seed

__all__ = ["AdamArgs", "AdamRule", "Done", "Segment", "StateSpec", "StepBuffers", "UpdateRule", "lr_of", "shape_problem", "wait_all"]


@dataclass(frozen=True)
class StateSpec:
    """One payload of a rule's state: a flat buffer of ``numel`` elements of ``dtype`` (a store
    ``PayloadSpec`` without its home, which placement picks)."""

    numel: int
    dtype: torch.dtype
    spans: Optional[tuple] = None
    """None: laid out like the params (``numel`` is the chunk's; a param's state sits at its own
    elements' offsets). Else the payload is sized by the params' shapes: each param's elements
    ``(lo, hi)`` in it, in the order of the ``shapes`` ``payloads`` was given (``lo == hi``: that
    param has none of this state)."""


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of a chunk updated by one call with step count ``step`` (1-based;
    params that missed steps keep their own count, as torch.optim does) and ``args`` (the
    rule's arguments from the param group's hyperparameters). ``shape``: the parameter's shape
    when the segment is exactly one whole parameter (always, for a rule that is not
    elementwise; None for merged runs)."""

    start: int
    stop: int
    step: int
    args: Any
    shape: Optional[tuple] = None
    spans: Optional[Mapping[str, tuple]] = None
    """For a rule with payloads sized by shapes: payload name -> this param's ``(lo, hi)`` in it
    (``StateSpec.spans``); None for a rule without such payloads."""


@dataclass(frozen=True, kw_only=True)
class StepBuffers:
    """The buffers of one chunk's update, all flat and in one place (the host for ``cpu_job``,
    the compute device for ``device_step``)."""

    cid: int
    """The chunk (for seeds)."""
    param: torch.Tensor
    """fp32 params (the master copy), updated in place."""
    grad: torch.Tensor
    """The grads to apply (working dtype, or the fp32 accumulation buffer)."""
    state: Mapping[str, torch.Tensor]
    """The rule's state payloads by name (``state_keys``), updated in place."""
    lowp: Optional[torch.Tensor] = None
    """Working-dtype params that receive the updated params rounded (None: none)."""
    seed: int = 0
    """Base of stochastic-rounding seeds ([Note: stochastic rounding] in ops/rounding.py)."""
    device: Optional[torch.device] = None
    """The compute device when it is a GPU (a CPU job may run part of its update there); None:
    the CPU is all there is."""


class Done:
    """The ticket of a CPU job that ran at once: ``wait()`` returns its seconds."""

    __slots__ = ("start", "seconds")

    def __init__(self, start: float, seconds: float):
        self.start, self.seconds = start, seconds

    @classmethod
    def timing(cls, fn, *args, **kw) -> "Done":
        """Run ``fn(*args, **kw)`` now and return its ticket."""
        t0 = time.perf_counter()
        fn(*args, **kw)
        return cls(t0, time.perf_counter() - t0)

    def wait(self) -> float:
        return self.seconds


def shape_problem(rule: "UpdateRule", shape: tuple) -> Optional[str]:
    """Why ``rule`` cannot update a param of ``shape`` (None: it can). A rule with such a limit
    says so by a ``shape_problem(shape)`` method (Muon: 2-D params only)."""
    check = getattr(rule, "shape_problem", None)
    return None if check is None else check(tuple(shape))


def lr_of(group: Mapping[str, Any]) -> float:
    """A param group's lr as a float (``torch.optim`` allows a one-element tensor)."""
    lr = group["lr"]
    return float(lr.item() if hasattr(lr, "item") else lr)


def wait_all(tickets) -> None:
    for t in tickets:
        try:
            t.wait()
        except BaseException:
            pass  # the caller raises the first error


@runtime_checkable
class UpdateRule(Protocol):
    """See [Note: update rules]."""

    name: str
    """For messages ("AdamW")."""
    elementwise: bool
    state_keys: tuple
    """Names of the state payloads (torch.optim's state keys, "step" aside)."""
    hyper_keys: tuple
    """Keys of a param group that ``args`` reads."""

    def payloads(self, numel: int, shapes: Sequence[tuple] = ()) -> dict:
        """``{name: StateSpec}`` of a chunk (or a rank's shard) of ``numel`` elements holding
        the params of ``shapes`` (whole params, in order; only a rule that is not elementwise
        needs them)."""
        ...

    def args(self, group: Mapping[str, Any], *, grad_scale: float = 1.0) -> Any:
        """The per-step arguments of a param group's hyperparameters, read now."""
        ...

    def cpu_job(self, bufs: StepBuffers, segments: Sequence[Segment], *,
                threads: Optional[int] = None) -> list:
        """Update the host buffers; returns tickets (``wait() -> seconds``, ``start``). When it
        raises, nothing it queued may still be running."""
        ...

    def device_step(self, bufs: StepBuffers, segments: Sequence[Segment]) -> None:
        """Update the device buffers on the current stream."""
        ...


# ---- Adam / AdamW ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AdamArgs:
    """Hyperparameters of one Adam update, read when it is submitted (an lr scheduler may change
    them between steps)."""

    lr: float
    betas: tuple
    eps: float
    weight_decay: float
    adamw: bool
    grad_scale: float = 1.0
    """The update applies ``grad / grad_scale``: loss scale divided by the clip coefficient."""


_MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class AdamRule:
    """``torch.optim.Adam`` (``adamw=False``: L2 weight decay) or ``AdamW`` (decoupled decay).

    ``moments_dtype``: torch.float32 (exact: torch's results) or torch.bfloat16 (stored with
    stochastic rounding, an opt-in inexact mode; "fp32"/"bf16" are accepted too)."""

    adamw: bool = True
    moments_dtype: Any = torch.float32

    elementwise = True
    state_keys = ("exp_avg", "exp_avg_sq")
    hyper_keys = ("lr", "betas", "eps", "weight_decay")

    def __post_init__(self):
        if not isinstance(self.adamw, bool):
            raise TypeError(f"AdamRule.adamw must be True or False, got {self.adamw!r}")
        dt = _MOMENTS.get(self.moments_dtype, self.moments_dtype)
        if dt not in (torch.float32, torch.bfloat16):
            raise ValueError(f"AdamRule.moments_dtype={self.moments_dtype!r} is invalid: use "
                             f"torch.float32 (exact) or torch.bfloat16 (stochastically rounded)")
        object.__setattr__(self, "moments_dtype", dt)

    @property
    def name(self) -> str:
        return "AdamW" if self.adamw else "Adam"

    # ---- torch's face (what a torch.optim-style front end records and checks) -------------

    @property
    def implementation_options(self) -> dict:
        """torch's implementation options as a group records them, whatever a caller or a loaded
        state dict says ([Note: groups record fused=True] in ops/cpu_adam.py)."""
        from ..ops.cpu_adam import IMPLEMENTATION_OPTIONS
        return dict(IMPLEMENTATION_OPTIONS)

    @property
    def group_options(self) -> dict:
        """The rest of torch.optim.Adam(W)'s param-group keys, with the values this rule runs."""
        from ..ops.cpu_adam import UNSUPPORTED_OPTIONS
        return {**UNSUPPORTED_OPTIONS, "decoupled_weight_decay": self.adamw, **self.implementation_options}

    def check(self, group: Mapping[str, Any], *, owner: str) -> dict:
        """A param group's hyperparameters checked as torch.optim.Adam checks them (a ValueError
        naming ``owner.key``; an option this rule does not run refused), as floats."""
        from ..ops.cpu_adam import UNSUPPORTED_OPTIONS, AdamHyper
        for key in UNSUPPORTED_OPTIONS:
            if group.get(key):
                raise ValueError(f"{owner}: {key}=True is not supported; remove it from the param group")
        h = AdamHyper.checked(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                              weight_decay=group["weight_decay"], adamw=self.adamw, owner=owner)
        return {"lr": h.lr, "betas": (h.beta1, h.beta2), "eps": h.eps, "weight_decay": h.weight_decay}

    # ---- the rule -------------------------------------------------------------------------

    def payloads(self, numel: int, shapes: Sequence[tuple] = ()) -> dict:
        return {k: StateSpec(numel, self.moments_dtype) for k in self.state_keys}

    def state_shape(self, key: str, shape: tuple) -> tuple:
        return tuple(shape)  # torch's moments are shaped like the param

    def args(self, group: Mapping[str, Any], *, grad_scale: float = 1.0) -> AdamArgs:
        """A tensor lr (``torch.optim`` allows one) is unwrapped to a float."""
        return AdamArgs(lr=lr_of(group),
                        betas=tuple(float(b) for b in group["betas"]), eps=float(group["eps"]),
                        weight_decay=float(group["weight_decay"]), adamw=self.adamw,
                        grad_scale=grad_scale)

    def cpu_job(self, bufs: StepBuffers, segments: Sequence[Segment], *,
                threads: Optional[int] = None) -> list:
        """One native CPU-Adam call per segment, queued on the kernel thread (``adam_step_async``;
        the working params written rounded by the kernel itself)."""
        from ..ops import cpu_adam  # the native kernel; imported here so importing this module stays cheap

        m, v = bufs.state["exp_avg"], bufs.state["exp_avg_sq"]
        rounded = m.dtype is not torch.float32  # bf16 moments: [Note: stochastic rounding]
        tickets = []
        try:
            for seg in segments:
                a, sl = seg.args, slice(seg.start, seg.stop)
                seed = {"seed": update_seed(bufs.seed, bufs.cid, seg.step, seg.start)} if rounded else {}
                tickets.append(cpu_adam.adam_step_async(
                    bufs.param[sl], bufs.grad[sl], m[sl], v[sl], step=seg.step, lr=a.lr,
                    betas=a.betas, eps=a.eps, weight_decay=a.weight_decay, adamw=a.adamw,
                    grad_scale=a.grad_scale, out_lowp=None if bufs.lowp is None else bufs.lowp[sl],
                    threads=threads, **seed))
        except BaseException:
            wait_all(tickets)  # nothing queued may run on after the caller lets the buffers go
            raise
        return tickets

    def device_step(self, bufs: StepBuffers, segments: Sequence[Segment]) -> None:
        """torch's fused Adam(W) (``torch._fused_adamw_``) per segment; bf16 moments are widened
        to fp32 for it and rounded back stochastically with the CPU kernel's bits."""
        master, src = bufs.param, bufs.grad
        m, v = bufs.state["exp_avg"], bufs.state["exp_avg_sq"]
        rounded = m.dtype is not torch.float32
        for seg in segments:
            a, sl = seg.args, slice(seg.start, seg.stop)
            fused = torch._fused_adamw_ if a.adamw else torch._fused_adam_
            # torch.full, not torch.tensor: a fill on the device, where torch.tensor(x, device=)
            # copies from pageable host memory and waits for the stream (a host sync per chunk)
            step = torch.full((), float(seg.step), dtype=torch.float32, device=master.device)
            scale = (None if a.grad_scale == 1.0
                     else torch.full((), a.grad_scale, dtype=torch.float32, device=master.device))
            m32, v32 = (m[sl].float(), v[sl].float()) if rounded else (m[sl], v[sl])
            fused([master[sl]], [src[sl].float()], [m32], [v32], [], [step], lr=a.lr,
                  beta1=a.betas[0], beta2=a.betas[1], weight_decay=a.weight_decay, eps=a.eps,
                  amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
            if rounded:
                seed = update_seed(bufs.seed, bufs.cid, seg.step, seg.start)
                round_moments_bf16_into(m32, v32, seed, m[sl], v[sl])  # one kernel on CUDA
            if bufs.lowp is not None:
                bufs.lowp[sl].copy_(master[sl])
