"""The engine on 2 GPUs with NCCL (the GPU machine): the collectives overlap compute there (the
next chunk's all-gather issued ahead, the grads' reduce-scatter waited for on a side stream
before the shard goes to the host), which gloo on the CPU does not exercise. Parity with
single-process torch AdamW on the same global batch, fp32, params on the CPU (gathered at each
use) and on the GPU (a replica per GPU), accumulation reduced every micro-batch or at the
window's end, global-norm clipping; and the optimizer's GPU share ("auto"), whose updates run on
the compute stream behind each reduce-scatter (chunk_group.py's [Note: GPU share]), each followed
by the all-gather of the updated params into the replicas "auto" keeps where the whole state fits
([Note: gathers after the update]); with no clipping, forward and backward after the first step
never make the host wait for the device (``torch.cuda.set_sync_debug_mode("error")``)."""
import pytest
import torch

import zero_offload as zo
from _dist_util import run_ranks, values
from _engine_util import SMALL_CHUNK_MB, Reference, assert_params_close, gpt_batches, gpt_loss, micro_gpt

WORLD = 2
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD
                                 or not torch.distributed.is_nccl_available(),
                                 reason="needs 2 CUDA devices and NCCL")]
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


def _rank(rank, world, kw, steps, accum):
    device = torch.device("cuda", rank)
    cfg = zo.OffloadConfig(**{**dict(params="cpu", optimizer="cpu", dtype="fp32", chunk_mb=SMALL_CHUNK_MB,
                                     threads=2, prefetch_depth=2, grad_accum=accum), **kw})
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=cfg, device=device)
    norms = []
    # the share without a window-wide decision: nothing in forward or backward syncs the host
    # (the first step measures the device for the share: it may)
    sync_free = kw.get("optimizer") == "auto" and "grad_clip" not in kw
    for i, (x, y) in enumerate(gpt_batches(steps * accum, batch=2 * world)):
        sl = slice(2 * rank, 2 * rank + 2)
        x, y = x[sl].to(device), y[sl].to(device)
        torch.cuda.set_sync_debug_mode("error" if sync_free and i >= accum else "default")
        try:
            loss = engine(x, y)
            engine.backward(loss / accum)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if engine.step() and engine.last_grad_norm is not None:
            norms.append(engine.last_grad_norm)
    sd = engine.state_dict()
    on_gpu = engine.stats().placement["tiers"]["gpu"]["optimizer"]
    replicas = engine.plan.request.replicas
    engine.close()
    return sd, norms, on_gpu, replicas


@pytest.mark.parametrize("kw", [dict(), dict(params="gpu"), dict(grad_clip=0.05, grad_sync="every"),
                                dict(grad_clip=0.05, grad_sync="final", params="gpu"),
                                dict(params="auto", optimizer="auto"),
                                dict(params="auto", optimizer="auto", grad_clip=0.05, grad_sync="every"),
                                dict(params="gpu", optimizer="auto", grad_clip=0.05, grad_sync="final")],
                         ids=["cpu", "gpu-replica", "clip-every", "clip-final-replica", "share",
                              "share-clip-every", "share-clip-final-replica"])
def test_nccl_ranks_train_like_one_torch_process(kw, tmp_path):
    accum = 2 if "grad_sync" in kw else 1
    out = values(run_ranks(_rank, WORLD, tmp_path, kw, 3, accum, backend="nccl", timeout_s=300))
    ref = Reference(micro_gpt(), SPEC, accum=accum, grad_clip=kw.get("grad_clip"))
    for b in gpt_batches(3 * accum, batch=2 * WORLD):
        ref.step(b, gpt_loss)
    for sd, norms, on_gpu, replicas in out:
        assert (on_gpu > 0) == (kw.get("optimizer") == "auto"), on_gpu  # the share is there to test
        # params="gpu" keeps replicas; "auto" where the whole state is on the device (the micro GPT)
        assert replicas is (kw.get("params") == "gpu" or kw.get("params") == kw.get("optimizer") == "auto")
        assert_params_close(sd, ref.master_state(), rtol=1e-4)
        if "grad_clip" in kw:
            assert norms == pytest.approx(ref.norms, rel=1e-4)
