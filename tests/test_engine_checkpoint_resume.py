"""save_checkpoint / load_checkpoint restore the whole training state: resuming (in a new engine,
with other initial weights, NVMe optimizer state, another chunk size) gives the same next-step
losses as training on without the interruption, dropout RNG and lr schedule included."""
import torch

import zero_offload as zo
from _engine_util import DEVICE, config, gpt_batches, gpt_loss, micro_gpt, train_engine


def _engine(seed, tmp_path, **kw):
    cfg = config(dtype="bf16", optimizer="nvme", nvme_dir=str(tmp_path / f"swap{seed}"), **kw)
    return zo.initialize(micro_gpt(seed, dropout=0.1), optimizer=zo.AdamW(lr=3e-3), config=cfg,
                         device=DEVICE,
                         lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))


def test_resume_gives_same_losses(tmp_path):
    batches = gpt_batches(6)
    engine = _engine(0, tmp_path)
    train_engine(engine, batches[:3], gpt_loss)
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = train_engine(engine, batches[3:], gpt_loss)
    expected_sd = engine.state_dict()
    engine.close()

    resumed = _engine(1, tmp_path, chunk_mb=8192 / 2**20)
    try:
        assert len(resumed.partition.chunks) != len(engine.partition.chunks)
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert resumed.global_step == 3
        assert resumed.optimizer.param_groups[0]["lr"] == 3e-3 * 0.5
        got = train_engine(resumed, batches[3:], gpt_loss)
        assert got == expected
        sd = resumed.state_dict()
        for k in expected_sd:
            assert torch.equal(sd[k], expected_sd[k]), k
    finally:
        resumed.close()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    engine = _engine(0, tmp_path)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    other = zo.initialize(micro_gpt(0, d_model=32), optimizer=zo.AdamW(), config=config(), device=DEVICE)
    try:
        import pytest
        with pytest.raises(zo.runtime.checkpoint.CheckpointError, match="shape mismatch"):
            other.load_checkpoint(tmp_path / "ckpt")
    finally:
        other.close()
