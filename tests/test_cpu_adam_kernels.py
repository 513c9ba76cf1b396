"""The native kernels beyond the Adam formula: grad sum of squares, inf/NaN check, bf16/fp16
rounding of special values, thread splitting, ISA selection, GIL release and fork safety."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from _cpu_adam_util import ALL_ISAS, each_isa, torch_one_thread  # noqa: F401
from zero_offload.cpu_adam import (adam_step, default_threads, grad_nonfinite, grad_sumsq, isa, set_isa,
                                   supported_isas)

GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ADAM = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=False)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("grad_scale", [1.0, 1024.0, 0.75])
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("size", [0, 1, 17, 4097, 300_001])
def test_sumsq_matches_torch(each_isa, size, dtype, grad_scale, threads):
    grad = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(dtype)
    expected = (grad.double() / grad_scale).square().sum().item()
    got = grad_sumsq(grad, grad_scale=grad_scale, threads=threads)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_sumsq_propagates_inf_and_nan(each_isa, dtype):
    grad = torch.ones(1000, dtype=dtype)
    grad[500] = float("inf")
    assert grad_sumsq(grad) == float("inf")
    grad[999] = float("nan")
    assert grad_sumsq(grad) != grad_sumsq(grad)  # NaN


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_nonfinite_found_anywhere(each_isa, dtype, bad, threads):
    size = 200_003  # several per-thread ranges, several blocks, a partial vector at the end
    grad = torch.randn(size, generator=torch.Generator().manual_seed(7)).to(dtype)
    assert grad_nonfinite(grad, threads=threads) is False
    for position in (0, 15, 16, 65_537, size // 2, size - 1):
        grad[position] = bad
        assert grad_nonfinite(grad, threads=threads) is True, f"{bad} at {position}"
        grad[position] = 0.5


def test_nonfinite_edges(each_isa):
    assert grad_nonfinite(torch.empty(0)) is False
    # the largest finite values of each dtype are finite
    assert grad_nonfinite(torch.full((33,), torch.finfo(torch.float16).max, dtype=torch.float16)) is False
    assert grad_nonfinite(torch.full((33,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)) is False
    assert grad_nonfinite(torch.full((33,), torch.finfo(torch.float32).max)) is False


def _special_floats() -> torch.Tensor:
    """Random fp32 bit patterns over every exponent, plus the rounding edge cases of bf16/fp16."""
    bits = torch.randint(-2**31, 2**31, (20_000,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    edges = torch.tensor([
        0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 65536.0, 1e38, 3.4e38, float("inf"),
        -float("inf"), 2.0**-14, 2.0**-14 * (1 - 2**-12), 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001, 2.0**-26,
        3 * 2.0**-25, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1e-40, -1e-45,
    ], dtype=torch.float32)
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FA00000, -0x00400001, 0x7FFFFFFF], dtype=torch.int64)
    all_bits = torch.cat([bits, edges.view(torch.int32).to(torch.int64), nans])
    return all_bits.to(torch.int32).view(torch.float32).clone()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_copy_out_rounding_of_special_values(each_isa, out_dtype):
    """With lr = 0 and zero grads the param comes back unchanged (param + -0.0), so the copy-out
    is a plain conversion: it must equal torch's .to(dtype) bit for bit on every fp32 pattern,
    NaN payloads, infinities, overflow to inf, subnormals and ties included."""
    param = _special_floats()
    n = param.numel()
    out = torch.empty(n, dtype=out_dtype)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    adam_step(param, torch.zeros(n), exp_avg, exp_avg_sq, step=1, lr=0.0, out_lowp=out, **ADAM)
    expected = param.to(out_dtype)
    mismatch = (out.view(torch.int16) != expected.view(torch.int16)).nonzero().flatten()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} conversions differ, e.g. fp32 bits {param.view(torch.int32)[mismatch[0]].item():#x}: "
        f"{out.view(torch.int16)[mismatch[0]].item() & 0xFFFF:#06x} vs "
        f"{expected.view(torch.int16)[mismatch[0]].item() & 0xFFFF:#06x}"
    )


def test_thread_count_does_not_change_results(each_isa):
    n = 300_007
    gen = torch.Generator().manual_seed(11)
    start = [torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen)]
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    results = []
    for threads in (1, 2, 3, 8):
        param, exp_avg, exp_avg_sq = (t.clone() for t in start)
        out = torch.empty(n, dtype=torch.bfloat16)
        adam_step(param, grad, exp_avg, exp_avg_sq, step=4, lr=1e-3, out_lowp=out, threads=threads,
                  betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw=True)
        results.append((param, exp_avg, exp_avg_sq, out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    # chunks depend on the length only, and partial sums add in chunk order: bit-equal sums
    sums = {grad_sumsq(grad, threads=threads) for threads in (1, 2, 3, 8)}
    assert len(sums) == 1


def test_isa_names_and_switching():
    supported = supported_isas()
    assert supported[0] == "scalar" and set(supported) <= set(ALL_ISAS)
    before = isa()
    assert before == supported[-1]  # the default is the fastest path the CPU has
    try:
        for name in supported:
            set_isa(name)
            assert isa() == name
    finally:
        set_isa(before)
    with pytest.raises(ValueError, match="unknown ISA path 'sse9'"):
        set_isa("sse9")
    with pytest.raises(TypeError):
        set_isa(2)
    assert isa() == before
    assert default_threads() == len(os.sched_getaffinity(0))


def _import_with_env(value: str) -> subprocess.CompletedProcess:
    code = "import zero_offload.cpu_adam as c; print(c.isa())"
    env = dict(os.environ, ZERO_OFFLOAD_ISA=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_env_var_forces_a_path():
    forced = _import_with_env("scalar")
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip() == "scalar"
    bogus = _import_with_env("avx1024")
    assert bogus.returncode != 0
    assert "ZERO_OFFLOAD_ISA='avx1024'" in bogus.stderr and "ValueError" in bogus.stderr


def test_env_var_unsupported_path_is_a_clear_error():
    missing = [name for name in ALL_ISAS if name not in supported_isas()]
    if not missing:
        pytest.skip("this CPU supports every path, so no forced path can be missing")
    result = _import_with_env(missing[-1])
    assert result.returncode != 0
    assert "needs CPU features this machine lacks" in result.stderr


def test_gil_is_released_during_the_kernel():
    """While one thread is inside a long kernel call, another thread keeps running Python."""
    before = isa()
    set_isa("scalar")  # the slow path makes one call last tens of milliseconds
    n = 6_000_000
    param, grad, exp_avg, exp_avg_sq = torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
    window = {}

    def worker():
        window["start"] = time.perf_counter()
        adam_step(param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, threads=1, **ADAM)
        window["end"] = time.perf_counter()

    ticks = []
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        while thread.is_alive():
            ticks.append(time.perf_counter())
        thread.join()
    finally:
        set_isa(before)
    inside = [t for t in ticks if window["start"] < t < window["end"]]
    assert len(inside) > 10, f"main thread ran {len(inside)} times during a {window['end'] - window['start']:.3f}s call"
    torch.testing.assert_close(param, torch.full((n,), -1e-3))  # first Adam step: -lr * sign(grad)


def test_forked_child_gets_its_own_pool():
    """A child forked after the pool started has none of its threads; its first call must build a
    fresh pool instead of waiting forever on the parent's. (The child runs only our kernel: torch's
    own OpenMP pool is not fork-safe, so the buffers are made before the fork.)"""
    n = 100_000
    buffers = [torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)]
    expected = buffers[0].clone()
    adam_step(expected, buffers[1], torch.zeros(n), torch.zeros(n), step=1, lr=1e-3, threads=2, **ADAM)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: one kernel call on two threads, report two elements, exit
        try:
            adam_step(*buffers, step=1, lr=1e-3, threads=2, **ADAM)
            os.write(write_end, f"{buffers[0][0].item()!r} {buffers[0][n - 1].item()!r}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("kernel call in a forked child hung")
    report = os.read(read_end, 200).decode().split()
    os.close(read_end)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [float(v) for v in report] == [expected[0].item(), expected[n - 1].item()]
