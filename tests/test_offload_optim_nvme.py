"""state="nvme": Adam state lives in swap files, read ahead and written behind per chunk; the
result equals torch; host RAM holds only chunks in flight; the files go away on close."""
import os

import pytest
import torch

from _offload_optim_util import batches, make_model, max_rel_diff, train
from _pipeline_util import late_read_ahead
from zero_offload.offload_optim import OffloadAdamW
from zero_offload.store import Residency


def _state_on_host(opt):
    """(chunk, payload) of the optimizer state copies resident in host RAM (settled first)."""
    opt._store.synchronize()  # writes in flight land, their source copies are freed
    return [(c.cid, n) for c in opt._chunks for n in opt._group.names(c).values()
            if opt._store.state(c.cid, n, "cpu") is not Residency.ABSENT]


def test_nvme_state_parity_and_cleanup(tmp_path):
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, state="nvme", nvme_dir=tmp_path,
                       chunk_mb=0.02, threads=1)
    n = sum(p.numel() for p in model.parameters())
    assert os.listdir(tmp_path)  # the swap space exists
    # nothing of the state stays in host RAM between steps, once the writes in flight have landed
    # (host RAM holds the grads, homed there)
    assert _state_on_host(opt) == []
    data = batches(8)
    opt.reset_stats()
    train(model, opt, data)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1), data)
    assert max_rel_diff(model, reference) < 1e-5
    read, written = opt.nvme_bytes()
    # every step reads and writes the whole state (12 B/param; the upper bound leaves room for
    # the pipeline's read-ahead reading back a chunk just written: see the exact test below)
    assert 8 * 12 * n <= read <= 8 * (12 * n + 4096 * len(opt._chunks))
    assert 8 * 12 * n <= written <= 8 * (12 * n + 4096 * len(opt._chunks))
    sd = opt.state_dict()
    ref_sd = torch.optim.AdamW(reference.parameters()).state_dict()  # only for the format
    assert set(sd["param_groups"][0]) == set(ref_sd["param_groups"][0])
    opt.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("evicted_between", [False, True])
@pytest.mark.parametrize("overlap_forward", [False, True])
def test_copy_back_reads_the_kept_master(evicted_between, overlap_forward, tmp_path, monkeypatch):
    """[Note: copy-back source]: the param copies of fp32 chunks read the host master that the
    update wrote (its eviction is deferred to the last unpin), so each step reads and writes the state exactly
    once, and nothing of it stays in host RAM after the step. If that master is gone when the
    write-back runs (as when the store's budget policy evicts it in between), the write-back
    reads it back from NVMe: same result, one more read.
    prefetch_depth=0: a read-ahead for the next step can meet the kept master of this one just
    before the write-back drops it; the chunk is then read once more (same result, ~1 run in 20),
    which would blur the exact counts."""
    if evicted_between:
        from zero_offload.runtime.chunk_group import ChunkGroup  # the worker's copy into the params
        original = ChunkGroup._write_back

        def evict_then_write_back(self, cid):
            self.store.evict(cid, "master", "cpu")
            original(self, cid)
        monkeypatch.setattr(ChunkGroup, "_write_back", evict_then_write_back)
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, state="nvme", nvme_dir=tmp_path, chunk_mb=0.02,
                       threads=1, prefetch_depth=0, overlap_forward=overlap_forward)
    n = sum(p.numel() for p in model.parameters())
    opt.reset_stats()
    data = batches(4)
    train(model, opt, data)
    opt.synchronize()
    train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3), data)
    assert max_rel_diff(model, reference) < 1e-5
    read, written = opt.nvme_bytes()
    assert read == 4 * (16 if evicted_between else 12) * n
    assert written == 4 * 12 * n
    assert _state_on_host(opt) == []
    opt.close()


def test_a_late_read_ahead_leaves_no_state_on_host(tmp_path, monkeypatch):
    """[Note: state read-ahead] in runtime/pipeline.py: a read-ahead from the caller's thread
    that fetches a chunk's state only after its update has written it behind and dropped it (the
    caller lost the CPU meanwhile) drops what it fetched: nothing of the state stays in host RAM
    after the steps, and they equal torch's."""
    late = late_read_ahead(monkeypatch)
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, state="nvme", nvme_dir=tmp_path, chunk_mb=0.02,
                       threads=1, prefetch_depth=2)
    try:
        data = batches(3)
        train(model, opt, data)
        train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3), data)
        assert late  # the race ran: fetches after the updates they read ahead for
        assert _state_on_host(opt) == []
        assert max_rel_diff(model, reference) < 1e-5
    finally:
        opt.close()


def test_nvme_load_state_dict(tmp_path):
    data = batches(6)
    a, b = make_model(), make_model()
    opt_a = OffloadAdamW(a.parameters(), lr=3e-3, chunk_mb=0.02, threads=1)
    train(a, opt_a, data[:3])
    b.load_state_dict(a.state_dict())
    opt_b = OffloadAdamW(b.parameters(), lr=3e-3, state="nvme", nvme_dir=tmp_path, chunk_mb=0.02, threads=1)
    opt_b.load_state_dict(opt_a.state_dict())
    train(a, opt_a, data[3:])
    train(b, opt_b, data[3:])
    assert max_rel_diff(a, b) == 0.0
    opt_a.close()
    opt_b.close()
