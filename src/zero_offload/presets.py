"""The GPT shapes: ``GPTConfig`` and the named ``PRESETS`` (re-exported by zero_offload.models).

No torch here: the ``zero-offload`` command lists the preset names in its parser, and a usage
error must be answered before torch is imported (cli.py [Note: torch after parsing]).
"""
from __future__ import annotations

import dataclasses
from typing import Optional
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT decoder. All fields keyword-only; checked on construction."""

    vocab_size: int
    """Token ids are in [0, vocab_size). 256 for the byte-level corpus of zero_offload.data."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads; must divide d_model."""
    d_model: int
    """Residual stream width (hidden size)."""
    seq_len: int
    """Longest sequence (size of the learned positional embedding)."""
    mlp_ratio: int = 4
    """MLP hidden width = mlp_ratio * d_model."""
    dropout: float = 0.0
    """Dropout on attention weights, attention output and MLP output (training mode only)."""
    tie_embeddings: bool = True
    """The LM head shares the token embedding's weight (counted once in num_params)."""
    bias: bool = True
    """Biases in linears and layer norms (GPT-2 style)."""
    activation_checkpointing: bool = False
    """Initial checkpointing flag of every block (torch.utils.checkpoint, use_reentrant=False);
    change per block with ``GPT.set_activation_checkpointing``."""
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    """Std of the normal init; residual output projections use init_std / sqrt(2 * n_layer)."""

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head among the divisors of d_model, e.g. {self.d_model // 64 or 1}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    def num_params(self, *, include_position: bool = True) -> int:
        """Closed-form parameter count (equals ``GPT(cfg).num_params()``; no allocation)."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        b = 1 if self.bias else 0
        ln = d * (1 + b)
        block = 2 * ln + (d * 3 * d + b * 3 * d) + (d * d + b * d) + (d * h + b * h) + (h * d + b * d)
        total = self.n_layer * block + ln + self.vocab_size * d
        if not self.tie_embeddings:
            total += self.vocab_size * d
        if include_position:
            total += self.seq_len * d
        return total

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token: 6·P + 12·L·H·S (H = d_model, S = sequence length).

        Model TFLOPS = flops_per_token * tokens / seconds / 1e12, the formula of BASELINES.md.
        """
        s = self.seq_len if seq_len is None else seq_len
        return 6 * self.num_params() + 12 * self.n_layer * self.d_model * s


# name -> GPTConfig. Counts (checked by tests/test_models.py): tiny 0.85M, small 10.8M,
# 125m 124.5M, 350m 354.9M, 1.3b 1.314B, 5b 5.05B, 7b 6.58B, 13b 12.75B, 14b 14.01B, 20b 19.60B,
# 24b 23.62B, 28b 27.65B, 30b 30.53B, 52b 51.82B.
PRESETS: dict[str, GPTConfig] = {
    # trains in about a minute on 2 CPU cores through the offload engine
    "tiny": GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, seq_len=128),
    # a CPU-sized model with several chunks per layer: for CPU benchmarks of the engine
    "small": GPTConfig(vocab_size=256, n_layer=6, n_head=6, d_model=384, seq_len=256),
    "125m": GPTConfig(vocab_size=50304, n_layer=12, n_head=12, d_model=768, seq_len=1024),
    "350m": GPTConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=1024, seq_len=1024),
    # the models of ../shared/BASELINES.md
    "1.3b": GPTConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=1024),
    "5b": GPTConfig(vocab_size=32000, n_layer=32, n_head=28, d_model=3584, seq_len=1024),
    "7b": GPTConfig(vocab_size=32000, n_layer=32, n_head=32, d_model=4096, seq_len=1024),
    "13b": GPTConfig(vocab_size=32000, n_layer=40, n_head=40, d_model=5120, seq_len=1024),
    # issue 24's size goals: >= 14B exact on one H100 + its host, >= 30B on the 4-GPU node
    "14b": GPTConfig(vocab_size=32000, n_layer=44, n_head=40, d_model=5120, seq_len=1024),
    "30b": GPTConfig(vocab_size=32000, n_layer=57, n_head=52, d_model=6656, seq_len=1024),
    # the baselines at the largest size each fits on the 4-GPU node (issue 24): d_model 8192 gives
    # every rank's shard of a block matrix a power-of-two size (64 and 256 MiB at 4 ranks), which
    # torch's pinned host allocator would otherwise round up (FSDP2's pinned params and grads: 1.78x
    # at d_model 6144, 1.28x at 5120)
    "20b": GPTConfig(vocab_size=32000, n_layer=24, n_head=64, d_model=8192, seq_len=1024),
    # FSDP2's CPU offload takes 19.5-19.8 B/param of host memory, measured (s16 at 14.01B on 4
    # ranks, s22 at 12.75B on 2): 28b would need the whole 503 GiB of the 4-GPU node, 24b ~436 GiB
    "24b": GPTConfig(vocab_size=32000, n_layer=29, n_head=64, d_model=8192, seq_len=1024),
    "28b": GPTConfig(vocab_size=32000, n_layer=34, n_head=64, d_model=8192, seq_len=1024),
    # the engine's largest on the 4x H200 node (4 x 141 GB, 503 GiB of host), exact state, by
    # benchmarks/lab/auto_placement.py: about 230 of 514 chunks' state per rank on its GPU and
    # 94-98 GiB of host homes per rank, the share as session 22's 27.65B had on 2x H200 + 251 GiB
    "52b": GPTConfig(vocab_size=32000, n_layer=64, n_head=64, d_model=8192, seq_len=1024),
}


def preset(name: str, **overrides) -> GPTConfig:
    """The preset's config with some fields replaced, e.g. ``preset("1.3b", seq_len=2048)``."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
