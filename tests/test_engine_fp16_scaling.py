"""fp16 with dynamic loss scaling behaves like torch.amp.GradScaler: overflowing steps are skipped
(params and moments untouched), the scale backs off and grows on the same steps."""
import math

import torch

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_params_close, config, mlp, mlp_batches,
                          mlp_loss, train_engine)

SCALER = dict(init_scale=2.0 ** 20, growth_interval=3)


def _engine(model, spec):
    cfg = config(dtype="fp16", initial_scale=SCALER["init_scale"], growth_interval=SCALER["growth_interval"])
    return zo.initialize(model, optimizer=spec, config=cfg, device=DEVICE)


def test_fp16_dynamic_scale_matches_grad_scaler():
    spec = zo.AdamW(lr=1e-2)
    model = mlp()
    ref = Reference(model, spec, dtype=torch.float16, scaler=SCALER)
    batches = mlp_batches(12)
    engine = _engine(model, spec)
    try:
        scales = []
        for b in batches:
            loss = mlp_loss(engine, b)
            engine.backward(loss)
            engine.step()
            ref.step(b, mlp_loss)
            scales.append((engine.stats().loss_scale, ref.scaler.get_scale()))
        # 2**20 overflows fp16 grads at first: both skip the same steps and reach the same scale.
        assert ref.skipped > 0
        assert engine.skipped_steps == ref.skipped
        assert engine.global_step == len(batches) - ref.skipped
        assert all(a == b for a, b in scales), scales
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=2e-3)
    finally:
        engine.close()


def test_forced_overflow_step_is_skipped():
    spec = zo.AdamW(lr=1e-2)
    engine = _engine(mlp(), spec)
    try:
        batches = mlp_batches(6)
        train_engine(engine, batches[:4], mlp_loss)
        before = engine.state_dict()
        moments = [engine.group.read(c, "exp_avg") for c in engine.group.chunks]
        steps, skipped, scale = engine.global_step, engine.skipped_steps, engine.stats().loss_scale
        x, y = batches[4]
        poisoned = (x.clone().index_fill_(0, torch.tensor([0]), 1e6), y)  # inf in fp16
        loss = mlp_loss(engine, poisoned)
        engine.backward(loss)
        assert engine.step() is False
        assert engine.skipped_steps == skipped + 1
        assert engine.global_step == steps
        assert engine.stats().loss_scale == scale * 0.5
        after = engine.state_dict()
        for k in before:
            assert torch.equal(before[k], after[k]), k
        for c, m in zip(engine.group.chunks, moments):
            assert torch.equal(engine.group.read(c, "exp_avg"), m)
        # Training goes on normally afterwards.
        loss = mlp_loss(engine, batches[5])
        engine.backward(loss)
        assert engine.step() is True
        assert math.isfinite(loss.item())
    finally:
        engine.close()
