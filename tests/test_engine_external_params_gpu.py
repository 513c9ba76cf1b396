"""On CUDA in bf16, where issue 10's tied head trained on NaN from step 0 with every placement:
a parameter read outside its module (tied LM head in the parent, a custom autograd.Function)
trains like the same bf16 recipe in plain torch, and close() gives the fp32 values back on the
device the model had."""

import pytest
import torch

import zero_offload as zo
from _engine_util import reference_bf16, rel_err
import _external_util as ext

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = "cuda"
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


@pytest.mark.parametrize("params,optimizer", [("cpu", "cpu"), ("gpu", "cpu"), ("nvme", "nvme")])
def test_cuda_bf16_tied_head_parity(params, optimizer, tmp_path):
    model = ext.model(("tied", "function")).to(CUDA)
    batches = ext.batches(6)
    ref_losses, ref_masters = reference_bf16(model, SPEC, batches)
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
