"""The rules beyond Adam on CUDA: Muon's Newton-Schulz iterations run on the GPU for a matrix whose
momentum lives in host memory (the worker's CPU job takes it there and back: runtime/rules.py,
[Note: where each rule runs]) or in the GPU share, and equal ``torch.optim.Muon`` on the GPU; the
other rules' host and device steps equal torch's on the same GPU."""
import pytest
import torch

import zero_offload as zo
from _engine_util import Reference, assert_params_close, config, gpt_batches, gpt_loss, micro_gpt, train_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _matrices_only(model):
    for n, p in model.named_parameters():
        if not (n.startswith("blocks.") and p.dim() == 2):
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("kw", [dict(), dict(params="gpu", optimizer="auto", gpu_budget=1 << 22)],
                         ids=["host-state", "gpu-share"])
def test_muon_on_cuda_equals_torch(kw, monkeypatch):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cuda")
    engine = zo.initialize(_matrices_only(micro_gpt()), optimizer=zo.Muon(lr=0.01, momentum=0.9),
                           config=config(**kw), device="cuda")
    try:
        ref = Reference(_matrices_only(micro_gpt()), zo.AdamW())
        ref.opt = torch.optim.Muon([m for m in ref.masters if m.requires_grad], lr=0.01, momentum=0.9)
        batches = gpt_batches(3)
        for b in batches:
            ref.step(b, gpt_loss)
        train_engine(engine, batches, gpt_loss)
        # (the host's add and lerp may differ from the GPU's in the last bit: a few steps only,
        # test_rules.py's [Note: Muon is chaotic in its last bits])
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["sgd", "lion", "adafactor"])
def test_offloaded_rules_on_a_cuda_model_equal_torch(name):
    from _offload_optim_util import batches, make_model, max_rel_diff, train
    from test_rules_offload_optim import ours, theirs
    model, reference = make_model("cuda"), make_model("cuda")
    for kw in (dict(), dict(state="auto", gpu_budget=200_000)):
        opt, ref = ours(name, model, **kw), theirs(name, reference)
        data = batches(4, device="cuda")
        train(model, opt, data)
        train(reference, ref, data)
        assert max_rel_diff(model, reference) < 1e-5, kw
        opt.close()
