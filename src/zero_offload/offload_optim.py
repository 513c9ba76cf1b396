"""Optimizer-only offload for scripts that keep their own loop: one ``torch.optim.Optimizer`` per
update rule, each with its torch optimizer's signature, param groups and ``state_dict`` format,
its state in host RAM, on NVMe or in a GPU share, stepped during backward.

=====================  ==============================================  ==========================
class                  equals                                          state per param (fp32)
=====================  ==============================================  ==========================
``OffloadAdam``        ``torch.optim.Adam``                            master, exp_avg, exp_avg_sq
``OffloadAdamW``       ``torch.optim.AdamW``                           master, exp_avg, exp_avg_sq
``OffloadSGD``         ``torch.optim.SGD`` (momentum, Nesterov)        master, momentum_buffer
                                                                       (none with momentum 0)
``OffloadLion``        Lion (Chen et al. 2023), decoupled decay        master, exp_avg
``OffloadAdafactor``   ``torch.optim.Adafactor``                       master, row_var + col_var
                                                                       (matrices), variance (1-D)
``OffloadMuon``        ``torch.optim.Muon`` (2-D params only)          master, momentum_buffer
=====================  ==============================================  ==========================

The machinery is one class, ``optim_base.OffloadOptimizer`` (its docstring has the step, and its
Notes what overlap means for the caller: [Note: overlap semantics], [Note: forward overlap]);
the update rules are in runtime/update_rule.py and runtime/rules.py ([Note: where each rule
runs]). The keyword options every class takes (``state``, ``nvme_dir``, ``chunk_mb``,
``threads``, ``overlap``, ``overlap_forward``, ``grad_accum``, ``prefetch_depth``,
``cpu_budget``, ``gpu_budget``, ``process_group``) are documented on ``OffloadAdam``.

Muon takes 2-D params only, as torch's: build a second optimizer for the rest, as torch's recipe
does (``OffloadMuon(matrices) + OffloadAdamW(others)``, both stepped each iteration).
"""
from __future__ import annotations

from typing import Iterable

from .optim_base import OffloadOptimizer, OffloadStats, read_once
from .runtime.rules import MUON_NS, AdafactorRule, LionRule, MuonRule, SGDRule
from .runtime.update_rule import AdamRule

__all__ = ["OffloadAdafactor", "OffloadAdam", "OffloadAdamW", "OffloadLion", "OffloadMuon", "OffloadSGD",
           "OffloadStats"]


class OffloadAdam(OffloadOptimizer):
    """Adam with state in host RAM or on NVMe, stepped by CPU-Adam during backward.

    ``torch.optim.Adam`` semantics (``weight_decay`` as an L2 penalty); ``OffloadAdamW`` has
    ``torch.optim.AdamW``'s decoupled decay. Read optim_base.py's docstring, in particular
    [Note: overlap semantics] and [Note: forward overlap].

    Args:
        params: iterable of params or of param-group dicts (as any torch optimizer); groups may
            set their own ``lr``, ``betas``, ``eps``, ``weight_decay``.
        lr, betas, eps, weight_decay: defaults, as torch.optim.Adam(W).
        state: "cpu" (host RAM, pinned when CUDA), "nvme" (swap files under ``nvme_dir``,
            read ahead and written behind per chunk) or "auto": the GPU share first (see
            [Note: GPU share of the optimizer]), then host RAM, then, with ``nvme_dir``, NVMe
            for what does not fit ``cpu_budget``.
        nvme_dir: directory on a fast disk; required with ``state="nvme"``.
        chunk_mb: MiB of fp32 master per chunk (the unit of transfer and of CPU-Adam jobs).
        threads: CPU-Adam threads (None: every core this process may use).
        overlap: step each chunk during backward (True) or everything in ``step()`` (False).
        overlap_forward: ``step()`` returns without waiting for the updates; each module's
            forward waits for its own params (see [Note: forward overlap]; call
            ``synchronize()`` before reading params outside a forward).
        grad_accum: backward passes per ``step()`` (``overlap=True`` only needs to know).
        prefetch_depth: NVMe chunks read ahead of the update being run.
        cpu_budget: bytes (or "auto") of pinned host memory the optimizer may use ("cpu" state
            must fit whole; "nvme" state stages through it). "auto": the free memory less a
            reserve; with several ranks on the node, this rank's share ([Note: rank budgets] in
            runtime/placement.py), as the NVMe space is.
        gpu_budget: with ``state="auto"`` (and only then; required): bytes of the params'
            device the optimizer's GPU share may take (fp32 master, moments and a flat grads
            buffer: 12 + the param's item size bytes per element with fp32 moments).
        process_group: data parallelism (see [Note: data parallel]). "auto" (default): the
            default group when ``torch.distributed`` is initialized with several ranks; None:
            every rank keeps the whole state; or a ProcessGroup.
        moments_dtype: "fp32" (default, exact: torch's results) or "bf16": the moments stored in
            bf16 with stochastic rounding, an opt-in INEXACT mode (8 instead of 12 bytes of state
            per param; as ``OffloadConfig.moments_dtype``). ``state_dict`` gives fp32 moments.
    """

    _adamw = False
    _state_hints = {"max_exp_avg_sq": "amsgrad=True"}

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, moments_dtype: str = "fp32", **offload):
        if moments_dtype not in ("fp32", "bf16"):
            raise ValueError(f"{type(self).__name__}: moments_dtype={moments_dtype!r} is invalid: use 'fp32' "
                             f"(exact, the default) or 'bf16' (stochastically rounded, inexact)")
        rule = AdamRule(adamw=self._adamw, moments_dtype=moments_dtype)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), rule=rule,
                         **offload)


class OffloadAdamW(OffloadAdam):
    """``OffloadAdam`` with ``torch.optim.AdamW``'s decoupled weight decay (default 1e-2)."""

    _adamw = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, moments_dtype: str = "fp32", **offload):
        super().__init__(params, lr, betas, eps, weight_decay, moments_dtype=moments_dtype, **offload)


class OffloadSGD(OffloadOptimizer):
    """``torch.optim.SGD`` (momentum, dampening, Nesterov, L2 weight decay) with its state offloaded:
    the native SGD kernel on the host (``ops.cpu_rules``, else torch ops), torch ops for the GPU
    share. No momentum buffer is kept when every group's momentum is 0 (as torch keeps no state
    then). ``state_dict``: torch's (``momentum_buffer``, no step count). Options: ``OffloadAdam``'s."""

    _step_in_state = False
    _required_state = ()  # torch's SGD has no buffer before its first step with momentum

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, **offload):
        params = read_once(params)
        groups = params if isinstance(params, list) else []
        buffer = momentum != 0 or any(isinstance(g, dict) and g.get("momentum", 0) != 0 for g in groups)
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov), rule=SGDRule(buffer=buffer), **offload)

    def _keeps(self, key: str, group: dict) -> bool:
        return group["momentum"] != 0


class OffloadLion(OffloadOptimizer):
    """Lion (Chen et al. 2023, decoupled weight decay) with its one moment (``exp_avg``) offloaded;
    the native Lion kernel on the host (``ops.cpu_rules``, else torch ops). Take lr 3-10x smaller
    and weight decay 3-10x larger than AdamW's. Options: ``OffloadAdam``'s."""

    _step_in_state = False

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, **offload):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), rule=LionRule(), **offload)


class OffloadAdafactor(OffloadOptimizer):
    """``torch.optim.Adafactor`` with its state offloaded: factored second moment (``row_var``,
    ``col_var``) for params of 2 or more dims, full (``variance``) for the others, so the state
    beside the fp32 master is about (rows + cols) floats per matrix. Updates whole params (torch
    ops on the host, per param). Options: ``OffloadAdam``'s."""

    def __init__(self, params: Iterable, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0, **offload):
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay),
                         rule=AdafactorRule(), **offload)


class OffloadMuon(OffloadOptimizer):
    """``torch.optim.Muon`` with its momentum offloaded: per matrix, the momentum update on the host,
    the Newton-Schulz iterations on the GPU (runtime/rules.py, [Note: where each rule runs]), the
    decayed master updated on the host. 2-D params only: give the others to an ``OffloadAdamW``.
    Options: ``OffloadAdam``'s."""

    _step_in_state = False

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple = MUON_NS, eps: float = 1e-7, ns_steps: int = 5,
                 adjust_lr_fn: "str | None" = None, **offload):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn), rule=MuonRule(), **offload)

