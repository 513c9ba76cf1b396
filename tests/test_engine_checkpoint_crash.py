"""A crash in the middle of save_checkpoint leaves the previous checkpoint whole and loadable (the
new one is written aside and renamed into place only when complete)."""
import os

import pytest
import torch

import zero_offload as zo
import zero_offload.runtime.checkpoint as ckpt
from _engine_util import DEVICE, config, mlp, mlp_batches, mlp_loss, train_engine


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    batches = mlp_batches(4)
    engine = zo.initialize(mlp(), optimizer=zo.AdamW(lr=1e-2), config=config(), device=DEVICE)
    try:
        train_engine(engine, batches[:2], mlp_loss)
        engine.save_checkpoint(path)
        saved = engine.state_dict()
        train_engine(engine, batches[2:], mlp_loss)

        real_save, calls = ckpt._save, []

        def failing_save(obj, file):
            calls.append(file)
            if len(calls) == 2:
                raise OSError(5, "Input/output error (simulated)")
            return real_save(obj, file)

        monkeypatch.setattr(ckpt, "_save", failing_save)
        with pytest.raises(OSError, match="simulated"):
            engine.save_checkpoint(path)
        monkeypatch.setattr(ckpt, "_save", real_save)
        assert len(calls) == 2
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temp dir left behind

        engine.load_checkpoint(path)
        assert engine.global_step == 2
        after = engine.state_dict()
        for k in saved:
            assert torch.equal(after[k], saved[k]), k
    finally:
        engine.close()


def test_crash_between_renames_falls_back_to_previous(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    engine = zo.initialize(mlp(), optimizer=zo.AdamW(lr=1e-2), config=config(), device=DEVICE)
    try:
        train_engine(engine, mlp_batches(1), mlp_loss)
        engine.save_checkpoint(path)
        real_rename, renames = os.rename, []

        def crash_on_second_rename(src, dst):
            renames.append(dst)
            if len(renames) == 2:
                raise KeyboardInterrupt("killed between the renames (simulated)")
            real_rename(src, dst)

        monkeypatch.setattr(ckpt.os, "rename", crash_on_second_rename)
        train_engine(engine, mlp_batches(1, seed=5), mlp_loss)
        with pytest.raises(KeyboardInterrupt):
            engine.save_checkpoint(path)
        monkeypatch.setattr(ckpt.os, "rename", real_rename)
        assert not path.exists()
        with pytest.warns(UserWarning, match="interrupted"):
            engine.load_checkpoint(path)
        assert engine.global_step == 1
    finally:
        engine.close()
