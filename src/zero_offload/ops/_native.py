"""Loading of the native CPU kernels (``zero_offload._C.cpu_adam``, ``zero_offload._C.cpu_rules``)
and ISA selection.

The extension holds three builds of the same kernels (portable scalar, AVX2+FMA+F16C, AVX-512)
and starts on the fastest one this CPU supports (cpuid). ``ZERO_OFFLOAD_ISA=scalar|avx2|avx512``
forces a path for the whole process; ``set_isa`` switches at run time (the tests use it to run
every path in one process). One switch serves every kernel family.
"""
from __future__ import annotations

import enum
import os

import torch

ISA_ENV = "ZERO_OFFLOAD_ISA"


try:
    from .. import _C
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "zero_offload's native extension (zero_offload._C) is not built: run "
        "`pip install -e .` (or `python setup.py build_ext --inplace`) in the repository"
    ) from exc

kernels = _C.cpu_adam
"""CPU-Adam, the grad reductions, and what every kernel family shares: the ISA switch
(``set_isa``) and the kernel queue's ``kernel_wait`` / ``kernel_ready``."""

rules = _C.cpu_rules
"""SGD, Lion, Adafactor and Muon's host passes (``sgd_step``, ``lion_step``, ``adafactor_step``,
``muon_momentum``, ``muon_apply`` and their ``_async`` forms)."""

rng = getattr(_C, "rng", None)
"""torch's CPU random stream moved forward (``advance``); None in an extension built before it
(ops/rng.py then draws serially and says to rebuild)."""


class Dtype(enum.IntEnum):
    """Element-type codes understood by the native kernels (csrc/cpu_adam.h ``Dtype``)."""

    NONE = -1
    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2


TORCH_DTYPES = {
    torch.float32: Dtype.FLOAT32,
    torch.bfloat16: Dtype.BFLOAT16,
    torch.float16: Dtype.FLOAT16,
}


def isa() -> str:
    """The ISA path the kernels use now: "avx512", "avx2" or "scalar"."""
    return kernels.isa()


def supported_isas() -> list[str]:
    """The ISA paths this CPU can run, slowest first (always includes "scalar")."""
    return list(kernels.supported_isas())


def set_isa(name: str) -> None:
    """Switch the kernels to ISA path ``name`` ("scalar" | "avx2" | "avx512") for the process.

    Raises ValueError for an unknown name or a path this CPU lacks. Meant for tests and
    benchmarks; normal use keeps the default (the fastest supported path).
    """
    if not isinstance(name, str):
        raise TypeError(f"ISA name must be a str (scalar, avx2 or avx512), got {type(name).__name__}")
    kernels.set_isa(name)


def default_threads() -> int:
    """Threads a kernel call uses when none are given: the CPUs this process may run on."""
    return kernels.default_threads()


def _apply_env() -> None:
    forced = os.environ.get(ISA_ENV)
    if forced is None or forced == "":
        return
    try:
        kernels.set_isa(forced.strip().lower())
    except ValueError as exc:
        raise ValueError(f"{ISA_ENV}={forced!r}: {exc}") from None


_apply_env()
