"""CPUAdam / CPUAdamW: torch.optim drop-ins over the native fused CPU-Adam kernel.

One pass per element over fp32 params and moments, grads in fp32/bf16/fp16, the loss-scale
unscale fused in, and (for the offload engine) an optional bf16/fp16 copy of the updated params
written in the same pass. The flat-buffer calls also take bf16 moments (opt-in, stored by
stochastic rounding: see ``adam_step``). The arithmetic is torch's fused CPU Adam's, operation for operation
(see [Note: formula order] in csrc/cpu_adam_kernel.h), so results match
``torch.optim.Adam(fused=True)`` / ``torch.optim.AdamW(fused=True)`` bit for bit on fp32 grads
and on ``grad.float()`` of bf16/fp16 grads.

Layers:
  ``CPUAdam`` / ``CPUAdamW``  torch.optim.Optimizer subclasses (state dict as torch's)
  ``adam_step``               one fused step over flat buffers (the engine's entry point)
  ``grad_sumsq``, ``grad_nonfinite``   for global-norm clipping and fp16 overflow checks
Every kernel call releases the GIL, so the engine can run it on a worker thread.

[Note: validate, then mutate]
Every public entry checks all of its inputs (for an optimizer step: every param, grad and state
entry of every group) before it changes anything, so a bad input raises with params, moments
and step counters untouched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

from ._native import TORCH_DTYPES, Dtype, default_threads, isa, kernels, set_isa, supported_isas

__all__ = [
    "CPUAdam",
    "CPUAdamW",
    "adam_step",
    "adam_step_async",
    "KernelTicket",
    "grad_sumsq",
    "grad_nonfinite",
    "isa",
    "set_isa",
    "supported_isas",
    "default_threads",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOWP_DTYPES = (torch.bfloat16, torch.float16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_MAX_THREADS = 4096
_SEED_LIMIT = 2**32

# Bumps a tensor's autograd version counter after the kernel wrote it through its address, as
# an in-place torch op would (so autograd still catches a param modified after it was saved).
_set_version = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


# ---------------------------------------------------------------------------------------------
# Checks. Each raises TypeError (wrong kind of thing) or ValueError (right kind, bad value) with
# the name of the offending argument and what to do instead. The public ones (check_threads,
# as_float, check_grad_scale, check_buffer, check_no_overlap, bump_versions, FLOAT_DTYPES,
# LOWP_DTYPES) are shared with the other kernels' wrappers (ops/cpu_rules.py).


def check_threads(threads: Optional[int]) -> Optional[int]:
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, Integral):
        raise TypeError(f"threads must be an int or None, got {type(threads).__name__}")
    if not 1 <= threads <= _MAX_THREADS:
        raise ValueError(f"threads must be in [1, {_MAX_THREADS}] (or None for one per CPU), got {threads}")
    return int(threads)


def as_float(name: str, value: Any, what: str = "a number") -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return float(value)


def hyper_checker(owner: Optional[str]):
    """``(number, bad)`` for one hyperparameter validation: ``number(name, value)`` converts (a
    TypeError, or with an ``owner`` a ValueError naming ``owner.name``), ``bad(name, value,
    torch_words, need)`` builds the ValueError (torch's words without an owner)."""

    def bad(name, value, torch_words, need):
        if owner is not None:
            return ValueError(f"{owner}.{name}={value!r} is invalid: expected {need}")
        return ValueError(f"{torch_words}: {value} (need {need})")

    def number(name, value):
        try:
            return as_float(name, value)
        except (TypeError, ValueError) as e:
            if owner is None:
                raise
            raise bad(name, value, "", "a finite number") from e

    return number, bad


def checked_nonneg(number, bad, name: str, value: Any, torch_words: str, need: Optional[str] = None) -> float:
    """``value`` as a finite float >= 0, else ``bad``'s ValueError with torch's words (``number``,
    ``bad``: ``hyper_checker``'s; ``need`` defaults to "a finite NAME >= 0")."""
    value = number(name, value)
    if not (math.isfinite(value) and value >= 0):
        raise bad(name, value, torch_words, need or f"a finite {name} >= 0")
    return value


def checked_lr(number, bad, lr: Any) -> float:
    """A learning rate: finite and >= 0 (``number``, ``bad``: ``hyper_checker``'s)."""
    return checked_nonneg(number, bad, "lr", lr, "Invalid learning rate")


def checked_betas(number, bad, betas: Any, owner: Optional[str], *, one_allowed: bool,
                  example: str) -> tuple[float, float]:
    """A pair (beta1, beta2), each in [0, 1) (or [0, 1] when ``one_allowed``), as torch checks
    them; ``example`` goes in the error of a value that is not a pair."""
    span = "[0, 1]" if one_allowed else "[0, 1)"
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        if owner is not None:
            raise bad("betas", betas, "", f"a pair (beta1, beta2), each in {span}, e.g. betas={example}")
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    beta1, beta2 = number("betas[0]", betas[0]), number("betas[1]", betas[1])
    for index, beta in enumerate((beta1, beta2)):
        if not (0.0 <= beta <= 1.0 if one_allowed else 0.0 <= beta < 1.0):
            raise bad(f"betas[{index}]", beta, f"Invalid beta parameter at index {index}",
                      "0 <= beta <= 1" if one_allowed else "0 <= beta < 1")
    return beta1, beta2


@dataclass(frozen=True, kw_only=True)
class AdamHyper:
    """The scalars of one Adam/AdamW step, checked (torch's ranges) and converted to float. The one
    validator of Adam hyperparameters: ``config.Adam`` and ``OffloadAdam`` call it with their
    ``owner`` name, which makes every problem a ValueError naming ``owner.field=value``."""

    lr: float
    """Learning rate, >= 0."""
    beta1: float
    """Decay of the first moment, in [0, 1)."""
    beta2: float
    """Decay of the second moment, in [0, 1)."""
    eps: float
    """Added to the denominator, >= 0."""
    weight_decay: float
    """>= 0; L2 (added to the grad) for Adam, decoupled (param *= 1 - lr * wd) for AdamW."""
    adamw: bool
    """Decoupled weight decay (AdamW) instead of L2."""

    @classmethod
    def checked(cls, *, lr: Any, betas: Any, eps: Any, weight_decay: Any, adamw: bool,
                owner: Optional[str] = None) -> "AdamHyper":
        number, bad = hyper_checker(owner)

        lr = checked_lr(number, bad, lr)
        beta1, beta2 = checked_betas(number, bad, betas, owner, one_allowed=False, example="(0.9, 0.999)")
        eps = checked_nonneg(number, bad, "eps", eps, "Invalid epsilon value")
        weight_decay = checked_nonneg(number, bad, "weight_decay", weight_decay, "Invalid weight_decay value")
        if not isinstance(adamw, bool):
            raise TypeError(f"adamw must be a bool, got {type(adamw).__name__}")
        return cls(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw)


def _check_step(step: Any) -> float:
    value = as_float("step", step, "an int (the 1-based count of this update)")
    if not (math.isfinite(value) and value >= 1 and value == int(value)):
        raise ValueError(f"step must be a whole number >= 1 (the first update is step 1), got {value:g}")
    return value


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise TypeError(f"seed must be an int in [0, 2**32) (the stochastic-rounding seed of bf16 moments), "
                        f"got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**32) (the stochastic-rounding seed of bf16 moments), got {seed}")
    return int(seed)


def check_grad_scale(grad_scale: Any) -> float:
    value = as_float("grad_scale", grad_scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"grad_scale must be finite and > 0 (grads are divided by it), got {value}")
    return value


def check_buffer(name: str, tensor: Any, *, dtypes: tuple, numel: Optional[int] = None,
                 any_dense_layout: bool = False) -> None:
    """A kernel operand: a dense CPU tensor of one of `dtypes`, contiguous (or, with
    ``any_dense_layout``, of any layout `_flat` can update)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(
            f"{name} is a {tensor.layout} tensor; the native CPU kernels need dense tensors "
            "(call .to_dense(), or for sparse grads use torch.optim.SparseAdam / torch.optim.SGD)"
        )
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{name} is on {tensor.device}; the native CPU kernels update CPU tensors only "
            "(keep the model's params on the CPU, or use the torch optimizer on the GPU, e.g. "
            "torch.optim.Adam(fused=True))"
        )
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {tensor.dtype}; expected {allowed}")
    if any_dense_layout and not _dense_layout(tensor):
        raise ValueError(
            f"{name} (shape {tuple(tensor.shape)}, stride {tensor.stride()}) overlaps itself or has gaps in "
            "memory; CPU-Adam updates a param's memory in place, so a copy would lose the update: "
            "give the optimizer a param that owns its memory (e.g. p.data = p.data.contiguous() "
            "before building it)")
    if not any_dense_layout and not tensor.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()}); the kernel "
            "updates memory in place, so a .contiguous() copy would lose the update: make the tensor "
            "itself contiguous first (e.g. p.data = p.data.contiguous() before building the optimizer)"
        )
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements but the param has {numel}; they must match")


def check_no_overlap(named: list[tuple[str, torch.Tensor]]) -> None:
    """Written buffers must not share memory with any other operand."""
    spans = []
    for name, tensor in named:
        if tensor.numel():
            start = tensor.data_ptr()
            spans.append((start, start + tensor.numel() * tensor.element_size(), name))
    spans.sort()
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"{n0} and {n1} share memory; every kernel operand needs its own buffer")


# [Note: optimizer params of any dense layout and dtype]
# CPUAdam/CPUAdamW take what torch.optim.AdamW takes on the CPU: fp32, bf16 and fp16 params, in
# any layout whose elements fill one block of memory without overlap (contiguous, channels_last,
# a transposed or permuted view). Adam is elementwise, so the kernel runs over that block as a
# flat buffer (`_flat`): no .contiguous() copy, whose update would be lost. State is created with
# the param's strides (`zeros_like`, preserve_format, as torch's fused Adam) and the param's
# dtype (torch keeps bf16 state for bf16 params); state loaded with other strides is re-laid out
# once, a grad with other strides is copied into the param's layout (it is only read). bf16/fp16
# params and state are widened to fp32, updated by the fp32 kernel and rounded back to nearest
# even: exactly what torch's fused CPU Adam does (it loads them as fp32, computes in fp32 and
# rounds each store), so results equal torch.optim.AdamW(fused=True) bit for bit.

def _dense_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill exactly ``t.numel()`` consecutive slots of its storage from
    ``storage_offset`` on (contiguous up to a permutation of its dims), each once."""
    if t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The memory of a `_dense_layout` tensor as a 1-D view (writes go to ``t``)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _in_layout_of(p: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` with ``p``'s strides and the given dtype: ``t`` itself when it already is."""
    if t.dtype == dtype and (t.stride() == p.stride() or p.numel() <= 1) and _dense_layout(t):
        return t
    out = torch.empty_like(p, dtype=dtype)
    out.copy_(t.reshape(p.shape))
    return out


def _check_buffer_any_layout(name: str, tensor: Any, *, dtypes: tuple, numel: int) -> None:
    """A tensor the optimizer reads (grad) or re-lays out (loaded state): dense, on the CPU, of
    one of ``dtypes`` and ``numel`` elements; any strides."""
    if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
        # The checks below on a flat view (or, with gaps, a copy: a copy is taken when used too).
        tensor = _flat(tensor) if _dense_layout(tensor) else tensor.contiguous()
    check_buffer(name, tensor, dtypes=dtypes, numel=numel)


def _checked_flat_call(param, grad, exp_avg, exp_avg_sq, out_lowp, *, step, lr, betas, eps,
                       weight_decay, adamw, grad_scale, threads, seed=0) -> dict:
    """Every check of a flat-buffer call (raises before anything changes); returns the checked
    keyword arguments of ``_launch`` / ``_native_args``."""
    hyper = AdamHyper.checked(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw)
    checked = dict(step=_check_step(step), hyper=hyper, grad_scale=check_grad_scale(grad_scale),
                   threads=check_threads(threads), seed=_check_seed(seed))
    check_buffer("param", param, dtypes=(torch.float32,))
    check_buffer("grad", grad, dtypes=FLOAT_DTYPES, numel=param.numel())
    check_buffer("exp_avg", exp_avg, dtypes=_MOMENT_DTYPES, numel=param.numel())
    check_buffer("exp_avg_sq", exp_avg_sq, dtypes=_MOMENT_DTYPES, numel=param.numel())
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(f"exp_avg has dtype {exp_avg.dtype} but exp_avg_sq has dtype {exp_avg_sq.dtype}; "
                        "the moments must both be torch.float32 or both torch.bfloat16")
    named = [("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if out_lowp is not None:
        check_buffer("out_lowp", out_lowp, dtypes=LOWP_DTYPES, numel=param.numel())
        named.append(("out_lowp", out_lowp))
    check_no_overlap(named)
    return checked


def _native_args(param, grad, exp_avg, exp_avg_sq, out_lowp, *, step: float, hyper: AdamHyper,
                 grad_scale: float, threads: Optional[int], seed: int = 0) -> dict:
    """The keyword arguments of the native adam_step / adam_step_async for checked operands."""
    return dict(
        param=param.data_ptr(), grad=grad.data_ptr(), grad_dtype=int(TORCH_DTYPES[grad.dtype]),
        exp_avg=exp_avg.data_ptr(), exp_avg_sq=exp_avg_sq.data_ptr(), numel=param.numel(),
        out=0 if out_lowp is None else out_lowp.data_ptr(),
        out_dtype=int(Dtype.NONE if out_lowp is None else TORCH_DTYPES[out_lowp.dtype]),
        step=step, lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps,
        weight_decay=hyper.weight_decay, adamw=hyper.adamw, grad_scale=grad_scale,
        threads=default_threads() if threads is None else threads,
        moment_dtype=int(TORCH_DTYPES[exp_avg.dtype]), seed=seed,
    )


def bump_versions(written: list) -> None:
    """Tell autograd the kernel wrote these tensors (as an in-place torch op would)."""
    if _set_version is not None and written:
        _set_version(written, [t._version + 1 for t in written])


def _launch(param, grad, exp_avg, exp_avg_sq, out_lowp, **checked) -> float:
    """Runs the kernel on checked operands and ``_native_args``'s checked keyword arguments (see
    [Note: validate, then mutate]); returns the seconds the kernel ran."""
    if param.numel() == 0:
        return 0.0
    seconds = kernels.adam_step(**_native_args(param, grad, exp_avg, exp_avg_sq, out_lowp, **checked))
    bump_versions([param] if out_lowp is None else [param, out_lowp])
    return seconds


# ---------------------------------------------------------------------------------------------
# Flat-buffer API (docs/internals.md, "cpu_adam.py").


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_scale: float = 1.0,
    out_lowp: Optional[torch.Tensor] = None,
    threads: Optional[int] = None,
    seed: int = 0,
) -> float:
    """One fused Adam (``adamw=False``, L2 decay) or AdamW step over flat CPU buffers, in place.

    ``param``: fp32, contiguous. ``exp_avg``, ``exp_avg_sq``: contiguous, same numel, both fp32
    or both bf16 (mixed: TypeError). ``grad``: fp32, bf16 or fp16, same numel; the update uses
    ``grad / grad_scale`` (grad itself is not modified). ``step``: this update's 1-based count
    (bias correction). ``out_lowp``: optional bf16/fp16 buffer that receives the updated params
    rounded to nearest even. ``threads``: None = one per CPU this process may use.

    bf16 moments (opt-in): each element's moments are widened to fp32, updated with exactly the
    fp32 formula (param and ``out_lowp`` equal, bit for bit, what fp32 moments holding the same
    values give), and the new moments are stored as bf16 by stochastic rounding with one hash per
    element of its index in the call and ``seed`` ([Note: stochastic rounding] in ops/rounding.py,
    whose ``stochastic_round_moments_bf16`` gives the same bits). The stored value is unbiased,
    deterministic for a given ``seed`` (any ISA path, any thread count). ``seed``: an int in
    [0, 2**32), ignored for fp32 moments; pass a different one each step (e.g. ``step``), else an
    element whose moment stays put rounds the same way every step.
    See [Note: bf16 moments with stochastic rounding] in csrc/cpu_adam_kernel.h.

    Releases the GIL for the whole call. Raises TypeError / ValueError before touching anything
    on bad input. Returns the seconds the kernel itself ran (without the checks and without
    re-taking the GIL): the worker's trace tells the two apart.
    """
    checked = _checked_flat_call(param, grad, exp_avg, exp_avg_sq, out_lowp, step=step, lr=lr,
                                 betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw,
                                 grad_scale=grad_scale, threads=threads, seed=seed)
    return _launch(param, grad, exp_avg, exp_avg_sq, out_lowp, **checked)


class KernelTicket:
    """A kernel call queued on the native kernel thread (``adam_step_async``, and the rules'
    ``sgd_step_async`` / ``lion_step_async`` in ops/cpu_rules.py: one queue, one order). ``wait()``
    blocks (GIL released) until it ran and returns its kernel seconds, or raises its error;
    ``ready()`` polls. The tensors it reads and writes stay referenced until ``wait`` returns;
    a ticket dropped unwaited waits in ``__del__`` before it lets them go."""

    __slots__ = ("_ticket", "_keep", "_seconds", "_written", "start")

    def __init__(self, ticket: int, keep: tuple, written: list):
        self._ticket, self._keep, self._written, self._seconds = ticket, keep, written, None
        self.start: Optional[float] = None
        """When the kernel began, on ``time.perf_counter``'s clock (set by ``wait``)."""

    def ready(self) -> bool:
        return self._seconds is not None or kernels.kernel_ready(self._ticket)

    def __del__(self):
        # Dropped before wait(): the tensors in _keep would be freed while the kernel thread may
        # still write them. Wait first (errors were the caller's to collect).
        if getattr(self, "_keep", ()):
            try:
                kernels.kernel_wait(self._ticket)
            except BaseException:
                pass

    def wait(self) -> float:
        if self._seconds is None:
            try:
                self.start, self._seconds = kernels.kernel_wait(self._ticket)
            finally:
                self._keep = ()
            bump_versions(self._written)
            self._written = []
        return self._seconds


def adam_step_async(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_scale: float = 1.0,
    out_lowp: Optional[torch.Tensor] = None,
    threads: Optional[int] = None,
    seed: int = 0,
) -> KernelTicket:
    """``adam_step`` queued on the native kernel thread: the arguments are checked now (errors
    raise here, before anything is queued or changed), the kernel runs after the calls queued
    before it, and the caller goes on at once. Calls run one at a time in submission order, each
    on all ``threads``. The buffers must not be read or written until ``wait()`` returns: see
    [Note: why a native queue] in csrc/kernel_queue.h. bf16 moments and ``seed``: as ``adam_step``."""
    checked = _checked_flat_call(param, grad, exp_avg, exp_avg_sq, out_lowp, step=step, lr=lr,
                                 betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw,
                                 grad_scale=grad_scale, threads=threads, seed=seed)
    ticket = kernels.adam_step_async(**_native_args(param, grad, exp_avg, exp_avg_sq, out_lowp, **checked))
    written = [param] if out_lowp is None else [param, out_lowp]
    return KernelTicket(ticket, (param, grad, exp_avg, exp_avg_sq, out_lowp), written)


def grad_sumsq(grad: torch.Tensor, *, grad_scale: float = 1.0, threads: Optional[int] = None) -> float:
    """``sum((grad / grad_scale) ** 2)`` accumulated in fp64 (for global-norm clipping).

    ``grad``: a contiguous CPU fp32/bf16/fp16 tensor. inf/NaN grads give inf/NaN.
    """
    scale = check_grad_scale(grad_scale)
    return _grad_kernel(kernels.grad_sumsq, grad, threads, 0.0, grad_scale=scale)


def grad_nonfinite(grad: torch.Tensor, *, threads: Optional[int] = None) -> bool:
    """Whether any element of ``grad`` (contiguous CPU fp32/bf16/fp16) is inf or NaN."""
    return _grad_kernel(kernels.grad_nonfinite, grad, threads, False)


def _grad_kernel(kernel, grad, threads, empty, **scalars):
    """``kernel`` over a checked grad (``empty`` for a grad without elements)."""
    threads = check_threads(threads)
    check_buffer("grad", grad, dtypes=FLOAT_DTYPES)
    if grad.numel() == 0:
        return empty
    return kernel(grad=grad.data_ptr(), dtype=int(TORCH_DTYPES[grad.dtype]), numel=grad.numel(),
                  threads=default_threads() if threads is None else threads, **scalars)


# ---------------------------------------------------------------------------------------------
# Optimizers.

UNSUPPORTED_OPTIONS = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
"""torch.optim.Adam options the CPU kernel does not implement (with torch's defaults)."""

IMPLEMENTATION_OPTIONS = {"foreach": None, "fused": True}
"""torch's implementation options as this package's optimizers' param groups record them, whatever
the caller or a loaded state dict says; see [Note: groups record fused=True]."""


def _check_supported(options: dict) -> None:
    for key, off in UNSUPPORTED_OPTIONS.items():
        if options.get(key, off):
            raise NotImplementedError(
                f"CPUAdam does not implement {key}=True; use torch.optim.Adam for it, or drop the option"
            )


def _group_hyper(group: dict) -> AdamHyper:
    _check_supported(group)
    return AdamHyper.checked(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                             weight_decay=group["weight_decay"],
                             adamw=bool(group.get("decoupled_weight_decay", False)))


class CPUAdam(Optimizer):
    """``torch.optim.Adam`` on the CPU, over the native fused kernel.

    Same constructor and defaults as ``torch.optim.Adam``; ``decoupled_weight_decay=True`` gives
    AdamW (see ``CPUAdamW``). Not implemented (NotImplementedError): ``amsgrad``, ``maximize``,
    ``capturable``, ``differentiable``. ``foreach`` and ``fused`` are accepted and ignored
    (this optimizer is always one fused pass; its groups record ``fused=True``, see
    [Note: groups record fused=True]). Params: CPU fp32/bf16/fp16 of any layout without
    gaps or overlap (contiguous, channels_last, transposed; see [Note: optimizer params of any
    dense layout and dtype]); grads: CPU fp32/bf16/fp16, dense, any strides. State: ``step``
    (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq`` in the param's dtype and strides, as
    torch's, so state dicts load both ways.

    Keyword-only extra: ``threads`` (None = one per CPU this process may use).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        decoupled_weight_decay: bool = False,
        threads: Optional[int] = None,
    ) -> None:
        # [Note: groups record fused=True]: whatever foreach/fused the caller passed, the groups
        # say fused=True, foreach=None. The arithmetic is torch's fused kernel's, so a torch
        # Adam/AdamW that loads this optimizer's state dict continues bit for bit (torch takes
        # these options from the loaded groups; fused=None would switch it to its foreach path).
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, capturable=capturable, differentiable=differentiable,
                        decoupled_weight_decay=decoupled_weight_decay, **IMPLEMENTATION_OPTIONS)
        _group_hyper(defaults)
        self.threads = check_threads(threads)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        if isinstance(param_group, dict) and not isinstance(param_group.get("params"), (set, type(None))):
            _group_hyper({**self.defaults, **param_group})
            params = param_group["params"]
            items = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group["params"] = items  # torch's add_param_group makes it a list too
            for index, item in enumerate(items):
                tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
                if isinstance(tensor, torch.Tensor):  # anything else: torch's own TypeError below
                    check_buffer(f"params[{index}]", tensor, dtypes=FLOAT_DTYPES, any_dense_layout=True)
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, default in {**UNSUPPORTED_OPTIONS, "decoupled_weight_decay": False}.items():
                group.setdefault(key, default)
            group.update(IMPLEMENTATION_OPTIONS)  # [Note: groups record fused=True]
            for p in group["params"]:
                p_state = self.state.get(p)
                if p_state and not torch.is_tensor(p_state.get("step")):
                    p_state["step"] = torch.tensor(float(p_state["step"]), dtype=torch.float32)

    def load_state_dict(self, state_dict: dict) -> None:
        for index, group in enumerate(state_dict.get("param_groups", [])):
            try:
                _group_hyper({**self.defaults, **group})
            except NotImplementedError as exc:
                raise NotImplementedError(f"state_dict param_groups[{index}]: {exc}") from None
        super().load_state_dict(state_dict)

    def _check_state(self, p: torch.Tensor, state: dict, where: str) -> None:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if key not in state:
                raise ValueError(f"{where}: optimizer state lacks '{key}'; load a state dict saved by "
                                 "torch.optim.Adam/AdamW or CPUAdam, or start without one")
        step = state["step"]
        if torch.is_tensor(step):
            step = step.item() if step.numel() == 1 else step
        _check_step(step + 1 if isinstance(step, Real) and not isinstance(step, bool) else step)
        for key in ("exp_avg", "exp_avg_sq"):
            # Any layout: re-laid out to the param's before the update ([Note: optimizer params
            # of any dense layout and dtype]); the dtype is the param's, as torch keeps it.
            _check_buffer_any_layout(f"{where} state['{key}']", state[key], dtypes=(p.dtype,),
                                     numel=p.numel())

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Adam/AdamW update of every param that has a grad; returns closure()'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # [Note: validate, then mutate]: check every group, param, grad and state first.
        updates: list[tuple[torch.Tensor, AdamHyper]] = []  # (param, its group's scalars)
        for gi, group in enumerate(self.param_groups):
            hyper = _group_hyper(group)
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param_groups[{gi}]['params'][{pi}]"
                check_buffer(f"{where} param", p, dtypes=FLOAT_DTYPES, any_dense_layout=True)
                _check_buffer_any_layout(f"{where} grad", p.grad, dtypes=FLOAT_DTYPES, numel=p.numel())
                named = [(f"{where} param", p)] + ([(f"{where} grad", p.grad)] if _dense_layout(p.grad) else [])
                state = self.state.get(p)
                if state:
                    self._check_state(p, state, where)
                    named += [(f"{where} state['{k}']", state[k]) for k in ("exp_avg", "exp_avg_sq")
                              if _dense_layout(state[k])]
                check_no_overlap(named)
                updates.append((p, hyper))
        for p, hyper in updates:
            state = self.state[p]
            if not state:  # lazy init, as torch's Adam: the param's dtype and strides
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key in ("exp_avg", "exp_avg_sq"):  # loaded with other strides: same values, p's layout
                state[key] = _in_layout_of(p, state[key], p.dtype)
            grad = _flat(_in_layout_of(p, p.grad, p.grad.dtype))
            state["step"] += 1
            buffers = (_flat(p), _flat(state["exp_avg"]), _flat(state["exp_avg_sq"]))
            wide = buffers if p.dtype == torch.float32 else tuple(t.float() for t in buffers)
            _launch(wide[0], grad, wide[1], wide[2], None, step=float(state["step"]),
                    hyper=hyper, grad_scale=1.0, threads=self.threads)
            if wide is not buffers:  # round back to nearest even, as torch's fused kernel stores
                for t, w in zip(buffers, wide):
                    t.copy_(w)
        return loss


class CPUAdamW(CPUAdam):
    """``torch.optim.AdamW`` on the CPU (decoupled weight decay, default 1e-2), over the native
    fused kernel. Same constructor and defaults as ``torch.optim.AdamW``; everything else as
    ``CPUAdam``."""

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        threads: Optional[int] = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, threads=threads)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # AdamW is always decoupled, as in torch
            group["decoupled_weight_decay"] = True
