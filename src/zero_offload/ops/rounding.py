"""Stochastic rounding of fp32 to bf16, as the CPU-Adam kernel does it for bf16 moments
(``OffloadConfig.moments_dtype="bf16"``), in torch for any device, and the per-update seeds.
The GPU share of the optimizer rounds through ``round_moments_bf16_into``: one Triton kernel on
CUDA (ops/rounding_triton.py), the same bits.

[Note: stochastic rounding] A value ``x`` between two neighbouring bf16 values is stored as the
upper one with probability equal to its distance from the lower one, in units of their gap, so
the stored value is unbiased: E[round(x)] = x. The rule is the fp32 bit pattern ``u`` plus 16
random bits, truncated: ``(u + r) >> 16``. NaN becomes the canonical bf16 NaN; infinities stay.
The random bits come from a counter-based hash of (element index in the call, seed), so a
result does not depend on how the kernel splits the work between threads, and one update
computes the same bits every time it runs. Each element has ONE hash, whose two halves round
its two moments:

    x = idx * 0x9E3779B9 + seed * 0x85EBCA6B                                (mod 2**32)
    x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16   ("lowbias32")
    r = x & 0xFFFF for exp_avg, r = x >> 16 for exp_avg_sq

Each half is uniform on [0, 2**16), so each stored moment is unbiased; the two moments of one
element use disjoint bits of one hash (hashing once per element, not once per moment, halves
the CPU kernel's hashing work). ``stochastic_round_moments_bf16`` rounds both moments so.
``update_seed`` gives each update call its seed from the chunk, the step and the call's offset
in the chunk (and a base, e.g. the rank), so repeated updates of one element use fresh bits.
"""
from __future__ import annotations

import warnings

import torch

_M32 = 0xFFFFFFFF


def update_seed(base: int, cid: int, step: float, start: int) -> int:
    """The uint32 seed of one update call: chunk ``cid``, Adam step ``step``, offset ``start``."""
    x = (int(base) * 0x9E3779B1 + int(cid) * 0x85EBCA77 + int(step) * 0xC2B2AE3D
         + int(start) * 0x27D4EB2F) & _M32
    return _mix(x)


def _mix(x):
    """lowbias32 of ``x`` (uint32 values): a Python int, or an int64 tensor elementwise."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def stochastic_round_moments_bf16(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp_avg`` and ``exp_avg_sq`` (fp32, same numel) rounded stochastically to bf16 with
    [Note: stochastic rounding]'s bits for elements ``0 .. numel - 1``: one hash per element,
    its low half for exp_avg, its high half for exp_avg_sq; on the inputs' device, in their
    shapes. Gives the CPU-Adam kernel's bits for the same fp32 values and seed."""
    _check_moments(exp_avg, exp_avg_sq)
    idx = torch.arange(exp_avg.numel(), device=exp_avg.device, dtype=torch.int64)
    h = _mix((idx * 0x9E3779B9 + ((int(seed) * 0x85EBCA6B) & _M32)) & _M32)
    return _round(exp_avg, h & 0xFFFF), _round(exp_avg_sq, h >> 16)


def _check_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """Both fp32, of one numel; a TypeError or ValueError naming them otherwise."""
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype is not torch.float32:
            raise TypeError(f"stochastic_round_moments_bf16 takes fp32 tensors, got {name} {t.dtype}")
    if exp_avg.numel() != exp_avg_sq.numel():
        raise ValueError(f"stochastic_round_moments_bf16: exp_avg has {exp_avg.numel()} elements, "
                         f"exp_avg_sq {exp_avg_sq.numel()}")


_triton_failed: str | None = None  # why the Triton kernel could not run (then torch ops, warned once)
_TRITON_DEVICES = ("cuda",)  # where round_moments_bf16_into tries the kernel (a test adds "cpu")
_triton_checked: set = set()  # devices where the kernel gave the torch ops' bits on a probe


def round_moments_bf16_into(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, seed: int,
                            out_avg: torch.Tensor, out_avg_sq: torch.Tensor) -> None:
    """``stochastic_round_moments_bf16`` written into ``out_avg`` and ``out_avg_sq`` (bf16, the
    inputs' numel and device). On CUDA one Triton kernel ([Note: one kernel for the rounding] in
    ops/rounding_triton.py) where Triton imports and compiles; otherwise, or if it fails (said
    once, as a warning), the torch ops: the same bits either way."""
    global _triton_failed
    _check_moments(exp_avg, exp_avg_sq)
    for name, t in (("out_avg", out_avg), ("out_avg_sq", out_avg_sq)):
        if t.dtype is not torch.bfloat16 or t.numel() != exp_avg.numel() or t.device != exp_avg.device:
            raise ValueError(f"round_moments_bf16_into: {name} must be bf16 with exp_avg's {exp_avg.numel()} "
                             f"elements on {exp_avg.device}, got {t.dtype} x {t.numel()} on {t.device}")
    tensors = (exp_avg, exp_avg_sq, out_avg, out_avg_sq)
    if exp_avg.device.type in _TRITON_DEVICES and _triton_failed is None and all(t.is_contiguous() for t in tensors):
        try:
            from .rounding_triton import round_moments_bf16_
            if exp_avg.device not in _triton_checked:
                _check_kernel(round_moments_bf16_, exp_avg.device)
                _triton_checked.add(exp_avg.device)
            round_moments_bf16_(*tensors[:2], seed, *tensors[2:])
            return
        except ImportError as e:  # a torch build without Triton: the torch ops, silently
            _triton_failed = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 (a compile or launch failure: said once, then torch ops)
            _triton_failed = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            warnings.warn(f"zero_offload: the Triton kernel that rounds bf16 moments on the GPU failed "
                          f"({_triton_failed}); rounding with torch ops from now on (the same bits, "
                          f"slower: see [Note: one kernel for the rounding])", stacklevel=2)
    m, v = stochastic_round_moments_bf16(exp_avg, exp_avg_sq, seed)
    out_avg.copy_(m.reshape(out_avg.shape))
    out_avg_sq.copy_(v.reshape(out_avg_sq.shape))


def _check_kernel(kernel, device: torch.device) -> None:
    """The kernel against the torch ops on a probe of 4099 elements (NaN, infinities, the
    largest finite values, seeds on both sides of 2**31), once per device before its first use:
    a compiler that computes other bits must not round the moments. Raises RuntimeError on a
    difference (``round_moments_bf16_into`` then warns and uses the torch ops)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    m = torch.randn(4099, generator=g) * 1e-3
    v = torch.rand(4099, generator=g) * 1e-6
    m[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3895313892515355e38, 1.5])
    m, v = m.to(device), v.to(device)
    for seed in (1, 0x80000001):
        want_m, want_v = stochastic_round_moments_bf16(m, v, seed)
        got_m, got_v = torch.empty_like(want_m), torch.empty_like(want_v)
        kernel(m, v, seed, got_m, got_v)
        if not (torch.equal(got_m.view(torch.int16), want_m.view(torch.int16))
                and torch.equal(got_v.view(torch.int16), want_v.view(torch.int16))):
            raise RuntimeError(f"its bits differ from the torch ops' on a probe on {device}")


def _round(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` to bf16 with the rounding bits ``r`` (int64 in [0, 2**16), one per element)."""
    flat = x.reshape(-1)
    u = flat.view(torch.int32).to(torch.int64) & _M32
    bits = ((u + r) >> 16) & 0xFFFF
    bits = torch.where(torch.isnan(flat), torch.full_like(bits, 0x7FC0), bits)
    return ((bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16).reshape(x.shape)
