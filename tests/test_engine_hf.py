"""Hugging Face causal LMs (GPT-2, Llama) built from a config train unchanged through the engine,
equal to plain torch (model(**batch) with labels -> output.loss)."""
import copy

import pytest
import torch

import zero_offload as zo
from _engine_util import DEVICE, config, rel_err, torch_optimizer

import transformers  # a test extra (pyproject: test): the Hugging Face tests run in CI

from _engine_util import HF_TINY_CONFIGS as CONFIGS


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_hf_model_trains_like_torch(kind):
    kwargs = dict(CONFIGS[kind])
    cfg = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    ref = copy.deepcopy(model).to(DEVICE)
    spec = zo.AdamW(lr=3e-3, weight_decay=0.1)
    opt = torch_optimizer(spec, ref.parameters())
    engine = zo.initialize(model, optimizer=spec, config=config(), device=DEVICE)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(4):
            ids = torch.randint(0, 64, (2, 16), generator=g)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            ref_out = ref(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE))
            ref_out.loss.backward()
            opt.step()
            opt.zero_grad()
            assert out.loss.item() == pytest.approx(ref_out.loss.item(), rel=1e-5)
        sd = engine.state_dict()
        for n, p in ref.named_parameters():
            if n.endswith("c_attn.bias"):
                continue  # key part: zero grad up to rounding noise, see tests/_engine_util.py
            assert rel_err(sd[n], p.detach().cpu()) < 1e-5, n
    finally:
        engine.close()
