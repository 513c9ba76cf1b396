"""OffloadAdamW state dicts are torch.optim.AdamW state dicts, both ways: resuming from either
one continues the run exactly."""
import pytest
import torch

from _offload_optim_util import batches, make_model, max_rel_diff, train
from zero_offload.offload_optim import OffloadAdamW

HP = dict(lr=3e-3, weight_decay=0.1)
OPTS = dict(chunk_mb=0.02, threads=1)


def test_format_matches_torch():
    """torch's fused AdamW: ours is fused too (one kernel per chunk), and its dict says so."""
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), **HP, **OPTS)
    ref = torch.optim.AdamW(reference.parameters(), **HP, fused=True)
    data = batches(3)
    train(model, opt, data)
    train(reference, ref, data)
    ours, theirs = opt.state_dict(), ref.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for k, entry in theirs["state"].items():
        assert ours["state"][k].keys() == entry.keys()
        for name, t in entry.items():
            assert ours["state"][k][name].shape == t.shape and ours["state"][k][name].dtype == t.dtype
            torch.testing.assert_close(ours["state"][k][name], t, rtol=1e-5, atol=1e-9)
    opt.close()


@pytest.mark.parametrize("direction", ["ours->torch", "torch->ours"])
def test_resume_across_implementations(direction):
    data = batches(10)
    straight = make_model()
    train(straight, torch.optim.AdamW(straight.parameters(), **HP), data)

    first, second = make_model(), make_model()
    if direction == "ours->torch":
        opt1 = OffloadAdamW(first.parameters(), **HP, **OPTS)
    else:
        opt1 = torch.optim.AdamW(first.parameters(), **HP)
    train(first, opt1, data[:5])
    sd = opt1.state_dict()
    second.load_state_dict(first.state_dict())
    if direction == "ours->torch":
        opt2 = torch.optim.AdamW(second.parameters(), lr=1.0)  # hyperparameters come from sd
    else:
        opt2 = OffloadAdamW(second.parameters(), lr=1.0, **OPTS)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == HP["lr"]
    train(second, opt2, data[5:])
    assert max_rel_diff(second, straight) < 1e-5
    for o in (opt1, opt2):
        if isinstance(o, OffloadAdamW):
            o.close()


def test_a_fused_torch_adamw_that_loads_ours_stays_fused_and_round_trips():
    """torch's load_state_dict takes every option from the dict: ours says fused=True (it was
    None, which turned a fused AdamW's off, silently). A dict loaded into ours (fused or not)
    leaves ours fused: those options describe the implementation, not the run."""
    data = batches(6)
    first, second, third = make_model(), make_model(), make_model()
    opt1 = OffloadAdamW(first.parameters(), **HP, **OPTS)
    train(first, opt1, data[:2])
    second.load_state_dict(first.state_dict())
    opt2 = torch.optim.AdamW(second.parameters(), lr=1.0, fused=True)
    opt2.load_state_dict(opt1.state_dict())
    assert [g["fused"] for g in opt2.param_groups] == [True] and opt2.param_groups[0]["lr"] == HP["lr"]
    train(first, opt1, data[2:4])
    train(second, opt2, data[2:4])
    assert max_rel_diff(second, first) < 1e-5
    third.load_state_dict(second.state_dict())
    opt3 = OffloadAdamW(third.parameters(), lr=1.0, **OPTS)
    opt3.load_state_dict(opt2.state_dict())  # back: torch's fused dict into ours
    assert opt3.param_groups[0]["fused"] is True and opt3.param_groups[0]["lr"] == HP["lr"]
    plain = torch.optim.AdamW(make_model().parameters(), **HP)  # fused=None: ours stays fused
    opt1.load_state_dict(plain.state_dict())
    assert opt1.param_groups[0]["fused"] is True
    opt1.load_state_dict(opt3.state_dict())
    train(first, opt1, data[4:])
    train(third, opt3, data[4:])
    assert max_rel_diff(third, first) < 1e-5
    opt1.close()
    opt3.close()


def test_round_trip_bf16_keeps_master():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 33).bfloat16())
    opt = OffloadAdamW([p], lr=1e-3, overlap=False, **OPTS)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["master"].dtype == torch.float32
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = OffloadAdamW([q], lr=1e-3, overlap=False, **OPTS)
    opt2.load_state_dict(sd)
    g = torch.randn_like(p)
    p.grad, q.grad = g, g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, q)
    torch.testing.assert_close(opt.state_dict()["state"][0]["master"], opt2.state_dict()["state"][0]["master"],
                               rtol=0, atol=0)
    opt.close()
    opt2.close()


def test_bad_state_dicts_raise_before_any_change():
    model = make_model()
    opt = OffloadAdamW(model.parameters(), **HP, **OPTS)
    train(model, opt, batches(2))
    good = opt.state_dict()
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in good["state"].items()}
    bad_groups = {"state": {}, "param_groups": good["param_groups"] * 2}
    with pytest.raises(ValueError, match="2 parameter groups"):
        opt.load_state_dict(bad_groups)
    wrong = {"state": dict(good["state"]), "param_groups": good["param_groups"]}
    wrong["state"][0] = dict(wrong["state"][0], exp_avg=torch.zeros(3))
    with pytest.raises(ValueError, match="'exp_avg' for param 0 has 3 elements"):
        opt.load_state_dict(wrong)
    amsgrad = {"state": {0: dict(good["state"][0], max_exp_avg_sq=torch.zeros(1))},
               "param_groups": good["param_groups"]}
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(amsgrad)
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})
    after = opt.state_dict()["state"]
    for k, v in before.items():
        for n, t in v.items():
            assert torch.equal(after[k][n], t)
    opt.close()
