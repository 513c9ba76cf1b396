"""An lr scheduler given as a factory drives the CPU optimizer: the same lr sequence and params as
the scheduler on torch.optim.AdamW, and engine.optimizer works with any torch scheduler."""
import pytest
import torch

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_params_close, config, mlp, mlp_batches,
                          mlp_loss)


def warmup_then_decay(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.5 ** (s // 3))


def test_scheduler_matches_torch(recwarn):
    spec = zo.AdamW(lr=1e-2, weight_decay=0.1)
    model = mlp()
    ref = Reference(model, spec, scheduler=warmup_then_decay)
    engine = zo.initialize(model, optimizer=spec, config=config(), device=DEVICE,
                           lr_scheduler=warmup_then_decay)
    try:
        lrs, ref_lrs = [], []
        for b in mlp_batches(10):
            lrs.append(engine.optimizer.param_groups[0]["lr"])
            ref_lrs.append(ref.opt.param_groups[0]["lr"])
            loss = mlp_loss(engine, b)
            engine.backward(loss)
            engine.step()
            ref.step(b, mlp_loss)
        assert lrs == ref_lrs
        assert len(set(lrs)) > 3
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    finally:
        engine.close()


def test_scheduler_instance_is_refused():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="callable taking the optimizer"):
        zo.initialize(model, optimizer=zo.AdamW(), config=config(), device=DEVICE,
                      lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
