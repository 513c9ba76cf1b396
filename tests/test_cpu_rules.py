"""The native SGD and Lion kernels (ops/cpu_rules.py): equal to torch.optim.SGD and to a torch-ops
Lion over 20 steps on every ISA path, with bf16/fp16 grads, loss-scale unscale, the fused
low-precision copy-out, tail sizes, thread counts and the async queue; every bad argument raises
one clear line before any buffer changes."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from _cpu_adam_util import each_isa, on_each_isa, torch_one_thread  # noqa: F401
from zero_offload import _C
from zero_offload.ops.cpu_adam import KernelTicket, adam_step, adam_step_async, isa
from zero_offload.ops.cpu_rules import LionHyper, SgdHyper, lion_step, lion_step_async, sgd_step, sgd_step_async

GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LOWP = [torch.bfloat16, torch.float16]
SIZES = [1, 7, 17, 1037]  # a lone element, shorter than one vector, one vector + 1, many + a tail
BIG = 1_000_003  # many chunks (several threads), a partial vector at the end
STEPS = 20
# torch runs each op's last few elements through a scalar loop whose rounding its compiler chose;
# everything before them is its vectorised body (at most 2 x 16 lanes per iteration).
TORCH_TAIL = 64

SGD_CASES = {
    "plain": dict(lr=0.05),
    "momentum": dict(lr=0.05, momentum=0.9),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True),
    "dampening": dict(lr=0.05, momentum=0.9, dampening=0.3),
    "decay": dict(lr=0.05, weight_decay=0.01),
    "all": dict(lr=0.05, momentum=0.8, dampening=0.0, weight_decay=0.02, nesterov=True),
}
LION_CASES = {
    "default": dict(lr=1e-3, betas=(0.9, 0.99)),
    "decay": dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1),
    "betas": dict(lr=1e-3, betas=(0.95, 0.98), weight_decay=1.0),
}


def _grads(size: int, dtype: torch.dtype, seed: int, scale: float = 1.0):
    """STEPS grads of ``dtype``, as the loss-scaled grads a model would give (times ``scale``)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, generator=gen) * scale).to(dtype) for _ in range(STEPS)]


def _assert_equal(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bit for bit on torch's vectorised body; rtol 1e-6 on its last TORCH_TAIL elements."""
    body = max(0, ours.numel() - TORCH_TAIL)
    if not torch.equal(ours[:body], ref[:body]):
        bad = (ours[:body] != ref[:body]).nonzero().flatten()
        raise AssertionError(f"{what}: {bad.numel()} of {body} body elements differ, first at {bad[0].item()}: "
                             f"{ours[bad[0]].item()!r} vs {ref[bad[0]].item()!r}")
    torch.testing.assert_close(ours[body:], ref[body:], rtol=1e-6, atol=1e-7, msg=f"{what}: tail")


def _assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    assert a.dtype == b.dtype, what
    assert torch.equal(a.view(bits), b.view(bits)), what


def _run_sgd(hyper: dict, size: int, grad_dtype, grad_scale: float, out_dtype, threads=None, seed=0):
    """Our SGD and torch.optim.SGD(foreach=False) over the same STEPS grads; compares param, buffer
    and copy-out after every step."""
    gen = torch.Generator().manual_seed(seed + size)
    param = torch.randn(size, generator=gen)
    ref = param.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], foreach=False, **hyper)
    momentum = hyper.get("momentum", 0.0)
    buf = torch.full((size,), float("nan")) if momentum else None  # first step must not read it
    out = None if out_dtype is None else torch.empty(size, dtype=out_dtype)
    for step, grad in enumerate(_grads(size, grad_dtype, seed, grad_scale)):
        sgd_step(param, grad, buf, out, first_step=step == 0, grad_scale=grad_scale, threads=threads, **hyper)
        ref.grad = grad.float() / grad_scale
        opt.step()
        what = f"step {step + 1}"
        _assert_equal(param, ref.detach(), f"{what} param")
        if momentum:
            _assert_equal(buf, opt.state[ref]["momentum_buffer"], f"{what} momentum_buffer")
        if out is not None:
            _assert_bits(out, param.to(out_dtype), f"{what} out_lowp")
    return param


def _lion_reference(param, exp_avg, grad, *, lr, betas, weight_decay=0.0):
    """Lion (Chen et al. 2023, Algorithm 2, decoupled decay) in torch ops, in place; sign(NaN)
    is NaN ([Note: sign of NaN] in csrc/cpu_rules_kernel.h; torch.sign gives 0)."""
    beta1, beta2 = betas
    c = exp_avg.mul(beta1).add(grad, alpha=1 - beta1)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.add_(torch.where(c.isnan(), c, c.sign()), alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


def _run_lion(hyper: dict, size: int, grad_dtype, grad_scale: float, out_dtype, threads=None, seed=0):
    gen = torch.Generator().manual_seed(seed + size)
    param = torch.randn(size, generator=gen)
    exp_avg = torch.zeros(size)
    ref, ref_avg = param.clone(), exp_avg.clone()
    out = None if out_dtype is None else torch.empty(size, dtype=out_dtype)
    for step, grad in enumerate(_grads(size, grad_dtype, seed, grad_scale)):
        lion_step(param, grad, exp_avg, out, grad_scale=grad_scale, threads=threads, **hyper)
        _lion_reference(ref, ref_avg, grad.float() / grad_scale, **hyper)
        what = f"step {step + 1}"
        _assert_equal(param, ref, f"{what} param")
        _assert_equal(exp_avg, ref_avg, f"{what} exp_avg")
        if out is not None:
            _assert_bits(out, param.to(out_dtype), f"{what} out_lowp")
    return param


# ---------------------------------------------------------------------------------------------
# Every ISA path runs the kernels it claims to.


def test_rules_follow_the_isa_switch(each_isa):
    assert _C.cpu_rules.isa() == isa() == each_isa


# ---------------------------------------------------------------------------------------------
# SGD = torch.optim.SGD.


@pytest.mark.parametrize("grad_scale", [1.0, 1024.0])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SGD_CASES))
@pytest.mark.parametrize("size", SIZES)
def test_sgd_matches_torch(each_isa, torch_one_thread, size, case, grad_dtype, grad_scale):
    _run_sgd(SGD_CASES[case], size, grad_dtype, grad_scale, out_dtype=None)


@pytest.mark.parametrize("out_dtype", LOWP, ids=str)
@pytest.mark.parametrize("case", ["plain", "all"])
def test_sgd_copy_out_is_the_rounded_param(each_isa, torch_one_thread, case, out_dtype):
    _run_sgd(SGD_CASES[case], 1037, torch.bfloat16, 1.0, out_dtype=out_dtype)


@pytest.mark.parametrize("case", ["plain", "all", "dampening"])
def test_sgd_matches_torch_on_many_chunks(each_isa, torch_one_thread, case):
    _run_sgd(SGD_CASES[case], BIG, torch.bfloat16, 512.0, out_dtype=torch.bfloat16, threads=3)


def test_sgd_ignores_a_buffer_without_momentum():
    """momentum == 0: torch keeps no buffer; one given is checked and left as it is."""
    param, grad, buf = torch.ones(33), torch.full((33,), 2.0), torch.full((33,), 7.0)
    sgd_step(param, grad, buf, lr=0.25, first_step=False)
    assert torch.equal(param, torch.full((33,), 0.5))
    assert torch.equal(buf, torch.full((33,), 7.0))


def test_sgd_first_step_does_not_read_the_buffer():
    """first_step=True: buf = grad (torch clones it), whatever the buffer held (NaN here)."""
    param, grad, buf = torch.zeros(40), torch.arange(40.0), torch.full((40,), float("nan"))
    sgd_step(param, grad, buf, lr=1.0, momentum=0.9, dampening=0.5, first_step=True)
    assert torch.equal(buf, grad)
    assert torch.equal(param, -grad)


# ---------------------------------------------------------------------------------------------
# Lion = its published update.


@pytest.mark.parametrize("grad_scale", [1.0, 1024.0])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(LION_CASES))
@pytest.mark.parametrize("size", SIZES)
def test_lion_matches_reference(each_isa, torch_one_thread, size, case, grad_dtype, grad_scale):
    _run_lion(LION_CASES[case], size, grad_dtype, grad_scale, out_dtype=None)


@pytest.mark.parametrize("out_dtype", LOWP, ids=str)
def test_lion_copy_out_is_the_rounded_param(each_isa, torch_one_thread, out_dtype):
    _run_lion(LION_CASES["decay"], 1037, torch.float16, 1.0, out_dtype=out_dtype)


def test_lion_matches_reference_on_many_chunks(each_isa, torch_one_thread):
    _run_lion(LION_CASES["decay"], BIG, torch.bfloat16, 512.0, out_dtype=torch.bfloat16, threads=3)


def test_lion_update_is_the_sign_of_the_interpolation(each_isa):
    """Each element moves by exactly lr (after decay): +-lr by the sign of beta1 * m + (1 - beta1)
    * g, 0 where that is +-0; a NaN grad makes its param NaN."""
    m = torch.tensor([1.0, -1.0, 1.0, 0.0, -0.0, 0.0, -0.0, 0.0] * 3)
    g = torch.tensor([0.0, 0.0, -20.0, 0.0, 0.0, float("nan"), -0.0, -0.0] * 3)
    param = torch.full((24,), 4.0)
    lion_step(param, g, m, lr=0.5, betas=(0.9, 0.99), weight_decay=0.25)
    # param * (1 - 0.5 * 0.25) - 0.5 * sign(c); c = 0.9 m + 0.1 g = [0.9, -0.9, -1.1, 0, 0, nan, -0, 0]
    decayed = 4.0 * (1 - 0.5 * 0.25)
    expected = torch.tensor([decayed - 0.5, decayed + 0.5, decayed + 0.5, decayed, decayed, float("nan"),
                             decayed, decayed] * 3)
    torch.testing.assert_close(param, expected, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# Paths and thread counts agree bit for bit.


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_every_path_and_thread_count_gives_the_same_bits(rule):
    size = 300_007
    steps = _run_sgd_steps if rule == "sgd" else _run_lion_steps
    per_isa = on_each_isa(lambda: [(threads, steps(size, threads)) for threads in (1, 2, 5)])
    results = [(f"{name}/{threads} threads", param) for name, runs in per_isa for threads, param in runs]
    for what, param in results[1:]:
        _assert_bits(param, results[0][1], f"{what} vs {results[0][0]}")


def _run_sgd_steps(size: int, threads: int) -> torch.Tensor:
    param, buf = torch.randn(size, generator=torch.Generator().manual_seed(1)), torch.empty(size)
    out = torch.empty(size, dtype=torch.float16)
    for step, grad in enumerate(_grads(size, torch.float16, 2)[:3]):
        sgd_step(param, grad, buf, out, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True,
                 first_step=step == 0, grad_scale=8.0, threads=threads)
    return torch.cat([param, buf, out.float()])


def _run_lion_steps(size: int, threads: int) -> torch.Tensor:
    param, m = torch.randn(size, generator=torch.Generator().manual_seed(1)), torch.zeros(size)
    out = torch.empty(size, dtype=torch.bfloat16)
    for grad in _grads(size, torch.bfloat16, 2)[:3]:
        lion_step(param, grad, m, out, lr=1e-3, weight_decay=0.1, grad_scale=8.0, threads=threads)
    return torch.cat([param, m, out.float()])


# ---------------------------------------------------------------------------------------------
# Async: the same results through the kernel queue, in submission order with CPU-Adam's calls.


def test_async_steps_equal_sync_steps_in_order():
    size = 70_001
    grads = _grads(size, torch.bfloat16, 5)[:4]
    start = torch.randn(size, generator=torch.Generator().manual_seed(3))
    sync_p, sync_b, sync_lp, sync_m = start.clone(), torch.empty(size), start.clone(), torch.zeros(size)
    for step, grad in enumerate(grads):
        sgd_step(sync_p, grad, sync_b, lr=0.1, momentum=0.9, first_step=step == 0)
        lion_step(sync_lp, grad, sync_m, lr=1e-3, weight_decay=0.1)
    p, b, lp, m = start.clone(), torch.empty(size), start.clone(), torch.zeros(size)
    out = torch.empty(size, dtype=torch.bfloat16)
    version = p._version
    tickets = []
    for step, grad in enumerate(grads):  # all queued before any wait: order is the queue's
        tickets.append(sgd_step_async(p, grad, b, out, lr=0.1, momentum=0.9, first_step=step == 0))
        tickets.append(lion_step_async(lp, grad, m, lr=1e-3, weight_decay=0.1))
    for ticket in tickets:
        assert isinstance(ticket, KernelTicket)
        seconds = ticket.wait()
        assert isinstance(seconds, float) and seconds >= 0 and isinstance(ticket.start, float)
        assert ticket.wait() == seconds  # once waited, the result stays
    for ours, ref, what in ((p, sync_p, "sgd param"), (b, sync_b, "momentum_buffer"), (lp, sync_lp, "lion param"),
                            (m, sync_m, "exp_avg")):
        _assert_bits(ours, ref, what)
    _assert_bits(out, p.to(torch.bfloat16), "out_lowp")
    assert p._version > version  # autograd sees the in-place update once waited


def test_async_rules_and_adam_share_one_order():
    """An Adam step queued after an SGD step on the same param sees the SGD result."""
    size = 4099
    param = torch.randn(size, generator=torch.Generator().manual_seed(9))
    grad = torch.randn(size, generator=torch.Generator().manual_seed(10))
    ref = param.clone()
    sgd_step(ref, grad, None, lr=0.5, first_step=True)
    adam = dict(step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True)
    ref_m, ref_v = torch.zeros(size), torch.zeros(size)
    adam_step(ref, grad, ref_m, ref_v, **adam)
    m, v = torch.zeros(size), torch.zeros(size)
    first = sgd_step_async(param, grad, None, lr=0.5, first_step=True)
    second = adam_step_async(param, grad, m, v, **adam)
    second.wait()
    first.wait()
    _assert_bits(param, ref, "param")


def test_async_with_no_elements():
    empty = torch.empty(0)
    assert sgd_step_async(empty, empty, None, lr=0.1, first_step=True).wait() == 0.0
    assert lion_step_async(empty, empty, torch.empty(0), lr=0.1).wait() == 0.0
    sgd_step(empty, empty, None, lr=0.1, first_step=True)
    lion_step(empty, empty, torch.empty(0), lr=0.1)


# ---------------------------------------------------------------------------------------------
# Bad arguments: one clear line, raised before any buffer changes.

N = 37
SGD_GOOD = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, first_step=False)
LION_GOOD = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)


def _buffers():
    gen = torch.Generator().manual_seed(0)
    return {"param": torch.randn(N, generator=gen), "grad": torch.randn(N, generator=gen),
            "state": torch.randn(N, generator=gen), "out_lowp": torch.randn(N, generator=gen).bfloat16()}


def _buffer_cases(state: str):
    wide = torch.randn(N, 2)
    return [
        ("param_fp64", {"param": torch.randn(N, dtype=torch.float64)}, {}, TypeError, "param has dtype torch.float64"),
        ("param_bf16", {"param": torch.randn(N).bfloat16()}, {}, TypeError, "param has dtype torch.bfloat16"),
        ("param_list", {"param": [0.0] * N}, {}, TypeError, "param must be a torch.Tensor"),
        ("param_meta", {"param": torch.empty(N, device="meta")}, {}, ValueError, "CPU tensors only"),
        ("param_strided", {"param": wide[:, 0]}, {}, ValueError, "param is not contiguous"),
        ("grad_int", {"grad": torch.ones(N, dtype=torch.int32)}, {}, TypeError, "grad has dtype torch.int32"),
        ("grad_size", {"grad": torch.randn(N + 1)}, {}, ValueError, "grad has 38 elements but the param has 37"),
        ("grad_sparse", {"grad": torch.randn(N).to_sparse()}, {}, ValueError, "sparse_coo"),
        ("state_bf16", {"state": torch.zeros(N, dtype=torch.bfloat16)}, {}, TypeError, f"{state} has dtype"),
        ("state_size", {"state": torch.zeros(N - 1)}, {}, ValueError, f"{state} has 36 elements"),
        ("out_fp32", {"out_lowp": torch.empty(N)}, {}, TypeError, "out_lowp has dtype torch.float32"),
        ("out_size", {"out_lowp": torch.empty(N + 3, dtype=torch.bfloat16)}, {}, ValueError, "out_lowp has 40"),
        ("lr_negative", {}, {"lr": -1e-3}, ValueError, "Invalid learning rate"),
        ("lr_nan", {}, {"lr": float("nan")}, ValueError, "Invalid learning rate"),
        ("lr_str", {}, {"lr": "0.1"}, TypeError, "lr must be a number"),
        ("wd_negative", {}, {"weight_decay": -0.1}, ValueError, "Invalid weight_decay"),
        ("wd_inf", {}, {"weight_decay": math.inf}, ValueError, "Invalid weight_decay"),
        ("grad_scale_zero", {}, {"grad_scale": 0.0}, ValueError, "grad_scale must be finite and > 0"),
        ("grad_scale_nan", {}, {"grad_scale": float("nan")}, ValueError, "grad_scale must be finite and > 0"),
        ("threads_zero", {}, {"threads": 0}, ValueError, "threads must be in"),
        ("threads_float", {}, {"threads": 2.0}, TypeError, "threads must be an int"),
    ]


SGD_BAD = _buffer_cases("momentum_buffer") + [
    ("momentum_negative", {}, {"momentum": -0.5}, ValueError, "Invalid momentum value"),
    ("momentum_inf", {}, {"momentum": math.inf}, ValueError, "Invalid momentum value"),
    ("dampening_nan", {}, {"dampening": math.nan}, ValueError, "Invalid dampening value"),
    ("nesterov_without_momentum", {"state": None}, {"momentum": 0.0, "nesterov": True}, ValueError,
     "Nesterov momentum requires a momentum and zero dampening"),
    ("nesterov_with_dampening", {}, {"dampening": 0.1, "nesterov": True}, ValueError,
     "Nesterov momentum requires a momentum and zero dampening"),
    ("nesterov_int", {}, {"nesterov": 1}, TypeError, "nesterov must be a bool"),
    ("first_step_int", {}, {"first_step": 1}, TypeError, "first_step must be a bool"),
    ("first_step_missing", {}, {"first_step": None}, TypeError, "missing 1 required keyword-only argument: 'first_step'"),
    ("no_buffer_with_momentum", {"state": None}, {}, ValueError, "momentum_buffer is None but momentum=0.9"),
    ("buffer_is_param", {"state": "param"}, {}, ValueError, "share memory"),
    ("out_is_grad", {"out_lowp": "grad"}, {"grad_as": torch.bfloat16}, ValueError, "share memory"),
]

LION_BAD = _buffer_cases("exp_avg") + [
    ("beta1_above_one", {}, {"betas": (1.5, 0.99)}, ValueError, "Invalid beta parameter at index 0"),
    ("beta2_negative", {}, {"betas": (0.9, -0.1)}, ValueError, "Invalid beta parameter at index 1"),
    ("betas_single", {}, {"betas": (0.9,)}, TypeError, "betas must be a pair"),
    ("exp_avg_none", {"state": None}, {}, TypeError, "exp_avg must be a torch.Tensor"),
    ("exp_avg_is_param", {"state": "param"}, {}, ValueError, "share memory"),
]


def _call(fn, case, good):
    """Runs one bad call; checks the error and that no buffer changed."""
    _, overrides, kwargs, error, fragment = case
    buffers = _buffers()
    kwargs = {**good, **kwargs}
    grad_as = kwargs.pop("grad_as", None)
    if grad_as is not None:
        buffers["grad"] = buffers["grad"].to(grad_as)
    for key, value in overrides.items():  # "param" / "grad": that very buffer again
        buffers[key] = buffers[value] if isinstance(value, str) else value
    if kwargs.get("first_step", False) is None:
        kwargs.pop("first_step")
    before = {k: v.clone() for k, v in buffers.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
    with pytest.raises(error, match=fragment) as info:
        fn(buffers["param"], buffers["grad"], buffers["state"], buffers["out_lowp"], **kwargs)
    assert "\n" not in str(info.value), "one line"
    for key, value in before.items():
        now = buffers[key]
        now, value = (now.to_dense(), value.to_dense()) if now.is_sparse else (now, value)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[value.element_size()]
        assert torch.equal(now.view(bits), value.view(bits)), f"{key} changed"


@pytest.mark.parametrize("fn", [sgd_step, sgd_step_async], ids=["sync", "async"])
@pytest.mark.parametrize("case", SGD_BAD, ids=lambda case: case[0])
def test_sgd_rejects_and_leaves_buffers_untouched(fn, case):
    _call(fn, case, SGD_GOOD)


@pytest.mark.parametrize("fn", [lion_step, lion_step_async], ids=["sync", "async"])
@pytest.mark.parametrize("case", LION_BAD, ids=lambda case: case[0])
def test_lion_rejects_and_leaves_buffers_untouched(fn, case):
    _call(fn, case, LION_GOOD)


def test_hyper_checks_name_their_owner():
    with pytest.raises(ValueError, match=r"^SGD.lr=-1.0 is invalid: expected a finite lr >= 0$"):
        SgdHyper.checked(lr=-1.0, owner="SGD")
    with pytest.raises(ValueError, match=r"^SGD.nesterov=True is invalid: Nesterov momentum needs momentum > 0"):
        SgdHyper.checked(lr=0.1, nesterov=True, owner="SGD")
    with pytest.raises(ValueError, match=r"^Lion.betas\[1\]=2.0 is invalid: expected 0 <= beta <= 1$"):
        LionHyper.checked(lr=0.1, betas=(0.9, 2.0), owner="Lion")
    with pytest.raises(ValueError, match=r"^Lion.lr='x' is invalid: expected a finite number$"):
        LionHyper.checked(lr="x", owner="Lion")
    assert SgdHyper.checked(lr=torch.tensor(0.5), momentum=1).momentum == 1.0
    assert LionHyper.checked(lr=1e-4, betas=(1.0, 0.0)).beta1 == 1.0  # the closed range is allowed


def test_native_entry_points_recheck_what_python_checked():
    """The native calls also refuse what would be undefined behaviour (a caller bypassing Python)."""
    p = torch.zeros(8)
    common = dict(param=p.data_ptr(), grad=p.data_ptr(), numel=8, out=0, out_dtype=-1, lr=0.1,
                  grad_scale=1.0, threads=1)
    sgd = dict(common, momentum_buffer=0, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
               first_step=False)
    with pytest.raises(ValueError, match="grad dtype code"):
        _C.cpu_rules.sgd_step(**{**sgd, "grad_dtype": 7})
    with pytest.raises(ValueError, match="null buffer address"):
        _C.cpu_rules.sgd_step(**{**sgd, "grad_dtype": 0, "momentum": 0.9})
    with pytest.raises(ValueError, match="Nesterov"):
        _C.cpu_rules.sgd_step(**{**sgd, "grad_dtype": 0, "nesterov": True})
    with pytest.raises(ValueError, match="out and out_dtype"):
        _C.cpu_rules.lion_step(**{**common, "grad_dtype": 0, "exp_avg": p.data_ptr(), "beta1": 0.9, "beta2": 0.99,
                                  "weight_decay": 0.0, "out_dtype": 1})
    with pytest.raises(ValueError, match="grad_scale"):
        _C.cpu_rules.lion_step(**{**common, "grad_dtype": 0, "exp_avg": p.data_ptr(), "beta1": 0.9, "beta2": 0.99,
                                  "weight_decay": 0.0, "grad_scale": 0.0})
    assert torch.equal(p, torch.zeros(8))


def test_benchmark_script_checks_and_times(tmp_path):
    """benchmarks/bench_cpu_rules.py runs end to end (its checks against the references included) at
    a tiny size, the elementwise rules and the whole-param ones."""
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "rules.json"
    env = dict(os.environ)  # zero_offload as this process imports it (a CI install: site-packages)
    r = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_cpu_rules.py"), "--numel", "5000",
                        "--threads", "1", "--repeats", "20", "--warmup", "0", "--check-numel", "3001",
                        "--json-out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "check passed" in r.stdout and "| sgd | ours |" in r.stdout and "| lion | torch ops |" in r.stdout
    rows = json.loads(out.read_text())["results"]
    assert {(row["rule"], row["row"]) for row in rows} >= {("sgd", "torch fused"), ("lion", "ours + copy-out")}
    assert all(row["samples"] == 20 and row["median_ms"] > 0 for row in rows)
    r = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_cpu_rules.py"), "--rules", "adafactor,muon",
                        "--d-model", "48", "--layers", "1", "--threads", "1", "--repeats", "20", "--warmup", "0",
                        "--json-out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "check passed" in r.stdout and "| adafactor | ours + copy-out |" in r.stdout
    rows = json.loads(out.read_text())["results"]
    assert {(row["rule"], row["row"]) for row in rows} == {(rule, row) for rule in ("adafactor", "muon")
                                                           for row in ("ours + copy-out", "torch ops + out")}
    r = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_cpu_rules.py"), "--repeats", "5"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and "--repeats must be >= 20" in r.stderr
