"""Checkpoints carry a manifest (sizes, CRC-32s) and a marker; a damaged file is named with what is
wrong; a refused load changes nothing in the engine; a full disk is one clear error with the
previous checkpoint intact; killed saves leave nothing that the next save does not clean."""
import errno
import os

import pytest
import torch

import zero_offload as zo
import zero_offload.runtime.checkpoint as ckpt
from _engine_util import DEVICE, config, mlp, mlp_batches, mlp_loss, train_engine


def _engine(seed=0, **kw):
    return zo.initialize(mlp(seed), optimizer=zo.AdamW(lr=1e-2), config=config(chunk_mb=256 / 2**20),
                         device=DEVICE, **kw)


def _snapshot(engine):
    return (engine.state_dict(), engine.global_step, engine.skipped_steps,
            [dict((k, v) for k, v in g.items() if k != "params") for g in engine.optimizer.param_groups],
            [list(c.steps) for c in engine.group.chunks])


def _assert_unchanged(engine, before):
    sd, step, skipped, groups, steps = _snapshot(engine)
    assert step == before[1] and skipped == before[2] and groups == before[3] and steps == before[4]
    assert sd.keys() == before[0].keys()
    for k in sd:
        assert torch.equal(sd[k], before[0][k]), k


@pytest.fixture
def saved(tmp_path):
    """A checkpoint after 2 steps, and an engine trained 3 steps further (so a load would change it)."""
    engine = _engine()
    batches = mlp_batches(5)
    train_engine(engine, batches[:2], mlp_loss)
    engine.save_checkpoint(tmp_path / "ckpt")
    train_engine(engine, batches[2:], mlp_loss)
    yield engine, tmp_path / "ckpt"
    engine.close()


def test_manifest_and_marker(saved):
    engine, path = saved
    names = sorted(os.listdir(path))
    assert ".zero_offload" in names and "manifest.json" in names and "engine.pt" in names
    assert len([n for n in names if n.startswith("chunk_")]) == len(engine.group.chunks) > 1
    assert ckpt.is_zero_offload_checkpoint(path)
    assert ckpt.verify(path) == str(path)


def test_truncated_chunk_is_named_and_changes_nothing(saved):
    engine, path = saved
    victim = path / "chunk_00001.pt"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    before = _snapshot(engine)
    with pytest.raises(ckpt.CheckpointCorrupt, match=rf"chunk_00001\.pt is truncated: {size // 2} of {size} bytes.*load an earlier"):
        engine.load_checkpoint(path)
    _assert_unchanged(engine, before)
    with pytest.raises(ckpt.CheckpointCorrupt, match="truncated"):
        ckpt.verify(path)


def test_flipped_byte_fails_checksum(saved):
    engine, path = saved
    victim = path / "chunk_00000.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))
    before = _snapshot(engine)
    with pytest.raises(ckpt.CheckpointCorrupt, match=r"chunk_00000\.pt fails its checksum"):
        engine.load_checkpoint(path)
    _assert_unchanged(engine, before)
    ckpt.verify(path, checksums=False)  # sizes alone cannot see it


def test_refused_load_leaves_engine_bit_identical(saved):
    """The checkpoint has no scheduler state; the engine has a scheduler. Before the fix the load
    raised only after weights, counters and hyperparameters had been overwritten."""
    _, path = saved
    engine = _engine(seed=3, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    try:
        train_engine(engine, mlp_batches(1, seed=9), mlp_loss)
        before = _snapshot(engine)
        with pytest.raises(ckpt.CheckpointError, match="no lr scheduler state"):
            engine.load_checkpoint(path)
        _assert_unchanged(engine, before)
    finally:
        engine.close()


def test_full_disk_mid_save_is_one_error_and_keeps_previous(saved, monkeypatch):
    engine, path = saved
    written = []

    class FullDisk:
        """The checkpoint files as the OS sees them: ENOSPC once 3000 bytes are written."""

        def __init__(self, f):
            self.f = f

        def write(self, data):
            written.append(memoryview(data).nbytes)
            if sum(written) > 3000:  # part-way through a later chunk file
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    real_init = ckpt._Checksummed.__init__
    monkeypatch.setattr(ckpt._Checksummed, "__init__", lambda self, f: real_init(self, FullDisk(f)))
    with pytest.raises(ckpt.CheckpointError,
                       match=rf"no space left on /\S* while writing chunk_\d+\.pt of checkpoint {path} "
                             rf"\(about \d+ bytes needed, \d+ free\); free space or save elsewhere; "
                             rf"the previous checkpoint {path} is intact"):
        engine.save_checkpoint(path)
    monkeypatch.undo()
    assert sorted(os.listdir(path.parent)) == ["ckpt"]  # the partial temp dir is gone
    engine.load_checkpoint(path)
    assert engine.global_step == 2


def test_killed_saves_are_cleaned_only_when_ours(saved):
    engine, path = saved
    parent = path.parent
    # a save killed part-way (marker, no manifest), owned by a process that no longer exists
    ours = parent / ".ckpt.tmp-999999999-0"
    ours.mkdir()
    (ours / ".zero_offload").write_text(ckpt._MARKER_TEXT)
    (ours / "chunk_00000.pt").write_bytes(b"partial")
    # a directory of the user's that happens to match the pattern
    theirs = parent / ".ckpt.tmp-999999998-0"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ckpt.CheckpointCorrupt, match="incomplete checkpoint"):
        ckpt.verify(ours)
    assert not ckpt.remove_checkpoint(theirs) and (theirs / "notes.txt").exists()
    engine.save_checkpoint(path)
    assert not ours.exists()
    assert (theirs / "notes.txt").read_text() == "mine"
    ckpt.verify(path)


def test_temp_name_with_impossible_pid_does_not_break_saves(saved):
    """A directory named like a killed save's temp dir but with a pid too large for the OS made
    every later save raise OverflowError (from os.kill); it is no live save: cleaned only if ours."""
    engine, path = saved
    odd = path.parent / ".ckpt.tmp-99999999999999999999-0"
    odd.mkdir()
    (odd / "notes.txt").write_text("mine")
    engine.save_checkpoint(path)
    assert (odd / "notes.txt").read_text() == "mine"
    ckpt.verify(path)


def test_client_state_is_stored_and_read_back_without_an_engine(tmp_path):
    engine = _engine()
    try:
        train_engine(engine, mlp_batches(1), mlp_loss)
        with pytest.raises(TypeError, match="client_state must be a JSON-serializable dict"):
            engine.save_checkpoint(tmp_path / "bad", client_state={"t": torch.zeros(1)})
        assert not (tmp_path / "bad").exists()  # refused before anything was written
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 3, "data": [1, "a"]})
        engine.save_checkpoint(tmp_path / "none")
    finally:
        engine.close()
    assert ckpt.read_client_state(tmp_path / "ckpt") == {"epoch": 3, "data": [1, "a"]}
    assert ckpt.read_client_state(tmp_path / "none") is None
    meta = tmp_path / "ckpt" / "engine.pt"
    data = bytearray(meta.read_bytes())
    data[-100] ^= 0xFF  # same size, other bytes
    meta.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointCorrupt, match="engine.pt fails its checksum"):
        ckpt.read_client_state(tmp_path / "ckpt")
