"""Params copies are kept on the device from forward to backward when the GPU budget has room
(prefetch.py, [Note: holds]): each step moves the params to the device about once, not
twice; a tight budget still pages them (and is never exceeded); training equals torch."""
import zero_offload as zo
from zero_offload.runtime.placement import window_bytes
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          gpt_batches, gpt_loss, micro_gpt, train_engine)


def _run(gpu_budget=None, **kw):
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    model = micro_gpt(n_layer=4)
    ref = Reference(model, spec)
    cfg = config(params="cpu", optimizer="cpu", prefetch_depth=1, **kw)
    if gpu_budget == "tight":
        probe = zo.initialize(micro_gpt(n_layer=4), optimizer=spec, config=cfg, device=DEVICE)
        gpu_budget = window_bytes(probe.plan.request)
        probe.close()
    if gpu_budget is not None:
        cfg = cfg.replace(gpu_budget=gpu_budget)
    engine = zo.initialize(model, optimizer=spec, config=cfg, device=DEVICE)
    try:
        batches = gpt_batches(5)
        train_engine(engine, batches[:1], gpt_loss)  # the first step records the access order
        engine.synchronize()
        engine.reset_stats()
        losses = train_engine(engine, batches[1:], gpt_loss)
        ref_losses = [ref.step(b, gpt_loss) for b in batches]
        assert_losses_close(losses, ref_losses[1:], rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        stats = engine.stats()
        params_bytes = sum(engine.store.payload_spec(c.cid, "params").nbytes for c in engine.group.chunks)
        assert len(engine.group.chunks) >= 6
        return stats, params_bytes, len(batches) - 1, gpu_budget
    finally:
        engine.close()


def test_params_fetched_once_per_step_when_budget_allows():
    stats, params_bytes, steps, _ = _run(gpu_budget=1 << 30)
    per_step = stats.bytes_moved["cpu->gpu"] / steps
    # Once per step (plus at most the look-ahead re-fetching a chunk whose update lands later).
    assert params_bytes <= per_step < 1.5 * params_bytes, (per_step, params_bytes)


def test_tight_budget_still_pages_within_budget():
    stats, params_bytes, steps, budget = _run(gpu_budget="tight")
    assert stats.peak_bytes["gpu"] <= budget
    assert stats.bytes_moved["cpu->gpu"] / steps >= 1.5 * params_bytes
