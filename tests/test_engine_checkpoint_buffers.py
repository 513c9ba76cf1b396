"""Checkpoints hold the model's persistent buffers (BatchNorm running statistics): before, a
resumed run silently kept whatever buffers the model had at load time."""
import pytest
import torch
from torch import nn

import zero_offload as zo
from zero_offload.runtime.checkpoint import CheckpointError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _train(engine, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g) * 3 + 1
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()


def test_buffers_are_saved_and_restored(tmp_path):
    model = _model()
    engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-2), config=zo.OffloadConfig(params="cpu", optimizer="cpu", dtype="fp32"),
                           device="cpu")
    try:
        _train(engine, 2, seed=1)
        saved = {k: v.clone() for k, v in model[1].named_buffers()}
        engine.save_checkpoint(tmp_path / "ck")
        _train(engine, 3, seed=2)
        assert not torch.equal(model[1].running_mean, saved["running_mean"])
        engine.load_checkpoint(tmp_path / "ck")
        for k, v in model[1].named_buffers():
            assert torch.equal(v, saved[k]), k
    finally:
        engine.close()


def test_buffer_mismatch_is_refused_before_anything_changes(tmp_path):
    engine = zo.initialize(_model(), optimizer=zo.AdamW(lr=1e-2), config=zo.OffloadConfig(params="cpu", optimizer="cpu", dtype="fp32"),
                           device="cpu")
    _train(engine, 1, seed=1)
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    other = _model()
    other[1].register_buffer("extra", torch.zeros(3))
    engine = zo.initialize(other, optimizer=zo.AdamW(lr=1e-2), config=zo.OffloadConfig(params="cpu", optimizer="cpu", dtype="fp32"),
                           device="cpu")
    try:
        step = engine.global_step
        with pytest.raises(CheckpointError, match="buffers"):
            engine.load_checkpoint(tmp_path / "ck")
        assert engine.global_step == step
    finally:
        engine.close()
