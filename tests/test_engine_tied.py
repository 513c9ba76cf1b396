"""Tied params (GPT's embedding and LM head share one Parameter) get one slot, one grad (the sum
of both uses) and one update, exactly like torch."""
import torch

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          gpt_batches, gpt_loss, micro_gpt, train_engine)


def test_tied_embedding_matches_torch():
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    model = micro_gpt()
    assert model.lm_head.weight is model.wte.weight
    ref = Reference(model, spec)
    engine = zo.initialize(model, optimizer=spec, config=config(), device=DEVICE)
    try:
        names = [s.name for s in engine.partition.slots]
        assert "wte.weight" in names and "lm_head.weight" not in names
        assert engine.partition.names["lm_head.weight"] is engine.partition.names["wte.weight"]
        batches = gpt_batches(6)
        losses = train_engine(engine, batches, gpt_loss)
        ref_losses = [ref.step(b, gpt_loss) for b in batches]
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        sd = engine.state_dict()
        assert torch.equal(sd["wte.weight"], sd["lm_head.weight"])
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
    finally:
        engine.close()
