"""Frozen params (requires_grad=False) live in chunks without grads or optimizer state, never
change, and the trainable ones train exactly like torch."""
import pytest
import torch

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_params_close, config, mlp, mlp_batches,
                          mlp_loss, train_engine)


def test_frozen_params_stay_and_have_no_state():
    spec = zo.AdamW(lr=1e-2, weight_decay=0.1)
    model = mlp()
    model.fc2.weight.requires_grad_(False)
    model.fc1.bias.requires_grad_(False)
    frozen = {"fc2.weight": model.fc2.weight.detach().clone(), "fc1.bias": model.fc1.bias.detach().clone()}
    ref = Reference(model, spec)
    engine = zo.initialize(model, optimizer=spec, config=config(), device=DEVICE)
    try:
        frozen_chunks = [c for c in engine.group.chunks if not c.layout.trainable]
        assert {s.name for c in frozen_chunks for s in c.layout.slots} == set(frozen)
        for c in frozen_chunks:
            for payload in ("grads", "master", "exp_avg", "exp_avg_sq"):
                with pytest.raises(KeyError):
                    engine.store.payload_spec(c.cid, payload)
        batches = mlp_batches(10)
        train_engine(engine, batches, mlp_loss)
        [ref.step(b, mlp_loss) for b in batches]
        sd = engine.state_dict()
        for name, value in frozen.items():
            assert torch.equal(sd[name], value), name
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
    finally:
        engine.close()
