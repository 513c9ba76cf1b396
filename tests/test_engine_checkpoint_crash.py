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


def test_save_never_replaces_files_zero_offload_did_not_write(tmp_path):
    """save_checkpoint replaces the directory at its path: a directory of the user's (no marker)
    or a checkpoint someone saved a file into is refused before anything is written, and its
    files stay; an empty directory and our own checkpoint are replaced. remove_checkpoint (the
    CLI's clean-up) leaves a checkpoint holding a foreign file alone too."""
    engine = zo.initialize(mlp(), optimizer=zo.AdamW(lr=1e-2), config=config(), device=DEVICE)
    try:
        train_engine(engine, mlp_batches(1), mlp_loss)
        mine = tmp_path / "my_project"
        mine.mkdir()
        (mine / "notes.txt").write_text("the user's")
        with pytest.raises(ckpt.CheckpointError, match=r"my_project is a directory zero_offload did not "
                                                       r"write \(no \.zero_offload marker, or a link\)"):
            engine.save_checkpoint(mine)
        assert sorted(os.listdir(mine)) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["my_project"]

        path = tmp_path / "ckpt"
        (tmp_path / "empty").mkdir()
        engine.save_checkpoint(tmp_path / "empty")  # an empty directory takes the checkpoint
        assert ckpt.is_zero_offload_checkpoint(tmp_path / "empty")
        engine.save_checkpoint(path)
        engine.save_checkpoint(path)  # our own checkpoint is replaced
        (path / "config.json").write_text("{}")  # e.g. saved beside the weights by the user
        with pytest.raises(ckpt.CheckpointError, match=r"holds 1 file\(s\) zero_offload did not write "
                                                       r"\(config\.json\)"):
            engine.save_checkpoint(path)
        assert (path / "config.json").read_text() == "{}"
        engine.load_checkpoint(path)  # still whole
        assert not ckpt.remove_checkpoint(path) and (path / "config.json").exists()
        (path / "config.json").unlink()
        assert ckpt.remove_checkpoint(path) and not path.exists()
    finally:
        engine.close()
