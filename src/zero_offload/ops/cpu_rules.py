"""SGD, Lion, Adafactor and Muon's host passes over flat CPU buffers: the native kernels beside
CPU-Adam.

One pass per element over an fp32 param and its one fp32 state buffer, the grad in fp32, bf16 or
fp16 (read as ``grad / grad_scale``, converted in registers), and an optional bf16/fp16 copy of
the updated param written in the same pass (the offload engine's copy-out, as ``adam_step``'s).
The arithmetic is the reference's tensor ops, operation for operation, so fp32 results equal
them bit for bit except, at most, an ulp in the last few elements (see [Note: SGD and Lion
formula order] in csrc/cpu_rules_kernel.h):

  ``sgd_step``   ``torch.optim.SGD`` (maximize=False): momentum, dampening, Nesterov, L2 decay
  ``lion_step``  Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
                 Algorithm 2): ``c = beta1 * m + (1 - beta1) * g``;
                 ``param = param * (1 - lr * wd) - lr * sign(c)``; ``m = beta2 * m + (1 - beta2) * g``

Two rules need a whole parameter, so their calls take one param at a time, in few passes over it
([Note: Muon and Adafactor formula order] in csrc/cpu_rules_kernel.h):

  ``adafactor_step``  ``torch.optim.Adafactor`` (maximize=False) on one param of ``shape``: pass 1
                      the sums of squares of the param and of g's rows and columns (factored, 2 or
                      more dims) or the variance update (fewer dims); pass 2 the update's sum of
                      squares (factored); the last pass the decay, the update and the copy-out
  ``muon_momentum``   ``torch.optim.Muon``'s host part before Newton-Schulz: the momentum lerp and
                      the (Nesterov) update, written as bf16 (the input of the iterations)
  ``muon_apply``      its host part after them: decay, ``param -= adjusted_lr * ortho`` (bf16 in)
                      and the copy-out

Elementwise, everything equals torch's ops bit for bit; Adafactor's sums are fp64 in a fixed
order (any thread count gives the same bits), so its norms and factor means may differ from
torch's fp32 ones in their last bit.

Each has an ``_async`` form that queues the call on the native kernel thread CPU-Adam uses (one
queue: calls of every rule run in submission order) and returns a ``KernelTicket``. The ISA path
is CPU-Adam's (``cpu_adam.set_isa``). Every check raises before anything changes ([Note:
validate, then mutate] in ops/cpu_adam.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Optional, Sequence

import torch

from ._native import TORCH_DTYPES, Dtype, default_threads, rules
from .cpu_adam import (FLOAT_DTYPES, LOWP_DTYPES, KernelTicket, as_float, bump_versions, check_buffer,
                       check_grad_scale, check_no_overlap, check_threads, checked_betas, checked_lr, checked_nonneg,
                       hyper_checker)

__all__ = ["AdafactorHyper", "LionHyper", "MuonHyper", "SgdHyper", "adafactor_step", "adafactor_step_async",
           "lion_step", "lion_step_async", "muon_apply", "muon_apply_async", "muon_momentum",
           "muon_momentum_async", "sgd_step", "sgd_step_async"]


@dataclass(frozen=True, kw_only=True)
class SgdHyper:
    """The scalars of one SGD step, checked as ``torch.optim.SGD`` checks them (plus finiteness)
    and converted to float. Without ``owner`` the errors use torch's words; with one (a config or
    front end's name) each names ``owner.field=value``."""

    lr: float
    """Learning rate, finite, >= 0."""
    momentum: float
    """Momentum factor, finite, >= 0; 0 keeps no buffer."""
    dampening: float
    """Dampening of the momentum (finite); ignored on the first step, as torch does."""
    weight_decay: float
    """L2 penalty (added to the grad), finite, >= 0."""
    nesterov: bool
    """Nesterov momentum: needs momentum > 0 and dampening == 0."""

    @classmethod
    def checked(cls, *, lr: Any, momentum: Any = 0.0, dampening: Any = 0.0, weight_decay: Any = 0.0,
                nesterov: Any = False, owner: Optional[str] = None) -> "SgdHyper":
        number, bad = hyper_checker(owner)
        lr = checked_lr(number, bad, lr)
        momentum = checked_nonneg(number, bad, "momentum", momentum, "Invalid momentum value")
        dampening = number("dampening", dampening)
        if not math.isfinite(dampening):
            raise bad("dampening", dampening, "Invalid dampening value", "a finite dampening")
        weight_decay = checked_nonneg(number, bad, "weight_decay", weight_decay, "Invalid weight_decay value")
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
        if nesterov and (momentum <= 0 or dampening != 0):
            need = f"momentum > 0 and dampening == 0 (got momentum={momentum}, dampening={dampening})"
            if owner is not None:
                raise ValueError(f"{owner}.nesterov=True is invalid: Nesterov momentum needs {need}")
            raise ValueError(f"Nesterov momentum requires a momentum and zero dampening: {need}")
        return cls(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)


@dataclass(frozen=True, kw_only=True)
class LionHyper:
    """The scalars of one Lion step, checked and converted to float (errors as ``SgdHyper``'s)."""

    lr: float
    """Learning rate, finite, >= 0."""
    beta1: float
    """Interpolation of the update direction ``c``, in [0, 1]."""
    beta2: float
    """Decay of the momentum, in [0, 1]."""
    weight_decay: float
    """Decoupled: ``param *= 1 - lr * weight_decay``; finite, >= 0."""

    @classmethod
    def checked(cls, *, lr: Any, betas: Any = (0.9, 0.99), weight_decay: Any = 0.0,
                owner: Optional[str] = None) -> "LionHyper":
        number, bad = hyper_checker(owner)
        lr = checked_lr(number, bad, lr)
        beta1, beta2 = checked_betas(number, bad, betas, owner, one_allowed=True, example="(0.9, 0.99)")
        weight_decay = checked_nonneg(number, bad, "weight_decay", weight_decay, "Invalid weight_decay value")
        return cls(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)


@dataclass(frozen=True, kw_only=True)
class AdafactorHyper:
    """The scalars of one Adafactor step, checked as ``torch.optim.Adafactor`` checks them (plus
    finiteness) and converted to float (errors as ``SgdHyper``'s)."""

    lr: float
    """Learning rate (the relative step size's cap), finite, >= 0."""
    beta2_decay: float
    """The second moment's decay exponent, finite, <= 0."""
    eps1: Optional[float]
    """Floor of the second moment (squared) and of the row factors' mean; None: fp32's eps."""
    eps2: float
    """Floor of the param's RMS in the step size, finite, >= 0."""
    d: float
    """Clipping threshold of the update's RMS, finite, >= 1."""
    weight_decay: float
    """Decoupled: ``param *= 1 - lr * weight_decay``; finite, >= 0."""

    @classmethod
    def checked(cls, *, lr: Any, beta2_decay: Any = -0.8, eps: Any = (None, 1e-3), d: Any = 1.0,
                weight_decay: Any = 0.0, owner: Optional[str] = None) -> "AdafactorHyper":
        number, bad = hyper_checker(owner)
        lr = checked_lr(number, bad, lr)
        beta2_decay = number("beta2_decay", beta2_decay)
        if not (math.isfinite(beta2_decay) and beta2_decay <= 0):
            raise bad("beta2_decay", beta2_decay, "beta2_decay should be <= 0", "a finite beta2_decay <= 0")
        if isinstance(eps, (str, bytes)) or not hasattr(eps, "__len__") or len(eps) != 2:
            if owner is not None:
                raise bad("eps", eps, "", "a pair (eps1 or None, eps2), e.g. eps=(None, 1e-3)")
            raise TypeError(f"eps must be a pair (eps1 or None, eps2), got {eps!r}")
        eps1 = None if eps[0] is None else number("eps[0]", eps[0])
        if eps1 is not None and not (math.isfinite(eps1) and eps1 >= 0):
            raise bad("eps[0]", eps1, "epsilon1 should be >= 0", "None or a finite eps1 >= 0")
        eps2 = checked_nonneg(number, bad, "eps[1]", eps[1], "epsilon2 should be >= 0", "a finite eps2 >= 0")
        d = number("d", d)
        if not (math.isfinite(d) and d >= 1):
            raise bad("d", d, "Clipping threshold d should be >= 1", "a finite d >= 1")
        weight_decay = checked_nonneg(number, bad, "weight_decay", weight_decay, "weight_decay should be >= 0")
        return cls(lr=lr, beta2_decay=beta2_decay, eps1=eps1, eps2=eps2, d=d, weight_decay=weight_decay)


@dataclass(frozen=True, kw_only=True)
class MuonHyper:
    """The scalars of Muon's host passes, checked as ``torch.optim.Muon`` checks them (plus
    finiteness) and converted to float (errors as ``SgdHyper``'s)."""

    lr: float
    """Learning rate, finite, >= 0 (the decay's; the update's is ``adjusted_lr``)."""
    weight_decay: float
    """Decoupled: ``param *= 1 - lr * weight_decay``; finite, >= 0."""
    momentum: float
    """``buf.lerp_(g, 1 - momentum)``; finite, >= 0."""
    nesterov: bool
    """The update is ``g.lerp(buf, momentum)`` instead of ``buf``."""

    @classmethod
    def checked(cls, *, lr: Any = 1e-3, weight_decay: Any = 0.1, momentum: Any = 0.95, nesterov: Any = True,
                owner: Optional[str] = None) -> "MuonHyper":
        number, bad = hyper_checker(owner)
        lr = checked_lr(number, bad, lr)
        weight_decay = checked_nonneg(number, bad, "weight_decay", weight_decay, "Weight decay should be >= 0")
        momentum = checked_nonneg(number, bad, "momentum", momentum, "Momentum should be >= 0")
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
        return cls(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)


# ---------------------------------------------------------------------------------------------
# Checks of a flat call: everything, before anything is touched. Each returns the native call's
# keyword arguments and the tensors the kernel writes.


def _checked_operands(param, grad, state_name: str, state, out_lowp, *, state_used: bool,
                      grad_scale, threads) -> tuple[dict, list]:
    """The buffers of one call (``state`` may be None when not ``state_used``) and the
    arguments every rule takes."""
    scale = check_grad_scale(grad_scale)
    threads = check_threads(threads)
    check_buffer("param", param, dtypes=(torch.float32,))
    check_buffer("grad", grad, dtypes=FLOAT_DTYPES, numel=param.numel())
    named = [("param", param), ("grad", grad)]
    if state is not None:  # given but unused (SGD without momentum): checked, left untouched
        check_buffer(state_name, state, dtypes=(torch.float32,), numel=param.numel())
        named.append((state_name, state))
    if out_lowp is not None:
        check_buffer("out_lowp", out_lowp, dtypes=LOWP_DTYPES, numel=param.numel())
        named.append(("out_lowp", out_lowp))
    check_no_overlap(named)
    native = dict(
        param=param.data_ptr(), grad=grad.data_ptr(), grad_dtype=int(TORCH_DTYPES[grad.dtype]),
        numel=param.numel(), out=0 if out_lowp is None else out_lowp.data_ptr(),
        out_dtype=int(Dtype.NONE if out_lowp is None else TORCH_DTYPES[out_lowp.dtype]),
        grad_scale=scale, threads=default_threads() if threads is None else threads,
    )
    native[state_name] = state.data_ptr() if state_used else 0
    return native, [param] if out_lowp is None else [param, out_lowp]


def _checked_sgd(param, grad, momentum_buffer, out_lowp, *, lr, momentum, dampening, weight_decay, nesterov,
                 first_step, grad_scale, threads) -> tuple[dict, list]:
    hyper = SgdHyper.checked(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                             nesterov=nesterov)
    if not isinstance(first_step, bool):
        raise TypeError(f"first_step must be a bool (True on a param's first update with momentum: the buffer "
                        f"starts as a copy of the grad, as torch.optim.SGD does), got {type(first_step).__name__}")
    if hyper.momentum != 0 and momentum_buffer is None:
        raise ValueError(f"momentum_buffer is None but momentum={hyper.momentum}: pass the param's fp32 momentum "
                         "buffer (with first_step=True its old values are not read)")
    native, written = _checked_operands(param, grad, "momentum_buffer", momentum_buffer, out_lowp,
                                        state_used=hyper.momentum != 0, grad_scale=grad_scale, threads=threads)
    native.update(lr=hyper.lr, momentum=hyper.momentum, dampening=hyper.dampening,
                  weight_decay=hyper.weight_decay, nesterov=hyper.nesterov, first_step=first_step)
    return native, written


def _checked_lion(param, grad, exp_avg, out_lowp, *, lr, betas, weight_decay, grad_scale,
                  threads) -> tuple[dict, list]:
    hyper = LionHyper.checked(lr=lr, betas=betas, weight_decay=weight_decay)
    if exp_avg is None:
        raise TypeError("exp_avg must be a torch.Tensor (the param's fp32 Lion momentum), got None")
    native, written = _checked_operands(param, grad, "exp_avg", exp_avg, out_lowp, state_used=True,
                                        grad_scale=grad_scale, threads=threads)
    native.update(lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, weight_decay=hyper.weight_decay)
    return native, written


def matrix_dims(shape: Sequence[int]) -> tuple[int, int, int]:
    """``(batch, rows, cols)`` of a param of ``shape`` as Adafactor factors it: the last two dims
    are a matrix's rows and columns, the leading ones its batch (torch.optim.Adafactor's
    ``row_var`` is ``shape[:-1] + (1,)``, ``col_var`` ``shape[:-2] + (1, shape[-1])``)."""
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def _checked_shape(shape: Any, numel: int) -> tuple:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or not all(isinstance(n, Integral) and not isinstance(n, bool)
                                                       and n >= 0 for n in shape):
        raise TypeError(f"shape must be a tuple of ints >= 0 (the param's shape), got {shape!r}")
    shape = tuple(int(n) for n in shape)
    if math.prod(shape) != numel:
        raise ValueError(f"shape {shape} has {math.prod(shape)} elements but the param has {numel}; they must match")
    return shape


def _checked_adafactor(param, grad, row_var, col_var, variance, out_lowp, *, shape, step, lr, beta2_decay, eps, d,
                       weight_decay, grad_scale, threads) -> tuple[dict, list]:
    hyper = AdafactorHyper.checked(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay)
    step = as_float("step", step, "an int (the 1-based count of this update)")
    if not (math.isfinite(step) and step >= 1 and step == int(step)):
        raise ValueError(f"step must be a whole number >= 1 (the first update is step 1), got {step:g}")
    scale, threads = check_grad_scale(grad_scale), check_threads(threads)
    check_buffer("param", param, dtypes=(torch.float32,))
    shape = _checked_shape(shape, param.numel())
    check_buffer("grad", grad, dtypes=FLOAT_DTYPES, numel=param.numel())
    named = [("param", param), ("grad", grad)]
    factored = len(shape) > 1
    if factored:
        batch, rows, cols = matrix_dims(shape)
        for name, t, n in (("row_var", row_var, batch * rows), ("col_var", col_var, batch * cols)):
            if t is None:
                raise TypeError(f"{name} must be a torch.Tensor (the fp32 {name} of a param of shape {shape}), got None")
            check_buffer(name, t, dtypes=(torch.float32,))
            if t.numel() != n:
                raise ValueError(f"{name} has {t.numel()} elements but a param of shape {shape} has {n}; they must "
                                 f"match (torch.optim.Adafactor's state shapes)")
            named.append((name, t))
        if variance is not None:
            raise ValueError(f"variance is given for a param of shape {shape}: a param of 2 or more dims has "
                             "row_var and col_var instead")
    else:
        batch, rows, cols = 1, 1, param.numel()
        if variance is None:
            raise TypeError(f"variance must be a torch.Tensor (the fp32 variance of a param of shape {shape}), got None")
        check_buffer("variance", variance, dtypes=(torch.float32,), numel=param.numel())
        if row_var is not None or col_var is not None:
            raise ValueError(f"row_var/col_var are given for a param of shape {shape}: a param of fewer than 2 dims "
                             "has a variance instead")
        named.append(("variance", variance))
    if out_lowp is not None:
        check_buffer("out_lowp", out_lowp, dtypes=LOWP_DTYPES, numel=param.numel())
        named.append(("out_lowp", out_lowp))
    check_no_overlap(named)
    native = dict(
        param=param.data_ptr(), grad=grad.data_ptr(), grad_dtype=int(TORCH_DTYPES[grad.dtype]),
        row_var=row_var.data_ptr() if factored else 0, col_var=col_var.data_ptr() if factored else 0,
        variance=0 if factored else variance.data_ptr(), batch=batch, rows=rows, cols=cols,
        out=0 if out_lowp is None else out_lowp.data_ptr(),
        out_dtype=int(Dtype.NONE if out_lowp is None else TORCH_DTYPES[out_lowp.dtype]),
        step=step, lr=hyper.lr, beta2_decay=hyper.beta2_decay,
        eps1=torch.finfo(torch.float32).eps if hyper.eps1 is None else hyper.eps1,  # torch: finfo(param.dtype).eps
        eps2=hyper.eps2, d=hyper.d, weight_decay=hyper.weight_decay, grad_scale=scale,
        threads=default_threads() if threads is None else threads)
    written = [t for _, t in named if t is not grad]
    return native, written


def _checked_muon_momentum(grad, momentum_buffer, out, *, momentum, nesterov, grad_scale,
                           threads) -> tuple[dict, list]:
    hyper = MuonHyper.checked(momentum=momentum, nesterov=nesterov)
    scale, threads = check_grad_scale(grad_scale), check_threads(threads)
    check_buffer("momentum_buffer", momentum_buffer, dtypes=(torch.float32,))
    check_buffer("grad", grad, dtypes=FLOAT_DTYPES, numel=momentum_buffer.numel())
    check_buffer("out", out, dtypes=(torch.bfloat16,), numel=momentum_buffer.numel())
    check_no_overlap([("grad", grad), ("momentum_buffer", momentum_buffer), ("out", out)])
    native = dict(grad=grad.data_ptr(), grad_dtype=int(TORCH_DTYPES[grad.dtype]),
                  momentum_buffer=momentum_buffer.data_ptr(), numel=momentum_buffer.numel(), out=out.data_ptr(),
                  momentum=hyper.momentum, nesterov=hyper.nesterov, grad_scale=scale,
                  threads=default_threads() if threads is None else threads)
    return native, [momentum_buffer, out]


def _checked_muon_apply(param, ortho, out_lowp, *, lr, weight_decay, adjusted_lr, threads) -> tuple[dict, list]:
    hyper = MuonHyper.checked(lr=lr, weight_decay=weight_decay)
    adjusted_lr = as_float("adjusted_lr", adjusted_lr)
    if not (math.isfinite(adjusted_lr) and adjusted_lr >= 0):
        raise ValueError(f"adjusted_lr must be finite and >= 0 (the lr of the orthogonalised update), got {adjusted_lr}")
    threads = check_threads(threads)
    check_buffer("param", param, dtypes=(torch.float32,))
    check_buffer("ortho", ortho, dtypes=(torch.bfloat16,), numel=param.numel())
    named = [("param", param), ("ortho", ortho)]
    if out_lowp is not None:
        check_buffer("out_lowp", out_lowp, dtypes=LOWP_DTYPES, numel=param.numel())
        named.append(("out_lowp", out_lowp))
    check_no_overlap(named)
    native = dict(param=param.data_ptr(), ortho=ortho.data_ptr(), numel=param.numel(),
                  out=0 if out_lowp is None else out_lowp.data_ptr(),
                  out_dtype=int(Dtype.NONE if out_lowp is None else TORCH_DTYPES[out_lowp.dtype]),
                  lr=hyper.lr, weight_decay=hyper.weight_decay, adjusted_lr=adjusted_lr,
                  threads=default_threads() if threads is None else threads)
    return native, [param] if out_lowp is None else [param, out_lowp]


def _run(kernel, native: dict, written: list) -> float:
    if native.get("numel", 1) == 0:
        return 0.0
    seconds = kernel(**native)
    bump_versions(written)
    return seconds


def _queue(kernel_async, native: dict, written: list, operands: tuple) -> KernelTicket:
    """``_run``'s counterpart for the ``*_async`` forms: queues the checked call on the native
    kernel thread; the ticket keeps ``operands`` alive and bumps ``written``'s versions on wait."""
    return KernelTicket(kernel_async(**native), operands, written)


# ---------------------------------------------------------------------------------------------
# Flat-buffer API.


def sgd_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor],
    out_lowp: Optional[torch.Tensor] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first_step: bool,
    grad_scale: float = 1.0,
    threads: Optional[int] = None,
) -> None:
    """One fused ``torch.optim.SGD`` step (maximize=False) over flat CPU buffers, in place.

    ``param``: fp32, contiguous. ``grad``: fp32, bf16 or fp16, same numel; the update uses
    ``grad / grad_scale`` (grad itself is not modified). ``momentum_buffer``: the param's fp32
    buffer, required when ``momentum != 0`` (may be None otherwise; one given then is checked and
    left untouched). ``first_step``: the buffer's first update, where torch starts it as a copy of
    the (decayed) grad, without dampening: its old values are not read. ``out_lowp``: optional
    bf16/fp16 buffer that receives the updated params rounded to nearest even. ``threads``: None
    = one per CPU this process may use. Hyperparameters are checked as torch checks them
    (``SgdHyper``).

    Releases the GIL for the whole call. Raises TypeError / ValueError before touching anything
    on bad input.
    """
    native, written = _checked_sgd(param, grad, momentum_buffer, out_lowp, lr=lr, momentum=momentum,
                                   dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                                   first_step=first_step, grad_scale=grad_scale, threads=threads)
    _run(rules.sgd_step, native, written)


def sgd_step_async(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: Optional[torch.Tensor],
    out_lowp: Optional[torch.Tensor] = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first_step: bool,
    grad_scale: float = 1.0,
    threads: Optional[int] = None,
) -> KernelTicket:
    """``sgd_step`` queued on the native kernel thread: checked now (errors raise here, before
    anything is queued or changed), run after the calls queued before it (CPU-Adam's included);
    the caller goes on at once. The buffers must not be read or written until the ticket's
    ``wait()`` returns (see [Note: why a native queue] in csrc/kernel_queue.h)."""
    native, written = _checked_sgd(param, grad, momentum_buffer, out_lowp, lr=lr, momentum=momentum,
                                   dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                                   first_step=first_step, grad_scale=grad_scale, threads=threads)
    return _queue(rules.sgd_step_async, native, written, (param, grad, momentum_buffer, out_lowp))


def lion_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    out_lowp: Optional[torch.Tensor] = None,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    threads: Optional[int] = None,
) -> None:
    """One fused Lion step (decoupled weight decay) over flat CPU buffers, in place.

    ``param``: fp32, contiguous. ``grad``: fp32, bf16 or fp16 (used as ``grad / grad_scale``).
    ``exp_avg``: the param's fp32 momentum (zeros before the first step). ``out_lowp``,
    ``threads``: as ``sgd_step``. Hyperparameters: ``LionHyper``. A NaN in the interpolated
    momentum makes the param NaN ([Note: sign of NaN] in csrc/cpu_rules_kernel.h).

    Releases the GIL for the whole call. Raises TypeError / ValueError before touching anything
    on bad input.
    """
    native, written = _checked_lion(param, grad, exp_avg, out_lowp, lr=lr, betas=betas,
                                    weight_decay=weight_decay, grad_scale=grad_scale, threads=threads)
    _run(rules.lion_step, native, written)


def lion_step_async(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    out_lowp: Optional[torch.Tensor] = None,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    threads: Optional[int] = None,
) -> KernelTicket:
    """``lion_step`` queued on the native kernel thread, as ``sgd_step_async``."""
    native, written = _checked_lion(param, grad, exp_avg, out_lowp, lr=lr, betas=betas,
                                    weight_decay=weight_decay, grad_scale=grad_scale, threads=threads)
    return _queue(rules.lion_step_async, native, written, (param, grad, exp_avg, out_lowp))


def adafactor_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    row_var: Optional[torch.Tensor] = None,
    col_var: Optional[torch.Tensor] = None,
    variance: Optional[torch.Tensor] = None,
    out_lowp: Optional[torch.Tensor] = None,
    shape: Sequence[int],
    step: int,
    lr: float,
    beta2_decay: float = -0.8,
    eps: tuple = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    threads: Optional[int] = None,
) -> float:
    """One ``torch.optim.Adafactor`` step (maximize=False) of one whole param, in place.

    ``param``: fp32, contiguous, the ``shape``'s elements (row-major). ``grad``: fp32, bf16 or
    fp16 (used as ``grad / grad_scale``). State, fp32 and contiguous: for 2 or more dims
    ``row_var`` (``batch * rows`` elements, torch's ``shape[:-1] + (1,)``) and ``col_var``
    (``batch * cols``, torch's ``shape[:-2] + (1, shape[-1])``), for fewer ``variance`` (the
    param's size); zeros before the first step. ``step``: this update's 1-based count.
    ``out_lowp``, ``threads``: as ``sgd_step``. Hyperparameters: ``AdafactorHyper``.

    Releases the GIL for the whole call. Raises TypeError / ValueError before touching anything
    on bad input. Returns the seconds the kernels ran.
    """
    native, written = _checked_adafactor(param, grad, row_var, col_var, variance, out_lowp, shape=shape, step=step,
                                         lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
                                         grad_scale=grad_scale, threads=threads)
    if param.numel() == 0:
        return 0.0
    return _run(rules.adafactor_step, native, written)


def adafactor_step_async(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    row_var: Optional[torch.Tensor] = None,
    col_var: Optional[torch.Tensor] = None,
    variance: Optional[torch.Tensor] = None,
    out_lowp: Optional[torch.Tensor] = None,
    shape: Sequence[int],
    step: int,
    lr: float,
    beta2_decay: float = -0.8,
    eps: tuple = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    threads: Optional[int] = None,
) -> KernelTicket:
    """``adafactor_step`` queued on the native kernel thread, as ``sgd_step_async``."""
    native, written = _checked_adafactor(param, grad, row_var, col_var, variance, out_lowp, shape=shape, step=step,
                                         lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
                                         grad_scale=grad_scale, threads=threads)
    return _queue(rules.adafactor_step_async, native, written, (param, grad, row_var, col_var, variance, out_lowp))


def muon_momentum(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    out: torch.Tensor,
    *,
    momentum: float,
    nesterov: bool,
    grad_scale: float = 1.0,
    threads: Optional[int] = None,
) -> float:
    """``torch.optim.Muon``'s momentum step over flat CPU buffers: ``momentum_buffer.lerp_(g,
    1 - momentum)`` in place (g = ``grad / grad_scale``, grad fp32/bf16/fp16), and the update
    (``g.lerp(buf, momentum)`` when ``nesterov``, else ``buf``) written into ``out`` as bf16
    (round to nearest even: the input Newton-Schulz casts to). All contiguous, one numel.

    Releases the GIL for the whole call. Raises TypeError / ValueError before touching anything
    on bad input. Returns the kernel's seconds."""
    native, written = _checked_muon_momentum(grad, momentum_buffer, out, momentum=momentum, nesterov=nesterov,
                                             grad_scale=grad_scale, threads=threads)
    return _run(rules.muon_momentum, native, written)


def muon_momentum_async(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    out: torch.Tensor,
    *,
    momentum: float,
    nesterov: bool,
    grad_scale: float = 1.0,
    threads: Optional[int] = None,
) -> KernelTicket:
    """``muon_momentum`` queued on the native kernel thread, as ``sgd_step_async``."""
    native, written = _checked_muon_momentum(grad, momentum_buffer, out, momentum=momentum, nesterov=nesterov,
                                             grad_scale=grad_scale, threads=threads)
    return _queue(rules.muon_momentum_async, native, written, (grad, momentum_buffer, out))


def muon_apply(
    param: torch.Tensor,
    ortho: torch.Tensor,
    out_lowp: Optional[torch.Tensor] = None,
    *,
    lr: float,
    weight_decay: float,
    adjusted_lr: float,
    threads: Optional[int] = None,
) -> float:
    """``torch.optim.Muon``'s update of a param from its orthogonalised update ``ortho`` (bf16,
    the param's elements in its order): ``param.mul_(1 - lr * weight_decay)``, then
    ``param.add_(ortho, alpha=-adjusted_lr)``, over flat CPU buffers; ``out_lowp``: as
    ``sgd_step``.

    Releases the GIL for the whole call. Raises TypeError / ValueError before touching anything
    on bad input. Returns the kernel's seconds."""
    native, written = _checked_muon_apply(param, ortho, out_lowp, lr=lr, weight_decay=weight_decay,
                                          adjusted_lr=adjusted_lr, threads=threads)
    return _run(rules.muon_apply, native, written)


def muon_apply_async(
    param: torch.Tensor,
    ortho: torch.Tensor,
    out_lowp: Optional[torch.Tensor] = None,
    *,
    lr: float,
    weight_decay: float,
    adjusted_lr: float,
    threads: Optional[int] = None,
) -> KernelTicket:
    """``muon_apply`` queued on the native kernel thread, as ``sgd_step_async``."""
    native, written = _checked_muon_apply(param, ortho, out_lowp, lr=lr, weight_decay=weight_decay,
                                          adjusted_lr=adjusted_lr, threads=threads)
    return _queue(rules.muon_apply_async, native, written, (param, ortho, out_lowp))
