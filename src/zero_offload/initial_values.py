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

[Note: fill at memory speed] Within ``InitialValues.drawing(threads)`` (the engine's loop over
the chunks) the values come in as fast as memory takes them, and stay exactly what one thread
would give:
- ``init`` and ``reset_parameters()`` run with their large ``normal_`` / ``uniform_`` fills drawn
  on ``threads`` threads (ops/rng.py, [Note: parallel draws]): the same values, the generator left
  where the serial calls leave it. With several ranks a rank draws only the slices of a fill
  that overlap its shard, the generator moved past the rest; an init that then reads what it
  drew elsewhere in the parameter (a norm, a QR) is run again for that parameter in full
  (ops/rng.py, [Note: kept draws]);
- a weights file's tensors are read with ``preadv`` straight into the chunk (no copy in between),
  in pieces on ``threads`` threads, a rank reading only its shard's bytes (``fill(..., mine=)``);
  a tensor stored in another dtype is converted on the way.

[Note: hand-over] ``Handover`` moves the values between the model and the engine's chunks, one
chunk at a time both ways, so host memory never holds the model's copy beside all the state (a
13B model's 51 GB of fp32 values on top of its pinned state was an OOM kill): ``take`` writes a
chunk's first values into its full-precision payload and lets the model's own copies go (the
parameters then hold the guard's placeholders); ``give_back`` reads each chunk taken (the fp32
master, or the params payload for fp32 and frozen chunks) straight from the store's buffer into
each parameter's own new tensor, frees the chunk's memory in every tier and so puts the values
back into the parameters, on the device and in the dtype each had at
initialize (the CPU for a model built on the meta device). It runs when initialize fails part
way (the chunks taken so far) and at ``close`` (the store is closed right after).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import struct
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .ops.rng import ParallelDraws
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
        self.files: dict[str, _Stored] = {} if weights is None else _index(weights)
        """Tensor name -> where a safetensors file holds it."""
        self._owner = {}  # slot index -> module holding it first (module order)
        for module in model.modules():
            for p in module._parameters.values():
                slot = partition.slot_of(p) if p is not None else None
                if slot is not None:
                    self._owner.setdefault(slot.index, module)
        self._aliases: dict[int, list] = {}
        for name, slot in partition.names.items():
            self._aliases.setdefault(slot.index, []).append(name)
        self._draws: Optional[ParallelDraws] = None
        self._reader: Optional[_Reader] = None

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
            for s in self.partition.slots:
                key = self._key(s)
                if key is None:
                    missing.append(s.name)
                elif self.files[key].shape != tuple(s.shape):
                    bad.append(f"{key}: {self.files[key].shape} in the file, {tuple(s.shape)} in the model")
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

    @contextlib.contextmanager
    def drawing(self, threads: int, *, ranked: bool = False):
        """Within: ``fill`` draws and reads on ``threads`` threads ([Note: fill at memory speed]);
        ``ranked``: each chunk is a rank's shard, its draws kept to it (even on one thread)."""
        try:
            if self.files:
                self._reader = _Reader(threads)
            elif threads > 1 or ranked:
                self._draws = ParallelDraws(threads=threads)
            yield
        finally:
            for each in (self._reader, self._draws):
                if each is not None:
                    each.close()
            self._reader = self._draws = None

    def fill(self, layout: ChunkLayout, flat: torch.Tensor, *, mine: Optional[tuple[int, int]] = None) -> None:
        """Write the first values of the chunk's slots into ``flat`` (the chunk's elements) at
        their offsets: ``init`` writes straight into it; a file's tensors are read into it and
        the model's own copied. ``mine``: the elements ``[lo, hi)`` the caller keeps (a rank's
        shard): the weights' bytes outside it are not read."""
        if self.files:
            lo, hi = (0, flat.numel()) if mine is None else mine
            reader = self._reader if self._reader is not None else _Reader(1)
            try:
                for s in layout.slots:
                    a, b = max(s.offset, lo), min(s.end, hi)
                    if a < b:
                        reader.read(self.files[self._key(s)], flat[s.offset:s.end], a - s.offset, b - s.offset)
                reader.wait()
            finally:
                if reader is not self._reader:
                    reader.close()
            return
        with self._draws.mode() if self._draws is not None else contextlib.nullcontext():
            for s in layout.slots:
                p, dst = s.param, flat[s.offset:s.end].view(s.shape)
                if p.is_meta and self.init is not None:
                    with torch.no_grad():
                        self._init(s, dst, flat, mine)
                    continue
                if p.is_meta:
                    module = self._owner[s.index]
                    for q in module._parameters.values():
                        if q is not None and q.is_meta:
                            set_values(q, torch.empty(q.shape, dtype=q.dtype))
                    with torch.no_grad():
                        module.reset_parameters()
                dst.copy_(p.detach())

    def _init(self, s, dst: torch.Tensor, flat: torch.Tensor, mine: Optional[tuple[int, int]]) -> None:
        """``init`` of one slot; a rank that keeps only ``mine`` of the chunk draws only the
        slices of it that it keeps, and the slot again in full if the init read a skipped
        element (ops/rng.py's [Note: kept draws])."""
        draws = self._draws
        if draws is None or mine is None or (mine[0] <= s.offset and s.end <= mine[1]):
            self.init(s.name, dst)
            return
        with draws.keeping(flat, *mine):
            self.init(s.name, dst)
        if draws.tainted:
            draws.undo()
            dst.zero_()  # as the chunk's buffer was before
            self.init(s.name, dst)

    def buffers(self) -> None:
        """Meta buffers get their values from the weights (``check`` made sure they are there)."""
        if not self.files:
            return
        with _Reader(1) as reader:
            for key, (mod, n) in self._meta_buffers().items():
                stored = self.files[key]
                t = torch.empty(stored.shape, dtype=stored.dtype)
                reader.read(stored, t.view(-1), 0, t.numel())
                reader.wait()
                mod._buffers[n] = t

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
        lo, hi, _ = group.shards.span(chunk.whole)
        group.write_values(chunk, functools.partial(self._values.fill, layout, mine=(lo, hi)))
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
        freed as soon as its values are out (``group.read_values(take=True)``), in the order that
        frees host memory first (``ChunkGroup.values_back_order``): a handover that failed for
        want of host room (``initialize``'s clean-up) still gives the model all its values back."""
        group.drop_buffers()
        taken, self._taken = self._taken, []
        for chunk in group.values_back_order(taken):
            with group.values(chunk, take=True) as flat:  # one copy: the store's buffer -> each param
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


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where a safetensors file holds one tensor (the format: an 8-byte little-endian header
    length, a JSON header naming each tensor's dtype, shape and byte range, then the bytes)."""

    file: str
    dtype: torch.dtype
    shape: tuple
    offset: int
    """Byte offset of the tensor's first element in the file."""


def _header(path: str) -> dict:
    """name -> ``_Stored`` of every tensor of one safetensors file, checked against its size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than its 8-byte header length")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"a header of {n} bytes in a file of {size}")
        meta = json.loads(f.read(n))
    if not isinstance(meta, dict):
        raise ValueError("its header is not a JSON object")
    out = {}
    for key, v in meta.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(v.get("dtype")) if isinstance(v, dict) else None
        if dtype is None:
            raise ValueError(f"tensor {key!r} has dtype {v.get('dtype') if isinstance(v, dict) else v!r}, "
                             f"which zero_offload does not read")
        shape = tuple(int(d) for d in v["shape"])
        begin, end = (int(x) for x in v["data_offsets"])
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0 or 8 + n + end > size:
            raise ValueError(f"tensor {key!r}: bytes [{begin}, {end}) do not hold {dtype} {list(shape)} "
                             f"inside the file")
        out[key] = _Stored(file=path, dtype=dtype, shape=shape, offset=8 + n + begin)
    return out


def _index(weights) -> dict:
    """tensor name -> ``_Stored``, for a safetensors file or a directory of them."""
    try:
        path = os.fspath(weights)
    except TypeError:
        raise TypeError(f"initialize: weights must be a path to a .safetensors file or a directory "
                        f"of them, got {type(weights).__name__}") from None
    wmap = None
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                wmap = json.load(f).get("weight_map", {})
            files = sorted({os.path.join(path, v) for v in wmap.values()})
        else:
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
            out.update(_header(file))
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign file: say which
            raise ValueError(f"initialize: {file!r} is not a readable safetensors file ({e})") from None
    if wmap is not None:  # the index names the file of each tensor
        out = {k: out[k] for k, v in wmap.items() if k in out and out[k].file == os.path.join(path, v)}
    return out


_PIECE = 32 << 20
"""Bytes one thread reads at a time."""


class _Reader:
    """Reads stored tensors (or element ranges of them) into CPU tensors with ``preadv``, in
    pieces of ``_PIECE`` bytes on ``threads`` threads (the calling thread when 1); a piece stored
    in another dtype goes through a piece-sized buffer and is converted. ``wait`` returns when
    every read issued so far is done (raising the first failure)."""

    def __init__(self, threads: int):
        self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                            thread_name_prefix="zero_offload-read")
                      if threads > 1 else None)
        self._fds: dict[str, int] = {}
        self._pending: list = []

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def read(self, stored: _Stored, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Elements ``[lo, hi)`` of ``stored`` (flattened) into the same elements of ``dst`` (a
        contiguous CPU tensor of the tensor's numel)."""
        fd = self._fd(stored.file)
        flat = dst.view(-1)
        step = max(1, _PIECE // stored.dtype.itemsize)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            job = functools.partial(_read_piece, fd, stored, flat, a, b)
            self._pending.append(self._pool.submit(job) if self._pool is not None else job())

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for f in pending:
            if f is not None:
                f.result()

    def close(self) -> None:
        """Wait for the reads still running (their failures are ``wait``'s to raise), close the
        files."""
        try:
            self._pending = []
            if self._pool is not None:
                self._pool.shutdown(wait=True)
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_piece(fd: int, stored: _Stored, flat: torch.Tensor, a: int, b: int) -> None:
    """Elements ``[a, b)`` of ``stored`` into ``flat[a:b]``."""
    size = stored.dtype.itemsize
    convert = flat.dtype != stored.dtype
    into = torch.empty(b - a, dtype=stored.dtype) if convert else flat[a:b]
    view = memoryview((ctypes.c_char * ((b - a) * size)).from_address(into.data_ptr())).cast("B")
    done, offset = 0, stored.offset + a * size
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"initialize: {stored.file!r} ends before the bytes of a tensor it lists; "
                             f"the file is truncated: save it again")
        done += n
    if convert:
        flat[a:b].copy_(into)
