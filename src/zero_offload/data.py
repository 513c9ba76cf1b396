"""The corpus shipped in the package and its byte-level tokenizer.

Nothing is downloaded: ``zero_offload/data/coriolanus.txt`` (a public-domain Shakespeare text,
see ``zero_offload/data/SOURCE.md``) is package data. Tokens are the UTF-8 bytes of the text,
so the vocabulary is fixed at 256 and any text (or file) can be used in its place; the shipped
text is plain ASCII, so one token is one character.

    corpus = CharCorpus.default()
    g = torch.Generator().manual_seed(0)
    x, y = corpus.batch(batch_size=16, seq_len=128, generator=g)   # y is x shifted by one
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

__all__ = ["CharCorpus", "DEFAULT_CORPUS", "VOCAB_SIZE", "default_text", "encode", "decode"]

DEFAULT_CORPUS = "coriolanus.txt"
"""File name of the shipped text inside the package's data directory."""

VOCAB_SIZE = 256
"""Byte-level tokenizer: token id = byte value."""


def default_text() -> str:
    """The shipped public-domain text."""
    return resources.files("zero_offload").joinpath("data", DEFAULT_CORPUS).read_text(encoding="utf-8")


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as an int64 tensor of token ids in [0, 256)."""
    if not isinstance(text, str):
        raise TypeError(f"encode takes a str, got {type(text).__name__}")
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids) -> str:
    """Text of token ids (a 1-D tensor or a sequence of ints in [0, 256)). Byte sequences that
    are not valid UTF-8 (a model can sample them) decode to U+FFFD instead of raising."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"decode takes a 1-D sequence of ids, got shape {tuple(ids.shape)}; "
                             f"decode one row at a time")
        ids = ids.tolist()
    bad = [i for i in ids if not 0 <= int(i) < VOCAB_SIZE]
    if bad:
        raise ValueError(f"token ids must be in [0, {VOCAB_SIZE}), got {bad[:5]}")
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class CharCorpus:
    """A text as a byte sequence, split into train and validation parts, with random batches.

    Args:
        text: the corpus; ``None`` uses the shipped text.
        val_fraction: the last ``val_fraction`` of the bytes form the "val" split.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, text: Optional[str] = None, *, val_fraction: float = 0.1):
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        self.text = default_text() if text is None else text
        self.tokens = encode(self.text)
        if self.tokens.numel() < 2:
            raise ValueError("the corpus needs at least 2 bytes of text")
        n_val = int(self.tokens.numel() * val_fraction)
        n_train = self.tokens.numel() - n_val
        self._splits = {"train": self.tokens[:n_train], "val": self.tokens[n_train:]}

    @classmethod
    def default(cls, **kwargs) -> "CharCorpus":
        """The shipped public-domain text."""
        return cls(None, **kwargs)

    @classmethod
    def from_file(cls, path: Union[str, Path], **kwargs) -> "CharCorpus":
        """A UTF-8 text file as corpus."""
        return cls(Path(path).read_text(encoding="utf-8"), **kwargs)

    def __len__(self) -> int:
        return self.tokens.numel()

    encode = staticmethod(encode)
    decode = staticmethod(decode)

    def split(self, name: str) -> torch.Tensor:
        """The int64 token ids of the "train" or "val" split."""
        if name not in self._splits:
            raise ValueError(f"split must be one of {tuple(self._splits)}, got {name!r}")
        return self._splits[name]

    def batch(self, *, batch_size: int, seq_len: int, generator: Optional[torch.Generator] = None,
              split: str = "train", device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: ``x`` [batch_size, seq_len] int64 and ``y`` = x shifted by one token.

        Deterministic for a given ``generator`` state (draws ``batch_size`` start offsets).
        """
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        data = self.split(split)
        if data.numel() < seq_len + 1:
            raise ValueError(
                f"the {split!r} split has {data.numel()} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use a shorter seq_len, a larger corpus or a smaller val_fraction")
        starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)
        window = starts[:, None] + torch.arange(seq_len + 1)
        chunk = data[window]
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return x, y

    def batches(self, *, batch_size: int, seq_len: int, seed: int = 0, split: str = "train",
                device=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless stream of ``batch`` draws from a generator seeded with ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield self.batch(batch_size=batch_size, seq_len=seq_len, generator=generator,
                             split=split, device=device)
