"""Larger than the compute device: the training state is many times the GPU budget, the store's
peak on the GPU tier never passes it, and training still equals torch. With params and
optimizer state on NVMe, host memory stays within its budget too."""
import zero_offload as zo
from zero_offload.runtime.placement import window_bytes
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          gpt_batches, gpt_loss, micro_gpt, mlp, train_engine)


def test_gpu_budget_holds_for_state_many_times_larger(tmp_path):
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    model = micro_gpt(d_model=32, n_layer=6)
    ref = Reference(model, spec)
    cfg = config(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path), prefetch_depth=1)
    # The smallest GPU budget initialize accepts: homes (none) + the working window.
    probe = zo.initialize(micro_gpt(d_model=32, n_layer=6), optimizer=spec, config=cfg, device=DEVICE)
    gpu_budget = window_bytes(probe.partition, cfg)
    probe.close()
    state = 16 * sum(p.numel() for p in model.parameters())  # params, grads, 2 moments, fp32
    assert state >= 6 * gpu_budget
    cpu_budget = state // 2
    cfg = cfg.replace(gpu_budget=gpu_budget, cpu_budget=cpu_budget)
    engine = zo.initialize(model, optimizer=spec, config=cfg, device=DEVICE)
    try:
        batches = gpt_batches(4)
        losses = train_engine(engine, batches, gpt_loss)
        ref_losses = [ref.step(b, gpt_loss) for b in batches]
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        stats = engine.stats()
        assert stats.peak_bytes["gpu"] <= gpu_budget
        assert stats.peak_bytes["cpu"] <= cpu_budget
        # Params really were paged: each step moved more than the whole model to the device.
        params_bytes = 4 * sum(c.numel for c in engine.partition.chunks)
        assert stats.bytes_moved["cpu->gpu"] >= len(batches) * params_bytes
    finally:
        engine.close()


def test_auto_nvme_budget_is_the_free_space_with_no_hidden_cap(tmp_path, monkeypatch):
    """nvme_budget="auto" plans against the disk's free space less the reserve, even above the
    64 GiB the store caps its own "auto" at (the engine then sizes the swap files to the plan)."""
    import collections
    import zero_offload.engine as eng
    from zero_offload.runtime.store import Tier
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(eng.shutil, "disk_usage", lambda path: usage(1 << 41, 0, 1 << 41))  # 2 TiB free
    seen = {}
    plan = eng.plan_placement

    def spy(partition, cfg, budgets, **kw):
        seen.update(budgets)
        return plan(partition, cfg, budgets, **kw)

    monkeypatch.setattr(eng, "plan_placement", spy)
    engine = zo.initialize(mlp(), optimizer=zo.AdamW(), device=DEVICE,
                           config=config(optimizer="nvme", nvme_dir=str(tmp_path / "swap"), nvme_budget="auto"))
    try:
        assert seen[Tier.NVME] == int((1 << 41) * 0.9)  # free - 10% reserve, not 64 GiB
        assert engine.store.budgets[Tier.NVME] == engine.plan.need[Tier.NVME] + (4 << 20)
    finally:
        engine.close()
