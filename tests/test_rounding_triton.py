"""The GPU share's bf16 moments rounded by one Triton kernel ([Note: one kernel for the rounding]
in ops/rounding_triton.py): the same bits as the torch ops of ``stochastic_round_moments_bf16``
(which the CPU tests hold to the CPU-Adam kernel), checked on the CPU under Triton's interpreter
and on CUDA compiled; a kernel that cannot run falls back to the torch ops, said once."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from zero_offload.ops import rounding

_SCRIPT = textwrap.dedent("""
    import torch
    from zero_offload.ops import rounding
    rounding._TRITON_DEVICES = ("cpu",)
    g = torch.Generator().manual_seed(0)
    for n in (1, 1023, 1024, 5000):
        m = torch.randn(n, generator=g) * 1e-3
        v = torch.rand(n, generator=g) * 1e-6
        if n > 8:  # NaN (canonical), infinities, the largest finite values, exact bf16 values
            m[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3895313892515355e38,
                                  -3.3895313892515355e38, 1.5])
            v[:3] = torch.tensor([-float("nan"), 0.0, 2.0 ** -133])
        for seed in (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF):
            want_m, want_v = rounding.stochastic_round_moments_bf16(m, v, seed)
            out_m, out_v = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
            rounding.round_moments_bf16_into(m, v, seed, out_m, out_v)
            assert rounding._triton_failed is None, rounding._triton_failed
            assert torch.equal(out_m.view(torch.int16), want_m.view(torch.int16)), (n, seed)
            assert torch.equal(out_v.view(torch.int16), want_v.view(torch.int16)), (n, seed)
    print("same bits")
""")


def test_the_kernel_gives_the_torch_ops_bits_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is in the test extra; without it the CUDA test checks the kernel")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "same bits" in r.stdout, r.stdout + r.stderr


def test_a_kernel_that_cannot_run_falls_back_to_the_torch_ops_once(monkeypatch):
    """Not under the interpreter, a Triton launch on CPU tensors fails (no GPU): the rounding
    warns once, naming the fallback, and gives the torch ops' bits, now and after."""
    pytest.importorskip("triton", reason="Triton is in the test extra")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(rounding, "_TRITON_DEVICES", ("cpu",))
    monkeypatch.setattr(rounding, "_triton_failed", None)
    monkeypatch.setattr(rounding, "_triton_checked", set())
    m, v = torch.randn(3000) * 1e-3, torch.rand(3000) * 1e-6
    want_m, want_v = rounding.stochastic_round_moments_bf16(m, v, 7)
    for attempt in range(2):
        out_m, out_v = torch.empty(3000, dtype=torch.bfloat16), torch.empty(3000, dtype=torch.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rounding.round_moments_bf16_into(m, v, 7, out_m, out_v)
        said = [str(w.message) for w in caught if "Triton kernel that rounds" in str(w.message)]
        assert len(said) == (1 if attempt == 0 else 0), said
        assert torch.equal(out_m, want_m) and torch.equal(out_v, want_v)
    assert rounding._triton_failed


def test_a_kernel_that_computes_other_bits_is_not_used(monkeypatch):
    """The probe before a device's first use: a kernel whose bits differ (a miscompile, say) is
    refused with the warning, and the torch ops round."""
    pytest.importorskip("triton", reason="Triton is in the test extra")
    import zero_offload.ops.rounding_triton as rt

    def off_by_one(m, v, seed, out_m, out_v):
        a, b = rounding.stochastic_round_moments_bf16(m, v, seed)
        out_m.copy_(a)
        out_v.copy_((b.view(torch.int16) ^ 1).view(torch.bfloat16))  # one bit of exp_avg_sq
    monkeypatch.setattr(rt, "round_moments_bf16_", off_by_one)
    monkeypatch.setattr(rounding, "_TRITON_DEVICES", ("cpu",))
    monkeypatch.setattr(rounding, "_triton_failed", None)
    monkeypatch.setattr(rounding, "_triton_checked", set())
    m, v = torch.randn(100) * 1e-3, torch.rand(100) * 1e-6
    out_m, out_v = torch.empty(100, dtype=torch.bfloat16), torch.empty(100, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="bits differ from the torch ops"):
        rounding.round_moments_bf16_into(m, v, 3, out_m, out_v)
    want_m, want_v = rounding.stochastic_round_moments_bf16(m, v, 3)
    assert torch.equal(out_m, want_m) and torch.equal(out_v, want_v)


def test_outputs_of_the_wrong_kind_are_refused_before_writing():
    m, v = torch.zeros(8), torch.zeros(8)
    good = torch.full((8,), 5.0, dtype=torch.bfloat16)
    for bad in (torch.empty(8), torch.empty(7, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="out_avg_sq must be bf16"):
            rounding.round_moments_bf16_into(m, v, 1, good, bad)
        assert torch.equal(good, torch.full((8,), 5.0, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_gives_the_torch_ops_bits():
    g = torch.Generator(device="cuda").manual_seed(0)
    n = (1 << 22) + 77
    m = torch.randn(n, device="cuda", generator=g) * 1e-3
    v = torch.rand(n, device="cuda", generator=g) * 1e-6
    m[:3] = torch.tensor([float("nan"), float("inf"), -3.3895313892515355e38], device="cuda")
    for seed in (0, 0x80000000, 0xFFFFFFFF):
        want_m, want_v = rounding.stochastic_round_moments_bf16(m, v, seed)
        out_m = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        out_v = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        rounding.round_moments_bf16_into(m, v, seed, out_m, out_v)
        assert rounding._triton_failed is None, rounding._triton_failed  # the kernel ran, not the fallback
        assert m.device in rounding._triton_checked  # after the probe
        assert torch.equal(out_m.view(torch.int16), want_m.view(torch.int16))
        assert torch.equal(out_v.view(torch.int16), want_v.view(torch.int16))


def test_the_kernel_compiles_for_hopper_without_a_gpu():
    """Triton compiles the kernel for sm_90 (H100/H200) here, to PTX and a cubin, with both
    integer types a seed argument takes (below 2**31: i32, above: u32): what the CPU tests cannot
    run is at least built, and its IR truncates (not saturates) the bits to bf16's 16."""
    triton = pytest.importorskip("triton", reason="Triton is in the test extra")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import zero_offload.ops.rounding_triton as rt
    for seed_type in ("i32", "u32"):
        src = ASTSource(fn=rt._round_kernel, constexprs={"BLOCK": rt._BLOCK},
                        signature={"m_ptr": "*fp32", "v_ptr": "*fp32", "m_out": "*bf16", "v_out": "*bf16",
                                   "n": "i64", "seed_term": seed_type, "BLOCK": "constexpr"})
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        except RuntimeError as e:  # a Triton without its NVIDIA back end's tools is not this test's concern
            if "ptxas" in str(e):
                pytest.skip(f"this Triton cannot assemble for sm_90 here: {str(e).splitlines()[0]}")
            raise
        assert len(compiled.asm["cubin"]) > 0
        assert "arith.trunci" in compiled.asm["ttir"] and "tensor<1024xi16> -> tensor<1024xbf16>" in compiled.asm["ttir"]
