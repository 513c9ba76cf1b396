"""torch.utils.checkpoint (non-reentrant) re-runs forward inside backward: the pre-forward hooks
fetch the chunks again. Results equal torch without checkpointing; the budget holds."""
import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          gpt_batches, gpt_loss, micro_gpt, train_engine)


def test_activation_checkpointing_matches_torch():
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    model = micro_gpt()
    ref = Reference(model, spec)  # no checkpointing in the reference
    model.set_activation_checkpointing(True)
    engine = zo.initialize(model, optimizer=spec, config=config(gpu_budget=48 << 10), device=DEVICE)
    try:
        batches = gpt_batches(5)
        losses = train_engine(engine, batches, gpt_loss)
        ref_losses = [ref.step(b, gpt_loss) for b in batches]
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        assert engine.store.peak_bytes(zo.Tier.GPU) <= 48 << 10
    finally:
        engine.close()
