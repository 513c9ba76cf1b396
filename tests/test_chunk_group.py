"""runtime/chunk_group.py: the update segments and (runtime/update_rule.py) the Adam arguments
both front ends use."""
import torch

from zero_offload.runtime.chunk_group import update_segments
from zero_offload.runtime.update_rule import AdamRule


def test_segments_merge_touching_ranges_of_equal_step_and_key():
    spans = [(0, 64, 3, 0), (64, 128, 3, 0), (128, 192, 1, 0),  # step changes
             (192, 256, 1, 1),                                  # group changes
             (320, 384, 1, 1), (384, 448, 1, 1)]                # a gap (256..320 not updated)
    assert update_segments(spans) == [(0, 128, 3, 0), (128, 192, 1, 0), (192, 256, 1, 1), (320, 448, 1, 1)]
    assert update_segments([]) == []


def test_adam_args_from_a_param_group_unwraps_a_tensor_lr():
    group = {"lr": torch.tensor(3e-3), "betas": (0.8, torch.tensor(0.95)), "eps": 1e-6, "weight_decay": 0.1}
    a = AdamRule(adamw=True).args(group, grad_scale=2.0)
    assert type(a.lr) is float and abs(a.lr - 3e-3) < 1e-9
    assert a.betas == (0.8, float(torch.tensor(0.95))) and all(type(b) is float for b in a.betas)
    assert (a.eps, a.weight_decay, a.adamw, a.grad_scale) == (1e-6, 0.1, True, 2.0)


def test_chunk_phase_moves_are_checked():
    import pytest

    from zero_offload.runtime.chunk_group import ChunkPhase, GroupChunk
    c = GroupChunk(cid=3, slots=(), numel=8)
    with pytest.raises(RuntimeError, match="chunk 3 cannot go from IDLE to QUEUED"):
        c.to(ChunkPhase.QUEUED)  # IDLE -> QUEUED skips FILLING: a job without grads
    c.to(ChunkPhase.FILLING)
    c.to(ChunkPhase.QUEUED)
    c.to(ChunkPhase.IDLE)
    assert c.phase is ChunkPhase.IDLE
