"""Bad configurations and misuse fail with a clear message naming the problem and the fix, before
anything changes (the model keeps its weights when initialize refuses)."""
import pytest
import torch

import zero_offload as zo
from zero_offload.runtime.placement import FitError
from _engine_util import DEVICE, config, mlp, mlp_batches, mlp_loss


def _unchanged(model, before):
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_gpu_budget_below_working_window():
    model = mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(FitError, match=r"gpu_budget=8192 bytes cannot hold the working set.*Raise "
                                       r"gpu_budget to at least \d+, or lower chunk_mb"):
        zo.initialize(model, optimizer=zo.AdamW(), config=config(gpu_budget=8192), device=DEVICE)
    assert _unchanged(model, before)


def test_failures_inside_initialize_leave_the_model_whole(monkeypatch):
    model = mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def bad_factory(opt):
        raise RuntimeError("scheduler factory failed")

    with pytest.raises(RuntimeError, match="scheduler factory failed"):
        zo.initialize(model, optimizer=zo.AdamW(), config=config(), device=DEVICE, lr_scheduler=bad_factory)
    assert _unchanged(model, before)
    # A store failure after some chunks took their weights: they are given back.
    from zero_offload.engine import Engine
    real, calls = Engine._add_chunk, []

    def failing_add_chunk(self, layout, homes):
        calls.append(layout.index)
        if len(calls) == 3:
            raise MemoryError("cudaHostRegister failed (simulated)")
        return real(self, layout, homes)

    monkeypatch.setattr(Engine, "_add_chunk", failing_add_chunk)
    with pytest.raises(MemoryError, match="simulated"):
        zo.initialize(model, optimizer=zo.AdamW(), config=config(), device=DEVICE)
    assert len(calls) == 3
    assert _unchanged(model, before)


def test_cpu_budget_too_small():
    with pytest.raises(FitError, match=r"cpu_budget=20000 bytes is too small.*optimizer='nvme'"):
        zo.initialize(mlp(), optimizer=zo.AdamW(), config=config(cpu_budget=20000), device=DEVICE)


def test_nvme_dir_too_small(tmp_path, monkeypatch):
    import shutil

    real = shutil.disk_usage

    def tiny_disk(path):
        u = real(path)
        return type(u)(total=u.total, used=u.total - 10_000, free=10_000)

    monkeypatch.setattr(shutil, "disk_usage", tiny_disk)  # what every free-space check reads
    with pytest.raises(FitError, match=r"NVMe directory .* is too small: the state placed there needs \d+ bytes"):
        zo.initialize(mlp(), optimizer=zo.AdamW(),
                      config=config(optimizer="nvme", nvme_dir=str(tmp_path)), device=DEVICE)


def test_nvme_budget_explicitly_too_small(tmp_path):
    with pytest.raises(FitError, match="nvme_budget=4096"):
        zo.initialize(mlp(), optimizer=zo.AdamW(),
                      config=config(params="nvme", nvme_dir=str(tmp_path), nvme_budget=4096), device=DEVICE)


def test_nvme_placement_needs_a_directory():
    with pytest.raises(ValueError, match="nvme_dir"):
        zo.initialize(mlp(), optimizer=zo.AdamW(), config=dict(optimizer="nvme"), device=DEVICE)


def test_optimizer_must_be_a_spec():
    model = mlp()
    with pytest.raises(TypeError, match=r"zero_offload.Adam\(...\) or zero_offload.AdamW"):
        zo.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), config=config(), device=DEVICE)
    with pytest.raises(ValueError, match="needs an optimizer spec"):
        zo.initialize(model, config=config(), device=DEVICE)


def test_frozen_only_models():
    # (Models on the meta device are initialized, or refused, in test_engine_meta_init.py.)
    frozen = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        zo.initialize(frozen, optimizer=zo.AdamW(), config=config(), device=DEVICE)


def test_misuse_after_initialize():
    engine = zo.initialize(mlp(), optimizer=zo.AdamW(), config=config(), device=DEVICE)
    try:
        x, y = mlp_batches(1)[0]
        with pytest.raises(RuntimeError, match=r"outside the engine.*engine\(batch\)"):
            engine.module(x)
        out = engine(x)
        with pytest.raises(ValueError, match="scalar loss"):
            engine.backward(out)
        with pytest.raises(RuntimeError, match="holds hyperparameters only"):
            engine.optimizer.step()
        # The engine still trains after the refused calls.
        loss = mlp_loss(engine, (x, y))
        assert torch.isfinite(loss)
        engine.backward(loss)
        assert engine.step() is True
        assert all(torch.isfinite(v).all() for v in engine.state_dict().values())
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine(x)
