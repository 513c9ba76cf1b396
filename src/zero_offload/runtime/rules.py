"""Update rules beyond Adam: SGD, Lion, Adafactor and Muon, on the interface of update_rule.py
([Note: update rules]). Each equals its reference: ``torch.optim.SGD``, ``torch.optim.Adafactor``
and ``torch.optim.Muon`` (the same operations in the same order), Lion as published (Chen et al.
2023, "Symbolic Discovery of Optimization Algorithms", decoupled weight decay).

[Note: where each rule runs] Per step, for a chunk whose optimizer state lives in host memory or
on NVMe (the step pipeline's worker; the GPU share runs the same code on the device, on the
caller's stream, ``device_step``):

- SGD and Lion are elementwise: one call per run of touching params, the native kernel
  (``ops.cpu_rules``: ``sgd_step_async``/``lion_step_async``, queued on the kernel thread as
  CPU-Adam is) when that module is built, else torch ops on the worker with the same semantics.
  Host traffic per param: SGD 4 (master) + 4 (momentum, if any) bytes read and written plus the
  grad; Lion the same with its one moment. No GPU work.
- Adafactor needs a whole param (row and column means): one native call per param
  (``adafactor_step_async``, queued on the kernel thread, multi-threaded over row blocks), in
  three passes over it: (1) the param's sum of squares (its RMS) and the sums of squares of g's
  rows and columns, (2) the update's sum of squares, the update recomputed on the fly and never
  stored, (3) the decay, the update and the working copy's rounding, in one pass; the factors'
  lerps and means run between the passes. Host traffic per element, bf16 grads: 6 + 2 + 12 =
  20 bytes (the torch op chain it replaces made about ten passes with temporaries). State is
  factored for params of 2 or more dims (a row and a column vector per matrix: about (rows +
  cols) x 4 bytes instead of 4 per element), full for 1-D ones (two passes then: the variance
  update and both sums, then the apply). Without the native module: ``device_step``'s torch
  ops on the worker.
- Muon needs a whole 2-D param: per matrix, two native passes on the host and Newton-Schulz on
  the compute device when it is a GPU (``StepBuffers.device``), pipelined over the chunk's
  matrices ([Note: Muon's pipeline]). The momentum pass (lerp in fp32, in the tier placement
  chose, and the Nesterov blend) writes the update as bf16 (torch casts it to bf16 first
  anyway) into a pinned slot; it goes to the device (2 bytes per element), ``ns_steps``
  iterations of three bf16 matmuls run on a side stream (about ``ns_steps * (4 m^2 n + 2 m^3)``
  flops for an m x n matrix, m <= n: ~0.8 TFLOP for 2048 x 8192 at 5 steps, a few ms on an
  H100) and the orthogonalised matrix comes back into the same slot (2 bytes per element); the
  apply pass decays the master, adds the update and rounds the working copy in one pass. Host
  traffic per element, bf16 grads: 12 + 12 bytes; PCIe: 4. On a CPU-only run the iterations
  run on the host in torch (slow for large matrices: O(m^2 n) per iteration on the CPU's bf16
  matmul), exactly as ``torch.optim.Muon`` on the CPU does. Muon takes 2-D params only (torch's
  rule): embeddings' and heads' matrices may go to it, but torch's recipe puts them, and every
  1-D param, in an AdamW group.

Each rule's ``device_step`` (the GPU share) is its reference's torch ops, op for op, and so is
the host's fallback when the native module is missing. The native passes equal those ops bit
for bit except for Adafactor's sums of squares, which are fp64 in a fixed order (torch's are
fp32): its norms and factor means may differ in their last bit ([Note: Muon and Adafactor
formula order] in csrc/cpu_rules_kernel.h).

[Note: Muon's pipeline] A host job's matrices go through three stages: (A) the momentum passes on
the kernel thread, each writing its matrix's update as bf16 into its place in a pinned staging
buffer of the worker thread (laid out matrix after matrix); (B) each matrix to the GPU, its
Newton-Schulz iterations on a side stream and back into its place (an event marks the copy
back); (C) the apply passes on the kernel thread. A job (``_MuonJob``) does not run its stages
back to back: the step pipeline keeps two Muon jobs started beside the one it starts
(``MuonRule.lag`` = 2, [Note: jobs in flight] in pipeline.py), and starting job K queues job
K - 2's apply passes (its iterations were issued one job earlier: their events have fired), then
job K's momentum passes, then issues job K - 1's iterations (its momentum passes ran first).
So the kernel thread always has one job's passes queued behind the one it runs, while the worker
waits, issues the GPU work and completes job K - 2 (its bookkeeping between kernels); and each
matrix's round trip (about 3 ms for a 2048 x 8192 bf16 matrix over PCIe and back) runs beside
host passes. Each stage of a job finishes the stages before it first, so a job's ticket
(``_MuonJob``, the last of its tickets) can always be waited for: at the end of a step the
pipeline completes the last jobs that way, stage after stage. Measured on an H100 host before
this: a job that ran its stages in order idled the cores for about a round trip per chunk, and
with stage C queued only when the worker completed the job, for its bookkeeping too: 0.16 s of a
0.51 s step at 1.31B. Staging: a worker thread has three buffers, taken in turn job by job
(grown to the largest job seen: 3 x 2 bytes per element of the largest chunk's matrices); a job
takes the buffer of the job three before it only after that job has completed (finished here if
its owner has not waited for it yet); a matrix's copy back has landed (its event was waited for)
before its apply pass is queued; nothing is copied from pageable memory.
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from .update_rule import Done, Segment, StateSpec, StepBuffers, wait_all, lr_of

__all__ = ["AdafactorArgs", "AdafactorRule", "LionArgs", "LionRule", "MuonArgs", "MuonRule", "SGDArgs",
           "SGDRule", "adafactor_state_shapes", "check_adafactor", "check_lion", "check_muon", "check_sgd"]


def _native():
    """``ops.cpu_rules`` (the native SGD/Lion kernels) when it is built, else None (torch ops)."""
    try:
        from ..ops import cpu_rules
    except ImportError:
        return None
    return cpu_rules


def _number(owner: str, key: str, value: Any, *, low: Optional[float] = None, high: Optional[float] = None,
            low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float within the bounds, else a ValueError naming ``owner.key``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        bounds = [f"{'>' if low_open else '>='} {low}" if low is not None else "",
                  f"{'<' if high_open else '<='} {high}" if high is not None else ""]
        raise ValueError(f"{owner}.{key}={value!r} is invalid: expected a finite number "
                         f"{' and '.join(b for b in bounds if b)}".rstrip())
    return float(value)


def _flag(owner: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{key}={value!r} is invalid: expected True or False")
    return value


def _refuse(group: Mapping[str, Any], options: Mapping[str, Any], owner: str) -> None:
    """Options of torch's optimizer that the rule does not run (their torch defaults allowed)."""
    for key, default in options.items():
        if group.get(key, default) not in (default, None):
            raise ValueError(f"{owner}: {key}={group[key]!r} is not supported; remove it from the "
                             f"param group (the rule runs {key}={default!r})")


def _grad(bufs: StepBuffers, seg: Segment, scale: float) -> torch.Tensor:
    """The segment's grads in fp32, ``/ scale``; never a view the update may write through."""
    g = bufs.grad[seg.start:seg.stop]
    g = g.float() if g.dtype is not torch.float32 else g
    return g / scale if scale != 1.0 else g


def _host_scalars(t: torch.Tensor) -> bool:
    """A rule's step may read a scalar of ``t`` to the host (``.item()``): free on the CPU, a
    host sync on a CUDA device (Adafactor's ``device_step`` keeps its scalars there instead)."""
    return t.device.type == "cpu"


def _round_out(bufs: StepBuffers, seg: Segment) -> None:
    if bufs.lowp is not None:
        bufs.lowp[seg.start:seg.stop].copy_(bufs.param[seg.start:seg.stop])


def _like_params(numel: int, keys: Sequence[str]) -> dict:
    return {k: StateSpec(numel, torch.float32) for k in keys}


# ---- SGD ----------------------------------------------------------------------------------------

SGD_OPTIONS = {"maximize": False, "differentiable": False}
"""torch.optim.SGD options the rule does not run (with torch's defaults)."""
SGD_IMPLEMENTATION = {"foreach": None, "fused": None}


def check_sgd(group: Mapping[str, Any], *, owner: str) -> dict:
    """torch.optim.SGD's checks of a group's hyperparameters; returns them normalised."""
    _refuse(group, SGD_OPTIONS, owner)
    out = {"lr": _number(owner, "lr", group["lr"], low=0.0),
           "momentum": _number(owner, "momentum", group.get("momentum", 0.0), low=0.0),
           "dampening": _number(owner, "dampening", group.get("dampening", 0.0)),
           "weight_decay": _number(owner, "weight_decay", group.get("weight_decay", 0.0), low=0.0),
           "nesterov": _flag(owner, "nesterov", group.get("nesterov", False))}
    if out["nesterov"] and (out["momentum"] <= 0 or out["dampening"] != 0):
        raise ValueError(f"{owner}: nesterov=True requires momentum > 0 and dampening=0 (torch.optim.SGD's "
                         f"rule)")
    return out


@dataclass(frozen=True, kw_only=True)
class SGDArgs:
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    grad_scale: float = 1.0


@dataclass(frozen=True)
class SGDRule:
    """``torch.optim.SGD``: ``g += wd * p``; with momentum, ``buf = g`` at a param's first step,
    else ``buf = momentum * buf + (1 - dampening) * g``, and ``g = g + momentum * buf`` (Nesterov)
    or ``buf``; ``p -= lr * g``. ``buffer``: the rule keeps a momentum buffer (False: every group
    has momentum 0, as torch keeps no state then)."""

    buffer: bool = True

    name = "SGD"
    elementwise = True
    hyper_keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    @property
    def state_keys(self) -> tuple:
        return ("momentum_buffer",) if self.buffer else ()

    group_options = dict(SGD_OPTIONS, **SGD_IMPLEMENTATION)
    implementation_options = SGD_IMPLEMENTATION

    def check(self, group: Mapping[str, Any], *, owner: str) -> dict:
        out = check_sgd(group, owner=owner)
        if out["momentum"] != 0 and not self.buffer:
            raise ValueError(f"{owner}: momentum={out['momentum']} in a param group, but the optimizer "
                             f"was built with momentum=0 (no momentum buffers); give the optimizer "
                             f"(or the spec) a momentum > 0")
        return out

    def state_shape(self, key: str, shape: tuple) -> tuple:
        return tuple(shape)

    def payloads(self, numel: int, shapes: Sequence[tuple] = ()) -> dict:
        return _like_params(numel, self.state_keys)

    def args(self, group: Mapping[str, Any], *, grad_scale: float = 1.0) -> SGDArgs:
        momentum = float(group["momentum"])
        if momentum != 0 and not self.buffer:
            raise ValueError("SGD: a param group has momentum > 0 but the rule keeps no momentum buffer; "
                             "give the optimizer a momentum > 0")
        return SGDArgs(lr=lr_of(group), momentum=momentum, dampening=float(group["dampening"]),
                       weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]),
                       grad_scale=grad_scale)

    def cpu_job(self, bufs: StepBuffers, segments: Sequence[Segment], *,
                threads: Optional[int] = None) -> list:
        native = _native()
        if native is None:
            return [Done.timing(self.device_step, bufs, segments)]
        buf = bufs.state.get("momentum_buffer")
        tickets = []
        try:
            for seg in segments:
                a, sl = seg.args, slice(seg.start, seg.stop)
                tickets.append(native.sgd_step_async(
                    bufs.param[sl], bufs.grad[sl], None if buf is None else buf[sl],
                    None if bufs.lowp is None else bufs.lowp[sl], lr=a.lr, momentum=a.momentum,
                    dampening=a.dampening, weight_decay=a.weight_decay, nesterov=a.nesterov,
                    first_step=seg.step == 1, grad_scale=a.grad_scale, threads=threads))
        except BaseException:
            wait_all(tickets)
            raise
        return tickets

    def device_step(self, bufs: StepBuffers, segments: Sequence[Segment]) -> None:
        """torch.optim.SGD's single-tensor step, op for op (the CPU fallback too)."""
        for seg in segments:
            a, sl = seg.args, slice(seg.start, seg.stop)
            p, g = bufs.param[sl], _grad(bufs, seg, a.grad_scale)
            if a.weight_decay != 0:
                g = g.add(p, alpha=a.weight_decay)
            if a.momentum != 0:
                buf = bufs.state["momentum_buffer"][sl]
                if seg.step == 1:
                    buf.copy_(g)  # torch: buf = torch.clone(grad)
                else:
                    buf.mul_(a.momentum).add_(g, alpha=1 - a.dampening)
                g = g.add(buf, alpha=a.momentum) if a.nesterov else buf
            p.add_(g, alpha=-a.lr)
            _round_out(bufs, seg)


# ---- Lion ---------------------------------------------------------------------------------------


def check_lion(group: Mapping[str, Any], *, owner: str) -> dict:
    betas = group.get("betas", (0.9, 0.99))
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{owner}.betas={betas!r} is invalid: expected two numbers in [0, 1]")
    return {"lr": _number(owner, "lr", group["lr"], low=0.0),
            "betas": tuple(_number(owner, f"betas[{i}]", b, low=0.0, high=1.0) for i, b in enumerate(betas)),
            "weight_decay": _number(owner, "weight_decay", group.get("weight_decay", 0.0), low=0.0)}


@dataclass(frozen=True, kw_only=True)
class LionArgs:
    lr: float
    betas: tuple
    weight_decay: float
    grad_scale: float = 1.0


@dataclass(frozen=True)
class LionRule:
    """Lion (Chen et al. 2023) with decoupled weight decay, one moment ("exp_avg")::

        c = b1 * m + (1 - b1) * g
        p = p * (1 - lr * wd) - lr * sign(c)
        m = b2 * m + (1 - b2) * g
    """

    name = "Lion"
    elementwise = True
    state_keys = ("exp_avg",)
    hyper_keys = ("lr", "betas", "weight_decay")
    group_options = {}
    implementation_options = {}

    def check(self, group: Mapping[str, Any], *, owner: str) -> dict:
        return check_lion(group, owner=owner)

    def state_shape(self, key: str, shape: tuple) -> tuple:
        return tuple(shape)

    def payloads(self, numel: int, shapes: Sequence[tuple] = ()) -> dict:
        return _like_params(numel, self.state_keys)

    def args(self, group: Mapping[str, Any], *, grad_scale: float = 1.0) -> LionArgs:
        return LionArgs(lr=lr_of(group), betas=tuple(float(b) for b in group["betas"]),
                        weight_decay=float(group["weight_decay"]), grad_scale=grad_scale)

    def cpu_job(self, bufs: StepBuffers, segments: Sequence[Segment], *,
                threads: Optional[int] = None) -> list:
        native = _native()
        if native is None:
            return [Done.timing(self.device_step, bufs, segments)]
        m, tickets = bufs.state["exp_avg"], []
        try:
            for seg in segments:
                a, sl = seg.args, slice(seg.start, seg.stop)
                tickets.append(native.lion_step_async(
                    bufs.param[sl], bufs.grad[sl], m[sl], None if bufs.lowp is None else bufs.lowp[sl],
                    lr=a.lr, betas=a.betas, weight_decay=a.weight_decay, grad_scale=a.grad_scale,
                    threads=threads))
        except BaseException:
            wait_all(tickets)
            raise
        return tickets

    def device_step(self, bufs: StepBuffers, segments: Sequence[Segment]) -> None:
        for seg in segments:
            a, sl = seg.args, slice(seg.start, seg.stop)
            (b1, b2), p, m = a.betas, bufs.param[sl], bufs.state["exp_avg"][sl]
            g = _grad(bufs, seg, a.grad_scale)
            c = m.mul(b1).add_(g, alpha=1 - b1).sign_()   # c = b1*m + (1-b1)*g
            p.mul_(1 - a.lr * a.weight_decay)              # decoupled decay
            p.add_(c, alpha=-a.lr)                         # p -= lr * sign(c)
            m.mul_(b2).add_(g, alpha=1 - b2)               # m = b2*m + (1-b2)*g
            _round_out(bufs, seg)


# ---- Adafactor ----------------------------------------------------------------------------------

ADAFACTOR_OPTIONS = {"maximize": False}
ADAFACTOR_IMPLEMENTATION = {"foreach": None}


def check_adafactor(group: Mapping[str, Any], *, owner: str) -> dict:
    """torch.optim.Adafactor's checks; returns the hyperparameters normalised."""
    _refuse(group, ADAFACTOR_OPTIONS, owner)
    eps = group.get("eps", (None, 1e-3))
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"{owner}.eps={eps!r} is invalid: expected (eps1 or None, eps2)")
    return {"lr": _number(owner, "lr", group["lr"], low=0.0),
            "beta2_decay": _number(owner, "beta2_decay", group.get("beta2_decay", -0.8), high=0.0),
            "eps": (None if eps[0] is None else _number(owner, "eps[0]", eps[0], low=0.0),
                    _number(owner, "eps[1]", eps[1], low=0.0)),
            "d": _number(owner, "d", group.get("d", 1.0), low=1.0),
            "weight_decay": _number(owner, "weight_decay", group.get("weight_decay", 0.0), low=0.0)}


def adafactor_state_shapes(shape: Sequence[int]) -> dict:
    """torch.optim.Adafactor's state of a param of ``shape``: "row_var" (..., R, 1) and "col_var"
    (..., 1, C) for 2 or more dims, "variance" (the shape) for fewer."""
    shape = tuple(int(d) for d in shape)
    if len(shape) > 1:
        return {"row_var": shape[:-1] + (1,), "col_var": shape[:-2] + (1, shape[-1])}
    return {"variance": shape}


@dataclass(frozen=True, kw_only=True)
class AdafactorArgs:
    lr: float
    beta2_decay: float
    eps1: Optional[float]
    eps2: float
    d: float
    weight_decay: float
    grad_scale: float = 1.0


@dataclass(frozen=True)
class AdafactorRule:
    """``torch.optim.Adafactor`` (its single-tensor step, op for op): a factored second moment
    (row and column means of ``g^2``) for params of 2 or more dims, a full one for the others;
    relative step size ``min(lr, 1/sqrt(t)) * max(eps2, RMS(p))``, the update clipped to RMS
    ``d``. State sized by the params' shapes: needs whole params."""

    name = "Adafactor"
    elementwise = False
    state_keys = ("row_var", "col_var", "variance")
    hyper_keys = ("lr", "beta2_decay", "eps", "d", "weight_decay")
    group_options = dict(ADAFACTOR_OPTIONS, **ADAFACTOR_IMPLEMENTATION)
    implementation_options = ADAFACTOR_IMPLEMENTATION

    def check(self, group: Mapping[str, Any], *, owner: str) -> dict:
        return check_adafactor(group, owner=owner)

    def state_shape(self, key: str, shape: tuple) -> Optional[tuple]:
        return adafactor_state_shapes(shape).get(key)

    def payloads(self, numel: int, shapes: Sequence[tuple] = ()) -> dict:
        spans: dict = {k: [] for k in self.state_keys}
        fill = dict.fromkeys(self.state_keys, 0)
        for shape in shapes:
            mine = adafactor_state_shapes(shape)
            for k in self.state_keys:
                n = math.prod(mine[k]) if k in mine else 0
                spans[k].append((fill[k], fill[k] + n))
                fill[k] += n
        return {k: StateSpec(fill[k], torch.float32, tuple(spans[k])) for k in self.state_keys}

    def args(self, group: Mapping[str, Any], *, grad_scale: float = 1.0) -> AdafactorArgs:
        eps1, eps2 = group["eps"]
        return AdafactorArgs(lr=lr_of(group), beta2_decay=float(group["beta2_decay"]),
                             eps1=None if eps1 is None else float(eps1), eps2=float(eps2),
                             d=float(group["d"]), weight_decay=float(group["weight_decay"]),
                             grad_scale=grad_scale)

    def cpu_job(self, bufs: StepBuffers, segments: Sequence[Segment], *,
                threads: Optional[int] = None) -> list:
        """One native call per param (``adafactor_step_async``: three passes over it, queued on
        the kernel thread), else ``device_step``'s torch ops on the worker."""
        native = _native()
        if native is None:
            return [Done.timing(self.device_step, bufs, segments)]
        tickets = []
        try:
            for seg in segments:
                a, sl = seg.args, slice(seg.start, seg.stop)
                state = {k: bufs.state[k][slice(*seg.spans[k])] for k in adafactor_state_shapes(seg.shape)}
                tickets.append(native.adafactor_step_async(
                    bufs.param[sl], bufs.grad[sl], **state, out_lowp=None if bufs.lowp is None else bufs.lowp[sl],
                    shape=seg.shape, step=seg.step, lr=a.lr, beta2_decay=a.beta2_decay, eps=(a.eps1, a.eps2),
                    d=a.d, weight_decay=a.weight_decay, grad_scale=a.grad_scale, threads=threads))
        except BaseException:
            wait_all(tickets)
            raise
        return tickets

    def device_step(self, bufs: StepBuffers, segments: Sequence[Segment]) -> None:
        """torch.optim.Adafactor's single-tensor step, op for op (the host's fallback too). On a
        CUDA device its two norms stay there: torch reads each with ``.item()``, a host sync per
        param, which in the GPU share left the host waiting for the stream twice per param
        (the AdamW share had the same fault: session 17). The scale is then formed on the device
        in float64, as torch forms it in Python floats, and applied in the param's dtype, as
        ``add_(alpha=)`` casts it; the product and the sum round separately there (at most an
        ulp from torch's)."""
        for seg in segments:
            a, shape = seg.args, seg.shape
            param = bufs.param[seg.start:seg.stop].view(shape)
            grad = _grad(bufs, seg, a.grad_scale).view(shape)
            state = {k: bufs.state[k][lo:hi].view(s) for k, s in adafactor_state_shapes(shape).items()
                     for lo, hi in (seg.spans[k],)}
            eps1 = torch.finfo(param.dtype).eps if a.eps1 is None else a.eps1
            step = float(seg.step)
            one_minus_beta2_t = step ** a.beta2_decay
            rho_t = min(a.lr, 1 / (step ** 0.5))
            on_host = _host_scalars(param)
            norm = param.norm(2)
            alpha = (max(a.eps2, norm.item() / (param.numel() ** 0.5)) if on_host
                     else norm.double().div_(param.numel() ** 0.5).clamp_(min=a.eps2)) * rho_t
            if a.weight_decay != 0:
                param.mul_(1 - a.lr * a.weight_decay)
            if grad.dim() > 1:
                row_var, col_var = state["row_var"], state["col_var"]
                row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
                row_var.lerp_(row_mean, one_minus_beta2_t)
                col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
                col_var.lerp_(col_mean, one_minus_beta2_t)
                var_estimate = row_var @ col_var
                var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
            else:
                variance = state["variance"]
                variance.lerp_(grad * grad, one_minus_beta2_t)
                var_estimate = variance.clone()
            update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
            update.mul_(grad)
            if on_host:
                denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * a.d))
                param.add_(update, alpha=-alpha / denom)
            else:  # (no host sync: the scale is a device scalar)
                denom = update.norm(2).double().div_((update.numel() ** 0.5) * a.d).clamp_(min=1.0)
                param.add_(update.mul_(alpha.div_(denom).neg_().to(param.dtype)))
            _round_out(bufs, seg)


# ---- Muon ---------------------------------------------------------------------------------------

MUON_NS = (3.4445, -4.7750, 2.0315)
"""torch.optim.Muon's default Newton-Schulz coefficients (Keller Jordan's)."""
ADJUST_LR = (None, "original", "match_rms_adamw")


def check_muon(group: Mapping[str, Any], *, owner: str) -> dict:
    """torch.optim.Muon's checks; returns the hyperparameters normalised."""
    coeffs = group.get("ns_coefficients", MUON_NS)
    if not isinstance(coeffs, (tuple, list)) or len(coeffs) != 3:
        raise ValueError(f"{owner}.ns_coefficients={coeffs!r} is invalid: expected three numbers (a, b, c)")
    steps = group.get("ns_steps", 5)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"{owner}.ns_steps={steps!r} is invalid: expected an int in [0, 100)")
    fn = group.get("adjust_lr_fn")
    if fn not in ADJUST_LR:
        raise ValueError(f"{owner}.adjust_lr_fn={fn!r} is invalid: expected None, 'original' or "
                         f"'match_rms_adamw'")
    return {"lr": _number(owner, "lr", group["lr"], low=0.0),
            "weight_decay": _number(owner, "weight_decay", group.get("weight_decay", 0.1), low=0.0),
            "momentum": _number(owner, "momentum", group.get("momentum", 0.95), low=0.0),
            "nesterov": _flag(owner, "nesterov", group.get("nesterov", True)),
            "ns_coefficients": tuple(_number(owner, f"ns_coefficients[{i}]", c) for i, c in enumerate(coeffs)),
            "eps": _number(owner, "eps", group.get("eps", 1e-7), low=0.0),
            "ns_steps": steps, "adjust_lr_fn": fn}


@dataclass(frozen=True, kw_only=True)
class MuonArgs:
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple
    eps: float
    ns_steps: int
    adjust_lr_fn: Optional[str]
    grad_scale: float = 1.0


def newton_schulz(update: torch.Tensor, coefficients: tuple, steps: int, eps: float) -> torch.Tensor:
    """The orthogonalisation of torch.optim.Muon, op for op (bf16, quintic iteration on the wide
    orientation, spectral norm brought under 1 first); returns a bf16 matrix of ``update``'s shape.
    A bf16 ``update`` is normalised in place (as torch's is)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def muon_lr(lr: float, fn: Optional[str], shape: Sequence[int]) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of ``shape``."""
    rows, cols = shape[:2]
    if fn is None or fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class _Staging:
    """One of a worker thread's pinned staging buffers ([Note: Muon's pipeline])."""

    __slots__ = ("buffer", "device", "job")

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.device = None
        self.job: Optional["_MuonJob"] = None
        """The job whose stages use ``buffer``."""


class _Slots(threading.local):
    """A worker thread's staging buffers, taken in turn job by job, and its jobs whose apply
    passes are not queued yet, oldest first."""

    def __init__(self):
        self.sets = [_Staging() for _ in range(STAGING_SETS)]
        self.turn = 0
        self.open: list = []


STAGING_SETS = 3
"""Pinned bf16 staging buffers per worker thread: job K's, and those of jobs K - 1 and K - 2,
whose iterations and apply passes are still to run ([Note: Muon's pipeline])."""
_SLOTS = _Slots()
_SLOT_GRAIN = 1 << 20


def _staging(numel: int, device: torch.device) -> _Staging:
    """This thread's next staging buffer, with room for ``numel`` bf16 elements (grown in steps of
    a million) and free: the job that used it last has completed."""
    slots = _SLOTS
    staging = slots.sets[slots.turn]
    slots.turn = (slots.turn + 1) % len(slots.sets)
    if staging.job is not None:
        wait_all([staging.job])  # (its error, if any, is its own ticket's to report)
        staging.job = None
    if staging.device != device or staging.buffer is None or staging.buffer.numel() < numel:
        staging.buffer = _pinned_bf16(-(-numel // _SLOT_GRAIN) * _SLOT_GRAIN)
        staging.device = device
    return staging


def _pinned_bf16(numel: int) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)


class _MuonJob:
    """A pipelined Muon job's three stages ([Note: Muon's pipeline]) and its last ticket:
    ``wait()`` runs what is left of them (the iterations, the apply passes), waits for the apply
    passes and returns their kernel seconds; later waits return the same, or raise the same
    error. ``start``: when its first apply pass began."""

    MOMENTUM, ITERATING, APPLYING = range(3)

    def __init__(self, momentum: list, places: list, segments: Sequence[Segment], apply, stream, device):
        self.stage = self.MOMENTUM
        self._momentum, self._places, self._segments = momentum, places, segments
        self._apply, self._stream, self._device = apply, stream, device
        self._events: list = []
        self._applies: list = []
        self._seconds: Optional[float] = None
        self._error: Optional[BaseException] = None
        self.start: Optional[float] = None

    def iterate(self) -> None:
        """Stage B: as each momentum pass is done, the matrix to the GPU and back."""
        if self.stage != self.MOMENTUM:
            return
        self.stage = self.ITERATING
        try:
            for ticket, seg, place in zip(self._momentum, self._segments, self._places):
                ticket.wait()
                a, host = seg.args, place.view(seg.shape)
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    x = host.to(self._device, non_blocking=True)
                    ortho = newton_schulz(x, a.ns_coefficients, a.ns_steps, a.eps)
                    host.copy_(ortho, non_blocking=True)  # back into its place
                    done = torch.cuda.Event(blocking=True)  # (waited for asleep, not spinning on a
                    done.record(self._stream)               # core the host passes need)
                del x, ortho  # (the caching allocator reuses them on this stream only: in order)
                self._events.append(done)
        except BaseException as e:
            self._fail(e)

    def queue_applies(self) -> None:
        """Stage C: each apply pass queued once its matrix is back in its place."""
        self.iterate()
        if self.stage != self.ITERATING:
            return
        self.stage = self.APPLYING
        try:
            for done, seg, place in zip(self._events, self._segments, self._places):
                done.synchronize()  # (GIL released)
                self._applies.append(self._apply(seg, place))
        except BaseException as e:
            self._fail(e)

    def wait(self) -> float:
        self.queue_applies()
        if self._error is None and self._seconds is None:
            try:
                self._seconds = sum(t.wait() for t in self._applies)
            except BaseException as e:
                self._fail(e)
            starts = [t.start for t in self._applies if getattr(t, "start", None) is not None]
            self.start = min(starts) if starts else None
            if self._error is None:  # done: let go of the buffers (the thread's list may hold us a while)
                self._momentum = self._places = self._segments = self._applies = self._events = ()
                self._apply = None
        if self._error is not None:
            raise self._error
        return self._seconds

    def _fail(self, error: BaseException) -> None:
        """Keep the first error; let nothing still queued or in flight touch the staging after."""
        self.stage = self.APPLYING
        if self._error is None:
            self._error = error
        wait_all(self._momentum)
        wait_all(self._applies)
        try:
            self._stream.synchronize()  # no copy may still land in a staging buffer reused next
        except BaseException:
            pass


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream the worker's Newton-Schulz iterations run on (one per device): apart from the
    compute stream, so they overlap the model's forward and backward."""
    return torch.cuda.Stream(device)


@dataclass(frozen=True)
class MuonRule:
    """``torch.optim.Muon``: ``buf.lerp_(g, 1 - momentum)``; the update ``g.lerp(buf, momentum)``
    (Nesterov) or ``buf``, orthogonalised by Newton-Schulz; ``p *= 1 - lr * wd``; ``p -= adjusted
    lr * update``. 2-D params only, whole (see [Note: where each rule runs] for where each piece
    runs). The momentum buffer is laid out like the params."""

    name = "Muon"
    elementwise = False
    lag = 2
    """Jobs the step pipeline starts after one of ours before it completes it ([Note: jobs in
    flight] in pipeline.py): a job's stages run while the next two start ([Note: Muon's pipeline])."""
    state_keys = ("momentum_buffer",)
    hyper_keys = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                  "adjust_lr_fn")
    group_options = {}
    implementation_options = {}

    def check(self, group: Mapping[str, Any], *, owner: str) -> dict:
        return check_muon(group, owner=owner)

    def shape_problem(self, shape: tuple) -> Optional[str]:
        return None if len(shape) == 2 else "Muon updates 2-D params only (torch.optim.Muon's rule)"

    def state_shape(self, key: str, shape: tuple) -> tuple:
        return tuple(shape)

    def payloads(self, numel: int, shapes: Sequence[tuple] = ()) -> dict:
        return _like_params(numel, self.state_keys)

    def args(self, group: Mapping[str, Any], *, grad_scale: float = 1.0) -> MuonArgs:
        return MuonArgs(lr=lr_of(group), weight_decay=float(group["weight_decay"]),
                        momentum=float(group["momentum"]), nesterov=bool(group["nesterov"]),
                        ns_coefficients=tuple(float(c) for c in group["ns_coefficients"]),
                        eps=float(group["eps"]), ns_steps=int(group["ns_steps"]),
                        adjust_lr_fn=group["adjust_lr_fn"], grad_scale=grad_scale)

    def cpu_job(self, bufs: StepBuffers, segments: Sequence[Segment], *,
                threads: Optional[int] = None) -> list:
        """The native host passes around Newton-Schulz, pipelined over the chunk's matrices
        ([Note: Muon's pipeline]); without the native module, ``_step``'s torch ops."""
        native = _native()
        if native is None:
            return [Done.timing(self._step, bufs, segments, bufs.device)]
        segments = [seg for seg in segments if seg.stop > seg.start]
        for seg in segments:
            self._check_shape(seg.shape)
        if not segments:
            return []
        if bufs.device is None:
            return self._host_job(native, bufs, segments, threads)
        return self._pipelined_job(native, bufs, segments, threads, bufs.device)

    def device_step(self, bufs: StepBuffers, segments: Sequence[Segment]) -> None:
        self._step(bufs, segments, None)

    @staticmethod
    def _check_shape(shape) -> None:
        if shape is None or len(shape) != 2:
            raise ValueError(f"Muon updates 2-D params only, got one of shape {None if shape is None else tuple(shape)}")

    def _step(self, bufs: StepBuffers, segments: Sequence[Segment], ns_device) -> None:
        """torch.optim.Muon's single-tensor step, op for op (the GPU share's device step, and the
        host's fallback without the native module: Newton-Schulz on ``ns_device`` there)."""
        for seg in segments:
            a, shape, sl = seg.args, seg.shape, slice(seg.start, seg.stop)
            self._check_shape(shape)
            param = bufs.param[sl].view(shape)
            grad = _grad(bufs, seg, a.grad_scale).view(shape)
            buf = bufs.state["momentum_buffer"][sl].view(shape)
            buf.lerp_(grad, 1 - a.momentum)
            update = grad.lerp(buf, a.momentum) if a.nesterov else buf
            ortho = self._orthogonalise(update, a, ns_device)
            param.mul_(1 - a.lr * a.weight_decay)
            param.add_(ortho, alpha=-muon_lr(a.lr, a.adjust_lr_fn, shape))
            _round_out(bufs, seg)

    @staticmethod
    def _orthogonalise(update: torch.Tensor, a: MuonArgs, device) -> torch.Tensor:
        """Newton-Schulz where it is fast: on ``device`` (the GPU) for a host matrix, there and
        back in bf16 on a side stream, the worker waiting for the round trip; in place otherwise."""
        if device is None or update.device == device:
            return newton_schulz(update, a.ns_coefficients, a.ns_steps, a.eps)
        with torch.cuda.device(device), torch.cuda.stream(_side_stream(device)):
            x = update.bfloat16().to(device, non_blocking=True)  # (torch casts to bf16 first too)
            ortho = newton_schulz(x, a.ns_coefficients, a.ns_steps, a.eps)
            return ortho.to("cpu")  # waits for the stream's work

    # ---- the native host passes ([Note: Muon's pipeline]) ---------------------------------

    @staticmethod
    def _momentum(native, bufs: StepBuffers, seg: Segment, out: torch.Tensor, threads):
        a, sl = seg.args, slice(seg.start, seg.stop)
        return native.muon_momentum_async(bufs.grad[sl], bufs.state["momentum_buffer"][sl], out,
                                          momentum=a.momentum, nesterov=a.nesterov, grad_scale=a.grad_scale,
                                          threads=threads)

    @staticmethod
    def _apply(native, bufs: StepBuffers, seg: Segment, ortho: torch.Tensor, threads):
        a, sl = seg.args, slice(seg.start, seg.stop)
        return native.muon_apply_async(bufs.param[sl], ortho, None if bufs.lowp is None else bufs.lowp[sl],
                                       lr=a.lr, weight_decay=a.weight_decay,
                                       adjusted_lr=muon_lr(a.lr, a.adjust_lr_fn, seg.shape), threads=threads)

    def _host_job(self, native, bufs: StepBuffers, segments: Sequence[Segment], threads) -> list:
        """No GPU: per matrix, the momentum pass, Newton-Schulz in torch on the host (as
        torch.optim.Muon on the CPU), the apply pass (queued: it runs while the next matrix's
        iterations do)."""
        tickets = []
        try:
            for seg in segments:
                a = seg.args
                update = torch.empty(seg.shape, dtype=torch.bfloat16)
                tickets.append(self._momentum(native, bufs, seg, update.view(-1), threads))
                tickets[-1].wait()
                ortho = newton_schulz(update, a.ns_coefficients, a.ns_steps, a.eps).contiguous()
                tickets.append(self._apply(native, bufs, seg, ortho.view(-1), threads))
        except BaseException:
            wait_all(tickets)
            raise
        return tickets

    def _pipelined_job(self, native, bufs: StepBuffers, segments: Sequence[Segment], threads, device) -> list:
        """See [Note: Muon's pipeline]: queues job K - 2's apply passes and this job's momentum
        passes, issues job K - 1's iterations; returns this job's momentum tickets and the job."""
        slots = _SLOTS
        *older, last = slots.open or [None]
        for job in older:
            job.queue_applies()  # (an error stays with its job's ticket)
        slots.open = [last] if last is not None else []
        offsets = [0]
        for seg in segments:
            offsets.append(offsets[-1] + seg.stop - seg.start)
        staging = _staging(offsets[-1], device)
        places = [staging.buffer[lo:hi] for lo, hi in zip(offsets, offsets[1:])]
        momentum = []
        try:
            for seg, place in zip(segments, places):  # all queued now: the cores run them in order
                momentum.append(self._momentum(native, bufs, seg, place, threads))
        except BaseException:
            wait_all(momentum)
            raise
        job = _MuonJob(momentum, places, segments, functools.partial(self._apply, native, bufs, threads=threads),
                       _side_stream(device), device)
        staging.job = job
        if last is not None:
            last.iterate()
        slots.open = [j for j in slots.open if j.stage != _MuonJob.APPLYING] + [job]
        return momentum + [job]
