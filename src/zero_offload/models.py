"""The model zoo every benchmark and the CLI train: a GPT decoder and Hugging Face causal LMs.

``GPT`` is the decoder of ../shared/BASELINES.md: pre-LN blocks, causal attention through
``F.scaled_dot_product_attention(is_causal=True)``, an MLP of ``mlp_ratio`` x width with GELU,
a learned positional embedding and an LM head tied to the token embedding. Every linear and
layer norm has a bias (as GPT-2), which is what the parameter counts in BASELINES.md assume.

Output contract (the engine and the CLI rely on it): ``model(idx)`` returns logits
``[batch, seq, vocab]``; ``model(idx, targets)`` returns only the scalar mean cross-entropy
loss, so ``loss = engine(x, y); engine.backward(loss)`` works unchanged for every model here.
``from_hf`` wraps a transformers model in ``HFCausalLM`` with the same contract.

Big presets: build them on ``device="meta"`` (no memory, instant) and materialize where they
belong (``model.to_empty(device=...)`` then ``model.init_weights()``), or pass ``dtype``. A
CPU build whose fp32 weights would not fit in available host RAM raises instead of swapping
the machine to death.
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .presets import PRESETS, GPTConfig, preset

__all__ = ["GPTConfig", "GPT", "Block", "PRESETS", "preset", "build", "from_hf", "HFCausalLM", "generate"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias, **kw)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias, **kw)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # [b, t, d] -> [b, heads, t, head_dim]
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias, **kw)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias, **kw)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)).

    ``checkpoint`` (bool attribute): recompute this block's activations in backward instead of
    storing them (torch.utils.checkpoint, use_reentrant=False). Forward hooks of the block's
    submodules run again during that recomputation.
    """

    def __init__(self, cfg: GPTConfig, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias, **kw)
        self.attn = CausalSelfAttention(cfg, **kw)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias, **kw)
        self.mlp = MLP(cfg, **kw)
        self.checkpoint = cfg.activation_checkpointing

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


def _logits_or_loss(logits: torch.Tensor, targets: Optional[torch.Tensor]) -> torch.Tensor:
    """The output contract: the logits, or their scalar mean cross-entropy against ``targets``
    (entries equal to -100 are ignored)."""
    if targets is None:
        return logits
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)


def _check_fits_in_host_memory(cfg: GPTConfig, device, dtype) -> None:
    dev = torch.device(device) if device is not None else torch.empty(0).device
    if dev.type != "cpu":
        return
    dtype = dtype or torch.get_default_dtype()
    need = cfg.num_params() * dtype.itemsize
    import psutil  # a declared dependency; imported here to keep `import models` light

    available = psutil.virtual_memory().available
    if need > 0.9 * available:
        raise MemoryError(
            f"building this GPT ({cfg.num_params() / 1e9:.2f}B params) on the CPU in "
            f"{dtype} needs {need / 2**30:.1f} GiB but only "
            f"{available / 2**30:.1f} GiB of host RAM is available; pass device='meta' (no "
            f"memory; hand it to zero_offload.initialize or materialize with to_empty + "
            f"init_weights), a smaller dtype, or a smaller preset")


class GPT(nn.Module):
    """GPT decoder (see the module docstring for the output contract).

    Args:
        config: the shape.
        device, dtype: where and in which dtype the parameters are created (as ``nn.Linear``
            takes them). ``device="meta"`` allocates nothing; weights are initialized
            otherwise (``init_weights``), from torch's global RNG.
    """

    def __init__(self, config: GPTConfig, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT needs a GPTConfig, got {type(config).__name__}; "
                            f"use zero_offload.models.preset(name) for a preset")
        _check_fits_in_host_memory(config, device, dtype)
        self.config = config
        kw = dict(device=device, dtype=dtype)
        # On meta, the embeddings skip their own reset: torch's normal_ on a meta tensor goes
        # through torch._refs, whose first call imports torch._dynamo (2-5 s; meta draws nothing)
        meta = torch.empty(0, device=device).is_meta

        def embedding(rows: int) -> nn.Embedding:
            given = {"_weight": torch.empty(rows, config.d_model, **kw)} if meta else {}
            return nn.Embedding(rows, config.d_model, **kw, **given)
        self.wte = embedding(config.vocab_size)
        self.wpe = embedding(config.seq_len)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, **kw) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias, **kw)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, **kw)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if self.wte.weight.device.type != "meta":
            self.init_weights()

    def _apply(self, fn, recurse=True):
        # [Note: tied head] Module.to_empty (and swap-on-conversion moves) create a new tensor
        # per parameter *slot*, which unties lm_head from wte; tie them again after any move.
        super()._apply(fn, recurse)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        return self

    @torch.no_grad()
    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """GPT-2 init: normal(0, init_std) for linears and embeddings, zero biases, unit norms,
        residual output projections scaled by 1/sqrt(2·n_layer). Call after ``to_empty``."""
        for name, p in self.named_parameters():
            self.init_param(name, p, generator=generator)

    @torch.no_grad()
    def init_param(self, name: str, p: torch.Tensor, generator: Optional[torch.Generator] = None) -> None:
        """Fill one parameter (by its ``named_parameters`` name) as ``init_weights`` does; for a
        model built on the meta device, ``zero_offload.initialize(model, init=model.init_param)``
        fills each chunk as it goes, with the values ``init_weights`` would give."""
        std = self.config.init_std
        if name.endswith("bias"):
            p.zero_()
        elif ".ln" in name or name.startswith("ln_"):
            p.fill_(1.0)
        elif name.endswith("proj.weight"):
            p.normal_(0.0, std / math.sqrt(2 * self.config.n_layer), generator=generator)
        else:
            p.normal_(0.0, std, generator=generator)

    def set_activation_checkpointing(self, enabled: bool = True, *, layers=None) -> None:
        """Turn checkpointing on/off for the blocks whose indices are in ``layers`` (all: None)."""
        for i, block in enumerate(self.blocks):
            if layers is None or i in layers:
                block.checkpoint = bool(enabled)

    def num_params(self, *, include_position: bool = True) -> int:
        """Distinct parameters (the tied head counted once)."""
        n = sum(p.numel() for p in self.parameters())
        return n if include_position else n - self.wpe.weight.numel()

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """6·P + 12·L·H·S; model TFLOPS = flops_per_token · tokens / seconds / 1e12."""
        return self.config.flops_per_token(seq_len)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """idx: int64 [batch, seq] with seq <= config.seq_len. Returns logits
        [batch, seq, vocab], or the scalar mean cross-entropy against ``targets`` (same shape
        as idx; entries equal to -100 are ignored)."""
        if idx.dim() != 2:
            raise ValueError(f"GPT expects token ids of shape [batch, seq], got {tuple(idx.shape)}")
        t = idx.size(1)
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.config.seq_len}; "
                             f"crop the input or build the model with a larger seq_len")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return _logits_or_loss(self.lm_head(self.ln_f(x)), targets)


def build(name_or_config, *, device=None, dtype=None) -> GPT:
    """``GPT`` from a preset name or a GPTConfig."""
    cfg = preset(name_or_config) if isinstance(name_or_config, str) else name_or_config
    return GPT(cfg, device=device, dtype=dtype)


@torch.no_grad()
def generate(forward: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, *,
             max_new_tokens: int, seq_len: int, temperature: float = 1.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Sample ``max_new_tokens`` tokens after ``idx`` ([batch, t]).

    ``forward`` maps ids to logits: a GPT, an HFCausalLM, or an engine wrapping one. The
    context is cropped to the last ``seq_len`` tokens. Returns [batch, t + max_new_tokens].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    for _ in range(max_new_tokens):
        logits = forward(idx[:, -seq_len:])[:, -1, :].float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


# --------------------------------------------------------------------------- Hugging Face

def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("zero_offload.models.from_hf needs the 'transformers' package, which is not "
                          "installed; `pip install transformers` (or use a GPT preset)") from e
    return transformers


class HFCausalLM(nn.Module):
    """A transformers causal LM behind GPT's contract: ``forward(idx)`` -> logits,
    ``forward(idx, targets)`` -> scalar mean cross-entropy (targets already shifted, as
    zero_offload.data produces them; HF's own label shifting is not used)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model
        cfg = hf_model.config
        self.n_layer = cfg.num_hidden_layers
        self.d_model = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.seq_len = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        s = self.seq_len if seq_len is None else seq_len
        return 6 * self.num_params() + 12 * self.n_layer * self.d_model * s

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """As ``GPT.set_activation_checkpointing`` (the wrapper keeps GPT's contract)."""
        if enabled:
            self.hf_model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf_model.gradient_checkpointing_disable()

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _logits_or_loss(self.hf_model(input_ids=idx, use_cache=False).logits, targets)


def _hf_config(name_or_config):
    transformers = _transformers()
    if isinstance(name_or_config, transformers.PretrainedConfig):
        return name_or_config
    if isinstance(name_or_config, dict):
        kwargs = dict(name_or_config)
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ValueError("a Hugging Face config dict needs a 'model_type' key, e.g. "
                             "{'model_type': 'llama', 'hidden_size': 2048, ...}")
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    if isinstance(name_or_config, str):
        if os.path.isfile(name_or_config):  # a config.json
            with open(name_or_config) as f:
                return _hf_config(json.load(f))
        # a directory holding config.json or a hub name (may need the network or the HF cache)
        return transformers.AutoConfig.from_pretrained(name_or_config)
    raise TypeError(f"from_hf takes a model name, a config.json path, a dict with 'model_type' "
                    f"or a transformers.PretrainedConfig; got {type(name_or_config).__name__}")


def from_hf(name_or_config, *, device=None, dtype=None) -> HFCausalLM:
    """A randomly initialized transformers causal LM (GPT-2, Llama, ...) built from its config,
    wrapped in ``HFCausalLM``. ``name_or_config``: a hub name or local directory
    (``AutoConfig.from_pretrained``), a path to a config.json, a dict with ``model_type``
    (no network: ``AutoConfig.for_model``), or a ``PretrainedConfig``. ``device="meta"`` builds
    without memory. Weights are not downloaded: this is for training from scratch and for
    benchmarks of the architecture."""
    transformers = _transformers()
    config = _hf_config(name_or_config)
    with torch.device(device if device is not None else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, torch_dtype=dtype if dtype is not None else torch.float32)
    return HFCausalLM(model)
