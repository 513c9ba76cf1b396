"""The native kernels of the rules that need whole params (ops/cpu_rules.py): Adafactor's passes
equal ``torch.optim.Adafactor`` and Muon's host passes equal ``torch.optim.Muon``'s torch ops, on
every ISA path, with bf16/fp16 grads, loss-scale unscale, the copy-out, shapes with and without
a whole number of vectors per row, batches of matrices and vectors, several thread counts and
the async queue; every bad argument raises one clear line before any buffer changes.

Tolerances: Muon's passes are elementwise, so they equal torch's ops bit for bit (but in torch's
scalar tail, as test_cpu_rules.py's SGD and Lion). Adafactor's sums of squares are fp64 in a fixed
order where torch's are fp32 ([Note: Muon and Adafactor formula order] in
csrc/cpu_rules_kernel.h), so against torch.optim.Adafactor its params and factors are held to a
relative error (norm of the difference over the norm) of 1e-5 after 20 steps, and at least as
close as torch's to the same rule computed in float64; where no sum can differ (every square and
sum exact, the RMS floors eps2 and d in force) they are equal bit for bit."""
from __future__ import annotations

import math

import pytest
import torch

from _cpu_adam_util import each_isa, on_each_isa, torch_one_thread  # noqa: F401
from zero_offload import _C
from zero_offload.ops.cpu_adam import adam_step_async
from zero_offload.ops.cpu_rules import (AdafactorHyper, MuonHyper, adafactor_step, adafactor_step_async,
                                        muon_apply, muon_apply_async, muon_momentum, muon_momentum_async)
from zero_offload.runtime.rules import adafactor_state_shapes

GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEPS = 20
TORCH_TAIL = 64  # (test_cpu_rules.py: torch's last elements run through its scalar loop)

# ---- Adafactor --------------------------------------------------------------------------------

SHAPES = [(1,), (7,), (1037,), (1, 50), (50, 1), (64, 48), (33, 70), (3, 5, 17), (2, 3, 4, 5), (301, 997)]
"""Vectors and matrices, rows of a whole number of vectors (48) and not, one row, one column,
batches of matrices (3 and 4 dims), a matrix of many row blocks."""


def _state(shape) -> dict:
    return {k: torch.zeros(s) for k, s in adafactor_state_shapes(shape).items()}


def _flat(state: dict) -> dict:
    return {k: v.view(-1) for k, v in state.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def _run_adafactor(shape, *, grad_dtype=torch.float32, grad_scale=1.0, steps=STEPS, threads=None, seed=0,
                   grads=None, torch_dtype=torch.float32, **hyper):
    """Ours and torch.optim.Adafactor(foreach=False) over the same grads; returns (param, state,
    copy-out, torch's param, torch's state)."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(shape, generator=gen)
    param, state = start.clone(), _state(shape)
    out = torch.empty(shape, dtype=torch.bfloat16)
    ref = start.clone().to(torch_dtype).requires_grad_(True)
    eps = hyper.get("eps", (None, 1e-3))
    if torch_dtype is not torch.float32 and eps[0] is None:  # torch takes eps1 from the param's dtype
        hyper = {**hyper, "eps": (torch.finfo(torch.float32).eps, eps[1])}
    opt = torch.optim.Adafactor([ref], foreach=False, **{"lr": 1e-2, **hyper})
    for step in range(steps):
        if grads is None:
            grad = (torch.randn(shape, generator=gen) * grad_scale).to(grad_dtype)
        else:
            grad = grads(step, gen)
        adafactor_step(param.view(-1), grad.reshape(-1), **_flat(state), out_lowp=out.view(-1), shape=shape,
                       step=step + 1, grad_scale=grad_scale, threads=threads, **{"lr": 1e-2, **hyper})
        ref.grad = (grad.float() / grad_scale).to(torch_dtype)
        opt.step()
    theirs = opt.state[ref]
    ref_state = {k: theirs[k].reshape(v.shape) for k, v in state.items()}
    assert torch.equal(out, param.bfloat16()), "the copy-out is the rounded param"
    assert _rel(param, start) > 1e-4, "the param did not move: the comparison would prove nothing"
    return param, state, ref.detach(), ref_state


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_adafactor_matches_torch(each_isa, torch_one_thread, shape, grad_dtype):
    param, state, ref, ref_state = _run_adafactor(shape, grad_dtype=grad_dtype, grad_scale=1024.0,
                                                  weight_decay=0.01)
    assert _rel(param, ref) <= 1e-5, f"param {_rel(param, ref):.2e}"
    for k in state:
        assert _rel(state[k], ref_state[k]) <= 1e-5, f"{k} {_rel(state[k], ref_state[k]):.2e}"


HYPERS = {
    "defaults": dict(),
    "decay": dict(weight_decay=0.1, lr=0.05),
    "eps1": dict(eps=(1e-30, 1e-2)),
    "clip": dict(d=1.5, beta2_decay=-0.5),
    "no_floor": dict(eps=(0.0, 0.0), lr=1e-3),
}


@pytest.mark.parametrize("case", list(HYPERS))
@pytest.mark.parametrize("shape", [(37,), (33, 70), (3, 5, 17)], ids=str)
def test_adafactor_hyperparameters_match_torch(torch_one_thread, case, shape):
    param, state, ref, ref_state = _run_adafactor(shape, **HYPERS[case])
    assert _rel(param, ref) <= 1e-5
    for k in state:
        assert _rel(state[k], ref_state[k]) <= 1e-5, k


@pytest.mark.parametrize("shape", [(1037,), (64, 48), (301, 997), (3, 5, 17)], ids=str)
def test_adafactor_is_as_close_to_float64_as_torch(torch_one_thread, shape):
    """The same rule in float64 (torch.optim.Adafactor on a float64 copy): ours is no farther from
    it than torch's fp32 run, and within 1e-6."""
    ours, state, fp32, _ = _run_adafactor(shape, weight_decay=0.01)
    again, _, exact, exact_state = _run_adafactor(shape, weight_decay=0.01, torch_dtype=torch.float64)
    assert torch.equal(ours, again)  # (the same run twice: deterministic)
    assert _rel(ours, exact) <= 1e-6, f"{_rel(ours, exact):.2e}"
    assert _rel(ours, exact) <= 1.5 * _rel(fp32, exact) + 1e-7, (_rel(ours, exact), _rel(fp32, exact))
    for k in state:
        assert _rel(state[k], exact_state[k]) <= 1e-6, k


def _dyadic(shape):
    """Grads whose squares and every sum of them are exact in fp32 and fp64, in any order."""
    def grads(step, gen):
        return torch.randint(-8, 9, shape, generator=gen).float() / 16
    return grads


@pytest.mark.parametrize("shape", [(1037,), (1, 1000), (4, 1, 37)], ids=str)
@pytest.mark.parametrize("grad_scale", [1.0, 8.0])
def test_adafactor_equals_torch_bit_for_bit_where_no_sum_can_differ(each_isa, torch_one_thread, shape, grad_scale):
    """eps2 above the params' RMS and d above the update's: the step size is eps2 * rho, no norm
    enters it; a vector's variance is elementwise, and a matrix of one row has exact row and
    column sums (dyadic grads) and the mean of one row factor: every value is torch's."""
    grads = None if len(shape) == 1 else (lambda step, gen: _dyadic(shape)(step, gen) * grad_scale)
    param, state, ref, ref_state = _run_adafactor(shape, grads=grads, grad_scale=grad_scale, lr=1e-3,
                                                  eps=(None, 10.0), d=1e3, weight_decay=0.01)
    n = param.numel() - TORCH_TAIL
    assert torch.equal(param.flatten()[:n], ref.flatten()[:n])
    torch.testing.assert_close(param, ref, rtol=1e-6, atol=1e-7)
    for k in state:
        assert torch.equal(state[k], ref_state[k]), k


def test_adafactor_sums_do_not_depend_on_the_thread_count():
    """[Note: Adafactor's row blocks]: the same bits on 1, 2 and 5 threads (each ISA path), and
    within 1e-6 across the paths."""
    def run(threads):
        results = []
        for shape in [(257, 3001), (4099,), (2, 129, 65)]:
            param, state, _, _ = _run_adafactor(shape, grad_dtype=torch.bfloat16, steps=3,
                                                threads=threads, weight_decay=0.01)
            results.append(torch.cat([param.flatten(), *(v.flatten() for v in state.values())]))
        return torch.cat(results)

    per_isa = on_each_isa(lambda: [(threads, run(threads)) for threads in (1, 2, 5)])
    runs = [(name, threads, got) for name, per_thread in per_isa for threads, got in per_thread]
    for name, threads, got in runs:
        first = next(r for n, t, r in runs if n == name)
        assert torch.equal(got.view(torch.int32), first.view(torch.int32)), f"{name}/{threads} threads"
        assert _rel(got, runs[0][2]) <= 1e-6, f"{name} vs {runs[0][0]}"


def test_adafactor_async_equals_sync_and_keeps_the_queue_order():
    shape, gen = (65, 129), torch.Generator().manual_seed(4)
    grads = [torch.randn(shape, generator=gen).bfloat16().view(-1) for _ in range(3)]
    start = torch.randn(math.prod(shape), generator=gen)
    sync_p, sync_state = start.clone(), _flat(_state(shape))
    for step, grad in enumerate(grads):
        adafactor_step(sync_p, grad, **sync_state, shape=shape, step=step + 1, lr=0.01)
    p, state = start.clone(), _flat(_state(shape))
    out = torch.empty(p.numel(), dtype=torch.bfloat16)
    version = p._version
    tickets = [adafactor_step_async(p, grad, **state, out_lowp=out, shape=shape, step=step + 1, lr=0.01)
               for step, grad in enumerate(grads)]
    # an Adam step queued behind them sees their result (one queue, one order)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    tickets.append(adam_step_async(p, grads[0], m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                   weight_decay=0.0, adamw=True))
    for t in reversed(tickets):
        assert t.wait() >= 0
    adam_ref = sync_p.clone()
    from zero_offload.ops.cpu_adam import adam_step
    adam_step(adam_ref, grads[0], torch.zeros_like(p), torch.zeros_like(p), step=1, lr=1e-3, betas=(0.9, 0.999),
              eps=1e-8, weight_decay=0.0, adamw=True)
    assert torch.equal(p, adam_ref)
    for k in state:
        assert torch.equal(state[k], sync_state[k]), k
    assert p._version > version


def test_adafactor_without_elements():
    empty = torch.empty(0)
    assert adafactor_step(empty, empty, row_var=torch.empty(0), col_var=torch.empty(5), shape=(0, 5), step=1,
                          lr=0.1) == 0.0
    assert adafactor_step_async(empty, empty, variance=empty, shape=(0,), step=1, lr=0.1).wait() == 0.0


# ---- Muon's host passes -------------------------------------------------------------------------

SIZES = [1, 7, 17, 1037, 1_000_003]


def _assert_equal(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Bit for bit but in torch's scalar tail (rtol 1e-6 there; bf16 values: one bf16 ulp)."""
    body = max(0, ours.numel() - TORCH_TAIL)
    if not torch.equal(ours[:body], ref[:body]):
        bad = (ours[:body] != ref[:body]).nonzero().flatten()
        raise AssertionError(f"{what}: {bad.numel()} of {body} body elements differ, first at {bad[0].item()}")
    tol = 1e-2 if ours.dtype is torch.bfloat16 else 1e-6
    torch.testing.assert_close(ours[body:].float(), ref[body:].float(), rtol=tol, atol=tol, msg=f"{what}: tail")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("momentum,nesterov", [(0.95, True), (0.95, False), (0.3, True), (0.0, True)])
def test_muon_momentum_matches_torch(each_isa, torch_one_thread, size, grad_dtype, momentum, nesterov):
    """buf.lerp_(g, 1 - momentum); update = g.lerp(buf, momentum) or buf; update.bfloat16() (both
    branches of torch's lerp: weights below and above one half)."""
    gen = torch.Generator().manual_seed(size)
    buf = torch.randn(size, generator=gen)
    ref_buf = buf.clone()
    out = torch.empty(size, dtype=torch.bfloat16)
    for step in range(5):
        grad = (torch.randn(size, generator=gen) * 64).to(grad_dtype)
        muon_momentum(grad, buf, out, momentum=momentum, nesterov=nesterov, grad_scale=64.0)
        g = grad.float() / 64.0
        ref_buf.lerp_(g, 1 - momentum)
        update = g.lerp(ref_buf, momentum) if nesterov else ref_buf
        _assert_equal(buf, ref_buf, f"step {step} momentum_buffer")
        _assert_equal(out, update.bfloat16(), f"step {step} update")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_muon_apply_matches_torch(each_isa, torch_one_thread, size, out_dtype, weight_decay):
    """param.mul_(1 - lr * wd); param.add_(ortho, alpha=-adjusted_lr); the copy-out."""
    gen = torch.Generator().manual_seed(size)
    param = torch.randn(size, generator=gen)
    ref = param.clone()
    out = None if out_dtype is None else torch.empty(size, dtype=out_dtype)
    for step in range(5):
        ortho = torch.randn(size, generator=gen).bfloat16()
        muon_apply(param, ortho, out, lr=0.02, weight_decay=weight_decay, adjusted_lr=0.03)
        ref.mul_(1 - 0.02 * weight_decay)
        ref.add_(ortho, alpha=-0.03)
        _assert_equal(param, ref, f"step {step} param")
        if out is not None:
            assert torch.equal(out, param.to(out_dtype))


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_muon_passes_give_the_same_bits_on_every_path_and_thread_count(threads):
    size = 300_007

    def run():
        gen = torch.Generator().manual_seed(1)
        buf, param = torch.randn(size, generator=gen), torch.randn(size, generator=gen)
        update, out = torch.empty(size, dtype=torch.bfloat16), torch.empty(size, dtype=torch.float16)
        for _ in range(3):
            grad = torch.randn(size, generator=gen).half()
            muon_momentum(grad, buf, update, momentum=0.9, nesterov=True, grad_scale=8.0, threads=threads)
            muon_apply(param, update, out, lr=0.1, weight_decay=0.1, adjusted_lr=0.2, threads=threads)
        return torch.cat([buf, param, update.float(), out.float()])

    results = on_each_isa(run)
    for name, got in results[1:]:
        assert torch.equal(got.view(torch.int32), results[0][1].view(torch.int32)), f"{name} vs {results[0][0]}"


def test_muon_async_passes_run_in_queue_order():
    size = 70_001
    gen = torch.Generator().manual_seed(5)
    grad = torch.randn(size, generator=gen).bfloat16()
    buf, param = torch.randn(size, generator=gen), torch.randn(size, generator=gen)
    sync_buf, sync_param = buf.clone(), param.clone()
    update, sync_update = (torch.empty(size, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(2):
        muon_momentum(grad, sync_buf, sync_update, momentum=0.9, nesterov=True)
        muon_apply(sync_param, sync_update, lr=0.1, weight_decay=0.1, adjusted_lr=0.2)
    tickets = []
    for _ in range(2):  # the apply reads the update the momentum pass queued before it writes
        tickets.append(muon_momentum_async(grad, buf, update, momentum=0.9, nesterov=True))
        tickets.append(muon_apply_async(param, update, lr=0.1, weight_decay=0.1, adjusted_lr=0.2))
    for t in tickets:
        assert t.wait() >= 0
    assert torch.equal(buf, sync_buf) and torch.equal(param, sync_param) and torch.equal(update, sync_update)
    assert muon_momentum_async(torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.bfloat16),
                               momentum=0.9, nesterov=True).wait() == 0.0


# ---- bad arguments: one clear line, raised before any buffer changes ----------------------------

N = 12


def _af_buffers():
    gen = torch.Generator().manual_seed(0)
    return {"param": torch.randn(N, generator=gen), "grad": torch.randn(N, generator=gen),
            "row_var": torch.rand(3, generator=gen), "col_var": torch.rand(4, generator=gen), "variance": None,
            "out_lowp": torch.randn(N, generator=gen).bfloat16()}


AF_GOOD = dict(shape=(3, 4), step=1, lr=0.01)
AF_BAD = [
    ("param_bf16", {"param": torch.zeros(N, dtype=torch.bfloat16)}, {}, TypeError, "param has dtype torch.bfloat16"),
    ("param_strided", {"param": torch.zeros(N, 2)[:, 0]}, {}, ValueError, "param is not contiguous"),
    ("grad_size", {"grad": torch.zeros(N + 1)}, {}, ValueError, "grad has 13 elements but the param has 12"),
    ("shape_numel", {}, {"shape": (4, 4)}, ValueError, r"shape \(4, 4\) has 16 elements but the param has 12"),
    ("shape_kind", {}, {"shape": "3x4"}, TypeError, "shape must be a tuple of ints"),
    ("row_var_missing", {"row_var": None}, {}, TypeError, "row_var must be a torch.Tensor"),
    ("row_var_size", {"row_var": torch.zeros(4)}, {}, ValueError, "row_var has 4 elements but a param of shape"),
    ("col_var_fp16", {"col_var": torch.zeros(4, dtype=torch.float16)}, {}, TypeError, "col_var has dtype"),
    ("variance_for_a_matrix", {"variance": torch.zeros(N)}, {}, ValueError, "variance is given for a param of shape"),
    ("factors_for_a_vector", {"variance": torch.zeros(N)}, {"shape": (N,)}, ValueError,
     r"row_var/col_var are given for a param of shape \(12,\)"),
    ("variance_missing", {"row_var": None, "col_var": None}, {"shape": (N,)}, TypeError,
     "variance must be a torch.Tensor"),
    ("state_is_param", {"row_var": "param", "col_var": torch.zeros(1)}, {"shape": (N, 1)}, ValueError,
     "share memory"),
    ("out_is_grad", {"out_lowp": "grad"}, {"grad_as": torch.bfloat16}, ValueError, "share memory"),
    ("step_zero", {}, {"step": 0}, ValueError, "step must be a whole number >= 1"),
    ("step_fraction", {}, {"step": 1.5}, ValueError, "step must be a whole number >= 1"),
    ("lr_negative", {}, {"lr": -1.0}, ValueError, "Invalid learning rate"),
    ("beta2_decay_positive", {}, {"beta2_decay": 0.5}, ValueError, "beta2_decay should be <= 0"),
    ("eps_single", {}, {"eps": 1e-3}, TypeError, "eps must be a pair"),
    ("eps1_negative", {}, {"eps": (-1.0, 1e-3)}, ValueError, "epsilon1 should be >= 0"),
    ("eps2_nan", {}, {"eps": (None, math.nan)}, ValueError, "epsilon2 should be >= 0"),
    ("d_below_one", {}, {"d": 0.5}, ValueError, "Clipping threshold d should be >= 1"),
    ("wd_negative", {}, {"weight_decay": -0.1}, ValueError, "weight_decay should be >= 0"),
    ("grad_scale_zero", {}, {"grad_scale": 0.0}, ValueError, "grad_scale must be finite and > 0"),
    ("threads_zero", {}, {"threads": 0}, ValueError, "threads must be in"),
]


def _check_untouched(fn, buffers, kwargs, error, fragment):
    before = {k: v.clone() for k, v in buffers.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=fragment) as info:
        fn(**buffers, **kwargs)
    assert "\n" not in str(info.value), "one line"
    for key, value in before.items():
        bits = {2: torch.int16, 4: torch.int32}[value.element_size()]
        assert torch.equal(buffers[key].view(bits), value.view(bits)), f"{key} changed"


@pytest.mark.parametrize("fn", [adafactor_step, adafactor_step_async], ids=["sync", "async"])
@pytest.mark.parametrize("case", AF_BAD, ids=lambda case: case[0])
def test_adafactor_rejects_and_leaves_buffers_untouched(fn, case):
    _, overrides, kwargs, error, fragment = case
    buffers = _af_buffers()
    kwargs = {**AF_GOOD, **kwargs}
    grad_as = kwargs.pop("grad_as", None)
    if grad_as is not None:
        buffers["grad"] = buffers["grad"].to(grad_as)
    for key, value in overrides.items():
        buffers[key] = buffers[value] if isinstance(value, str) else value
    _check_untouched(lambda param, grad, **kw: fn(param, grad, **kw), buffers, kwargs, error, fragment)


def _muon_buffers():
    gen = torch.Generator().manual_seed(0)
    return {"grad": torch.randn(N, generator=gen), "momentum_buffer": torch.randn(N, generator=gen),
            "out": torch.randn(N, generator=gen).bfloat16()}


MUON_MOMENTUM_BAD = [
    ("out_fp32", {"out": torch.zeros(N)}, {}, TypeError, "out has dtype torch.float32"),
    ("out_size", {"out": torch.zeros(N + 1, dtype=torch.bfloat16)}, {}, ValueError, "out has 13 elements"),
    ("buffer_bf16", {"momentum_buffer": torch.zeros(N, dtype=torch.bfloat16)}, {}, TypeError,
     "momentum_buffer has dtype"),
    ("grad_size", {"grad": torch.zeros(N - 1)}, {}, ValueError, "grad has 11 elements"),
    ("out_is_grad", {"out": "grad"}, {"grad_as": torch.bfloat16}, ValueError, "share memory"),
    ("momentum_negative", {}, {"momentum": -0.1}, ValueError, "Momentum should be >= 0"),
    ("nesterov_int", {}, {"nesterov": 1}, TypeError, "nesterov must be a bool"),
    ("grad_scale_inf", {}, {"grad_scale": math.inf}, ValueError, "grad_scale must be finite and > 0"),
]


@pytest.mark.parametrize("fn", [muon_momentum, muon_momentum_async], ids=["sync", "async"])
@pytest.mark.parametrize("case", MUON_MOMENTUM_BAD, ids=lambda case: case[0])
def test_muon_momentum_rejects_and_leaves_buffers_untouched(fn, case):
    _, overrides, kwargs, error, fragment = case
    buffers = _muon_buffers()
    kwargs = {"momentum": 0.9, "nesterov": True, **kwargs}
    grad_as = kwargs.pop("grad_as", None)
    if grad_as is not None:
        buffers["grad"] = buffers["grad"].to(grad_as)
    for key, value in overrides.items():
        buffers[key] = buffers[value] if isinstance(value, str) else value
    _check_untouched(fn, buffers, kwargs, error, fragment)


MUON_APPLY_BAD = [
    ("ortho_fp32", {"ortho": torch.zeros(N)}, {}, TypeError, "ortho has dtype torch.float32"),
    ("ortho_size", {"ortho": torch.zeros(N + 2, dtype=torch.bfloat16)}, {}, ValueError, "ortho has 14 elements"),
    ("out_is_ortho", {"out_lowp": "ortho"}, {}, ValueError, "share memory"),
    ("adjusted_lr_negative", {}, {"adjusted_lr": -1.0}, ValueError, "adjusted_lr must be finite and >= 0"),
    ("wd_nan", {}, {"weight_decay": math.nan}, ValueError, "Weight decay should be >= 0"),
]


@pytest.mark.parametrize("fn", [muon_apply, muon_apply_async], ids=["sync", "async"])
@pytest.mark.parametrize("case", MUON_APPLY_BAD, ids=lambda case: case[0])
def test_muon_apply_rejects_and_leaves_buffers_untouched(fn, case):
    _, overrides, kwargs, error, fragment = case
    gen = torch.Generator().manual_seed(0)
    buffers = {"param": torch.randn(N, generator=gen), "ortho": torch.randn(N, generator=gen).bfloat16(),
               "out_lowp": torch.randn(N, generator=gen).bfloat16()}
    for key, value in overrides.items():
        buffers[key] = buffers[value] if isinstance(value, str) else value
    kwargs = {"lr": 0.1, "weight_decay": 0.1, "adjusted_lr": 0.2, **kwargs}
    _check_untouched(fn, buffers, kwargs, error, fragment)


def test_hyper_checks_name_their_owner():
    with pytest.raises(ValueError, match=r"^Adafactor.d=0.5 is invalid: expected a finite d >= 1$"):
        AdafactorHyper.checked(lr=0.1, d=0.5, owner="Adafactor")
    with pytest.raises(ValueError, match=r"^Adafactor.eps=0.001 is invalid: expected a pair"):
        AdafactorHyper.checked(lr=0.1, eps=1e-3, owner="Adafactor")
    with pytest.raises(ValueError, match=r"^Muon.momentum=-1.0 is invalid: expected a finite momentum >= 0$"):
        MuonHyper.checked(momentum=-1.0, owner="Muon")
    assert AdafactorHyper.checked(lr=torch.tensor(0.5)).eps1 is None


def test_native_entry_points_recheck_what_python_checked():
    """The native calls also refuse what would be undefined behaviour (a caller bypassing Python)."""
    p = torch.zeros(12)
    af = dict(param=p.data_ptr(), grad=p.data_ptr(), grad_dtype=0, row_var=p.data_ptr(), col_var=p.data_ptr(),
              variance=0, batch=1, rows=3, cols=4, out=0, out_dtype=-1, step=1.0, lr=0.1, beta2_decay=-0.8,
              eps1=1e-30, eps2=1e-3, d=1.0, weight_decay=0.0, grad_scale=1.0, threads=1)
    with pytest.raises(ValueError, match="a factored param takes row_var and col_var"):
        _C.cpu_rules.adafactor_step(**{**af, "variance": p.data_ptr()})
    with pytest.raises(ValueError, match="a factored param takes row_var and col_var"):
        _C.cpu_rules.adafactor_step(**{**af, "col_var": 0})
    with pytest.raises(ValueError, match="step must be finite and >= 1"):
        _C.cpu_rules.adafactor_step(**{**af, "step": 0.0})
    with pytest.raises(ValueError, match="batch, rows and cols must be >= 0"):
        _C.cpu_rules.adafactor_step(**{**af, "rows": -3})
    with pytest.raises(ValueError, match="null buffer address"):
        _C.cpu_rules.adafactor_step(**{**af, "param": 0})
    mm = dict(grad=p.data_ptr(), grad_dtype=0, momentum_buffer=0, numel=12, out=p.data_ptr(), momentum=0.9,
              nesterov=True, grad_scale=1.0, threads=1)
    with pytest.raises(ValueError, match="null buffer address"):
        _C.cpu_rules.muon_momentum(**mm)
    with pytest.raises(ValueError, match="grad dtype code"):
        _C.cpu_rules.muon_momentum(**{**mm, "grad_dtype": 5})
    with pytest.raises(ValueError, match="out and out_dtype"):
        _C.cpu_rules.muon_apply(param=p.data_ptr(), ortho=p.data_ptr(), numel=12, out=0, out_dtype=1, lr=0.1,
                                weight_decay=0.0, adjusted_lr=0.1, threads=1)
    assert torch.equal(p, torch.zeros(12))
