"""bf16 training equals the hand-written recipe (bf16 copy for forward/backward, fp32 master
params updated by torch.optim.AdamW and copied back), within bf16 tolerance."""
import torch

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          gpt_batches, gpt_loss, micro_gpt, train_engine)


def test_bf16_matches_hand_recipe():
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    model = micro_gpt()
    ref = Reference(model, spec, dtype=torch.bfloat16)
    batches = gpt_batches(8)
    engine = zo.initialize(model, optimizer=spec, config=config(dtype="bf16"), device=DEVICE)
    try:
        # Working params are bf16 on the compute device; master and moments are fp32.
        assert engine.module.lm_head.weight.dtype is torch.bfloat16
        assert engine.store.payload_spec(0, "master").dtype is torch.float32
        losses = train_engine(engine, batches, gpt_loss)
        ref_losses = [ref.step(b, gpt_loss) for b in batches]
        assert_losses_close(losses, ref_losses, rtol=2e-3)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=3e-2)
        # The working copy is the master rounded to bf16 (as the kernel's out_lowp writes it).
        with engine.gathered():
            pass
        chunk = engine.group.chunks[0]
        master = engine.group.read(chunk, "master")
        work = engine.group.read(chunk, "params")
        assert torch.equal(work, master.to(torch.bfloat16))
    finally:
        engine.close()
