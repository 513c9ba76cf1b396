"""A DeepSpeed config (zero_optimization offload sections, optimizer, clipping, accumulation)
drives the engine directly, and trains like the equivalent torch setup."""
import json

import pytest

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_params_close, mlp, mlp_batches, mlp_loss)


def test_deepspeed_json_config_trains_like_torch(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
        },
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    model = mlp()
    ref = Reference(model, zo.AdamW(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1), grad_clip=0.05, accum=2)
    with pytest.warns(UserWarning, match="ignored DeepSpeed keys.*train_micro_batch_size_per_gpu"):
        engine = zo.initialize(model, config=str(path), device=DEVICE)
    try:
        assert {h.params for h in engine.plan.homes} == {zo.Tier.NVME}
        assert engine.config.grad_accum == 2 and engine.config.grad_clip == 0.05
        for b in mlp_batches(8):
            engine.backward(mlp_loss(engine, b) / 2)
            engine.step()
            ref.step(b, mlp_loss)
        assert engine.global_step == 4
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()
