"""Gradient accumulation: grads of grad_accum micro-batches are summed (in fp32, on the CPU) and
applied once; step() returns True only on the window's last micro-batch."""
import pytest

import zero_offload as zo
from zero_offload.runtime.store import Hop
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          gpt_batches, gpt_loss, micro_gpt, mlp, mlp_batches, mlp_loss, train_engine)
ACCUM = 3
SHARE_BUDGET = 180_000
"""gpu_budget (bytes, no activation reserve) giving 7 of the micro GPT's 11 chunks to the GPU share
with grad_sync="final" (its fp32 grads window counted), and without accumulation less that window."""


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


@pytest.mark.parametrize("kw", [dict(), dict(grad_clip=0.05), dict(overlap=False),
                                dict(params="gpu", optimizer="auto", gpu_budget=SHARE_BUDGET, activation_reserve=0)],
                         ids=["plain", "clip", "no-overlap", "gpu-share"])
def test_final_grad_sync_sums_on_the_device_and_sends_once(kw):
    """grad_sync="final" on one process: the window's grads are summed in fp32 on the device and
    go down once per window, with no host accumulation buffer: the copies between device and host
    are those of training without accumulation ("every" sends each micro-batch's grads); results
    equal torch."""
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    batches = gpt_batches(3 * ACCUM)
    ref = Reference(micro_gpt(), spec, accum=ACCUM, grad_clip=kw.get("grad_clip"))
    for b in batches:
        ref.step(b, gpt_loss)
    moved, window = {}, 0
    for sync, accum in (("final", ACCUM), ("every", ACCUM), ("every", 1)):
        cfg = dict(kw)
        if accum == 1 and "gpu_budget" in kw:  # the same GPU share as "final", whose window it lacks
            cfg["gpu_budget"] -= window
        engine = zo.initialize(micro_gpt(), optimizer=spec, device=DEVICE,
                               config=config(grad_accum=accum, grad_sync=sync, **cfg))
        try:
            if sync == "final":
                window = 4 * sum(c.numel for c in engine.partition.chunks if c.trainable)
            accum_payloads = [c for c in range(len(engine.partition.chunks))
                              if engine.store.has_payload(c, "accum")]
            assert (accum_payloads == []) == (sync == "final" or accum == 1), accum_payloads
            train_engine(engine, batches if accum > 1 else batches[:3], gpt_loss, accum=accum)
            # The grads' sends alone: with params="gpu" the host-updated chunks' fp32 master is
            # homed on the device, and how often it is fetched depends on timing (the state
            # read-ahead, the write-behind's deferred drop), not on grad_sync.
            by_payload = engine.store.stats.by_payload
            moved[sync, accum] = by_payload.get((Hop.GPU_TO_CPU, "grads"), 0)
            if accum > 1:
                assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
                if "grad_clip" in kw:
                    assert engine.last_grad_norm == pytest.approx(ref.norms[-1], rel=1e-5)
        finally:
            engine.close()
    assert 0 < moved["final", ACCUM] == moved["every", 1] < moved["every", ACCUM], moved
