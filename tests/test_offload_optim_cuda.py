"""OffloadAdamW on CUDA params: grads stream on side streams during backward, CPU-Adam on the
worker, params copied back; equal to torch.optim.AdamW on the GPU."""
import pytest
import torch

from _offload_optim_util import batches, make_model, max_rel_diff, train
from zero_offload.offload_optim import OffloadAdamW

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("state", ["cpu", "nvme"])
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_fp32_parity(overlap, state, tmp_path):
    model, reference = make_model("cuda"), make_model("cuda")
    opt = OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, chunk_mb=0.02, overlap=overlap,
                       state=state, nvme_dir=tmp_path if state == "nvme" else None)
    data = batches(20, device="cuda")
    losses = train(model, opt, data)
    ref_losses = train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1), data)
    assert max_rel_diff(model, reference) < 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert opt.stats.d2h_bytes == opt.stats.h2d_bytes == 20 * 4 * sum(p.numel() for p in model.parameters())
    opt.close()


def test_cuda_bf16_params_follow_fp32_master():
    """bf16 model on the GPU: the fp32 master equals torch.optim.AdamW run on an fp32 copy fed
    the same bf16 grads, and each param is the bf16 rounding of its master."""
    model = make_model("cuda", dtype=torch.bfloat16)
    master = make_model("cuda", dtype=torch.bfloat16).float()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, chunk_mb=0.02, overlap=False)
    ref = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for x, y in batches(10, device="cuda"):
        model(x, y).backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        # the next forward reads params without any host synchronisation from step()
    sd = opt.state_dict()["state"]
    start = make_model("cuda", dtype=torch.bfloat16)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))
    for i, (p, q) in enumerate(zip(model.parameters(), master.parameters())):
        torch.testing.assert_close(sd[i]["master"], q.detach().cpu(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach().cpu(), sd[i]["master"].bfloat16())
    opt.close()
