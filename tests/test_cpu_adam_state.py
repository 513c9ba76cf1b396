"""CPUAdam as a torch.optim.Optimizer: state dicts that load both ways with torch's Adam/AdamW,
param groups, add_param_group, zero_grad, closures and lr schedulers."""
import io

import pytest
import torch

from _cpu_adam_util import assert_matches_torch, torch_fused, torch_one_thread  # noqa: F401
from zero_offload.cpu_adam import CPUAdam, CPUAdamW

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SHAPES = [(33, 7), (129,), (5, 4, 3)]


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in SHAPES]


def _grads(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _train(opt, params, steps, first=0):
    for step in range(first, first + steps):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()


def _roundtrip(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("adamw", [False, True])
def test_state_dict_keys_and_shapes_as_torch(adamw):
    ours_params, ref_params = _params(), _params()
    ours = (CPUAdamW if adamw else CPUAdam)(ours_params, lr=1e-2)
    ref = torch_fused(ref_params, adamw=adamw, lr=1e-2)
    _train(ours, ours_params, 3)
    _train(ref, ref_params, 3)
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert set(ours_sd) == set(ref_sd) == {"state", "param_groups"}
    assert set(ours_sd["param_groups"][0]) == set(ref_sd["param_groups"][0])
    for index in ref_sd["state"]:
        ours_state, ref_state = ours_sd["state"][index], ref_sd["state"][index]
        assert set(ours_state) == set(ref_state) == {"step", "exp_avg", "exp_avg_sq"}
        assert torch.is_tensor(ours_state["step"]) and ours_state["step"].shape == ()
        assert ours_state["step"].dtype == ref_state["step"].dtype == torch.float32
        assert float(ours_state["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours_state[key].shape == ref_state[key].shape == SHAPES[index]
            assert_matches_torch(ours_state[key], ref_state[key], f"state {index} {key}")


@pytest.mark.parametrize("adamw", [False, True])
def test_torch_state_loads_into_cpu_adam(adamw):
    """torch trains 4 steps, CPUAdam resumes from its state dict; both continue 4 more steps."""
    torch_params, ours_params = _params(), _params()
    ref = torch_fused(torch_params, adamw=adamw, lr=1e-2, weight_decay=0.05)
    _train(ref, torch_params, 4)
    with torch.no_grad():
        for mine, theirs in zip(ours_params, torch_params):
            mine.copy_(theirs)
    ours = (CPUAdamW if adamw else CPUAdam)(ours_params, lr=1.0, weight_decay=0.0)  # overwritten by load
    ours.load_state_dict(_roundtrip(ref.state_dict()))
    assert ours.param_groups[0]["lr"] == 1e-2 and ours.param_groups[0]["weight_decay"] == 0.05
    _train(ref, torch_params, 4, first=4)
    _train(ours, ours_params, 4, first=4)
    for index, (mine, theirs) in enumerate(zip(ours_params, torch_params)):
        assert_matches_torch(mine.detach(), theirs.detach(), f"param {index}")
        assert float(ours.state[mine]["step"]) == 8.0


@pytest.mark.parametrize("adamw", [False, True])
def test_cpu_adam_state_loads_into_torch(adamw):
    ours_params, torch_params = _params(), _params()
    ours = (CPUAdamW if adamw else CPUAdam)(ours_params, lr=1e-2, weight_decay=0.05)
    _train(ours, ours_params, 4)
    with torch.no_grad():
        for theirs, mine in zip(torch_params, ours_params):
            theirs.copy_(mine)
    ref = torch_fused(torch_params, adamw=adamw)
    ref.load_state_dict(_roundtrip(ours.state_dict()))
    _train(ours, ours_params, 4, first=4)
    _train(ref, torch_params, 4, first=4)
    for index, (mine, theirs) in enumerate(zip(ours_params, torch_params)):
        assert_matches_torch(mine.detach(), theirs.detach(), f"param {index}")


def test_non_fused_torch_state_loads_too():
    """torch's default (foreach) Adam keeps the same state layout; its state loads and runs."""
    torch_params, ours_params = _params(), _params()
    ref = torch.optim.Adam(torch_params, lr=1e-2)
    _train(ref, torch_params, 2)
    ours = CPUAdam(ours_params)
    ours.load_state_dict(_roundtrip(ref.state_dict()))
    assert ours.param_groups[0]["fused"] is True  # [Note: groups record fused=True]
    expected = 0.9 * ref.state[torch_params[0]]["exp_avg"] + 0.1 * _grads(2)[0]
    _train(ours, ours_params, 1, first=2)
    assert float(ours.state[ours_params[0]]["step"]) == 3.0
    torch.testing.assert_close(ours.state[ours_params[0]]["exp_avg"], expected)


def test_param_groups_and_add_param_group():
    ours_params, ref_params = _params(), _params()
    groups = lambda ps: [{"params": ps[:1], "lr": 1e-1, "weight_decay": 0.2}, {"params": ps[1:2]}]  # noqa: E731
    ours = CPUAdamW(groups(ours_params), lr=1e-2)
    ref = torch_fused(groups(ref_params), adamw=True, lr=1e-2)
    _train(ours, ours_params, 3)
    _train(ref, ref_params, 3)
    assert ours_params[2] not in ours.state  # not in any group yet: untouched
    ours.add_param_group({"params": [ours_params[2]], "betas": (0.5, 0.9)})
    ref.add_param_group({"params": [ref_params[2]], "betas": (0.5, 0.9)})
    assert ours.param_groups[2]["betas"] == (0.5, 0.9) and ours.param_groups[2]["lr"] == 1e-2
    _train(ours, ours_params, 3, first=3)
    _train(ref, ref_params, 3, first=3)
    for index, (mine, theirs) in enumerate(zip(ours_params, ref_params)):
        assert_matches_torch(mine.detach(), theirs.detach(), f"param {index}")


def test_params_without_grad_are_skipped_and_zero_grad_clears():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = CPUAdam(params, lr=1e-2)
    params[0].grad = torch.ones(SHAPES[0])
    opt.step()
    assert not torch.equal(params[0], before[0])
    assert torch.equal(params[1], before[1]) and torch.equal(params[2], before[2])
    assert params[1] not in opt.state and params[2] not in opt.state
    opt.zero_grad()
    assert params[0].grad is None
    opt.step()  # nothing has a grad: nothing changes
    assert float(opt.state[params[0]]["step"]) == 1.0


def test_closure_is_called_with_grad_enabled_and_its_loss_returned():
    weight = torch.zeros(3, requires_grad=True)
    opt = CPUAdam([weight], lr=0.1)
    target = torch.tensor([1.0, -2.0, 3.0])

    def closure():
        opt.zero_grad()
        loss = ((weight - target) ** 2).sum()
        loss.backward()
        return loss

    first = opt.step(closure)
    assert first.item() == pytest.approx(14.0)
    for _ in range(300):
        loss = opt.step(closure)
    assert loss.item() < 1e-2  # it actually optimises


def test_lr_scheduler_takes_effect():
    ours_params, ref_params = _params(), _params()
    ours = CPUAdam(ours_params, lr=1e-1)
    ref = torch_fused(ref_params, adamw=False, lr=1e-1)
    ours_sched = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.1)
    for step in range(6):
        _train(ours, ours_params, 1, first=step)
        _train(ref, ref_params, 1, first=step)
        ours_sched.step()
        ref_sched.step()
    assert ours.param_groups[0]["lr"] == pytest.approx(1e-4)
    for index, (mine, theirs) in enumerate(zip(ours_params, ref_params)):
        assert_matches_torch(mine.detach(), theirs.detach(), f"param {index}")
    # and a schedule that zeroes the lr stops all movement
    zero = torch.optim.lr_scheduler.LambdaLR(ours, lambda epoch: 0.0)
    zero.step()
    frozen = [p.detach().clone() for p in ours_params]
    _train(ours, ours_params, 2, first=10)
    assert all(torch.equal(a, b) for a, b in zip(ours_params, frozen))


def test_tensor_lr_and_threads_option():
    params = _params()
    ref_params = _params()
    ours = CPUAdam(params, lr=torch.tensor(0.01), threads=1)
    ref = torch_fused(ref_params, adamw=False, lr=0.01)
    assert ours.threads == 1
    _train(ours, params, 3)
    _train(ref, ref_params, 3)
    for mine, theirs in zip(params, ref_params):
        assert_matches_torch(mine.detach(), theirs.detach(), "tensor lr")
