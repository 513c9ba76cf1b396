"""OffloadAdamW (optimizer-only offload) with compiled blocks ([Note: compiled regions] in
zero_offload/compiled.py): equal to torch AdamW on the same compiled model, with the update in
backward or in step(), and with overlap_forward, where the forward pre-hook waits for a compiled
region's whole subtree at the region's call and does nothing inside its graph. A slow write-back
(30 ms per chunk: a compiled block runs in far less) makes the forward outrun the updates, so a
missing wait shows as a wrong loss."""
import copy
import time

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from _offload_optim_util import assert_moved, batches, make_model, max_rel_diff, train
from test_engine_compile import compile_blocks
from zero_offload.offload_optim import OffloadAdamW

CHUNK_MB = 0.02  # several chunks for the tiny GPT


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def slow_write_back(monkeypatch):
    from zero_offload.runtime.chunk_group import ChunkGroup  # the worker's copy into the params
    original = ChunkGroup._write_back

    def write_back(self, cid):
        time.sleep(0.03)
        original(self, cid)
    monkeypatch.setattr(ChunkGroup, "_write_back", write_back)


@pytest.mark.parametrize("how, overlap, overlap_forward", [
    ("method", True, True), ("wrapper", True, False), ("method", False, True)])
def test_compiled_blocks_train_like_torch(how, overlap, overlap_forward, slow_write_back):
    model = make_model()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        compile_blocks(m, how, fullgraph=how == "wrapper")
    opt = OffloadAdamW(model.parameters(), lr=2e-3, chunk_mb=CHUNK_MB, threads=1, overlap=overlap,
                       overlap_forward=overlap_forward, process_group=None)
    assert len(opt._chunks) > 3
    data = batches(6)
    losses = train(model, opt, data)
    opt.synchronize()
    ref_losses = train(reference, torch.optim.AdamW(reference.parameters(), lr=2e-3), data)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(model, reference) < 1e-5
    assert_moved(reference, make_model())
    assert counters["stats"]["unique_graphs"] >= 1
    # The only break: the region's own call reaching the wait (a frame of the hook alone).
    assert all("waits for a compiled region's params" in k for k in counters["graph_break"]), \
        dict(counters["graph_break"])
    opt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_blocks_on_cuda_train_like_torch(slow_write_back):
    model = make_model(device="cuda")
    reference = copy.deepcopy(model)
    for m in (model, reference):
        compile_blocks(m, "method", backend="inductor")
    opt = OffloadAdamW(model.parameters(), lr=2e-3, chunk_mb=CHUNK_MB, threads=1, overlap_forward=True,
                       process_group=None)
    data = batches(6, device="cuda")
    losses = train(model, opt, data)
    opt.synchronize()
    ref_losses = train(reference, torch.optim.AdamW(reference.parameters(), lr=2e-3), data)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert max_rel_diff(model, reference) < 1e-4
    assert counters["stats"]["unique_graphs"] >= 1
    opt.close()
