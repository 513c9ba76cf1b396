"""Bad input to CPUAdam / adam_step / grad_sumsq / grad_nonfinite raises a clear TypeError,
ValueError or NotImplementedError naming the problem, and leaves params and state untouched."""
import pytest
import torch

from _cpu_adam_util import TORCH_HAS_GRAD_DTYPE
from zero_offload.cpu_adam import CPUAdam, CPUAdamW, adam_step, grad_nonfinite, grad_sumsq

N = 37
GOOD = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=False)


def _buffers():
    gen = torch.Generator().manual_seed(0)
    return {
        "param": torch.randn(N, generator=gen),
        "grad": torch.randn(N, generator=gen),
        "exp_avg": torch.randn(N, generator=gen),
        "exp_avg_sq": torch.rand(N, generator=gen),
    }


def _bad_flat_calls():
    """(id, buffer overrides, keyword overrides, exception, message fragment)"""
    wide = torch.randn(N, 2)
    return [
        ("param_fp64", {"param": torch.randn(N, dtype=torch.float64)}, {}, TypeError, "param has dtype torch.float64"),
        ("param_not_tensor", {"param": [0.0] * N}, {}, TypeError, "param must be a torch.Tensor"),
        ("param_meta", {"param": torch.empty(N, device="meta")}, {}, ValueError, "CPU tensors only"),
        ("grad_int", {"grad": torch.ones(N, dtype=torch.int32)}, {}, TypeError, "grad has dtype torch.int32"),
        ("grad_size", {"grad": torch.randn(N + 1)}, {}, ValueError, "grad has 38 elements but the param has 37"),
        ("grad_strided", {"grad": wide[:, 0]}, {}, ValueError, "grad is not contiguous"),
        ("grad_sparse", {"grad": torch.randn(N).to_sparse()}, {}, ValueError, "sparse_coo"),
        ("exp_avg_bf16", {"exp_avg": torch.zeros(N, dtype=torch.bfloat16)}, {}, TypeError, "exp_avg has dtype"),
        ("exp_avg_sq_size", {"exp_avg_sq": torch.zeros(N - 1)}, {}, ValueError, "exp_avg_sq has 36 elements"),
        ("out_fp32", {}, {"out_lowp": torch.empty(N)}, TypeError, "out_lowp has dtype torch.float32"),
        ("out_size", {}, {"out_lowp": torch.empty(N + 3, dtype=torch.bfloat16)}, ValueError, "out_lowp has 40"),
        ("step_zero", {}, {"step": 0}, ValueError, "step must be a whole number >= 1"),
        ("step_fraction", {}, {"step": 1.5}, ValueError, "step must be a whole number >= 1"),
        ("step_str", {}, {"step": "1"}, TypeError, "step must be an int"),
        ("lr_negative", {}, {"lr": -1e-3}, ValueError, "Invalid learning rate"),
        ("lr_nan", {}, {"lr": float("nan")}, ValueError, "Invalid learning rate"),
        ("beta2_one", {}, {"betas": (0.9, 1.0)}, ValueError, "Invalid beta parameter at index 1"),
        ("betas_single", {}, {"betas": (0.9,)}, TypeError, "betas must be a pair"),
        ("eps_negative", {}, {"eps": -1.0}, ValueError, "Invalid epsilon"),
        ("wd_negative", {}, {"weight_decay": -0.1}, ValueError, "Invalid weight_decay"),
        ("adamw_str", {}, {"adamw": "yes"}, TypeError, "adamw must be a bool"),
        ("grad_scale_zero", {}, {"grad_scale": 0.0}, ValueError, "grad_scale must be finite and > 0"),
        ("grad_scale_inf", {}, {"grad_scale": float("inf")}, ValueError, "grad_scale must be finite and > 0"),
        ("threads_zero", {}, {"threads": 0}, ValueError, "threads must be in"),
        ("threads_float", {}, {"threads": 2.0}, TypeError, "threads must be an int"),
    ]


@pytest.mark.parametrize("case", _bad_flat_calls(), ids=lambda case: case[0])
def test_adam_step_rejects_and_leaves_buffers_untouched(case):
    _, overrides, kwargs, error, fragment = case
    buffers = {**_buffers(), **overrides}
    before = {k: v.clone() for k, v in buffers.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
    out = kwargs.get("out_lowp")
    out_before = None if out is None else out.clone()
    with pytest.raises(error, match=fragment):
        adam_step(buffers["param"], buffers["grad"], buffers["exp_avg"], buffers["exp_avg_sq"], **{**GOOD, **kwargs})
    for key, value in before.items():
        assert torch.equal(buffers[key].to_dense() if buffers[key].is_sparse else buffers[key],
                           value.to_dense() if value.is_sparse else value), key
    if out is not None:  # compare bits: an uninitialised buffer may hold NaNs (NaN != NaN)
        bits = torch.int16 if out.dtype.itemsize == 2 else torch.int32
        assert torch.equal(out.view(bits), out_before.view(bits))


def test_adam_step_rejects_shared_memory():
    b = _buffers()
    before = b["param"].clone()
    with pytest.raises(ValueError, match="share memory"):
        adam_step(b["param"], b["grad"], b["param"], b["exp_avg_sq"], **GOOD)
    halves = torch.zeros(2 * N)
    with pytest.raises(ValueError, match="share memory"):
        adam_step(b["param"], b["grad"], halves[:N], halves[N - 1:2 * N - 1], **GOOD)
    assert torch.equal(b["param"], before)


@pytest.mark.parametrize("fn", [grad_sumsq, grad_nonfinite])
def test_grad_reductions_reject_bad_grads(fn):
    with pytest.raises(TypeError, match="grad has dtype torch.float64"):
        fn(torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        fn(torch.ones(8, 2)[:, 1])
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        fn([1.0, 2.0])
    with pytest.raises(ValueError, match="threads"):
        fn(torch.ones(8), threads=-1)


def test_grad_sumsq_rejects_bad_scale():
    with pytest.raises(ValueError, match="grad_scale"):
        grad_sumsq(torch.ones(8), grad_scale=-2.0)


@pytest.mark.parametrize("option", ["amsgrad", "maximize", "capturable", "differentiable"])
@pytest.mark.parametrize("cls", [CPUAdam, CPUAdamW])
def test_unsupported_options_raise_not_implemented(cls, option):
    with pytest.raises(NotImplementedError, match=f"does not implement {option}=True"):
        if option == "amsgrad":
            cls([torch.zeros(3, requires_grad=True)], amsgrad=True)
        else:
            cls([torch.zeros(3, requires_grad=True)], **{option: True})


@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(lr=-1.0), ValueError, "Invalid learning rate"),
    (dict(betas=(1.0, 0.999)), ValueError, "index 0"),
    (dict(eps=-1e-8), ValueError, "Invalid epsilon"),
    (dict(weight_decay=-1.0), ValueError, "Invalid weight_decay"),
    (dict(threads=0), ValueError, "threads must be in"),
    (dict(threads="4"), TypeError, "threads must be an int"),
])
def test_constructor_rejects_bad_hyperparameters(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        CPUAdam([torch.zeros(3, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("param, error, fragment", [
    (torch.zeros(3, dtype=torch.float64, requires_grad=True), TypeError, "params\\[0\\] has dtype torch.float64"),
    (torch.zeros(1, 3).expand(4, 3).requires_grad_(), ValueError, "overlaps itself or has gaps"),
    (torch.zeros(4, 8)[:, ::2].requires_grad_(), ValueError, "overlaps itself or has gaps"),
    (torch.zeros(3, device="meta", requires_grad=True), ValueError, "CPU tensors only"),
])
def test_constructor_rejects_bad_params(param, error, fragment):
    with pytest.raises(error, match=fragment):
        CPUAdam([param])


def _snapshot(opt, params):
    return ([p.detach().clone() for p in params],
            {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params if p in opt.state})


def _assert_unchanged(opt, params, snapshot):
    values, state = snapshot
    for p, before in zip(params, values):
        assert torch.equal(p.detach(), before)
    for p in params:
        if id(p) in state:
            for key, value in state[id(p)].items():
                assert torch.equal(opt.state[p][key], value), key
        else:
            assert p not in opt.state or not opt.state[p]


def _trained():
    params = [torch.randn(N, requires_grad=True), torch.randn(5, 3, requires_grad=True),
              torch.randn(9, requires_grad=True)]
    opt = CPUAdam(params[:2], lr=1e-2)
    opt.add_param_group({"params": params[2:], "lr": 1e-3})
    for p in params[:2]:  # params[2] gets no grad: no state yet
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    return opt, params


def _bad_grad(kind, p):
    if kind == "fp64":
        p.grad_dtype = None
        return torch.randn(p.shape, dtype=torch.float64), TypeError, "grad has dtype torch.float64"
    if kind == "sparse":
        return torch.randn(p.shape).to_sparse(), ValueError, "use torch.optim.SparseAdam"
    raise AssertionError(kind)


@pytest.mark.parametrize("index", [0, 2])
@pytest.mark.parametrize("kind", ["fp64", "sparse"])
def test_step_with_a_bad_grad_changes_nothing(kind, index):
    """One bad grad anywhere: no param, moment or step counter changes, in any group."""
    if kind == "fp64" and not TORCH_HAS_GRAD_DTYPE:
        pytest.skip("this torch cannot give an fp32 param an fp64 grad")
    opt, params = _trained()
    grad, error, fragment = _bad_grad(kind, params[index])
    params[index].grad = grad
    snapshot = _snapshot(opt, params)
    with pytest.raises(error, match=fragment):
        opt.step()
    _assert_unchanged(opt, params, snapshot)
    assert params[2] not in opt.state


@pytest.mark.parametrize("key, value, error, fragment", [
    ("exp_avg", torch.zeros(N, dtype=torch.float16), TypeError, "state\\['exp_avg'\\] has dtype torch.float16"),
    ("exp_avg_sq", torch.zeros(N + 1), ValueError, "state\\['exp_avg_sq'\\] has 38 elements"),
    ("step", torch.tensor(-3.0), ValueError, "step must be a whole number"),
])
def test_step_with_corrupt_state_changes_nothing(key, value, error, fragment):
    opt, params = _trained()
    opt.state[params[0]][key] = value
    snapshot = _snapshot(opt, params)
    with pytest.raises(error, match=fragment):
        opt.step()
    _assert_unchanged(opt, params, snapshot)


def test_step_with_unsupported_group_option_changes_nothing():
    opt, params = _trained()
    opt.param_groups[1]["amsgrad"] = True
    snapshot = _snapshot(opt, params)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        opt.step()
    _assert_unchanged(opt, params, snapshot)


def test_add_param_group_rejects_without_adding():
    opt, params = _trained()
    groups_before = len(opt.param_groups)
    with pytest.raises(TypeError, match="dtype torch.float64"):
        opt.add_param_group({"params": [torch.zeros(3, dtype=torch.float64, requires_grad=True)]})
    with pytest.raises(NotImplementedError, match="maximize"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)], "maximize": True})
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)], "lr": -2.0})
    assert len(opt.param_groups) == groups_before


def test_load_state_dict_with_amsgrad_is_rejected_before_loading():
    params = [torch.zeros(4, requires_grad=True)]
    torch_opt = torch.optim.Adam(params, amsgrad=True)
    params[0].grad = torch.ones(4)
    torch_opt.step()
    opt, own = _trained()
    snapshot = _snapshot(opt, own)
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(NotImplementedError, match="param_groups\\[0\\].*amsgrad"):
        opt.load_state_dict(torch_opt.state_dict())
    _assert_unchanged(opt, own, snapshot)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in groups]
