"""Bad arguments raise clear errors before anything is built."""
import pytest
import torch

from _offload_optim_util import make_model
from zero_offload.offload_optim import OffloadAdam, OffloadAdamW


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"lr": -1.0}, ValueError, r"lr=-1.0 is invalid"),
    ({"betas": (0.9, 1.0)}, ValueError, r"betas\[1\]=1.0"),
    ({"eps": -1e-8}, ValueError, r"eps="),
    ({"weight_decay": -0.1}, ValueError, r"weight_decay="),
    ({"state": "disk"}, ValueError, r"state='disk' is invalid: use 'cpu'"),
    ({"state": "nvme"}, ValueError, r"needs nvme_dir"),
    ({"chunk_mb": 0}, ValueError, r"chunk_mb=0"),
    ({"threads": 0}, ValueError, r"threads=0"),
    ({"grad_accum": 0}, ValueError, r"grad_accum=0"),
    ({"prefetch_depth": -1}, ValueError, r"prefetch_depth=-1"),
    ({"overlap": 1}, TypeError, r"overlap must be True or False"),
    ({"cpu_budget": "8G"}, ValueError, r"ambiguous"),
    ({"stat": "cpu"}, TypeError, r"unexpected keyword argument 'stat'"),
])
@pytest.mark.parametrize("cls", [OffloadAdam, OffloadAdamW])
def test_bad_arguments(cls, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(make_model().parameters(), **kwargs)


@pytest.mark.parametrize("group, exc, match", [
    ({"amsgrad": True}, ValueError, "amsgrad=True is not supported"),
    ({"maximize": True}, ValueError, "maximize=True is not supported"),
    ({"lr": -0.5}, ValueError, "lr=-0.5"),
])
def test_bad_param_groups(group, exc, match):
    model = make_model()
    with pytest.raises(exc, match=match):
        OffloadAdamW([{"params": model.parameters(), **group}])


def test_bad_params():
    with pytest.raises(TypeError, match="params must be fp32, bf16 or fp16, got torch.float64"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="more than one parameter group|appear in more than one"):
        OffloadAdamW([{"params": [p]}, {"params": [p]}])


def test_add_param_group_failure_leaves_optimizer_unchanged():
    model = make_model()
    opt = OffloadAdamW(list(model.blocks.parameters()), threads=1)
    chunks = len(opt._chunks)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": list(model.ln_f.parameters()), "amsgrad": True})
    assert len(opt.param_groups) == 1 and len(opt._chunks) == chunks
    opt.add_param_group({"params": list(model.ln_f.parameters()), "lr": 0.5})
    assert len(opt.param_groups) == 2 and len(opt._chunks) > chunks
    opt.close()


def test_unfrozen_param_with_grad_raises():
    model = make_model()
    model.wpe.weight.requires_grad_(False)
    opt = OffloadAdamW(model.parameters(), overlap=False, threads=1)
    model.wpe.weight.requires_grad_(True)
    model.wpe.weight.grad = torch.ones_like(model.wpe.weight)
    with pytest.raises(RuntimeError, match="requires_grad=False when the optimizer was built"):
        opt.step()
    opt.close()


def test_closed_optimizer_raises():
    opt = OffloadAdamW(make_model().parameters(), threads=1)
    opt.close()
    opt.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
