"""models.py: GPT shapes and semantics, preset sizes (on the meta device), training signal."""
import time

import pytest
import torch
import torch.nn.functional as F

from zero_offload import models
from zero_offload.data import CharCorpus
from zero_offload.models import GPT, PRESETS, GPTConfig


def closed_form(cfg: GPTConfig) -> int:
    # GPT-2 layout with biases: 12·L·d² + 13·L·d (blocks) + V·d (tied wte/head) + S·d (wpe) + 2d (ln_f)
    L, d = cfg.n_layer, cfg.d_model
    return 12 * L * d * d + 13 * L * d + cfg.vocab_size * d + cfg.seq_len * d + 2 * d


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_count_on_meta(name):
    cfg = PRESETS[name]
    # No timing (it flaked on a loaded 2-core host): on meta nothing is allocated, and
    # init_weights must not run (it would draw from the RNG).
    before = torch.get_rng_state()
    model = GPT(cfg, device="meta")
    assert torch.equal(torch.get_rng_state(), before), "meta construction must not initialize"
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.num_params() == cfg.num_params() == closed_form(cfg)


def test_preset_sizes_match_baselines():
    billions = {name: round(PRESETS[name].num_params() / 1e9, 2) for name in ("1.3b", "5b", "7b")}
    # ../shared/BASELINES.md: 1.31B (24L h2048), 5.05B (32L h3584 vocab 32000), 6.58B (32L h4096)
    assert billions == {"1.3b": 1.31, "5b": 5.05, "7b": 6.58}
    assert 120e6 < PRESETS["125m"].num_params() < 130e6
    assert 340e6 < PRESETS["350m"].num_params() < 370e6
    assert 12e9 < PRESETS["13b"].num_params() < 14e9
    # issue 24's goals are ">= 14B" and ">= 30B": the presets must not fall short of them
    assert 14.0e9 <= PRESETS["14b"].num_params() < 14.1e9
    assert 30.0e9 <= PRESETS["30b"].num_params() < 31e9
    assert PRESETS["30b"].d_model // PRESETS["30b"].n_head == 128
    # the baselines' largest sizes (issue 24): a block matrix's shard over 4 ranks a power of two
    # in bytes, fp32 (64 and 256 MiB), so a pinned host allocator's rounding costs nothing
    assert 19.5e9 < PRESETS["20b"].num_params() < 20e9 and 27.5e9 < PRESETS["28b"].num_params() < 28e9
    assert 23.5e9 < PRESETS["24b"].num_params() < 23.7e9 and 51.8e9 < PRESETS["52b"].num_params() < 51.9e9
    for name in ("20b", "24b", "28b", "52b"):
        d = PRESETS[name].d_model
        for rows, cols in ((d, d), (4 * d, d)):
            shard = rows * cols * 4 // 4
            assert shard & (shard - 1) == 0, (name, rows, cols)
    assert PRESETS["tiny"].num_params() < 2e6


def test_flops_per_token_formula():
    cfg = PRESETS["1.3b"]
    assert cfg.flops_per_token() == 6 * 1_313_722_368 + 12 * 24 * 2048 * 1024
    assert GPT(cfg, device="meta").flops_per_token(512) == 6 * 1_313_722_368 + 12 * 24 * 2048 * 512


def test_shapes_loss_and_tied_head():
    torch.manual_seed(0)
    model = models.build("tiny")
    assert model.lm_head.weight is model.wte.weight
    x = torch.randint(0, 256, (3, 17))
    y = torch.randint(0, 256, (3, 17))
    logits = model(x)
    assert logits.shape == (3, 17, 256) and logits.dtype == torch.float32
    loss = model(x, y)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))
    # fresh init predicts close to uniform over the 256 byte values
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_attention_is_causal():
    torch.manual_seed(0)
    model = models.build("tiny").eval()
    x = torch.randint(0, 256, (1, 32))
    x2 = x.clone()
    x2[0, 20] = (x[0, 20] + 1) % 256
    a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_activation_checkpointing_gives_same_grads():
    torch.manual_seed(0)
    model = models.build("tiny")
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    model(x, y).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_activation_checkpointing(True)
    assert all(b.checkpoint for b in model.blocks)
    model(x, y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)


def test_loss_decreases_with_adamw_on_corpus():
    torch.manual_seed(0)
    model = models.build(models.preset("tiny", seq_len=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = CharCorpus.default()
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        x, y = corpus.batch(batch_size=8, seq_len=64, generator=g)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


def test_generate_is_seeded_and_appends():
    torch.manual_seed(0)
    model = models.build("tiny").eval()
    idx = torch.zeros(1, 4, dtype=torch.long)
    a = models.generate(model, idx, max_new_tokens=10, seq_len=128, generator=torch.Generator().manual_seed(1))
    b = models.generate(model, idx, max_new_tokens=10, seq_len=128, generator=torch.Generator().manual_seed(1))
    assert a.shape == (1, 14) and torch.equal(a, b) and torch.equal(a[:, :4], idx)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(vocab_size=256, n_layer=1, n_head=3, d_model=128, seq_len=8)
    with pytest.raises(ValueError, match="positive int"):
        GPTConfig(vocab_size=256, n_layer=0, n_head=1, d_model=8, seq_len=8)
    with pytest.raises(ValueError, match="choose one of"):
        models.preset("70b")
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        models.build("tiny")(torch.zeros(1, 129, dtype=torch.long))


def test_big_cpu_build_refused_before_allocating(monkeypatch):
    import psutil

    class Mem:
        available = 8 * 2**30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem())
    with pytest.raises(MemoryError, match="device='meta'"):
        GPT(PRESETS["7b"])


def test_meta_model_materializes():
    model = GPT(PRESETS["tiny"], device="meta")
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    assert model.lm_head.weight is model.wte.weight
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()


def test_from_hf_follows_the_gpt_contract():
    torch.manual_seed(0)
    model = models.from_hf({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64,
                            "n_positions": 64, "vocab_size": 256})
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    # transformers builds the model in train mode with GPT-2's dropout (0.1): two calls draw
    # different masks, so compare the contract in eval mode (the 0.28% gap seen with transformers
    # 5.x was dropout, not the loss).
    assert model.training
    model.eval()
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    torch.testing.assert_close(model(x, y), F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))
    model.train()
    meta = models.from_hf({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                           "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 256},
                          device="meta")
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_from_hf_without_transformers_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="pip install transformers"):
        models.from_hf({"model_type": "gpt2"})
