"""The engine on CUDA: params live on the GPU only while their module runs (bf16 views of chunk
buffers, within the GPU budget), host homes are pinned, and training equals the same recipe in
plain torch on the same GPU, for params/optimizer on CPU and on NVMe."""
import copy

import pytest
import torch
import torch.nn.functional as F

import zero_offload as zo
from _engine_util import gpt_batches, micro_gpt, reference_bf16, rel_err, torch_optimizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = "cuda"


@pytest.mark.parametrize("params,optimizer", [("cpu", "cpu"), ("nvme", "nvme"), ("gpu", "cpu")])
def test_cuda_bf16_parity(params, optimizer, tmp_path):
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    model = micro_gpt(d_model=32)
    batches = gpt_batches(6)
    ref_losses, ref_masters = reference_bf16(model, spec, batches)
    cfg = zo.OffloadConfig(params=params, optimizer=optimizer, dtype="bf16", chunk_mb=8192 / 2**20,
                           nvme_dir=str(tmp_path) if "nvme" in (params, optimizer) else None,
                           gpu_budget=1 << 20, cpu_budget=1 << 28)
    engine = zo.initialize(model, optimizer=spec, config=cfg, device=CUDA)
    try:
        assert engine.store.config.pin
        seen = []
        # A pre-hook registered after the engine's runs once the engine has paged the chunk in.
        handle = engine.module.blocks[0].attn.qkv.register_forward_pre_hook(
            lambda m, a: seen.append((m.weight.device.type, m.weight.dtype, m.weight.isnan().any().item())))
        losses = []
        for idx, tgt in batches:
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        handle.remove()
        assert seen and all(s == ("cuda", torch.bfloat16, False) for s in seen)
        assert engine.module.blocks[0].attn.qkv.weight.untyped_storage().nbytes() == 0  # released after use
        for a, b in zip(losses, ref_losses):
            assert a == pytest.approx(b, rel=5e-3)
        sd = engine.state_dict()
        worst = max(rel_err(sd[n], v) for n, v in ref_masters.items())
        assert worst < 3e-2
        assert engine.stats().peak_bytes["gpu"] <= 1 << 20
    finally:
        engine.close()


def test_cuda_fp32_clip_matches_torch():
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    model = micro_gpt(d_model=32)
    ref = copy.deepcopy(model).to(CUDA)
    opt = torch_optimizer(spec, ref.parameters())
    cfg = zo.OffloadConfig(params="cpu", optimizer="cpu", dtype="fp32", chunk_mb=8192 / 2**20,
                           grad_clip=0.1, gpu_budget=1 << 20, cpu_budget=1 << 28)
    engine = zo.initialize(model, optimizer=spec, config=cfg, device=CUDA)
    try:
        for idx, tgt in gpt_batches(5):
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            ref_loss = ref(idx.to(CUDA), tgt.to(CUDA))
            ref_loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1).item()
            opt.step()
            opt.zero_grad()
            assert engine.last_grad_norm == pytest.approx(norm, rel=1e-4)
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        sd = engine.state_dict()
        for n, p in ref.named_parameters():
            assert rel_err(sd[n], p.detach().cpu()) < 1e-5, n
    finally:
        engine.close()
