"""Engine checkpoints: the whole training state in one directory, written atomically and verified
on load.

Layout of a checkpoint directory::

    .zero_offload      marker, written first: proves zero_offload wrote this directory (only
                       directories carrying it are ever removed by zero_offload)
    engine.pt          meta: format version, counters (global step, skipped steps), the slot
                       table (name, shape, per-slot optimizer step), loss scaler, lr scheduler,
                       hyperparameters, RNG states (torch CPU and CUDA, python, numpy), config,
                       and the caller's ``client_state`` (JSON data, read by
                       ``read_client_state`` without loading the checkpoint)
    chunk_00000.pt     per saved chunk: "master" and the update rule's state (Adam: "exp_avg",
    ...                "exp_avg_sq"), fp32 flat tensors (trainable), or "frozen" in the working
                       dtype, plus the chunk's slot table (name, offset, elements) and, for state
                       sized by the params' shapes (Adafactor's factors), "spans": per such key,
                       each slot's (name, offset, elements) in it
    manifest.json      written last: every other file's size and CRC-32 (computed while the
                       file was written, so nothing is read back)

Values are stored by parameter *name*, so a checkpoint loads into an engine with another chunk
size, placement or working dtype (the working copy is rebuilt from the fp32 master, rounded to
nearest even exactly as the CPU-Adam kernel writes it). Optimizer state homed on NVMe is read
through host memory one chunk at a time, so saving needs no more RAM than one chunk.

[Note: atomic save] Everything is written into ``.<name>.tmp-<pid>-<n>`` beside the target and
fsynced; then an existing checkpoint at the target is renamed aside to ``.<name>.old-<pid>-<n>``,
the new one renamed into place, and the old one removed. A crash while writing leaves the
previous checkpoint untouched at the target (the temp dir is removed on the next save or by the
failing save itself; a full disk is one ``CheckpointError``); a crash between the two renames
leaves the previous one whole under its ``.old`` name, which ``load_checkpoint`` falls back to
when the target is missing. Temp and ``.old`` dirs are removed only when they carry the marker
and hold nothing else (``remove_checkpoint``); a target that is not empty is replaced only when
it is such a directory: a directory of the user's, or a checkpoint someone saved another file
into, is refused before anything is written.

[Note: verified load] ``load_checkpoint`` checks everything before it writes anything: the
manifest, every file's size and CRC-32, the format version, parameter names/shapes/trainable
flags, the chunk files' slot tables and payloads, optimizer group counts, scheduler presence
(and a dry-run load into copies of the optimizer and scheduler), loss scaler and RNG states.
Only then are weights, optimizer state, counters, hyperparameters and RNG written, so a refused
load leaves the engine exactly as it was. A damaged file raises ``CheckpointCorrupt`` naming the
file and what is wrong; a checkpoint that does not fit the engine raises ``CheckpointError``.
Verification reads each file once (engine.pt is parsed from the bytes that were checksummed);
the chunk files are read again while they are applied (from the page cache when they fit).
"""
from __future__ import annotations

import contextlib
import copy
import errno
import functools
import glob
import io
import itertools
import json
import os
import random
import re
import shutil
import warnings
import zlib
from typing import Optional

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_checkpoint", "chunk_state", "load_chunk_state", "verify", "read_client_state", "is_zero_offload_checkpoint", "replaceable",
           "remove_checkpoint", "save_in_progress", "CheckpointError", "CheckpointCorrupt", "FORMAT_VERSION"]

FORMAT_VERSION = 1
META = "engine.pt"
MANIFEST = "manifest.json"
MARKER = ".zero_offload"
_MARKER_TEXT = "zero_offload checkpoint: written by zero_offload.checkpoint.save_checkpoint\n"
_MANIFEST_KIND = "zero_offload checkpoint manifest"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_READ_BLOCK = 8 << 20
_counter = itertools.count()
_CHUNK_FILE = re.compile(r"chunk_\d{5,}\.pt")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not match the model."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's files are damaged: missing, truncated, failing their checksum, or the save
    that wrote them did not finish. An earlier checkpoint may still be whole."""


def _chunk_file(i: int) -> str:
    return f"chunk_{i:05d}.pt"


def _foreign(path: str) -> list[str]:
    """The entries of a checkpoint directory that ``save_checkpoint`` did not write there (a
    config or tokenizer file someone saved beside it, say)."""
    ours = (MARKER, MANIFEST, META)
    return sorted(e for e in os.listdir(path) if e not in ours and not _CHUNK_FILE.fullmatch(e))


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Checksummed:
    """Write-only file wrapper: counts the bytes and folds them into a CRC-32 as they pass, and
    keeps the first OSError (torch's zip writer masks it: a full disk surfaces as "unexpected
    pos" from its end-of-file record)."""

    def __init__(self, f):
        self._f = f
        self.size = 0
        self.crc = 0
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        view = memoryview(data)
        try:
            self._f.write(view)
        except OSError as e:
            self.error = self.error or e
            raise
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def _save(obj, path: str) -> dict:
    """torch.save ``obj`` to ``path``, fsynced; returns its manifest record (size, CRC-32)."""
    with open(path, "wb") as f:
        out = _Checksummed(f)
        try:
            torch.save(obj, out)
        except Exception:
            if out.error is not None:
                raise out.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return {"size": out.size, "crc32": out.crc}


def _write_small(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def is_zero_offload_checkpoint(path) -> bool:
    """True when directory ``path`` carries the marker every checkpoint directory (and temp dir)
    written by ``save_checkpoint`` gets first, whole or not. Only such directories are ever
    removed by zero_offload."""
    try:
        with open(os.path.join(os.fspath(path), MARKER)) as f:
            return f.read(len(_MARKER_TEXT) + 1) == _MARKER_TEXT
    except (OSError, UnicodeDecodeError):
        return False


def _ours_alone(path: str) -> bool:
    """A directory zero_offload wrote (not a link to one) that holds nothing else."""
    return not os.path.islink(path) and is_zero_offload_checkpoint(path) and not _foreign(path)


def replaceable(path) -> bool:
    """Whether ``save_checkpoint`` may replace directory ``path``: it is missing or empty, or a
    checkpoint zero_offload wrote holding nothing else."""
    path = os.fspath(path)
    return not os.path.isdir(path) or not os.listdir(path) or _ours_alone(path)


def remove_checkpoint(path) -> bool:
    """Remove directory ``path`` if zero_offload wrote it (``is_zero_offload_checkpoint``) and it
    holds nothing else; anything else is left alone, a checkpoint someone added a file to
    included. Returns whether it was removed."""
    path = os.fspath(path)
    if not _ours_alone(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.exists(path)


def save_in_progress(temp_name: str) -> bool:
    """Whether the process named in a ``.<name>.tmp-<pid>-<n>`` dir is still running (a save in
    progress elsewhere); False for our own pid (our own temp dirs are removed as they fail)."""
    try:
        pid = int(temp_name.rsplit("-", 2)[-2])
    except (ValueError, IndexError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no process can have that pid
        return False
    except OSError:
        return True
    return True


def _remove_stale(parent: str, name: str) -> None:
    """Temp dirs of killed saves of ``name``, and ``.old`` dirs once ``name`` is whole again;
    only those carrying the marker (or empty ones, killed before the marker was written)."""
    for stale in glob.glob(os.path.join(parent, f".{name}.tmp-*")):
        if save_in_progress(os.path.basename(stale)):
            continue
        if not remove_checkpoint(stale):
            with contextlib.suppress(OSError):
                os.rmdir(stale)  # only succeeds when empty
    if os.path.isfile(os.path.join(parent, name, MANIFEST)):
        for old in glob.glob(os.path.join(parent, f".{name}.old-*")):
            remove_checkpoint(old)


def _mount_point(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _estimated_bytes(engine) -> int:
    """fp32 master and rule state of trainable chunks, frozen ones in the working dtype."""
    fp32 = 4 * len(engine.group.state_names)
    return sum(c.numel * (fp32 if c.trainable else engine.dtype.itemsize) for c in engine.partition.chunks)


def _no_space(err: OSError, path: str, parent: str, file: str, needed: int) -> CheckpointError:
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        free = -1
    what = "no space left" if err.errno == errno.ENOSPC else "disk quota exceeded"
    previous = (f"the previous checkpoint {path} is intact" if os.path.isdir(path)
                else f"no earlier checkpoint at {path} was touched")
    return CheckpointError(
        f"{what} on {_mount_point(parent)} while writing {file} of checkpoint {path} (about "
        f"{needed} bytes needed, {free} free); free space or save elsewhere; {previous}")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])


def _buffers(module) -> dict:
    """The module's persistent buffers by name, as ``state_dict`` lists them (BatchNorm's running
    statistics, ...): a resumed run needs them as much as the weights."""
    out = {}
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def chunk_spans(group, layout) -> dict:
    """The keys ``chunk_state`` gives for ``layout`` ("frozen" for a frozen chunk), each with every
    slot's ``(lo, hi)`` in its flat tensor (runtime/chunk_group.py, [Note: state layout])."""
    if not layout.trainable:
        return {"frozen": tuple((s.offset, s.end) for s in layout.slots)}
    chunk = group.chunks[layout.index]
    return {k: group.spans(chunk, k) for k in group.names(chunk)}


def chunk_state(group, layout) -> dict:
    """CPU copies of one chunk's state (``group``: the engine's ``ChunkGroup``, ``layout``: the
    chunk's ``ChunkLayout``): the group's ``state_names`` keys ("master" and the update rule's
    state, e.g. "exp_avg", "exp_avg_sq"; fp32, bf16 moments widened) for a trainable chunk,
    "frozen" (working dtype) otherwise, and "steps" (one per slot). Collective with several
    ranks."""
    chunk = group.chunks[layout.index]
    if not layout.trainable:
        return {"frozen": group.read_values(chunk), "steps": [0] * len(layout.slots)}
    return group.state(chunk)  # (its slots are the layout's, in order)


def load_chunk_state(group, layout, fill, steps) -> None:
    """Overwrite one chunk's state: ``fill(key, buf, spans)`` writes the values of ``key`` (as
    ``chunk_state`` names them) into a zeroed flat buffer, slot i at ``spans[i]`` (a frozen chunk:
    ``fill("frozen", buf)``, at the slots' offsets); ``steps``: one per slot. bf16/fp16 working
    params become the master rounded, as the kernel writes them."""
    chunk = group.chunks[layout.index]
    if layout.trainable:
        group.load_state(chunk, fill, steps)
    else:
        group.write_values(chunk, functools.partial(fill, "frozen"))


class _ChunkStates:
    """``(layout, chunk_state(engine.group, layout))`` chunk by chunk; ``drain`` takes the rest, so every
    rank takes part in every gather of a data-parallel engine whatever happened on one of them."""

    def __init__(self, engine):
        self._engine, self._next = engine, 0

    def __iter__(self):
        chunks = self._engine.partition.chunks
        while self._next < len(chunks):
            layout = chunks[self._next]
            self._next += 1
            yield layout, chunk_state(self._engine.group, layout)

    def drain(self) -> None:
        for _ in self:
            pass


def save_checkpoint(engine, path, *, client_state: Optional[dict] = None) -> None:
    """See the module docstring and [Note: atomic save]. With several ranks every rank calls it:
    each chunk's state is gathered whole and rank 0 writes it (one chunk in memory at a time),
    so the checkpoint is the one a single process writes and loads at any world size.
    ``client_state`` (a JSON-serializable dict: the caller's own progress and settings) is stored
    with it; ``read_client_state`` returns it (rank 0's)."""
    if client_state is not None:
        try:
            client_state = json.loads(json.dumps(client_state))  # a copy of plain data, or refused now
        except (TypeError, ValueError) as e:
            raise TypeError(f"save_checkpoint: client_state must be a JSON-serializable dict ({e}); "
                            f"pass plain numbers, strings, lists and dicts") from None
        if not isinstance(client_state, dict):
            raise TypeError(f"save_checkpoint: client_state must be a dict, got "
                            f"{type(client_state).__name__}")
    states = _ChunkStates(engine)
    error = None
    try:
        if engine.shard.rank == 0:
            _write_checkpoint(engine, path, states, client_state)
    except BaseException as e:  # noqa: BLE001 - raised below, once every rank agrees
        error = e
    if engine.shard.world > 1:
        states.drain()
        if not engine.shard.agree(error is None) and error is None:
            raise CheckpointError(f"rank 0 could not write the checkpoint {path} (its error says why); "
                                  f"the previous checkpoint there is unchanged")
    if error is not None:
        raise error


def _write_checkpoint(engine, path, states: _ChunkStates, client_state: Optional[dict]) -> None:
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    if engine.micro_step != 0:
        raise CheckpointError(
            f"save_checkpoint called in the middle of a gradient accumulation window "
            f"({engine.micro_step} of {engine.config.grad_accum} micro-batches done); save after the "
            f"step() that completes the window")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a directory; pass a checkpoint directory path")
    if not replaceable(path):  # a save replaces the directory: never a user's
        foreign = _foreign(path) if is_zero_offload_checkpoint(path) else None
        if foreign:
            raise CheckpointError(f"{path} holds {len(foreign)} file(s) zero_offload did not write "
                                  f"({', '.join(foreign[:3])}); saving there would remove them: move "
                                  f"them out or pass another directory")
        raise CheckpointError(f"{path} is a directory zero_offload did not write (no {MARKER} marker, "
                              f"or a link); saving there would replace what it holds: pass a new "
                              f"directory or a checkpoint save_checkpoint wrote")
    _remove_stale(parent, name)
    tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{next(_counter)}")
    writing = tmp
    try:
        os.makedirs(tmp)
        writing = MARKER
        _write_small(os.path.join(tmp, MARKER), _MARKER_TEXT)
        engine.synchronize()
        chunks_meta, files, slot_table = [], {}, {}
        for layout, payload in states:
            for s, step in zip(layout.slots, payload.pop("steps")):
                slot_table[s.name] = {"shape": tuple(s.shape), "trainable": s.trainable,
                                      "step": step if s.trainable else 0}
            slots = [(s.name, s.offset, s.numel) for s in layout.slots]
            like = [(s.offset, s.end) for s in layout.slots]
            spans = {k: [(s.name, lo, hi - lo) for s, (lo, hi) in zip(layout.slots, sp)]
                     for k, sp in payload.pop("spans", {}).items() if list(sp) != like}
            writing = _chunk_file(layout.index)
            files[writing] = _save({"slots": slots, **({"spans": spans} if spans else {}), **payload},
                                   os.path.join(tmp, writing))
            del payload
            chunks_meta.append({"file": writing, "trainable": layout.trainable})
        meta = {
            "format_version": FORMAT_VERSION,
            "global_step": engine.global_step,
            "skipped_steps": engine.skipped_steps,
            "slots": slot_table,
            "chunks": chunks_meta,
            "working_dtype": str(engine.dtype),
            "optimizer_state": engine.optimizer.state_dict(),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
            "rng": _rng_state(),
            "buffers": {n: b.detach().to("cpu", copy=True) for n, b in _buffers(engine.module).items()},
            "config": engine.config.to_dict(),
            "spec": engine.spec.to_dict(),
            "client_state": client_state,
        }
        writing = META
        files[META] = _save(meta, os.path.join(tmp, META))
        writing = MANIFEST  # last: its presence means every file above is whole
        _write_small(os.path.join(tmp, MANIFEST), json.dumps(
            {"kind": _MANIFEST_KIND, "format_version": FORMAT_VERSION, "files": files}, indent=1))
        _fsync_dir(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in _NO_SPACE:
            raise _no_space(e, path, parent, writing, _estimated_bytes(engine)) from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(path):
        old = os.path.join(parent, f".{name}.old-{os.getpid()}-{next(_counter)}")
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(parent)
    if old is not None and not remove_checkpoint(old):  # (checked above: ours, or empty)
        with contextlib.suppress(OSError):
            os.rmdir(old)


def _is_whole_dir(path: str) -> bool:
    """A finished checkpoint: a manifest, or an engine.pt without our marker (written before
    manifests existed, where engine.pt was the last file)."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return True
    return os.path.isfile(os.path.join(path, META)) and not os.path.exists(os.path.join(path, MARKER))


def _resolve(path: str) -> str:
    """The checkpoint directory to read: ``path``, or the previous checkpoint left under its
    ``.old`` name by a save interrupted between its two renames ([Note: atomic save])."""
    if _is_whole_dir(path):
        return path
    parent, name = os.path.split(path)
    olds = sorted(glob.glob(os.path.join(parent, f".{name}.old-*")), key=os.path.getmtime)
    olds = [o for o in olds if _is_whole_dir(o)]
    if not os.path.exists(path) and olds:
        warnings.warn(f"checkpoint {path} is missing; a save was interrupted while replacing it. "
                      f"Loading the previous checkpoint, {olds[-1]}")
        return olds[-1]
    if os.path.isdir(path) and is_zero_offload_checkpoint(path):
        raise CheckpointCorrupt(f"{path} is an incomplete checkpoint (no {MANIFEST}: the save that "
                                f"wrote it was killed before it finished); load an earlier checkpoint")
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is not a zero_offload checkpoint (no {MANIFEST} or {META} "
                              f"inside); pass the directory written by engine.save_checkpoint")
    raise CheckpointError(f"no checkpoint at {path}")


def _damaged(path: str, what: str) -> CheckpointCorrupt:
    return CheckpointCorrupt(f"{path} {what}; the checkpoint is damaged: load an earlier checkpoint "
                             f"(or restore this one from a copy)")


def _read_manifest(path: str) -> Optional[dict]:
    """The manifest's file table, or None for a checkpoint written before manifests existed."""
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(file, f"is unreadable ({e})") from None
    if not isinstance(manifest, dict):
        raise _damaged(file, "is not a zero_offload manifest (not a JSON object)")
    files = manifest.get("files")
    if manifest.get("kind") != _MANIFEST_KIND or not isinstance(files, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("crc32"), int)
            for r in files.values()) or META not in files:
        raise _damaged(file, "is not a zero_offload manifest (fields missing)")
    _check_format(path, manifest.get("format_version"))
    return files


def _check_format(path: str, version) -> None:
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {version!r}, this version of zero_offload "
                              f"reads format {FORMAT_VERSION}")


def _crc_file(file: str, keep: bool) -> tuple:
    """(CRC-32, the bytes if ``keep``) of a file, read once in blocks."""
    crc, parts = 0, []
    with open(file, "rb", buffering=0) as f:
        for block in iter(lambda: f.read(_READ_BLOCK), b""):
            crc = zlib.crc32(block, crc)
            if keep:
                parts.append(block)
    return crc, (b"".join(parts) if keep else None)


def _check_files(path: str, files: dict, *, checksums: bool) -> Optional[bytes]:
    """Sizes of every file (all first: cheap), then CRC-32s; returns engine.pt's bytes when its
    checksum was computed (so it is parsed from what was verified, not read again)."""
    for fname, rec in files.items():
        file = os.path.join(path, fname)
        try:
            size = os.path.getsize(file)
        except OSError:
            raise _damaged(file, "is missing") from None
        if size < rec["size"]:
            raise _damaged(file, f"is truncated: {size} of {rec['size']} bytes")
        if size != rec["size"]:
            raise _damaged(file, f"has {size} bytes, the manifest says {rec['size']}")
    meta_bytes = None
    if checksums:
        for fname, rec in files.items():
            data = _checked_bytes(os.path.join(path, fname), rec, keep=fname == META)
            if data is not None:
                meta_bytes = data
    return meta_bytes


def _checked_bytes(file: str, rec: dict, *, keep: bool) -> Optional[bytes]:
    """Check ``file``'s CRC-32 against its manifest record; returns its bytes if ``keep``."""
    crc, data = _crc_file(file, keep=keep)
    if crc != rec["crc32"]:
        raise _damaged(file, f"fails its checksum (CRC-32 {crc:08x}, the manifest says "
                             f"{rec['crc32']:08x}: its bytes changed after the save)")
    return data


def _verified(path, *, checksums: bool) -> tuple[str, Optional[dict], Optional[bytes]]:
    """``(directory, manifest's file table, engine.pt's bytes)`` of the checkpoint at ``path``
    once ``_check_files`` passed; the table and bytes are None (with a warning) for a checkpoint
    written before manifests existed, the bytes None without ``checksums``."""
    resolved = _resolve(os.path.abspath(os.fspath(path)))
    files = _read_manifest(resolved)
    if files is None:
        warnings.warn(f"{resolved} was written by an older zero_offload without a manifest; its "
                      f"files cannot be verified")
        return resolved, None, None
    return resolved, files, _check_files(resolved, files, checksums=checksums)


def verify(path, *, checksums: bool = True) -> str:
    """Check that the checkpoint directory ``path`` is whole without loading it: the marker and
    manifest are present, and every file has its recorded size and (``checksums=True``) CRC-32.
    Returns the directory that ``load_checkpoint`` would read (``path``, or the previous one kept
    by a save interrupted between its renames). Raises ``CheckpointCorrupt`` naming the damaged
    file, ``CheckpointError`` when ``path`` is no checkpoint. Checkpoints written before manifests
    existed pass with a warning (nothing to check them against)."""
    return _verified(path, checksums=checksums)[0]


def read_client_state(path) -> Optional[dict]:
    """The ``client_state`` that ``save_checkpoint`` stored in checkpoint ``path``, without loading
    the checkpoint into an engine (None: none was passed, or an older zero_offload wrote it).
    Checks first what it reads: every file's size against the manifest and engine.pt's CRC-32 (the
    other files' checksums are checked by ``load_checkpoint``). Raises as ``verify`` does."""
    resolved, files, _ = _verified(path, checksums=False)
    meta_file = os.path.join(resolved, META)
    data = None if files is None else _checked_bytes(meta_file, files[META], keep=True)
    meta = _load_file(meta_file, data, weights_only=False)
    if not isinstance(meta, dict):
        raise _damaged(meta_file, "is not a zero_offload engine.pt (not a dict)")
    _check_format(resolved, meta.get("format_version"))
    client_state = meta.get("client_state")
    return client_state if isinstance(client_state, dict) else None


def _load_file(file: str, data: Optional[bytes] = None, **kw):
    """torch.load of ``file`` (or of ``data``, its bytes already read) onto the CPU."""
    try:
        return torch.load(file if data is None else io.BytesIO(data), map_location="cpu", **kw)
    except Exception as e:  # torch raises RuntimeError/pickle errors for damaged zip files
        raise _damaged(file, f"cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _plan_load(engine, path: str) -> tuple[str, dict, dict]:
    """Every check of [Note: verified load]; changes nothing. Returns what ``load_checkpoint``
    writes: the directory, engine.pt's contents and where each slot's values of each key are (slot
    name -> {key: (chunk file, offset, numel)})."""
    path, files, meta_bytes = _verified(path, checksums=True)
    meta = _load_file(os.path.join(path, META), meta_bytes, weights_only=False)
    _check_format(path, meta.get("format_version") if isinstance(meta, dict) else None)
    saved = meta["slots"]
    ours = {s.name: s for s in engine.partition.slots}
    missing, unexpected = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    wrong = [n for n in ours if n in saved and tuple(saved[n]["shape"]) != tuple(ours[n].shape)]
    frozen_flip = [n for n in ours if n in saved and saved[n]["trainable"] != ours[n].trainable]
    if missing or unexpected or wrong or frozen_flip:
        raise CheckpointError(
            f"{path} does not match this model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}, shape mismatch "
            f"{[(n, tuple(saved[n]['shape']), tuple(ours[n].shape)) for n in wrong[:5]]}, "
            f"trainable flag changed {frozen_flip[:5]}; build the same architecture (and the same "
            f"requires_grad flags) before load_checkpoint")
    saved_groups = len(meta["optimizer_state"]["param_groups"])
    if saved_groups != len(engine.optimizer.param_groups):
        raise CheckpointError(
            f"{path} was saved with {saved_groups} optimizer param group(s), this engine has "
            f"{len(engine.optimizer.param_groups)}; pass the same initialize(param_groups=...) "
            f"as the run that saved it")
    if engine.lr_scheduler is not None and meta["lr_scheduler"] is None:
        raise CheckpointError(f"{path} has no lr scheduler state but this engine has a scheduler; "
                              f"initialize without lr_scheduler=, or load a checkpoint of a run "
                              f"that had one")
    # Dry runs into copies: whatever torch's own load_state_dict refuses is refused here, first.
    for what, obj, state in (("optimizer", engine.optimizer, meta["optimizer_state"]),
                             ("lr scheduler", engine.lr_scheduler, meta["lr_scheduler"])):
        if obj is None:
            continue
        try:
            copy.deepcopy(obj).load_state_dict(state)
        except Exception as e:
            raise CheckpointError(f"{path}: its {what} state does not load into this engine's "
                                  f"({type(e).__name__}: {e}); use the same {what} as the run that "
                                  f"saved it") from None
    scaler = meta["loss_scaler"]
    if engine.scaler is not None and scaler is not None and not (
            isinstance(scaler, dict) and {"scale", "growth_tracker"} <= set(scaler)):
        raise _damaged(os.path.join(path, META), "holds no valid loss scaler state")
    buffers = meta.get("buffers")  # absent in checkpoints written before buffers were saved
    if buffers is not None:
        ours_b = _buffers(engine.module)
        if not isinstance(buffers, dict) or set(buffers) != set(ours_b):
            raise CheckpointError(
                f"{path}: its module buffers {sorted(buffers)[:5] if isinstance(buffers, dict) else buffers!r} "
                f"do not match the model's {sorted(ours_b)[:5]}; load it into the model that saved it")
        for n, b in buffers.items():
            if not isinstance(b, torch.Tensor) or b.shape != ours_b[n].shape:
                raise CheckpointError(f"{path}: buffer {n} has shape {getattr(b, 'shape', None)}, the "
                                      f"model's has {tuple(ours_b[n].shape)}; load it into the model "
                                      f"that saved it")
    rng = meta["rng"]
    if not (isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor)
            and rng["torch"].dtype is torch.uint8 and "python" in rng):
        raise _damaged(os.path.join(path, META), "holds no valid RNG state")
    if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) > torch.cuda.device_count():
        raise CheckpointError(f"{path} holds RNG states of {len(rng['cuda'])} GPUs, this machine has "
                              f"{torch.cuda.device_count()}; load it where as many GPUs are visible")
    # Where each saved slot's values of each key are (its params' elements, or its part of a
    # payload sized by shapes: "spans"), and that their bytes are there.
    where: dict = {}  # slot name -> {key: (chunk file, offset, elements)}
    for c in meta["chunks"]:
        file = os.path.join(path, c["file"])
        if files is not None and c["file"] not in files:
            raise _damaged(file, f"is named by {META} but not by {MANIFEST}")
        saved_chunk = _load_file(file, mmap=True, weights_only=True)
        if not isinstance(saved_chunk, dict) or not isinstance(saved_chunk.get("slots"), list):
            raise _damaged(file, "is not a zero_offload chunk file (no slot table)")
        flat = {k: v for k, v in saved_chunk.items() if isinstance(v, torch.Tensor) and v.dim() == 1}
        for n, off, numel in saved_chunk["slots"]:
            if n in ours and ours[n].numel != numel:
                raise _damaged(file, f"records {numel} values for {n}, the model has {ours[n].numel}")
            where[n] = {k: (c["file"], off, numel) for k in flat}
        for k, table in (saved_chunk.get("spans") or {}).items():
            for n, off, numel in table:
                where.setdefault(n, {})[k] = (c["file"], off, numel)
        for n, _, _ in saved_chunk["slots"]:
            for k, (_, off, numel) in where[n].items():
                if k not in flat or off + numel > flat[k].numel():
                    raise _damaged(file, f"is too short for {n} (its {k!r} needs {off + numel} values)")
        del saved_chunk, flat
    not_saved = sorted(set(ours) - set(where))
    if not_saved:
        raise _damaged(path, f"has no values for {not_saved[:5]} in its chunk files")
    for layout in engine.partition.chunks:  # every key each slot's chunk needs, of the size it needs
        for key, spans in chunk_spans(engine.group, layout).items():
            for s, (lo, hi) in zip(layout.slots, spans):
                got = where[s.name].get(key)
                if got is None:
                    kind, ours_kind = (meta.get("spec") or {}).get("type"), engine.spec.to_dict().get("type")
                    if kind != ours_kind:
                        raise CheckpointError(
                            f"{path} holds the state of optimizer {kind!r}, this engine runs {ours_kind!r} "
                            f"(it needs {key!r} of {s.name}); load it into an engine with the optimizer "
                            f"(and param groups) that saved it")
                    raise CheckpointError(f"{path} has no {key!r} state for {s.name}: it was saved with "
                                          f"another optimizer for that param; use the optimizer and "
                                          f"param groups that saved it")
                if got[2] != hi - lo:
                    raise CheckpointError(f"{path} holds {got[2]} values of {key!r} for {s.name}, this "
                                          f"engine's optimizer keeps {hi - lo}; use the optimizer that "
                                          f"saved it")
    return path, meta, where


def load_checkpoint(engine, path) -> None:
    """Restore everything ``save_checkpoint`` wrote. Checks everything first ([Note: verified
    load]); nothing changes in the engine when it raises ``CheckpointError``."""
    path, meta, where = _plan_load(engine, path)
    saved = meta["slots"]

    engine.synchronize()
    cache: dict = {}

    def saved_values(file: str) -> dict:
        if file not in cache:
            cache.clear()  # one file at a time keeps host memory to one chunk
            cache[file] = torch.load(os.path.join(path, file), map_location="cpu", mmap=True,
                                     weights_only=True)
        return cache[file]

    with torch.no_grad():
        for layout in engine.partition.chunks:
            def fill(key, buf, spans=None, slots=layout.slots):
                for i, s in enumerate(slots):
                    f, off, numel = where[s.name][key]
                    lo, hi = (s.offset, s.end) if spans is None else spans[i]
                    buf[lo:hi].copy_(saved_values(f)[key][off:off + numel])

            load_chunk_state(engine.group, layout, fill, [int(saved[s.name]["step"]) for s in layout.slots])
    cache.clear()
    engine.load_progress(global_step=meta["global_step"], skipped_steps=meta["skipped_steps"])
    engine.optimizer.load_state_dict(meta["optimizer_state"])
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if engine.scaler is not None and meta["loss_scaler"] is not None:
        engine.scaler.load_state_dict(meta["loss_scaler"])
    _set_rng_state(meta["rng"])
    if meta.get("buffers") is not None:
        ours_b = _buffers(engine.module)
        with torch.no_grad():
            for n, b in meta["buffers"].items():
                ours_b[n].copy_(b)
    else:
        warnings.warn(f"{path} was written before checkpoints held module buffers (running "
                      f"statistics and the like): the model keeps its current buffers")
