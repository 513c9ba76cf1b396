"""[Note: stochastic rounding]'s rule as one Triton kernel, for the GPU share's bf16 moments.

[Note: one kernel for the rounding] ``rounding.stochastic_round_moments_bf16`` is about 35
elementwise torch ops on int64 tensors (the hash, then each moment's rounding), each reading and
writing 8 bytes an element: some 600 bytes of device memory traffic per element, where the
update itself (torch's fused AdamW) moves about 30. At 30.5B on two H200s (session 22) that is
10.3 billion elements of the share per GPU per step, and the step's backward took twice as
long as an exact run's. ``round_moments_bf16_`` reads the two fp32 moments once and writes the
two bf16 ones once (12 bytes an element), computing the same int64 arithmetic, masked to 32
bits, as the torch ops and the CPU kernel: the same bits (the CPU tests run it under Triton's
interpreter against the torch ops).

Imported only where a CUDA tensor is rounded; ``triton`` is not a dependency of the package (it
comes with torch's CUDA builds).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _lowbias32(x):
    """lowbias32 of x (int64 holding uint32 values)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _to_bf16(x, r):
    """fp32 ``x`` to bf16 with the 16 rounding bits ``r``: (bits + r) >> 16, NaN canonical."""
    u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    bits = ((u + r) >> 16) & 0xFFFF
    bits = tl.where(x != x, 0x7FC0, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_kernel(m_ptr, v_ptr, m_out, v_out, n, seed_term, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    m = tl.load(m_ptr + idx, mask=mask, other=0.0)
    v = tl.load(v_ptr + idx, mask=mask, other=0.0)
    h = _lowbias32((idx * 0x9E3779B9 + seed_term.to(tl.int64)) & 0xFFFFFFFF)
    tl.store(m_out + idx, _to_bf16(m, h & 0xFFFF), mask=mask)
    tl.store(v_out + idx, _to_bf16(v, h >> 16), mask=mask)


def round_moments_bf16_(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, seed: int,
                        out_avg: torch.Tensor, out_avg_sq: torch.Tensor) -> None:
    """``out_avg``/``out_avg_sq`` (bf16) = ``exp_avg``/``exp_avg_sq`` (fp32) rounded as
    ``rounding.stochastic_round_moments_bf16`` rounds them; all four contiguous, of one numel,
    on one device. Checked by the caller."""
    n = exp_avg.numel()
    if n == 0:
        return
    seed_term = (int(seed) * 0x85EBCA6B) & 0xFFFFFFFF
    # Triton launches on the current device: make it the tensors' (a process may hold several)
    with torch.cuda.device(exp_avg.device) if exp_avg.device.type == "cuda" else contextlib.nullcontext():
        _round_kernel[(triton.cdiv(n, _BLOCK),)](exp_avg, exp_avg_sq, out_avg, out_avg_sq, n, seed_term,
                                                 BLOCK=_BLOCK)
