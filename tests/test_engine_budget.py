"""Larger than the compute device: the training state is many times the GPU budget, the store's
peak on the GPU tier never passes it, and training still equals torch. With params and
optimizer state on NVMe, host memory stays within its budget too."""
import zero_offload as zo
from zero_offload.runtime.placement import window_bytes
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          gpt_batches, gpt_loss, micro_gpt, mlp, mlp_batches, mlp_loss, train_engine)


def test_gpu_budget_holds_for_state_many_times_larger(tmp_path):
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    model = micro_gpt(d_model=32, n_layer=6)
    ref = Reference(model, spec)
    cfg = config(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path), prefetch_depth=1)
    # The smallest GPU budget initialize accepts: homes (none) + the working window.
    probe = zo.initialize(micro_gpt(d_model=32, n_layer=6), optimizer=spec, config=cfg, device=DEVICE)
    gpu_budget = window_bytes(probe.plan.request)
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


def _disk(monkeypatch, *, total, free):
    """The swap directory's file system reports ``total`` and ``free`` bytes (statvfs mocked)."""
    import collections
    import shutil
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(total, total - free, free))


def test_auto_nvme_budget_rule(monkeypatch, tmp_path):
    """Free space less a small reserve (at most 4 GiB, 5% of what is free): never a share of the
    disk's total (a 3.8 TB disk with 300 GB free got 0), and no cap."""
    from zero_offload.runtime.swap_io import auto_nvme_budget
    for total, free, budget in [(3_800 * 10**9, 300 * 10**9, 300 * 10**9 - (4 << 30)),  # big, busy disk
                                (1 << 50, 1 << 48, (1 << 48) - (4 << 30)),  # no 64 GiB cap
                                (100 << 30, 10 << 30, (10 << 30) - (10 << 30) // 20),  # small free: 5%
                                (100 << 30, 0, 0)]:
        _disk(monkeypatch, total=total, free=free)
        assert auto_nvme_budget(tmp_path) == budget


def test_auto_nvme_budget_plans_against_free_space_and_preallocates_the_plan(tmp_path, monkeypatch):
    """initialize plans against the "auto" budget (uncapped, not a share of the total) and the swap
    file is preallocated to exactly what the plan needs; an int budget too."""
    from zero_offload.runtime.store import Tier
    from zero_offload.runtime.swap_io import SWAP_FILE
    _disk(monkeypatch, total=3_800 * 10**9, free=300 * 10**9)
    for budget in ("auto", "1GiB"):
        swap = tmp_path / budget
        engine = zo.initialize(mlp(), optimizer=zo.AdamW(), device=DEVICE,
                               config=config(optimizer="nvme", nvme_dir=str(swap), nvme_budget=budget))
        try:  # the budget the plan was made against
            assert engine.plan.budgets[Tier.NVME] == (300 * 10**9 - (4 << 30) if budget == "auto" else 1 << 30)
            need = engine.plan.need[Tier.NVME]
            assert need > 0 and engine.store.budgets[Tier.NVME] == need
            train_engine(engine, mlp_batches(1), mlp_loss)
            [space] = [d for d in swap.iterdir()]
            assert (space / SWAP_FILE).stat().st_size == need  # exactly the plan, no slack
        finally:
            engine.close()
