"""Shared helpers of the test_cpu_adam_* files (not a test module)."""
from __future__ import annotations

import pytest
import torch

from zero_offload.cpu_adam import isa, set_isa, supported_isas

ALL_ISAS = ("scalar", "avx2", "avx512")
VECTOR = 16  # torch's fused CPU Adam works in 64-byte units of fp32


@pytest.fixture(params=ALL_ISAS)
def each_isa(request):
    """Runs the test once per ISA path this CPU supports, then restores the default path."""
    name = request.param
    if name not in supported_isas():
        pytest.skip(f"this CPU cannot run the {name} path (supports {supported_isas()})")
    before = isa()
    set_isa(name)
    yield name
    set_isa(before)


def on_each_isa(run):
    """``[(name, run())]`` with each ISA path this CPU supports selected in turn; the default path
    is restored after (also when ``run`` raises)."""
    before = isa()
    try:
        results = []
        for name in supported_isas():
            set_isa(name)
            results.append((name, run()))
        return results
    finally:
        set_isa(before)


@pytest.fixture
def torch_one_thread():
    """Runs torch's side on one intra-op thread. Its fused Adam is elementwise, so the result does
    not depend on the thread count, but its OpenMP pool can take milliseconds per step on a busy
    2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_matches_torch(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``ours`` equals torch's fused-Adam result bit for bit, except in the last numel % 16
    elements: torch runs those through a separate scalar loop with its own rounding (a plain
    lerp instead of the fmadd, and whatever its compiler contracted), so there a few ulps of
    drift are allowed. Every other element must be identical."""
    a, b = ours.reshape(-1), ref.reshape(-1)
    assert a.shape == b.shape, what
    body = a.numel() - a.numel() % VECTOR
    if not torch.equal(a[:body], b[:body]):
        bad = (a[:body] != b[:body]).nonzero().flatten()
        raise AssertionError(
            f"{what}: {bad.numel()} of {body} body elements differ from torch, first at {bad[0].item()}: "
            f"{a[bad[0]].item()!r} vs {b[bad[0]].item()!r}"
        )
    torch.testing.assert_close(a[body:], b[body:], rtol=1e-5, atol=1e-6, msg=f"{what}: tail")


# torch >= 2.10 lets an fp32 param hold a bf16/fp16 grad (Tensor.grad_dtype = None); older
# torch refuses to assign one, so optimizer-level low-precision-grad tests cannot be expressed.
TORCH_HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")
needs_grad_dtype = pytest.mark.skipif(not TORCH_HAS_GRAD_DTYPE,
                                      reason="this torch cannot give an fp32 param a bf16/fp16 grad")


def torch_fused(params, *, adamw: bool, **hyper) -> torch.optim.Optimizer:
    """The reference: torch.optim.Adam / AdamW with fused=True (the CPU fused kernel)."""
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    return cls(params, fused=True, **hyper)


# (adamw, weight_decay) triples used across the parity tests
MODES = {
    "adam": (False, 0.0),
    "adam_l2": (False, 0.1),
    "adamw": (True, 0.1),
}
