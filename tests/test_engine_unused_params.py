"""Params that get no grad in a step are skipped exactly as torch.optim skips a param whose .grad
is None (no update, no decay, their own step count for bias correction), also when the grad came
only in an earlier micro-batch of an accumulation window."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_params_close, config, mlp_batches)


class Branchy(nn.Module):
    """The side layer joins only when the batch says so."""

    def __init__(self):
        super().__init__()
        self.main = nn.Linear(16, 32)
        self.side = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x, use_side: bool):
        h = F.gelu(self.main(x))
        if use_side:
            h = h + self.side(h)
        return self.head(h)


def loss_fn(model, batch):
    x, y, use_side = batch
    return F.mse_loss(model(x, use_side).float(), y.to(DEVICE))


@pytest.mark.parametrize("accum", [1, 2])
def test_params_without_grads_are_skipped_like_torch(accum):
    torch.manual_seed(0)
    model = Branchy()
    spec = zo.AdamW(lr=1e-2, weight_decay=0.1)
    ref = Reference(model, spec, accum=accum)
    # accum=1: side used on every third step; accum=2: only in the first micro-batch of some windows
    uses = [i % 3 == 0 for i in range(12)] if accum == 1 else [i % 6 == 0 for i in range(12)]
    batches = [(x, y, u) for (x, y), u in zip(mlp_batches(12), uses)]
    engine = zo.initialize(model, optimizer=spec, config=config(grad_accum=accum), device=DEVICE)
    try:
        side_before = {k: v.clone() for k, v in engine.state_dict().items() if k.startswith("side")}
        for b in batches:
            engine.backward(loss_fn(engine, b) / accum)
            engine.step()
            ref.step(b, loss_fn)
        sd = engine.state_dict()
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
        assert not torch.equal(sd["side.weight"], side_before["side.weight"])
        side = engine.partition.names["side.weight"]
        steps = engine.group.chunks[side.chunk].steps[engine.group.chunks[side.chunk].layout.slots.index(side)]
        assert steps == ref.opt.state[ref.masters[2]]["step"].item() < engine.global_step
    finally:
        engine.close()
