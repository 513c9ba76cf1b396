"""Gradient accumulation: grads of grad_accum micro-batches are summed (in fp32, on the CPU) and
applied once; step() returns True only on the window's last micro-batch."""
import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          mlp, mlp_batches, mlp_loss)

ACCUM = 3


def test_accumulation_matches_torch():
    spec = zo.Adam(lr=1e-2, weight_decay=0.01)
    model = mlp()
    ref = Reference(model, spec, accum=ACCUM)
    batches = mlp_batches(4 * ACCUM)
    engine = zo.initialize(model, optimizer=spec, config=config(grad_accum=ACCUM), device=DEVICE)
    try:
        updated, losses, ref_losses = [], [], []
        for b in batches:
            loss = mlp_loss(engine, b)
            engine.backward(loss / ACCUM)
            updated.append(engine.step())
            losses.append(loss.item())
            ref_losses.append(ref.step(b, mlp_loss))
        assert updated == [False, False, True] * 4
        assert engine.global_step == 4
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()
