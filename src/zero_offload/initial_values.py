"""Where ``initialize`` takes each parameter's first values, chunk by chunk, so the host never
holds a second full copy of the model:

- the model's own tensors (a model built on the CPU or a GPU): each chunk copies them, then the
  engine frees them (``Handover.take``);
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

[Note: hand-over] ``Handover`` moves the values between the model and the engine's chunks, one
chunk at a time both ways, so host memory never holds the model's copy beside all the state (a
13B model's 51 GB of fp32 values on top of its pinned state was an OOM kill): ``take`` writes a
chunk's first values into its full-precision payload and lets the model's own copies go (the
parameters then hold the guard's placeholders); ``give_back`` reads each chunk taken (the fp32
master, or the params payload for fp32 and frozen chunks), frees its memory in every tier and
puts the values back into the parameters, on the device and in the dtype each had at
initialize (the CPU for a model built on the meta device). It runs when initialize fails part
way (the chunks taken so far) and at ``close`` (the store is closed right after).
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .runtime.partition import ChunkLayout, Partition
from .weights import INDEX

__all__ = ["Handover", "InitialValues", "handed_over_bytes", "set_values"]


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


def handed_over_bytes(partition: Partition) -> int:
    """Host bytes of the model's parameters that ``initialize`` frees (CPU tensors nothing but
    the parameter holds: a storage the caller also references stays resident and is not
    counted), so an "auto" host budget counts what is resident after the hand-over."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # pragma: no cover - a torch without it: count nothing
        return 0
    total = 0
    for s in partition.slots:
        p = s.param
        if p.device.type == "cpu":
            # The param holds its storage once; the temporary storage object once more.
            if use_count(p.untyped_storage()._cdata) <= 2:
                total += p.untyped_storage().nbytes()
    return total


def _home_of(t: torch.Tensor) -> torch.device:
    """Where ``close`` puts a tensor's values back: its device, the CPU for a meta tensor."""
    return torch.device("cpu") if t.is_meta else t.device


class Handover:
    """The model's values into the engine's chunks and back: [Note: hand-over]. Built before
    anything of the model changes: it records where each parameter and buffer came from."""

    def __init__(self, model: nn.Module, partition: Partition, values: InitialValues,
                 placeholders: Sequence[torch.Tensor]):
        self._model, self._partition, self._values = model, partition, values
        self._placeholders = placeholders
        """Each slot's zero-byte placeholder, by slot index (the guard's)."""
        self._origins = tuple((_home_of(s.param), s.param.dtype) for s in partition.slots)
        self._empty_origins = tuple((p, _home_of(p), p.dtype) for _, p in partition.empty)
        self._buffer_origins = tuple((m, name, _home_of(b)) for m in model.modules()
                                     for name, b in m._buffers.items() if b is not None)
        self._taken: list = []
        """The chunks (the chunk group's records) holding the model's values, in order."""

    def take(self, group, chunk) -> None:
        """The first values of ``chunk`` (a ``GroupChunk`` with its layout; the model's,
        ``init``'s or the weights file's) written straight into its full-precision payload (this
        rank's shard of it), the working-dtype params rounded from it; then the model's own
        copies are let go."""
        layout = chunk.layout
        group.write_values(chunk, functools.partial(self._values.fill, layout))
        for s in layout.slots:
            set_values(s.param, self._placeholders[s.index])
        self._taken.append(chunk)

    def take_rest(self, device: torch.device, dtype: torch.dtype) -> None:
        """What has no chunk: zero-element parameters get an empty ``dtype`` tensor on
        ``device``; buffers their first values (``InitialValues.buffers``), moved to ``device``."""
        for _, p in self._partition.empty:
            set_values(p, torch.empty(p.shape, device=device, dtype=dtype))
        self._values.buffers()
        for m in self._model.modules():
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = b.to(device)

    def give_back(self, group) -> None:
        """The values of every chunk taken back into the model's parameters, each chunk's memory
        freed as soon as its values are out (``group.read_values(take=True)``)."""
        group.drop_buffers()
        taken, self._taken = self._taken, []
        for chunk in taken:
            flat = group.read_values(chunk, take=True)
            for s in chunk.layout.slots:
                device, dtype = self._origins[s.index]
                s.param.data = flat[s.offset:s.end].view(s.shape).to(device=device, dtype=dtype,
                                                                       copy=True)

    def give_rest_back(self) -> None:
        """Zero-element parameters and buffers back where they were at initialize."""
        for p, device, dtype in self._empty_origins:
            p.data = p.data.to(device=device, dtype=dtype)
        for m, name, device in self._buffer_origins:
            b = m._buffers.get(name)
            if isinstance(b, torch.Tensor):
                m._buffers[name] = b.to(device)


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
