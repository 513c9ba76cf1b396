"""SGD and Lion over flat CPU buffers: the native fused kernels beside CPU-Adam.

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

Each has an ``_async`` form that queues the call on the native kernel thread CPU-Adam uses (one
queue: calls of every rule run in submission order) and returns a ``KernelTicket``. The ISA path
is CPU-Adam's (``cpu_adam.set_isa``). Every check raises before anything changes ([Note:
validate, then mutate] in ops/cpu_adam.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ._native import TORCH_DTYPES, Dtype, default_threads, rules
from .cpu_adam import (FLOAT_DTYPES, LOWP_DTYPES, KernelTicket, bump_versions, check_buffer,
                       check_grad_scale, check_no_overlap, check_threads, checked_betas, checked_lr,
                       hyper_checker)

__all__ = ["SgdHyper", "LionHyper", "sgd_step", "sgd_step_async", "lion_step", "lion_step_async"]


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
        momentum = number("momentum", momentum)
        if not (math.isfinite(momentum) and momentum >= 0):
            raise bad("momentum", momentum, "Invalid momentum value", "a finite momentum >= 0")
        dampening = number("dampening", dampening)
        if not math.isfinite(dampening):
            raise bad("dampening", dampening, "Invalid dampening value", "a finite dampening")
        weight_decay = number("weight_decay", weight_decay)
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise bad("weight_decay", weight_decay, "Invalid weight_decay value", "a finite weight_decay >= 0")
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
        weight_decay = number("weight_decay", weight_decay)
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise bad("weight_decay", weight_decay, "Invalid weight_decay value", "a finite weight_decay >= 0")
        return cls(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)


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


def _run(kernel, native: dict, written: list) -> None:
    if native["numel"] == 0:
        return
    kernel(**native)
    bump_versions(written)


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
    ticket = rules.sgd_step_async(**native)
    return KernelTicket(ticket, (param, grad, momentum_buffer, out_lowp), written)


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
    ticket = rules.lion_step_async(**native)
    return KernelTicket(ticket, (param, grad, exp_avg, out_lowp), written)
