"""Where ``initialize`` takes each parameter's first values, chunk by chunk, so the host never
holds a second full copy of the model:

- the model's own tensors (a model built on the CPU or a GPU): each chunk copies them, then the
  engine frees them (``Engine._load_initial``);
- a model built on the meta device (``with torch.device("meta"): model = ...``; no memory):
  ``init(name, tensor)`` fills an empty CPU tensor per parameter, called once per distinct
  parameter in ``named_parameters()`` order (a GPT-style initializer by name: the values equal
  those of the same function applied to a CPU-built model, RNG stream included); without
  ``init``, each module holding meta parameters is materialized on the CPU alone
  (``to_empty(recurse=False)``) and its ``reset_parameters()`` runs, as torch's own modules
  initialize themselves;
- ``weights``: safetensors files (one file, or a directory of shards as HF ``save_pretrained``
  writes them, with or without ``model.safetensors.index.json``), read tensor by tensor into the
  chunk being filled; a tied parameter may be stored under any of its names.

Every check runs in ``check()`` before the engine allocates anything: missing or misshapen
weights, meta parameters with no way to initialize them, buffers left on the meta device.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from .runtime.partition import ChunkLayout, Partition
from .weights import INDEX

__all__ = ["InitialValues", "set_values"]


def set_values(p: nn.Parameter, t: torch.Tensor) -> None:
    """Point parameter ``p`` (the same object: hooks and optimizers keep it) at ``t``; unlike
    ``p.data = t`` this works for a meta ``p`` (``Module.to_empty`` would make a new Parameter)."""
    if p.is_meta:
        torch.utils.swap_tensors(p, nn.Parameter(t, requires_grad=p.requires_grad))
    else:
        p.data = t


class InitialValues:
    """The first values of every slot of ``partition`` (see the module docstring)."""

    def __init__(self, model: nn.Module, partition: Partition, *,
                 init: Optional[Callable[[str, torch.Tensor], None]] = None, weights=None):
        if init is not None and not callable(init):
            raise TypeError(f"initialize: init must be a callable (name, tensor) that fills the "
                            f"tensor in place, or None; got {type(init).__name__}")
        self.model = model
        self.partition = partition
        self.init = init
        # tensor name -> safetensors file holding it
        self.files: dict[str, str] = {} if weights is None else _index(weights)
        self._owner = {}  # slot index -> module holding it first (module order)
        for module in model.modules():
            for p in module._parameters.values():
                slot = partition.slot_of(p) if p is not None else None
                if slot is not None:
                    self._owner.setdefault(slot.index, module)
        self._aliases: dict[int, list] = {}
        for name, slot in partition.names.items():
            self._aliases.setdefault(slot.index, []).append(name)

    def check(self) -> None:
        """Raise (one line naming the problem and the fix) before anything is allocated."""
        meta_buffers = self._meta_buffers()
        missing = [k for k in meta_buffers if k not in self.files]
        if missing:
            raise ValueError(f"buffer {missing[0]!r} is on the meta device and no weights file holds it; "
                             f"zero_offload fills parameters only: create buffers on the CPU (register "
                             f"them after building the model on meta) or save them in the weights")
        if self.files:
            missing, bad = [], []
            shapes = {k: f.get_slice(k).get_shape() for k, f in _opened(self.files, self.files)}
            for s in self.partition.slots:
                key = self._key(s)
                if key is None:
                    missing.append(s.name)
                elif tuple(shapes[key]) != tuple(s.shape):
                    bad.append(f"{key}: {tuple(shapes[key])} in the file, {tuple(s.shape)} in the model")
            if missing:
                raise ValueError(f"the weights have no tensor for {len(missing)} parameter(s) of the model "
                                 f"(e.g. {', '.join(repr(n) for n in missing[:5])}); pass the checkpoint "
                                 f"saved from this architecture (names as model.state_dict() has them)")
            if bad:
                raise ValueError(f"weights of the wrong shape: {'; '.join(bad[:5])}; pass the checkpoint "
                                 f"saved from this architecture and size")
            known = set(self.partition.names) | set(meta_buffers) | set(self.model.state_dict(keep_vars=True))
            extra = [k for k in self.files if k not in known]
            if extra:
                warnings.warn(f"initialize: the weights hold {len(extra)} tensor(s) the model does not "
                              f"have (e.g. {', '.join(repr(k) for k in extra[:5])}); they are not read",
                              RuntimeWarning, stacklevel=4)
            return
        if self.init is None:
            for s in self.partition.slots:
                module = self._owner.get(s.index)
                if s.param.is_meta and not callable(getattr(module, "reset_parameters", None)):
                    raise ValueError(
                        f"parameter {s.name!r} is on the meta device and its module "
                        f"({type(module).__name__}) has no reset_parameters(); pass "
                        f"initialize(..., init=fn) with fn(name, tensor) filling each parameter "
                        f"(e.g. GPT.init_param), or weights='path/to/safetensors'")

    def _key(self, slot) -> Optional[str]:
        return next((name for name in self._aliases.get(slot.index, [slot.name]) if name in self.files), None)

    def fill(self, layout: ChunkLayout, flat: torch.Tensor) -> None:
        """Write the first values of the chunk's slots into ``flat`` (the chunk's elements) at
        their offsets: ``init`` writes straight into it; a file's tensors and the model's own
        are copied."""
        if self.files:
            slot_of = {self._key(s): s for s in layout.slots}
            for key, f in _opened(self.files, slot_of):
                s = slot_of[key]
                flat[s.offset:s.end].view(s.shape).copy_(f.get_tensor(key))
            return
        for s in layout.slots:
            p, dst = s.param, flat[s.offset:s.end].view(s.shape)
            if p.is_meta and self.init is not None:
                with torch.no_grad():
                    self.init(s.name, dst)
                continue
            if p.is_meta:
                module = self._owner[s.index]
                for q in module._parameters.values():
                    if q is not None and q.is_meta:
                        set_values(q, torch.empty(q.shape, dtype=q.dtype))
                with torch.no_grad():
                    module.reset_parameters()
            dst.copy_(p.detach())

    def buffers(self) -> None:
        """Meta buffers get their values from the weights (``check`` made sure they are there)."""
        if not self.files:
            return
        where = self._meta_buffers()
        for key, f in _opened(self.files, where):
            mod, n = where[key]
            mod._buffers[n] = f.get_tensor(key)

    def _meta_buffers(self) -> dict:
        """state_dict name -> (module, buffer name) of the buffers on the meta device."""
        return {f"{m}.{n}" if m else n: (mod, n) for m, mod in self.model.named_modules()
                for n, b in mod._buffers.items() if b is not None and b.is_meta}


def _index(weights) -> dict:
    """tensor name -> file, for a safetensors file or a directory of them."""
    try:
        path = os.fspath(weights)
    except TypeError:
        raise TypeError(f"initialize: weights must be a path to a .safetensors file or a directory "
                        f"of them, got {type(weights).__name__}") from None
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError("initialize(weights=...) reads safetensors files: pip install safetensors "
                          "(or zero_offload[hf])") from None
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                wmap = json.load(f).get("weight_map", {})
            return {k: os.path.join(path, v) for k, v in wmap.items()}
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise ValueError(f"initialize: weights directory {path!r} holds no .safetensors file; pass "
                             f"the directory save_pretrained wrote or one .safetensors file")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ValueError(f"initialize: weights {path!r} does not exist; pass a .safetensors file or a "
                         f"directory of them")
    out = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for k in f.keys():
                    out[k] = file
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign file: say which
            raise ValueError(f"initialize: {file!r} is not a readable safetensors file ({e})") from None
    return out


def _opened(files: dict, keys):
    """``(key, open safetensors file holding it)`` for ``keys``, one file open at a time (its
    mapping lives only while it is open)."""
    from safetensors import safe_open
    by_file: dict[str, list] = {}
    for k in keys:
        by_file.setdefault(files[k], []).append(k)
    for path, ks in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            for k in ks:
                yield k, f
