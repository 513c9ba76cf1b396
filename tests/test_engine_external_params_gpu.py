"""On CUDA in bf16, where issue 10's tied head trained on NaN from step 0 with every placement:
a parameter read outside its module (tied LM head in the parent, a custom autograd.Function)
trains like the same bf16 recipe in plain torch, and close() gives the fp32 values back on the
device the model had."""
import copy

import pytest
import torch

import zero_offload as zo
from _engine_util import rel_err, torch_optimizer
import _external_util as ext

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = "cuda"
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


def _reference_bf16(model, batches):
    """bf16 copy on the GPU for forward/backward, fp32 masters updated by torch AdamW."""
    work = copy.deepcopy(model).to(device=CUDA, dtype=torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in work.parameters()]
    opt = torch_optimizer(SPEC, masters)
    losses = []
    for idx, tgt in batches:
        loss = work(idx.to(CUDA), tgt.to(CUDA))
        loss.backward()
        for p, m in zip(work.parameters(), masters):
            # A param no read reached this step has no grad: torch's AdamW skips it, as we do.
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(work.parameters(), masters):
                p.copy_(m)
        losses.append(loss.item())
    names = [n for n, _ in work.named_parameters()]
    return losses, {n: m.detach().cpu() for n, m in zip(names, masters)}


@pytest.mark.parametrize("params,optimizer", [("cpu", "cpu"), ("gpu", "cpu"), ("nvme", "nvme")])
def test_cuda_bf16_tied_head_parity(params, optimizer, tmp_path):
    model = ext.model(("tied", "function")).to(CUDA)
    batches = ext.batches(6)
    ref_losses, ref_masters = _reference_bf16(model, batches)
    cfg = zo.OffloadConfig(params=params, optimizer=optimizer, dtype="bf16", chunk_mb=4096 / 2**20,
                           nvme_dir=str(tmp_path) if "nvme" in (params, optimizer) else None,
                           gpu_budget=1 << 20, cpu_budget=1 << 28)
    engine = zo.initialize(model, optimizer=SPEC, config=cfg, device=CUDA)
    try:
        assert len(engine.partition.chunks) >= 6
        losses = []
        for idx, tgt in batches:
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        for a, b in zip(losses, ref_losses):
            assert a == pytest.approx(b, rel=5e-3)
        sd = engine.state_dict()
        worst = max(rel_err(sd[n], v) for n, v in ref_masters.items())
        assert worst < 3e-2
    finally:
        engine.close()
    # close() put the fp32 masters back on the GPU, where the model was.
    for name, p in model.named_parameters():
        assert p.device.type == "cuda" and p.dtype == torch.float32
        assert torch.equal(p.detach().cpu(), sd[name]), name
