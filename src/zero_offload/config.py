"""Validated configuration: where training state lives, how it moves, and the optimizer spec.

``OffloadConfig`` and the optimizer specs ``Adam`` / ``AdamW`` / ``SGD`` / ``Lion`` /
``Adafactor`` / ``Muon`` (hyperparameters only, no state) are frozen, keyword-only dataclasses. ``load_config(obj)`` reads any accepted form (a
config, a dict or JSON file of field names, a DeepSpeed config) into ``(OffloadConfig, Adam | None)``.

Every field is checked in ``__post_init__``; a bad value raises before anything is built, with a
message that names the field, the value and what to write instead. Unknown keys in dicts raise
too (with a close-match suggestion): a typo never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Union

import torch

from .runtime.vocab import Placement, round_up

__all__ = ["Adafactor", "Adam", "AdamW", "DeepSpeedTranslation", "Lion", "Muon", "OffloadConfig", "OptimizerSpec",
           "Placement", "Precision", "SGD", "load_config", "parse_bytes", "translate_deepspeed"]

Budget = Union[int, str]
"""A tier budget: bytes as an int, or "auto" (the store sizes it from free memory)."""


class Precision(enum.StrEnum):
    """Dtype of the working params and grads (the master copy and Adam moments are fp32)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


# ---------------------------------------------------------------------------------------------
# small validators, shared by every dataclass here (one copy each)
# ---------------------------------------------------------------------------------------------

def _fail(owner: str, name: str, value: Any, expected: str, fix: str | None = None) -> ValueError:
    return ValueError(f"{owner}.{name}={value!r} is invalid: expected {expected}" + (f"; {fix}" if fix else ""))


def as_float(owner: str, name: str, value: Any, *, above: float | None = None,
              below: float | None = None, fix: str | None = None) -> float:
    """``value`` as a finite float strictly between the bounds, or a ValueError naming the field."""
    bounds = [f"{op} {b}" for op, b in ((">", above), ("<", below)) if b is not None]
    expected = "a finite number" + (f" {' and '.join(bounds)}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (above is not None and value <= above) or (below is not None and value >= below):
        raise _fail(owner, name, value, expected, fix)
    return float(value)


def as_int(owner: str, name: str, value: Any, *, minimum: int, fix: str | None = None) -> int:
    """``value`` as an int >= ``minimum`` (bools and floats rejected), or a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(owner, name, value, f"an integer >= {minimum}", fix)
    return int(value)


def _as_enum(owner: str, name: str, value: Any, enum_cls: type[enum.Enum],
             allowed: tuple[enum.Enum, ...] | None = None, fix: str | None = None):
    allowed = tuple(enum_cls) if allowed is None else allowed
    choices = " | ".join(repr(a.value) for a in allowed)
    try:
        member = enum_cls(value.lower() if isinstance(value, str) else value)
    except ValueError:
        member = None
    if member not in allowed:
        raise _fail(owner, name, value, f"one of {choices}", fix)
    return member


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(value: Any, *, name: str = "size") -> int:
    """A byte count from an int or a string such as ``"8GiB"``, ``"512MB"``, ``"1.5 TiB"``.

    Units are case-insensitive: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of
    1024). Single letters ("8G") are refused as ambiguous. The result is a positive int
    (fractions of a byte are rounded to the nearest byte).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number of bytes")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"{name}={value!r} is not a size: write bytes as an int or a string like '8GiB' or '512MB'")
    m = _SIZE_RE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        hint = ""
        if unit in ("k", "m", "g", "t"):
            hint = f" ('{unit.upper()}' is ambiguous: write '{unit.upper()}iB' for powers of 1024 or '{unit.upper()}B' for powers of 1000)"
        raise ValueError(
            f"{name}={value!r} is not a size{hint}: write e.g. '8GiB', '512MB', '1.5TiB' or a plain "
            f"byte count; units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    nbytes = round(float(m.group(1)) * _SIZE_UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"{name}={value!r} must be a positive size")
    return nbytes


def as_budget(owner: str, name: str, value: Any, auto: str = "to size it from free memory") -> Budget:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bytes(value, name=f"{owner}.{name}")
    except ValueError as e:
        raise ValueError(f"{e}; or pass 'auto' {auto}") from None


def _unknown_keys(owner: str, keys, valid) -> ValueError:
    valid = sorted(valid)
    parts = []
    for k in sorted(map(str, keys)):
        close = difflib.get_close_matches(k, valid, n=1)
        parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ValueError(f"unknown {owner} key(s): {', '.join(parts)}; valid keys: {', '.join(valid)}")


def _from_mapping(cls, d: Mapping[str, Any]):
    if not isinstance(d, Mapping):
        raise TypeError(f"{cls.__name__}.from_dict expects a dict, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise _unknown_keys(cls.__name__, unknown, names)
    return cls(**d)


# ---------------------------------------------------------------------------------------------
# optimizer specs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """What ``initialize(optimizer=...)`` takes: an optimizer's hyperparameters (fields of a
    frozen dataclass, so ``dataclasses.replace`` checks a param group's overrides) and the update
    rule that runs them (runtime/update_rule.py, [Note: update rules]). A new optimizer is a
    subclass with its fields and these three methods, and its rule."""

    def rule(self, config: "OffloadConfig"):
        """The ``UpdateRule`` of this spec under ``config`` (e.g. its moments dtype)."""
        raise NotImplementedError(f"{type(self).__name__} names no update rule")

    def hyperparameters(self) -> dict[str, Any]:
        """The defaults of a param group: the rule's ``hyper_keys`` -> this spec's values."""
        raise NotImplementedError(f"{type(self).__name__} has no hyperparameters")

    def to_dict(self) -> dict[str, Any]:
        """Field values plus ``"type"`` (checkpoints and the ranks' agreement record it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be written down")


@dataclass(frozen=True, kw_only=True)
class Adam(OptimizerSpec):
    """Adam hyperparameters, ``torch.optim.Adam`` semantics: ``weight_decay`` is an L2 penalty
    added to the gradient (``grad += weight_decay * param``) before the moments are updated.

    A spec, not an optimizer: the engine builds the state (fp32 master, moments) where the config
    places it. ``lr`` is the initial rate; an lr scheduler changes it during training.
    """

    lr: float = 1e-3
    """Learning rate, >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates, each in [0, 1)."""
    eps: float = 1e-8
    """Added to the denominator ``sqrt(v_hat) + eps``, >= 0."""
    weight_decay: float = 0.0
    """L2 penalty coefficient (Adam) / decoupled decay coefficient (AdamW), >= 0."""

    def __post_init__(self):
        from .ops.cpu_adam import AdamHyper  # the one validator of Adam hyperparameters

        h = AdamHyper.checked(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                              adamw=self.adamw, owner=type(self).__name__)
        object.__setattr__(self, "lr", h.lr)
        object.__setattr__(self, "betas", (h.beta1, h.beta2))
        object.__setattr__(self, "eps", h.eps)
        object.__setattr__(self, "weight_decay", h.weight_decay)

    @property
    def adamw(self) -> bool:
        """True when weight decay is decoupled (AdamW), False for L2 (Adam)."""
        return False

    def rule(self, config: "OffloadConfig"):
        from .runtime.update_rule import AdamRule
        return AdamRule(adamw=self.adamw, moments_dtype=config.moments_dtype)

    def hyperparameters(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    def to_dict(self) -> dict[str, Any]:
        """Field values plus ``"type"`` ("adam" | "adamw"); ``spec_from_dict`` reads it back."""
        return {"type": "adamw" if self.adamw else "adam", "lr": self.lr,
                "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Adam":
        """Build from a dict of field names (no ``"type"`` key; see ``spec_from_dict``)."""
        return _from_mapping(cls, d)


@dataclass(frozen=True, kw_only=True)
class AdamW(Adam):
    """AdamW hyperparameters, ``torch.optim.AdamW`` semantics: decoupled weight decay
    (``param *= 1 - lr * weight_decay`` before the Adam update)."""

    weight_decay: float = 1e-2
    """Decoupled decay coefficient, >= 0 (torch.optim.AdamW's default, 1e-2)."""

    @property
    def adamw(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True)
class _RuleSpec(OptimizerSpec):
    """A spec whose fields are its rule's hyperparameters, checked by the rule's validator (one per
    rule, in runtime/rules.py; the torch front end checks its groups with the same one)."""

    _type = ""

    def __post_init__(self):
        checked = self._check({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                              owner=type(self).__name__)
        for k, v in checked.items():
            object.__setattr__(self, k, v)

    def _check(self, values: dict, *, owner: str) -> dict:
        raise NotImplementedError

    def _rule(self):
        raise NotImplementedError

    def rule(self, config: "OffloadConfig"):
        if config.moments_dtype != "fp32":
            raise ValueError(f"OffloadConfig.moments_dtype={config.moments_dtype!r} applies to Adam and "
                             f"AdamW only; {type(self).__name__} keeps its state in fp32: use "
                             f"moments_dtype='fp32'")
        return self._rule()

    def hyperparameters(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """Field values plus ``"type"``; ``spec_from_dict`` reads it back."""
        return {"type": self._type, **{k: list(v) if isinstance(v, tuple) else v
                                       for k, v in self.hyperparameters().items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        """Build from a dict of field names (no ``"type"`` key; see ``spec_from_dict``)."""
        return _from_mapping(cls, {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass(frozen=True, kw_only=True)
class SGD(_RuleSpec):
    """SGD, ``torch.optim.SGD`` semantics (momentum, dampening, Nesterov, L2 weight decay added to
    the grad). With ``momentum=0`` no state is kept but the fp32 master; else one momentum buffer
    (4 bytes per param). Runs on the host (native kernel) or, for the GPU share, on the device."""

    lr: float = 1e-3
    """Learning rate, >= 0."""
    momentum: float = 0.0
    """Momentum factor, >= 0 (0: plain SGD, no buffer)."""
    dampening: float = 0.0
    """Dampening of the momentum."""
    weight_decay: float = 0.0
    """L2 penalty (added to the grad), >= 0."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0 and dampening 0)."""

    _type = "sgd"

    def _check(self, values, *, owner):
        from .runtime.rules import check_sgd
        return check_sgd(values, owner=owner)

    def _rule(self):
        from .runtime.rules import SGDRule
        return SGDRule(buffer=self.momentum != 0)


@dataclass(frozen=True, kw_only=True)
class Lion(_RuleSpec):
    """Lion (Chen et al. 2023): the sign of an interpolated momentum, decoupled weight decay, one
    moment (4 bytes per param). Take lr 3-10x smaller and weight decay 3-10x larger than AdamW's."""

    lr: float = 1e-4
    """Learning rate, >= 0."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Interpolation of the update (beta1) and decay of the moment (beta2), each in [0, 1]."""
    weight_decay: float = 0.0
    """Decoupled decay coefficient, >= 0."""

    _type = "lion"

    def _check(self, values, *, owner):
        from .runtime.rules import check_lion
        return check_lion(values, owner=owner)

    def _rule(self):
        from .runtime.rules import LionRule
        return LionRule()


@dataclass(frozen=True, kw_only=True)
class Adafactor(_RuleSpec):
    """Adafactor, ``torch.optim.Adafactor`` semantics: factored second moment (a row and a column
    vector per matrix) for params of 2 or more dims, full for the others; relative step size.
    Needs whole params: its chunks and rank shards are cut at parameter boundaries."""

    lr: float = 1e-2
    """Learning rate (the step size is ``min(lr, 1/sqrt(t))`` relative to the param's RMS), >= 0."""
    beta2_decay: float = -0.8
    """Decay of the second moment: ``1 - beta2_t = t ** beta2_decay``, <= 0."""
    eps: tuple = (None, 1e-3)
    """(eps1: floor of the second moment, None: the dtype's machine epsilon; eps2: floor of the
    param's RMS in the step size)."""
    d: float = 1.0
    """Clipping threshold of the update's RMS, >= 1."""
    weight_decay: float = 0.0
    """Decoupled decay coefficient, >= 0."""

    _type = "adafactor"

    def _check(self, values, *, owner):
        from .runtime.rules import check_adafactor
        return check_adafactor(values, owner=owner)

    def _rule(self):
        from .runtime.rules import AdafactorRule
        return AdafactorRule()


@dataclass(frozen=True, kw_only=True)
class Muon(_RuleSpec):
    """Muon, ``torch.optim.Muon`` semantics: momentum, orthogonalised by Newton-Schulz iterations,
    decoupled weight decay. 2-D params only: give the others (embeddings, norms, biases, the head)
    a param group of their own with ``"optimizer": zo.AdamW(...)``, as torch's recipe does. The
    iterations run on the GPU (runtime/rules.py, [Note: where each rule runs])."""

    lr: float = 1e-3
    """Learning rate, >= 0 (adjusted per matrix shape by ``adjust_lr_fn``)."""
    weight_decay: float = 0.1
    """Decoupled decay coefficient, >= 0."""
    momentum: float = 0.95
    """Momentum factor, >= 0."""
    nesterov: bool = True
    """Nesterov momentum."""
    ns_coefficients: tuple = (3.4445, -4.7750, 2.0315)
    """Coefficients (a, b, c) of the quintic Newton-Schulz iteration."""
    eps: float = 1e-7
    """Floor of the norm the update is divided by before the iterations, >= 0."""
    ns_steps: int = 5
    """Newton-Schulz iterations, in [0, 100)."""
    adjust_lr_fn: "str | None" = None
    """None or "original" (lr * sqrt(max(1, rows/cols))) or "match_rms_adamw" (0.2 * lr *
    sqrt(max(rows, cols)))."""

    _type = "muon"

    def _check(self, values, *, owner):
        from .runtime.rules import check_muon
        return check_muon(values, owner=owner)

    def _rule(self):
        from .runtime.rules import MuonRule
        return MuonRule()


_SPECS = {"adam": Adam, "adamw": AdamW, "sgd": SGD, "lion": Lion, "adafactor": Adafactor, "muon": Muon}


def spec_from_dict(d: Mapping[str, Any]) -> OptimizerSpec:
    """A spec from ``{"type": "adam"|"adamw"|"sgd"|"lion"|"adafactor"|"muon", "lr": ..., ...}``
    (no type: AdamW)."""
    if not isinstance(d, Mapping):
        raise TypeError(f"an optimizer spec must be a dict, got {type(d).__name__}")
    d = dict(d)
    kind = str(d.pop("type", "adamw")).lower()
    if kind not in _SPECS:
        raise ValueError(f"optimizer type {kind!r} is not supported: use one of {', '.join(map(repr, _SPECS))}")
    return _SPECS[kind].from_dict(d)


# ---------------------------------------------------------------------------------------------
# the offload configuration
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where training state lives and how it moves. Every field is validated on construction.

    [Note: normalised values] ``__post_init__`` stores canonical values: placements as
    ``Placement``, ``dtype`` as ``Precision`` (both ``StrEnum``, so they still compare equal to
    their strings), budgets as int bytes or ``"auto"``, numbers as ``float``/``int``. So two
    configs that mean the same thing are equal, and ``from_dict(c.to_dict()) == c``.
    """

    params: Placement | str = Placement.AUTO
    """Home tier of the working (low-precision) params: "gpu" | "cpu" | "nvme" | "auto".
    "auto" keeps as many chunks on the GPU as ``gpu_budget`` allows, then pinned CPU, then NVMe
    (NVMe only when ``nvme_dir`` is set)."""
    optimizer: Placement | str = Placement.CPU
    """Home tier of the fp32 master weights and both Adam moments: "cpu" | "nvme" | "auto".
    "auto" keeps state in host RAM within ``cpu_budget`` and spills the rest to NVMe."""
    nvme_dir: str | None = None
    """Directory for NVMe swap files (created 0700 if missing; files are removed on close, and
    those of a killed run at the next start). Must not be a file. Required
    when ``params`` or ``optimizer`` is "nvme"; used by "auto" to spill when set."""
    dtype: Precision | str = Precision.BF16
    """Working precision of params and grads on the GPU: "fp32" | "bf16" | "fp16". The master
    copy and the moments are always fp32. "fp16" uses loss scaling (see ``loss_scale``)."""
    chunk_mb: float = 64.0
    """Target chunk size in MiB (params are packed in use order into chunks of about this size;
    a single larger param gets its own chunk). Bigger chunks move at higher bandwidth; smaller
    ones overlap sooner and need less GPU/pinned memory. > 0."""
    prefetch_depth: int = 2
    """Chunks kept in flight ahead of use on each hop (NVMe->CPU, CPU->GPU); 0 fetches on
    demand. >= 0."""
    gpu_budget: Budget = "auto"
    """Bytes the engine may hold on the compute device for chunks (not activations): an int, a
    string like "8GiB", or "auto" (free device memory minus a reserve)."""
    activation_reserve: Budget = "auto"
    """Bytes of ``gpu_budget`` that "auto" placements (params, the GPU share of the optimizer)
    leave to activations, which the engine does not see: an int, a size string, or "auto" (half
    of ``gpu_budget``, or less where host memory cannot hold what half leaves it, down to an
    eighth: [Note: auto reserve] in runtime/placement.py; the first step measures either way).
    Lower it with activation checkpointing or small micro-batches to give more chunks to the
    GPU; raise it if the forward runs out of memory."""
    cpu_budget: Budget = "auto"
    """Bytes of pinned host memory for chunks: int, size string or "auto" (available RAM minus a
    reserve)."""
    nvme_budget: Budget = "auto"
    """Most bytes of swap files under ``nvme_dir``: int, size string or "auto" (free disk space
    less min(4 GiB, 5% of it)). The swap file is preallocated to what the placement needs."""
    grad_clip: float | None = None
    """Max global L2 norm of the gradients (as ``torch.nn.utils.clip_grad_norm_``), > 0; None
    disables clipping."""
    grad_accum: int = 1
    """Micro-batches whose gradients are summed before each optimizer step, >= 1."""
    loss_scale: float | str = "dynamic"
    """fp16 only: "dynamic" (``torch.amp.GradScaler`` rules: skip the step and back off on
    inf/nan, grow after ``growth_interval`` clean steps) or a fixed positive scale."""
    initial_scale: float = 2.0 ** 16
    """fp16 dynamic scaling: the starting scale, > 0 (GradScaler's ``init_scale``)."""
    growth_factor: float = 2.0
    """fp16 dynamic scaling: multiplier after ``growth_interval`` clean steps, > 1."""
    backoff_factor: float = 0.5
    """fp16 dynamic scaling: multiplier on overflow, in (0, 1)."""
    growth_interval: int = 2000
    """fp16 dynamic scaling: clean steps between growths, >= 1."""
    threads: int | None = None
    """CPU-Adam threads, >= 1; None uses every core the process may run on."""
    io_threads: int = 4
    """NVMe I/O threads, >= 1."""
    io_block_size: int = 1 << 20
    """Bytes per NVMe request piece, a positive multiple of 4096."""
    io_queue_depth: int = 16
    """Requests in flight per I/O thread, >= 1."""
    overlap: bool = True
    """Run CPU-Adam on each chunk as its grads land, during backward, where that is exact (when
    clipping or fp16 overflow checks need every grad first, the engine keeps results equal to
    PyTorch; see docs). False steps every chunk after backward."""
    grad_sync: str = "every"
    """With ``grad_accum > 1``: "every" sends each micro-batch's grads down (several ranks:
    reduce-scatters them) and sums them on the host in an fp32 accumulation buffer (4 bytes per
    param of host memory); "final" sums the window's grads of the whole model on the GPU in fp32
    (4 bytes per param of GPU memory instead) and sends (reduce-scatters) them once, at the
    window's last micro-batch: no copies or communication on the others (DDP's ``no_sync``),
    no host accumulation buffer."""
    moments_dtype: str = "fp32"
    """Precision of the Adam moments (exp_avg, exp_avg_sq). "fp32" (default) is exact: results
    equal torch. "bf16" is an opt-in and INEXACT mode: both moments are stored in bf16 and
    rounded stochastically (unbiased) each time they are written, and computed in fp32 from
    the widened values. The master weights stay fp32. Optimizer state drops from 12 to
    8 bytes per param, host traffic per update from 28 to 20 bytes per param (bf16 grads and
    params), and NVMe bytes by a third. Results drift from torch's by the rounding noise
    (docs/engine.md, "Low-precision moments"). Checkpoints store fp32 moments either way."""
    host_grads: str = "auto"
    """How the grads of chunks updated on the host live in host memory: "persistent" (a host
    grads buffer per chunk: 2 bytes per param in bf16, written by the device-to-host copy and
    read by CPU-Adam), "window" (a bounded window of ``grads_window`` pinned chunk-sized slots:
    a chunk's grads land in a free slot and the slot is given back once its update (or the
    accumulation into the fp32 buffer) has consumed them, so host memory holds the window, not
    a grads buffer per param; backward waits for a slot when the host updates fall behind it)
    or "auto" (the window where it keeps optimizer state out of NVMe, or lets the placement
    fit at all; else persistent, which never waits). Results are identical either way. With
    clipping or fp16 and no host accumulation buffer, every chunk's grads wait for the
    window's decision, so the window holds them all (no saving: "auto" keeps "persistent")."""
    grads_window: int = 4
    """Slots of the grads window (``host_grads="window"``), >= 1; each holds one chunk's grads."""
    host_params: str = "auto"
    """How the bf16/fp16 working params of chunks whose params are homed in host memory live
    there: "copy" (a host buffer of the working dtype, 2 bytes per param: the device fetches it
    and the CPU update writes the rounded params into it), "from-master" (none where the chunk's
    fp32 master is in host memory too, ``optimizer="cpu"`` or "auto" on the host: each fetch
    sends the fp32 master up (4 bytes per param over PCIe instead of 2) and casts it on the
    device, with ranks each rank its shard before the all-gather; the CPU update writes no
    copy; chunks whose master is elsewhere (NVMe, the GPU) keep the copy, and the plan's report
    says so) or "auto" (from the master only where the copy's placement would put state on NVMe
    or not fit at all; else the copy, which costs no PCIe bytes). Results are identical bit for
    bit either way (the same round to nearest even)."""
    bind_cores: bool = False
    """Several ranks on the node (torchrun): bind this process's threads to its own block of the
    node's cores, grouped by NUMA node, before the CPU-Adam threads start, so two ranks' CPU-Adam
    threads never share a core and each reads memory on its own socket. Off by default: on the
    4x H100 VM we measure on, binding was slower (each rank's GPU-driving and NCCL threads then
    compete with its own CPU-Adam threads; benchmarks/README.md). No effect with one rank per node."""

    def __post_init__(self):
        o = "OffloadConfig"
        setv = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        setv("params", _as_enum(o, "params", self.params, Placement))
        setv("optimizer", _as_enum(
            o, "optimizer", self.optimizer, Placement,
            allowed=(Placement.CPU, Placement.NVME, Placement.AUTO),
            fix="optimizer state lives in host RAM ('cpu') or NVMe ('nvme'), or let 'auto' choose"))
        if self.nvme_dir is not None:
            if not isinstance(self.nvme_dir, (str, os.PathLike)) or not os.fspath(self.nvme_dir):
                raise _fail(o, "nvme_dir", self.nvme_dir, "a directory path (str or os.PathLike) or None")
            setv("nvme_dir", os.fspath(self.nvme_dir))
            from .runtime.swap_io import swap_dir_problem

            problem = swap_dir_problem(self.nvme_dir)  # only looks: nothing is created here
            if problem is not None:
                raise ValueError(f"{o}.nvme_dir={self.nvme_dir!r} {problem}; set nvme_dir to a directory "
                                 f"path (it is created 0700 if missing), or move that file away")
        nvme_users = [n for n in ("params", "optimizer") if getattr(self, n) is Placement.NVME]
        if nvme_users and self.nvme_dir is None:
            raise ValueError(
                f"OffloadConfig.{nvme_users[0]}='nvme' needs a swap directory: set "
                f"nvme_dir='/path/on/nvme' (a directory on a fast local disk), or choose another placement")
        setv("dtype", _as_enum(o, "dtype", self.dtype, Precision))
        setv("chunk_mb", as_float(o, "chunk_mb", self.chunk_mb, above=0.0,
                                   fix="typical values are 16-256"))
        for name in ("gpu_budget", "cpu_budget", "nvme_budget"):
            setv(name, as_budget(o, name, getattr(self, name)))
        if not (isinstance(self.activation_reserve, int) and self.activation_reserve == 0):  # 0: none
            setv("activation_reserve", as_budget(o, "activation_reserve", self.activation_reserve,
                                                  auto="(half of gpu_budget)"))
        if self.grad_clip is not None:
            setv("grad_clip", as_float(o, "grad_clip", self.grad_clip, above=0.0,
                                        fix="or None to disable clipping"))
        if isinstance(self.loss_scale, str):
            if self.loss_scale.lower() != "dynamic":
                raise _fail(o, "loss_scale", self.loss_scale, "'dynamic' or a positive number")
            setv("loss_scale", "dynamic")
        else:
            setv("loss_scale", as_float(o, "loss_scale", self.loss_scale, above=0.0,
                                         fix="or 'dynamic'"))
        for name, low, high in (("initial_scale", 0.0, None), ("growth_factor", 1.0, None),
                                ("backoff_factor", 0.0, 1.0)):  # bounds excluded
            setv(name, as_float(o, name, getattr(self, name), above=low, below=high))
        if self.threads is not None:
            setv("threads", as_int(o, "threads", self.threads, minimum=1,
                                    fix="or None for every available core"))
        for name, minimum in (("prefetch_depth", 0), ("grad_accum", 1), ("growth_interval", 1),
                              ("io_threads", 1), ("io_block_size", 4096), ("io_queue_depth", 1),
                              ("grads_window", 1)):
            setv(name, as_int(o, name, getattr(self, name), minimum=minimum))
        if self.io_block_size % 4096:
            raise _fail(o, "io_block_size", self.io_block_size, "a multiple of 4096 (O_DIRECT)",
                        f"e.g. {round_up(self.io_block_size)}")
        for name in ("overlap", "bind_cores"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(o, name, getattr(self, name), "True or False")
        if self.grad_sync not in ("every", "final"):
            raise _fail(o, "grad_sync", self.grad_sync, "'every' or 'final'")
        if self.host_grads not in ("auto", "persistent", "window"):
            raise _fail(o, "host_grads", self.host_grads, "'auto', 'persistent' or 'window'")
        if self.host_params not in ("auto", "copy", "from-master"):
            raise _fail(o, "host_params", self.host_params, "'auto', 'copy' or 'from-master'")
        if self.moments_dtype not in ("fp32", "bf16"):
            raise _fail(o, "moments_dtype", self.moments_dtype,
                        "'fp32' (exact, the default) or 'bf16' (stochastically rounded, inexact)")

    # -- derived values --------------------------------------------------------------------

    @property
    def chunk_bytes(self) -> int:
        """``chunk_mb`` in bytes, rounded up to a multiple of 4096."""
        return round_up(round(self.chunk_mb * 2**20))

    @property
    def host_accum(self) -> bool:
        """Grads are summed over the accumulation window in an fp32 "accum" payload (homed with
        the optimizer state): ``grad_accum > 1`` with ``grad_sync="every"``."""
        return self.grad_accum > 1 and self.grad_sync == "every"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The working dtype as a ``torch.dtype``."""
        return self.dtype.torch_dtype

    # -- conversions -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (enums as their strings); ``from_dict`` reads it back."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in values.items()}

    def to_json(self, path: str | os.PathLike) -> None:
        """Write ``to_dict()`` as JSON."""
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2)
            fh.write("\n")

    def replace(self, **changes) -> "OffloadConfig":
        """A copy with some fields changed (validated like a new config; unknown keys raise)."""
        return self.from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OffloadConfig":
        """Build from a dict of field names. Unknown keys raise, naming the valid ones."""
        return _from_mapping(cls, d)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "OffloadConfig":
        """Build from a JSON file holding a dict of field names."""
        return cls.from_dict(_read_json(path))

    @classmethod
    def from_deepspeed(cls, ds: Mapping[str, Any] | str | os.PathLike) -> "OffloadConfig":
        """Translate a DeepSpeed config (a dict or a JSON path). See ``translate_deepspeed`` for
        the mapping; keys that change nothing here are listed in a ``UserWarning``. The
        optimizer section, if any, is returned by ``load_config`` / ``translate_deepspeed``."""
        t = translate_deepspeed(ds)
        t.warn()
        return t.config


PER_RANK_FIELDS = frozenset({"nvme_dir", "gpu_budget", "cpu_budget", "nvme_budget", "activation_reserve",
                             "host_grads", "grads_window",
                             "threads", "io_threads", "io_block_size", "io_queue_depth", "bind_cores"})
"""``OffloadConfig`` fields each rank may set for itself: its swap directory, its budgets (where
its own shards live), its threads and I/O tuning. They change neither the collectives nor the
results; every other field must be the same on every rank (``initialize`` compares them)."""


def _read_json(path: str | os.PathLike) -> Any:
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {os.fspath(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {os.fspath(path)!r} is not valid JSON: {e}") from None


# ---------------------------------------------------------------------------------------------
# DeepSpeed translation
# ---------------------------------------------------------------------------------------------

# [Note: DeepSpeed keys] Every DeepSpeed key falls in one of three sets: mapped (translated to
# an OffloadConfig field or the optimizer spec), ignored (accepted because it only tunes
# DeepSpeed's own machinery or the data loader, never the maths of a step; listed in the
# translation's `ignored` so the user sees it), or refused (anything else: it would change the
# result or it names a feature we do not have, so silently dropping it would be a lie).
# A value of "auto" (Hugging Face Trainer's placeholder) on a mapped key means "our default".

_DS_IGNORED_TOP = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "dump_state", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
    "comet", "comms_logger", "monitor_config", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "communication_data_type", "seq_parallel_communication_data_type",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "activation_checkpointing",
    "checkpoint", "data_types", "timers", "elasticity", "autotuning", "compile",
    "use_data_before_expert_parallelism", "dataloader_drop_last",
})
_DS_MAPPED_TOP = frozenset({"zero_optimization", "bf16", "bfloat16", "fp16", "gradient_clipping",
                            "gradient_accumulation_steps", "optimizer", "aio"})
_DS_IGNORED_ZERO = frozenset({
    "stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "reduce_scatter",
    "allgather_partitions", "allgather_bucket_size", "round_robin_gradients", "sub_group_size",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold", "load_from_fp32_weights", "elastic_checkpoint",
    "ignore_unused_parameters", "memory_efficient_linear", "cpu_offload_use_pin_memory",
    "zero_hpz_partition_size", "mics_shard_size", "mics_hierarchical_params_gather",
    "log_trace_cache_warnings", "use_multi_rank_bucket_allreduce", "legacy_stage1",
    "pipeline_loading_checkpoint", "override_module_apply", "zeropp_loco_param",
})
_DS_MAPPED_ZERO = frozenset({"offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_params"})
_DS_OFFLOAD_COMMON_IGNORED = frozenset({"pin_memory", "buffer_count", "buffer_size", "max_in_cpu",
                                        "fast_init", "pipeline_read", "pipeline_write", "pipeline"})
_DS_AIO_IGNORED = frozenset({"single_submit", "overlap_events", "use_gds"})
_DS_AIO_MAPPED = {"block_size": "io_block_size", "queue_depth": "io_queue_depth",
                  "thread_count": "io_threads", "intra_op_parallelism": "io_threads"}
_DS_OPT_IGNORED = frozenset({"torch_adam", "fused", "foreach", "capturable", "differentiable",
                             "maximize_", "set_grad_none"})


@dataclass(frozen=True, kw_only=True)
class DeepSpeedTranslation:
    """The result of reading a DeepSpeed config (one record per translation)."""

    config: OffloadConfig
    """The equivalent offload configuration."""
    optimizer: Adam | None
    """The optimizer spec from the ``optimizer`` section, or None if the config has none."""
    ignored: tuple[str, ...]
    """Dotted keys accepted but without effect here (they tune DeepSpeed's own machinery)."""
    notes: tuple[str, ...]
    """How mapped values were interpreted where DeepSpeed's meaning differs from the obvious."""

    def warn(self) -> None:
        """Emit one ``UserWarning`` listing the ignored keys and notes, if there are any."""
        parts = []
        if self.ignored:
            parts.append("ignored DeepSpeed keys (no effect in zero_offload): " + ", ".join(self.ignored))
        parts.extend(self.notes)
        if parts:
            warnings.warn("; ".join(parts), UserWarning, stacklevel=3)


def _ds_section(parent: Mapping, path: str) -> Mapping:
    """The dict at the dotted ``path`` (its last key looked up in ``parent``); {} when absent."""
    v = parent.get(path.rpartition(".")[2]) or {}
    if not isinstance(v, Mapping):
        raise ValueError(f"DeepSpeed config: {path} must be a dict, got {v!r}")
    return v


def _ds_check_keys(section: Mapping, path: str, *, mapped, ignored, ignored_out: list) -> None:
    unknown = set(section) - set(mapped) - set(ignored)
    if unknown:
        raise _unknown_keys(f"DeepSpeed '{path}'" if path else "DeepSpeed top-level",
                            unknown, set(mapped) | set(ignored))
    prefix = f"{path}." if path else ""
    ignored_out.extend(prefix + k for k in sorted(section) if k in ignored)


def _ds_device(section: Mapping, path: str) -> Placement | None:
    dev = str(section.get("device", "none")).lower()
    if dev not in ("cpu", "nvme", "none"):
        raise ValueError(f"DeepSpeed config: {path}.device={section.get('device')!r} is invalid: "
                         f"expected 'cpu', 'nvme' or 'none'")
    return None if dev == "none" else Placement(dev)


def translate_deepspeed(ds: Mapping[str, Any] | str | os.PathLike) -> DeepSpeedTranslation:
    """Translate a DeepSpeed config (dict or JSON path) into an ``OffloadConfig`` + ``Adam`` spec.

    Mapping:

    - ``zero_optimization.offload_param.device``: cpu|nvme -> ``params``; none or absent ->
      "gpu" (DeepSpeed keeps params on the GPU then). ``nvme_path`` -> ``nvme_dir``.
    - ``zero_optimization.offload_optimizer.device``: cpu|nvme -> ``optimizer``; none or absent ->
      "auto" (state on the fastest tier with room). ``ratio`` must be 1.0 (partial offload is
      what "auto" does by budget; set ``cpu_budget`` instead). ``nvme_path`` -> ``nvme_dir``
      (both sections must agree: one swap directory serves both).
    - ``pin_memory``, ``buffer_count``, ``buffer_size``, ``max_in_cpu``, ``fast_init``,
      ``pipeline_read/write``: ignored (pinned staging and read-ahead are always on here; their
      size follows ``chunk_mb`` and ``prefetch_depth``).
    - ``bf16.enabled`` -> dtype "bf16"; ``fp16.enabled`` -> "fp16" with ``loss_scale`` (0 =
      dynamic), ``initial_scale_power`` (scale 2**p), ``loss_scale_window`` -> ``growth_interval``;
      ``hysteresis`` and ``min_loss_scale`` have no equivalent in GradScaler's rule (back off on
      every overflow): accepted, with a note. Neither -> "fp32".
    - ``gradient_clipping`` (0 = off) -> ``grad_clip``; ``gradient_accumulation_steps`` ->
      ``grad_accum``.
    - ``optimizer``: ``type`` "Adam" -> **AdamW** unless ``params.adam_w_mode`` is false
      (DeepSpeed's FusedAdam/DeepSpeedCPUAdam default ``adam_w_mode=True``: its "Adam" is
      decoupled-decay AdamW); "AdamW" -> AdamW. ``lr``, ``betas``, ``eps``, ``weight_decay``
      (default 0.0, DeepSpeed's default, also for AdamW). ``amsgrad`` and
      ``bias_correction: false`` are refused. Other optimizer types are refused.
    - ``aio.block_size``/``queue_depth``/``thread_count`` (or ``intra_op_parallelism``) ->
      ``io_block_size``/``io_queue_depth``/``io_threads``.
    - Batch sizes, logging, profiler, communication bucket sizes and ``stage3_*`` tuning knobs are
      ignored (listed in ``ignored``). Anything else raises, e.g. ``scheduler`` (pass a torch
      lr scheduler to ``initialize`` instead).
    """
    if not isinstance(ds, Mapping):
        ds = _read_json(ds)
        if not isinstance(ds, Mapping):
            raise ValueError("a DeepSpeed config file must hold a JSON object")
    ignored: list[str] = []
    notes: list[str] = []
    kw: dict[str, Any] = {}

    if "scheduler" in ds:
        raise ValueError("DeepSpeed 'scheduler' is not translated: build a torch.optim.lr_scheduler "
                         "on the optimizer and pass it to zero_offload.initialize(lr_scheduler=...)")
    _ds_check_keys(ds, "", mapped=_DS_MAPPED_TOP, ignored=_DS_IGNORED_TOP, ignored_out=ignored)

    def checked_section(parent: Mapping, path: str, *, mapped, skip=frozenset()) -> Mapping:
        """``_ds_section`` with its keys checked: ``mapped`` ones are read, ``skip`` ones ignored."""
        sec = _ds_section(parent, path)
        _ds_check_keys(sec, path, mapped=mapped, ignored=skip, ignored_out=ignored)
        return sec

    def mapped(section: Mapping, key: str, path: str):
        """The value, or None when absent or "auto" (Hugging Face's placeholder)."""
        v = section.get(key)
        if isinstance(v, str) and v.lower() == "auto":
            notes.append(f"{path}{key}='auto' -> zero_offload's default")
            return None
        return v

    # -- placement ------------------------------------------------------------------------
    zero = checked_section(ds, "zero_optimization", mapped=_DS_MAPPED_ZERO, skip=_DS_IGNORED_ZERO)
    nvme_paths = {}
    for key, field_name, absent in (("offload_param", "params", Placement.GPU),
                                    ("offload_optimizer", "optimizer", Placement.AUTO)):
        path = f"zero_optimization.{key}"
        extra = {"ratio"} if key == "offload_optimizer" else set()
        sec = checked_section(zero, path, mapped={"device", "nvme_path"} | extra, skip=_DS_OFFLOAD_COMMON_IGNORED)
        dev = _ds_device(sec, path) if sec else None
        if key == "offload_optimizer" and dev is None and zero.get("cpu_offload"):
            dev = Placement.CPU  # legacy ZeRO-2 flag
        kw[field_name] = dev if dev is not None else absent
        if sec.get("ratio", 1.0) != 1.0:
            raise ValueError(
                f"DeepSpeed {path}.ratio={sec['ratio']!r}: partial optimizer offload by ratio is not "
                f"supported; remove it, or use optimizer='auto' with a cpu_budget/gpu_budget")
        if dev is Placement.NVME:
            if not sec.get("nvme_path"):
                raise ValueError(f"DeepSpeed {path}.device='nvme' needs {path}.nvme_path")
            nvme_paths[path] = os.fspath(sec["nvme_path"])
    if zero.get("cpu_offload_params") and kw["params"] is Placement.GPU:
        kw["params"] = Placement.CPU  # legacy flag
    for flag in ("cpu_offload", "cpu_offload_params"):
        if flag in zero:
            notes.append(f"zero_optimization.{flag} is deprecated in DeepSpeed; read as "
                         f"offload_{'optimizer' if flag == 'cpu_offload' else 'param'}.device='cpu'"
                         if zero[flag] else f"zero_optimization.{flag}=false: no effect")
    if len(set(nvme_paths.values())) > 1:
        raise ValueError(
            f"DeepSpeed offload_param.nvme_path and offload_optimizer.nvme_path differ ({nvme_paths}); "
            f"zero_offload uses one swap directory: give both the same path")
    if nvme_paths:
        kw["nvme_dir"] = next(iter(nvme_paths.values()))
    if kw["optimizer"] is Placement.AUTO:
        notes.append("no optimizer offload in the DeepSpeed config: optimizer='auto' "
                     "(state in host RAM within cpu_budget)")

    # -- precision ------------------------------------------------------------------------
    bf16 = {**_ds_section(ds, "bfloat16"), **_ds_section(ds, "bf16")}
    _ds_check_keys(bf16, "bf16", mapped={"enabled"},
                   ignored={"immediate_grad_update", "check_grad_overflow"}, ignored_out=ignored)
    fp16 = checked_section(ds, "fp16", mapped={"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
                                       "hysteresis", "min_loss_scale"},
                   skip={"auto_cast", "consecutive_hysteresis"})
    bf16_on, fp16_on = bool(bf16.get("enabled", False)), bool(fp16.get("enabled", False))
    if bf16_on and fp16_on:
        raise ValueError("DeepSpeed config enables both bf16 and fp16: enable one")
    kw["dtype"] = Precision.BF16 if bf16_on else Precision.FP16 if fp16_on else Precision.FP32
    if fp16_on:
        ls = mapped(fp16, "loss_scale", "fp16.")
        if ls is not None:
            kw["loss_scale"] = "dynamic" if ls == 0 else ls
        power = mapped(fp16, "initial_scale_power", "fp16.")
        power = 16 if power is None else as_int("DeepSpeed fp16", "initial_scale_power", power, minimum=0)
        kw["initial_scale"] = 2.0 ** power  # DeepSpeed's default power is 16, as ours
        kw["growth_interval"] = mapped(fp16, "loss_scale_window", "fp16.")
        if kw["growth_interval"] is None:
            kw["growth_interval"] = 1000  # DeepSpeed's default window
            notes.append("fp16.loss_scale_window absent: growth_interval=1000 (DeepSpeed's default)")
        for k in ("hysteresis", "min_loss_scale"):
            if k in fp16:
                notes.append(f"fp16.{k}={fp16[k]!r} has no equivalent: the dynamic scale follows "
                             f"torch.amp.GradScaler (back off on every overflow, no floor)")
    elif fp16:
        ignored.extend(f"fp16.{k}" for k in sorted(fp16) if k != "enabled")

    # -- step -----------------------------------------------------------------------------
    clip = mapped(ds, "gradient_clipping", "")
    if clip is not None:
        kw["grad_clip"] = None if clip == 0 else clip
    accum = mapped(ds, "gradient_accumulation_steps", "")
    if accum is not None:
        kw["grad_accum"] = accum

    # -- aio --------------------------------------------------------------------------------
    aio = checked_section(ds, "aio", mapped=_DS_AIO_MAPPED, skip=_DS_AIO_IGNORED)
    if "thread_count" in aio and "intra_op_parallelism" in aio:
        raise ValueError("DeepSpeed aio.thread_count and aio.intra_op_parallelism both set: keep one")
    for k, ours in _DS_AIO_MAPPED.items():
        v = mapped(aio, k, "aio.")
        if v is not None:
            kw[ours] = v
    if aio.get("use_gds"):
        notes.append("aio.use_gds=true: GPUDirect Storage is not used; NVMe reads stage through pinned memory")

    # -- optimizer --------------------------------------------------------------------------
    spec = None
    opt = checked_section(ds, "optimizer", mapped={"type", "params"})
    if opt:
        typ = str(opt.get("type", "")).lower()
        valid = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction"}
        params = checked_section(opt, "optimizer.params", mapped=valid, skip=_DS_OPT_IGNORED)
        if typ not in ("adam", "adamw"):
            raise ValueError(f"DeepSpeed optimizer.type={opt.get('type')!r} is not supported: "
                             f"zero_offload implements 'Adam' and 'AdamW'")
        if params.get("amsgrad"):
            raise ValueError("DeepSpeed optimizer.params.amsgrad=true is not supported: remove it")
        if params.get("bias_correction", True) is False:
            raise ValueError("DeepSpeed optimizer.params.bias_correction=false is not supported: "
                             "zero_offload always applies Adam's bias correction")
        adamw = True if typ == "adamw" else bool(params.get("adam_w_mode", True))
        if typ == "adam" and "adam_w_mode" not in params:
            notes.append("DeepSpeed optimizer.type='Adam' defaults to adam_w_mode=true: read as AdamW "
                         "(decoupled weight decay); set optimizer.params.adam_w_mode=false for L2 Adam")
        hp = {"weight_decay": 0.0}  # DeepSpeed's default for both Adam and AdamW
        for k in ("lr", "betas", "eps", "weight_decay"):
            v = mapped(params, k, "optimizer.params.")
            if v is not None:
                hp[k] = v
        spec = (AdamW if adamw else Adam)(**hp)

    return DeepSpeedTranslation(config=OffloadConfig(**kw), optimizer=spec,
                                ignored=tuple(ignored), notes=tuple(notes))


def load_config(obj: Any) -> tuple[OffloadConfig, Adam | None]:
    """Any accepted form of configuration -> ``(OffloadConfig, optimizer spec or None)``.

    ``obj`` is an ``OffloadConfig``; a dict of our field names (optionally with an ``"optim"``
    entry ``{"type": "adam"|"adamw", "lr": ..., ...}`` giving the optimizer spec); a DeepSpeed
    config dict (recognised by its ``"zero_optimization"`` key; ignored keys are warned about);
    or a path to a JSON file holding either dict.
    """
    if isinstance(obj, OffloadConfig):
        return obj, None
    if isinstance(obj, (str, os.PathLike)):
        obj = _read_json(obj)
    if not isinstance(obj, Mapping):
        raise TypeError(f"load_config expects an OffloadConfig, a dict or a JSON path, got "
                        f"{type(obj).__name__}")
    if "zero_optimization" in obj:  # a DeepSpeed config
        t = translate_deepspeed(obj)
        t.warn()
        return t.config, t.optimizer
    d = dict(obj)
    optim = d.pop("optim", None)
    return OffloadConfig.from_dict(d), (None if optim is None else spec_from_dict(optim))
