"""OffloadAdamW with DDP on 2 GPUs (NCCL; the GPU machine): the same parity with torch AdamW as
on gloo, and ``state_dict()`` gathers the state with tensor collectives on the params' device,
whatever the current CUDA device is. It was an ``all_gather_object`` (of the step counts) on the
*current* device: a script that keeps its model on ``cuda:rank`` without ``set_device`` had both
ranks' NCCL calls on GPU 0 (an error or a hang)."""
import pytest
import torch

from _dist_util import run_ranks, values
from _offload_optim_util import batches, make_model

WORLD = 2
STEPS = 3
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD
                                 or not torch.distributed.is_nccl_available(),
                                 reason="needs 2 CUDA devices and NCCL")]


def _rank(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_offload import OffloadAdamW

    device = torch.device("cuda", rank)
    model = make_model().to(device)  # the reference's weights: built on the CPU (the CUDA RNG differs)
    ddp = DDP(model, device_ids=[rank])
    opt = OffloadAdamW(model.parameters(), lr=3e-3, chunk_mb=0.01, threads=2)
    per = 2
    for x, y in batches(STEPS, batch=2 * world, device=device):
        ddp(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.set_device(0)  # the current device is not the params' (rank 1)
    sd = opt.state_dict()
    opt.close()
    return ({n: p.detach().cpu() for n, p in model.named_parameters()},
            {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in e.items()}
             for i, e in sd["state"].items()})


def test_ddp_on_nccl_matches_torch_and_gathers_the_state_on_the_params_device(tmp_path):
    out = values(run_ranks(_rank, WORLD, tmp_path, backend="nccl", timeout_s=300, collective_timeout_s=60))
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for x, y in batches(STEPS, batch=2 * WORLD):
        model(x, y).backward()
        ref.step()
        ref.zero_grad()
    ref_sd = ref.state_dict()["state"]
    for params, state in out:
        for n, p in model.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-4, atol=1e-5)
        assert set(state) == set(ref_sd)
        for i, e in ref_sd.items():
            assert float(state[i]["step"]) == float(e["step"]) == STEPS
            torch.testing.assert_close(state[i]["exp_avg"], e["exp_avg"], rtol=1e-3, atol=1e-8)
