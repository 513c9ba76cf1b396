"""Every placement of params (gpu | cpu | nvme) x optimizer state (cpu | nvme) trains exactly like
torch.optim.Adam / AdamW: fp32 params within 1e-5 relative after 20 steps."""
import pytest
import torch

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          mlp, mlp_batches, mlp_loss, train_engine)

STEPS = 20


ADAMW = zo.AdamW(lr=1e-2, weight_decay=0.1)
ADAM = zo.Adam(lr=1e-2, weight_decay=0.05)  # L2 penalty folded into the grad
CASES = [(p, o, ADAMW) for p in ("gpu", "cpu", "nvme") for o in ("cpu", "nvme")]
CASES += [("cpu", "cpu", ADAM), ("nvme", "nvme", ADAM)]


@pytest.mark.parametrize("params,optimizer,spec", CASES,
                         ids=[f"{p}-{o}-{'adamw' if s.adamw else 'adam'}" for p, o, s in CASES])
def test_placement_matches_torch(params, optimizer, spec, tmp_path):
    model = mlp()
    ref = Reference(model, spec)
    batches = mlp_batches(STEPS)
    cfg = config(params=params, optimizer=optimizer,
                 nvme_dir=str(tmp_path) if "nvme" in (params, optimizer) else None)
    engine = zo.initialize(model, optimizer=spec, config=cfg, device=DEVICE)
    try:
        assert len(engine.partition.chunks) >= 3, "the test model must span several chunks"
        homes = {h.params for h in engine.plan.homes}
        assert homes == {zo.Tier(params)}
        assert {h.optimizer for h in engine.plan.homes} == {zo.Tier(optimizer)}
        losses = train_engine(engine, batches, mlp_loss)
        ref_losses = [ref.step(b, mlp_loss) for b in batches]
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        if "nvme" in (params, optimizer):
            moved = engine.stats().bytes_moved
            assert moved["cpu->nvme"] > 0 and moved["nvme->cpu"] > 0
    finally:
        engine.close()
