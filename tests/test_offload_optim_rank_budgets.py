"""OffloadAdamW under DDP (2 CPU processes, gloo) with an "auto" host budget: the ranks of a node
share its free memory, so each rank plans its shards into its share (the node's free memory less
the reserve, divided by LOCAL_WORLD_SIZE), as the engine does, not into the whole node's. With
nvme_dir the state that does not fit the share spills to NVMe; the ranks together stay within the
node's "auto" budget and still train like torch.optim.AdamW on the same global batch. The node's
memory is mocked (psutil) at 1.6 times what one rank's state would take in host memory: room for
one rank's, not for both."""
import os
import types

import pytest
import torch

from _dist_util import run_ranks, values
from _offload_optim_util import batches, make_model

WORLD = 2
STEPS = 3
KW = dict(lr=3e-3, chunk_mb=0.01, threads=1, prefetch_depth=1)
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _rank(rank, world, swap):
    import psutil
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_offload import OffloadAdamW

    # What one rank's state takes in host memory when all of it is there (state="cpu").
    probe = OffloadAdamW(make_model().parameters(), **KW)
    alone = probe._store.bytes("cpu")
    probe.close()
    from zero_offload.runtime.store import auto_budget

    # the node's "auto" host budget, about 1.6x one rank's state: available less 10% of itself
    fake = types.SimpleNamespace(total=10 * alone, available=int(1.6 * alone / 0.9), percent=0.0)
    node = auto_budget(fake.available, 0.1)
    psutil.virtual_memory = lambda: fake

    model = make_model()
    ddp = DDP(model)
    opt = OffloadAdamW(model.parameters(), **KW, state="auto", gpu_budget=0,
                       nvme_dir=os.path.join(swap, f"r{rank}"))
    per = 2
    for x, y in batches(STEPS, batch=per * world):
        ddp(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    peak = opt._store.peak_bytes("cpu")
    read, written = opt.nvme_bytes()
    opt.close()
    return node, peak, written, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_ddp_ranks_share_the_nodes_auto_host_budget(tmp_path):
    out = values(run_ranks(_rank, WORLD, tmp_path, str(tmp_path / "swap"), timeout_s=180))
    node = out[0][0]
    peaks = [peak for _, peak, _, _ in out]
    assert sum(peaks) <= node, (peaks, node)  # each rank within its share: the node within its budget
    assert all(written > 0 for _, _, written, _ in out)  # what does not fit the share went to NVMe
    ref = make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=KW["lr"])
    for x, y in batches(STEPS, batch=2 * WORLD):
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    for _, _, _, params in out:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6)
