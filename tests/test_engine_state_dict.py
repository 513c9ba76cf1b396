"""engine.state_dict() is a plain fp32 torch state dict (tied names and buffers included) that
loads into a fresh model, which then computes what the engine computes."""
import torch

import zero_offload as zo
import pytest

from _engine_util import DEVICE, config, gpt_batches, gpt_loss, micro_gpt, train_engine


def test_state_dict_loads_into_fresh_model():
    engine = zo.initialize(micro_gpt(), optimizer=zo.AdamW(lr=3e-3), config=config(), device=DEVICE)
    try:
        batches = gpt_batches(4)
        train_engine(engine, batches[:3], gpt_loss)
        sd = engine.state_dict()
        fresh = micro_gpt(seed=7)
        assert set(sd) == set(fresh.state_dict())
        assert all(v.dtype is torch.float32 and v.device.type == "cpu" for v in sd.values())
        fresh.load_state_dict(sd, strict=True)
        idx, targets = batches[3]
        with torch.no_grad():
            want = gpt_loss(fresh.to(DEVICE), (idx.to(DEVICE), targets)).item()
            got = gpt_loss(engine, batches[3]).item()
        assert got == pytest.approx(want, rel=1e-6)
        with engine.gathered() as m:  # read-only fp32 view through the user's module
            assert torch.equal(m.blocks[0].attn.qkv.weight, sd["blocks.0.attn.qkv.weight"])
        assert engine.module.blocks[0].attn.qkv.weight.untyped_storage().nbytes() == 0  # placeholder again
    finally:
        engine.close()
