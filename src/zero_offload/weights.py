"""``Engine.save_weights``: the model's weights as safetensors shards in the Hugging Face layout,
written chunk by chunk, so a model whose state fills the host can be exported while it trains.

``engine.state_dict()`` gathers every value in host memory at once (4 bytes per parameter beside
the 14-16 of training state: the 12.75B GPT of one H100 host would not fit). Here the values come
one chunk at a time and leave in shards of at most ``shard_size`` bytes: host memory holds one
shard and one chunk. The layout is what ``save_pretrained`` writes (``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``), so the directory
loads with ``initialize(model, weights=path)``, ``safetensors.torch.load_file`` or a Hugging Face
``from_pretrained`` of the same architecture (for a Hugging Face model the engine wraps, its
config.json and generation_config.json are written beside the shards). A tied parameter is
written once, under its first name (loaders tie it again).

The files are written into a new ``.<name>.tmp-*`` directory beside ``path`` and renamed into
place when whole: a failed or killed export leaves no partial directory at ``path``. An existing ``path``
must be an empty directory: an export never replaces files.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

import torch

from .config import parse_bytes

__all__ = ["ShardedWriter", "INDEX", "SINGLE"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ShardedWriter:
    """Collects ``(name, tensor)`` and writes shards of at most ``shard_size`` bytes (a tensor
    larger than that gets a shard of its own). Everything is checked in the constructor, before
    anything is written. ``write=False`` (ranks other than 0) checks and writes nothing."""

    def __init__(self, path, *, dtype: Optional[torch.dtype] = None, shard_size="5GB", write: bool = True):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError("save_weights writes safetensors files: pip install safetensors (or "
                              "zero_offload[hf])") from None
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"save_weights: dtype={dtype!r} is not supported; pass None (fp32), "
                             f"torch.bfloat16 or torch.float16")
        self._save_file = save_file
        self.dtype = dtype
        self.shard_size = parse_bytes(shard_size, name="save_weights shard_size")
        self.path = os.path.abspath(os.fspath(path))
        self.write = write
        self.error: Optional[BaseException] = None
        """The first failure of a write; later tensors are dropped (the caller keeps iterating:
        on several ranks every gather must still happen)."""
        self._tmp: Optional[str] = None
        self._shard: dict = {}
        self._shard_bytes = 0
        self._files: list[str] = []
        self._map: dict[str, int] = {}  # tensor name -> shard number
        self._total = 0
        self._extra: list[str] = []  # add_text's files
        if write:
            if os.path.lexists(self.path) and not (os.path.isdir(self.path) and not os.path.islink(self.path)
                                                   and not os.listdir(self.path)):
                raise ValueError(f"save_weights: {self.path} exists and is not an empty directory; pass a "
                                 f"new directory (an export never replaces files)")
            parent, name = os.path.split(self.path)
            os.makedirs(parent, exist_ok=True)
            self._tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)  # a new name: ours alone

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if not self.write or self.error is not None:
            return
        try:
            dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
            # one copy, its own storage (not a view into a whole chunk)
            t = tensor.detach().to("cpu", dtype=dtype, copy=True).contiguous()
            nbytes = t.numel() * t.element_size()
            if self._shard and self._shard_bytes + nbytes > self.shard_size:
                self._flush()
            self._shard[name] = t
            self._shard_bytes += nbytes
            self._total += nbytes
        except BaseException as e:  # noqa: BLE001 - kept, raised by close()
            self.error = e

    def add_text(self, file: str, text: str) -> None:
        """A small file beside the shards (a Hugging Face model's config.json)."""
        if self.write and self.error is None:
            try:
                with open(os.path.join(self._tmp, file), "w") as f:
                    f.write(text)
                self._extra.append(file)
            except BaseException as e:  # noqa: BLE001 - kept, raised by close()
                self.error = e

    def _flush(self) -> None:
        i = len(self._files)
        file = f"shard-{i:05d}.safetensors"
        self._save_file(self._shard, os.path.join(self._tmp, file), metadata={"format": "pt"})
        self._files.append(file)
        self._map.update((k, i) for k in self._shard)
        self._shard, self._shard_bytes = {}, 0

    def close(self) -> list[str]:
        """Write what is left, the index, and rename the directory into place; the files
        written (none when ``write`` is False). Raises the first failure (the partial
        directory removed)."""
        if not self.write:
            return []
        try:
            if self.error is not None:
                raise self.error
            if self._shard or not self._files:
                self._flush()
            n = len(self._files)
            names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
            for old, new in zip(self._files, names):
                os.rename(os.path.join(self._tmp, old), os.path.join(self._tmp, new))
            if n > 1:
                index = {"metadata": {"total_size": self._total},
                         "weight_map": {k: names[i] for k, i in sorted(self._map.items())}}
                with open(os.path.join(self._tmp, INDEX), "w") as f:
                    json.dump(index, f, indent=2)
                names.append(INDEX)
            names += self._extra
            for file in names:
                fd = os.open(os.path.join(self._tmp, file), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if os.path.isdir(self.path):
                os.rmdir(self.path)  # empty (checked first); rename needs the name free
            os.rename(self._tmp, self.path)
            return [os.path.join(self.path, f) for f in names]
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Remove the temporary directory (ours: made by this writer under a new name)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
