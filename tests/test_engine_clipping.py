"""Global-norm clipping equals torch.nn.utils.clip_grad_norm_ (exact: every grad is in before any
update), alone and with gradient accumulation."""
import pytest

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          mlp, mlp_batches, mlp_loss, train_engine)

CLIP = 0.05


@pytest.mark.parametrize("accum", [1, 3])
def test_clipping_matches_clip_grad_norm(accum):
    spec = zo.AdamW(lr=1e-2, weight_decay=0.1)
    model = mlp()
    ref = Reference(model, spec, grad_clip=CLIP, accum=accum)
    batches = mlp_batches(4 * accum)
    engine = zo.initialize(model, optimizer=spec, config=config(grad_clip=CLIP, grad_accum=accum),
                           device=DEVICE)
    try:
        assert not engine.group.overlap  # clipping needs the exact (after-backward) step
        norms = []
        for i, b in enumerate(batches):
            loss = mlp_loss(engine, b)
            engine.backward(loss / accum)
            if engine.step():
                norms.append(engine.last_grad_norm)
            ref.step(b, mlp_loss)
        assert len(norms) == len(ref.norms) == 4
        assert min(ref.norms) > CLIP, "clipping must be active in this test"
        for a, b in zip(norms, ref.norms):
            assert a == pytest.approx(b, rel=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()
