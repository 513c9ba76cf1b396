"""Stochastic rounding of fp32 to bf16, as the CPU-Adam kernel does it for bf16 moments
(``OffloadConfig.moments_dtype="bf16"``), in torch for any device (the GPU share of the
optimizer uses it), and the per-update seeds.

[Note: stochastic rounding] A value ``x`` between two neighbouring bf16 values is stored as the
upper one with probability equal to its distance from the lower one, in units of their gap, so
the stored value is unbiased: E[round(x)] = x. The rule is the fp32 bit pattern ``u`` plus 16
random bits, truncated: ``(u + r) >> 16``. NaN becomes the canonical bf16 NaN; infinities stay.
The random bits come from a counter-based hash of (element index in the call, seed, which
moment), so a result does not depend on how the kernel splits the work between threads, and
one update computes the same bits every time it runs:

    x = idx * 0x9E3779B9 + seed * 0x85EBCA6B + which * 0xC2B2AE35       (mod 2**32)
    x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16   ("lowbias32")
    r = x & 0xFFFF

``which`` is 0 for exp_avg and 1 for exp_avg_sq. ``update_seed`` gives each update call its seed
from the chunk, the step and the call's offset in the chunk (and a base, e.g. the rank), so
repeated updates of one element use fresh bits.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def update_seed(base: int, cid: int, step: float, start: int) -> int:
    """The uint32 seed of one update call: chunk ``cid``, Adam step ``step``, offset ``start``."""
    x = (int(base) * 0x9E3779B1 + int(cid) * 0x85EBCA77 + int(step) * 0xC2B2AE3D
         + int(start) * 0x27D4EB2F) & _M32
    return _mix(x)


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def stochastic_round_bf16(x: torch.Tensor, seed: int, which: int) -> torch.Tensor:
    """``x`` (fp32, flat) rounded stochastically to bf16 with [Note: stochastic rounding]'s bits
    for elements ``0 .. x.numel() - 1``; on ``x``'s device."""
    if x.dtype is not torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes an fp32 tensor, got {x.dtype}")
    flat = x.reshape(-1)
    idx = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    h = (idx * 0x9E3779B9 + ((int(seed) * 0x85EBCA6B + int(which) * 0xC2B2AE35) & _M32)) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _M32
    h = h ^ (h >> 16)
    u = flat.view(torch.int32).to(torch.int64) & _M32
    bits = ((u + (h & 0xFFFF)) >> 16) & 0xFFFF
    bits = torch.where(torch.isnan(flat), torch.full_like(bits, 0x7FC0), bits)
    return ((bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16).reshape(x.shape)
