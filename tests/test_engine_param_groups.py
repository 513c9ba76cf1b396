"""Param groups with their own hyperparameters (no decay on biases, another lr for one layer):
the engine equals torch.optim.AdamW built with the same groups, an lr scheduler drives each group,
checkpoints keep them, and bad groups are refused before anything changes."""
import copy

import pytest
import torch

import zero_offload as zo
from zero_offload.runtime.checkpoint import CheckpointError
from _engine_util import DEVICE, assert_params_close, config, mlp, mlp_batches, mlp_loss


def groups_of(model, *, by_name: bool):
    biases = [n for n, _ in model.named_parameters() if n.endswith("bias")]
    params = dict(model.named_parameters())
    fc3 = [params["fc3.weight"]]
    return [{"params": biases if by_name else [params[n] for n in biases], "weight_decay": 0.0},
            {"params": fc3, "lr": 3e-3, "betas": (0.8, 0.99)}]


def torch_reference(model, spec, *, scheduler=None):
    ref = copy.deepcopy(model).to(DEVICE)
    named = dict(ref.named_parameters())
    biases = [named[n] for n in named if n.endswith("bias")]
    rest = [p for n, p in named.items() if not n.endswith("bias") and n != "fc3.weight"]
    opt = torch.optim.AdamW([{"params": rest},
                             {"params": biases, "weight_decay": 0.0},
                             {"params": [named["fc3.weight"]], "lr": 3e-3, "betas": (0.8, 0.99)}],
                            lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                            foreach=False)
    return ref, opt, scheduler(opt) if scheduler is not None else None


def ref_step(ref, opt, sched, batch):
    loss = mlp_loss(ref, tuple(t.to(DEVICE) for t in batch))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()
    return loss.item()


@pytest.mark.parametrize("placement", [("cpu", "cpu"), ("gpu", "cpu"), ("cpu", "nvme")])
@pytest.mark.parametrize("by_name", [False, True])
def test_groups_match_torch(placement, by_name, tmp_path):
    spec = zo.AdamW(lr=1e-2, weight_decay=0.5)
    model = mlp()
    ref, opt, _ = torch_reference(model, spec)
    params, optimizer = placement
    engine = zo.initialize(model, optimizer=spec, device=DEVICE,
                           config=config(params=params, optimizer=optimizer,
                                         nvme_dir=str(tmp_path) if optimizer == "nvme" else None),
                           param_groups=groups_of(model, by_name=by_name))
    try:
        assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.5, 0.0, 0.5]
        for b in mlp_batches(20):
            loss = mlp_loss(engine, b)
            engine.backward(loss)
            engine.step()
            assert abs(loss.item() - ref_step(ref, opt, None, b)) <= 1e-5 * max(1.0, abs(loss.item()))
        assert_params_close(engine.state_dict(), {k: v.detach().cpu() for k, v in ref.state_dict().items()},
                            rtol=1e-5)
        # The groups matter: without them the biases would have decayed.
        plain = mlp()
        e2 = zo.initialize(plain, optimizer=spec, device=DEVICE, config=config())
        try:
            for b in mlp_batches(20):
                loss = mlp_loss(e2, b)
                e2.backward(loss)
                e2.step()
            diff = (e2.state_dict()["fc1.bias"] - engine.state_dict()["fc1.bias"]).abs().max()
            assert diff > 1e-4
        finally:
            e2.close()
    finally:
        engine.close()


def test_scheduler_drives_each_group():
    spec = zo.AdamW(lr=1e-2, weight_decay=0.1)

    def sched(o):
        return torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.9 ** s, lambda s: 1.0, lambda s: 1 / (1 + s)])

    model = mlp()
    ref, opt, ref_sched = torch_reference(model, spec, scheduler=sched)
    engine = zo.initialize(model, optimizer=spec, device=DEVICE, config=config(), lr_scheduler=sched,
                           param_groups=groups_of(model, by_name=True))
    try:
        for b in mlp_batches(8):
            assert [g["lr"] for g in engine.optimizer.param_groups] == [g["lr"] for g in opt.param_groups]
            loss = mlp_loss(engine, b)
            engine.backward(loss)
            engine.step()
            ref_step(ref, opt, ref_sched, b)
        assert_params_close(engine.state_dict(), {k: v.detach().cpu() for k, v in ref.state_dict().items()},
                            rtol=1e-5)
    finally:
        engine.close()


def test_checkpoint_keeps_groups(tmp_path):
    spec = zo.AdamW(lr=1e-2, weight_decay=0.5)
    batches = mlp_batches(10)

    def build():
        m = mlp()
        return zo.initialize(m, optimizer=spec, device=DEVICE, config=config(),
                             param_groups=groups_of(m, by_name=True))

    a = build()
    try:
        for b in batches[:5]:
            loss = mlp_loss(a, b)
            a.backward(loss)
            a.step()
        a.optimizer.param_groups[2]["lr"] = 7e-3  # changed by hand: must come back on load
        a.save_checkpoint(tmp_path / "ck")
        for b in batches[5:]:
            loss = mlp_loss(a, b)
            a.backward(loss)
            a.step()
        expected = a.state_dict()
    finally:
        a.close()
    b_ = build()
    try:
        b_.load_checkpoint(tmp_path / "ck")
        assert b_.optimizer.param_groups[2]["lr"] == 7e-3
        for b in batches[5:]:
            loss = mlp_loss(b_, b)
            b_.backward(loss)
            b_.step()
        assert_params_close(b_.state_dict(), expected, rtol=0)
    finally:
        b_.close()
    plain = zo.initialize(mlp(), optimizer=spec, device=DEVICE, config=config())
    try:
        before = plain.state_dict()
        with pytest.raises(CheckpointError, match="3 optimizer param group"):
            plain.load_checkpoint(tmp_path / "ck")
        assert_params_close(plain.state_dict(), before, rtol=0)
    finally:
        plain.close()


@pytest.mark.parametrize("groups, error, match", [
    ({"params": []}, TypeError, "list of dicts"),
    ([{"weight_decay": 0.0}], TypeError, "'params' list"),
    ([{"params": ["fc1.bias"], "momentum": 0.9}], ValueError, "unknown keys \\['momentum'\\]"),
    ([{"params": ["fc9.weight"]}], ValueError, "'fc9.weight' is not a parameter of the model"),
    ([{"params": [torch.nn.Parameter(torch.zeros(2))]}], ValueError, "not a parameter of the model"),
    ([{"params": ["fc1.bias"]}, {"params": ["fc1.bias"], "lr": 1.0}], ValueError, "belongs to one group"),
    ([{"params": ["fc1.bias"], "lr": -1.0}], ValueError, "lr"),
    ([{"params": [3]}], TypeError, "holds int"),
])
def test_bad_groups_refused_before_anything_changes(groups, error, match):
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=match):
        zo.initialize(model, optimizer=zo.AdamW(), device=DEVICE, config=config(), param_groups=groups)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        model(torch.zeros(1, 16))  # still a plain, usable module
