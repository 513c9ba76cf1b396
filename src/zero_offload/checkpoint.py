"""Engine checkpoints: the whole training state in one directory, written atomically.

Layout of a checkpoint directory::

    engine.pt          meta: format version, counters (global step, skipped steps), the slot
                       table (name, shape, per-slot optimizer step), loss scaler, lr scheduler,
                       hyperparameters, RNG states (torch CPU and CUDA, python, numpy), config
    chunk_00000.pt     per saved chunk: {"master", "exp_avg", "exp_avg_sq"} fp32 flat tensors
    ...                (trainable) or {"frozen"} in the working dtype, plus the chunk's slot table

Values are stored by parameter *name*, so a checkpoint loads into an engine with another chunk
size, placement or working dtype (the working copy is rebuilt from the fp32 master, rounded to
nearest even exactly as the CPU-Adam kernel writes it). Optimizer state homed on NVMe is read
through host memory one chunk at a time, so saving needs no more RAM than one chunk.

[Note: atomic save] Everything is written into ``.<name>.tmp-<pid>-<n>`` beside the target and
fsynced; then an existing checkpoint at the target is renamed aside to ``.<name>.old-<pid>-<n>``,
the new one renamed into place, and the old one removed. A crash while writing leaves the
previous checkpoint untouched at the target (the temp dir is removed on the next save or by the
failing save itself); a crash between the two renames leaves the previous one whole under its
``.old`` name, which ``load_checkpoint`` falls back to when the target is missing.
"""
from __future__ import annotations

import glob
import itertools
import os
import random
import shutil
import warnings

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "FORMAT_VERSION"]

FORMAT_VERSION = 1
META = "engine.pt"
_counter = itertools.count()


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not match the model."""


def _chunk_file(i: int) -> str:
    return f"chunk_{i:05d}.pt"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])


def _optimizer_names(engine) -> dict:
    """Canonical checkpoint key -> the engine's payload for trainable chunks."""
    master = "master" if engine.dtype is not torch.float32 else "params"
    return {"master": master, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def save_checkpoint(engine, path) -> None:
    """See the module docstring and [Note: atomic save]."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    if engine._micro != 0:
        raise CheckpointError(
            f"save_checkpoint called in the middle of a gradient accumulation window "
            f"({engine._micro} of {engine.config.grad_accum} micro-batches done); save after the "
            f"step() that completes the window")
    for stale in glob.glob(os.path.join(parent, f".{name}.tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)  # left by a save that crashed
    tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{next(_counter)}")
    os.makedirs(tmp)
    try:
        engine.synchronize()
        names = _optimizer_names(engine)
        chunks_meta = []
        for chunk in engine._chunks:
            layout = chunk.layout
            if layout.trainable:
                payload = {key: engine._read_payload(chunk, src) for key, src in names.items()}
            else:
                payload = {"frozen": engine._read_payload(chunk, "params")}
            slots = [(s.name, s.offset, s.numel) for s in layout.slots]
            _save({"slots": slots, **payload}, os.path.join(tmp, _chunk_file(layout.index)))
            chunks_meta.append({"file": _chunk_file(layout.index), "trainable": layout.trainable})
        slot_table = {}
        for chunk in engine._chunks:
            for i, s in enumerate(chunk.layout.slots):
                slot_table[s.name] = {"shape": tuple(s.shape), "trainable": s.trainable,
                                      "step": chunk.steps[i] if s.trainable else 0}
        meta = {
            "format_version": FORMAT_VERSION,
            "global_step": engine.global_step,
            "skipped_steps": engine.skipped_steps,
            "slots": slot_table,
            "chunks": chunks_meta,
            "working_dtype": str(engine.dtype),
            "hyperparams": {k: v for k, v in engine.optimizer.param_groups[0].items() if k != "params"},
            "optimizer_state": engine.optimizer.state_dict(),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
            "rng": _rng_state(),
            "config": engine.config.to_dict(),
            "spec": engine.spec.to_dict(),
        }
        _save(meta, os.path.join(tmp, META))
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(path):
        old = os.path.join(parent, f".{name}.old-{os.getpid()}-{next(_counter)}")
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _resolve(path: str) -> str:
    """The checkpoint directory to read: ``path``, or the previous checkpoint left under its
    ``.old`` name by a save interrupted between its two renames ([Note: atomic save])."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    parent, name = os.path.split(path)
    olds = sorted(glob.glob(os.path.join(parent, f".{name}.old-*")), key=os.path.getmtime)
    olds = [o for o in olds if os.path.isfile(os.path.join(o, META))]
    if not os.path.exists(path) and olds:
        warnings.warn(f"checkpoint {path} is missing; a save was interrupted while replacing it. "
                      f"Loading the previous checkpoint, {olds[-1]}")
        return olds[-1]
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is not a zero_offload checkpoint (no {META} inside); pass the "
                              f"directory written by engine.save_checkpoint")
    raise CheckpointError(f"no checkpoint at {path}")


def load_checkpoint(engine, path) -> None:
    """Restore everything ``save_checkpoint`` wrote. Checks first that every parameter name and
    shape matches the engine's model; nothing changes in the engine when it raises."""
    path = _resolve(os.path.abspath(os.fspath(path)))
    meta = torch.load(os.path.join(path, META), map_location="cpu", weights_only=False)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format_version')!r}, this version "
                              f"of zero_offload reads format {FORMAT_VERSION}")
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
    # Where each saved slot is: name -> (file, offset, numel).
    where = {}
    for c in meta["chunks"]:
        slots = torch.load(os.path.join(path, c["file"]), map_location="cpu", mmap=True,
                           weights_only=True)["slots"]
        for n, off, numel in slots:
            where[n] = (c["file"], off, numel)

    engine.synchronize()
    cache: dict = {}

    def saved_values(file: str) -> dict:
        if file not in cache:
            cache.clear()  # one file at a time keeps host memory to one chunk
            cache[file] = torch.load(os.path.join(path, file), map_location="cpu", mmap=True,
                                     weights_only=True)
        return cache[file]

    names = _optimizer_names(engine)
    lowp = engine.dtype is not torch.float32
    with torch.no_grad():
        for chunk in engine._chunks:
            slots = chunk.layout.slots

            def fill(key):
                def write(buf):
                    for s in slots:
                        f, off, numel = where[s.name]
                        buf[s.offset:s.end].copy_(saved_values(f)[key][off:off + numel])
                return write

            if chunk.layout.trainable:
                for key, payload in names.items():
                    engine._write_payload(chunk, payload, fill(key))
                if lowp:
                    engine._write_payload(chunk, "params", fill("master"))  # rounded like the kernel
                chunk.steps = [int(saved[s.name]["step"]) for s in slots]
            else:
                engine._write_payload(chunk, "params", fill("frozen"))
    cache.clear()
    for chunk in engine._chunks:
        chunk.window.clear()
        chunk.accumulating = False
    engine._micro = 0
    engine.global_step = int(meta["global_step"])
    engine.skipped_steps = int(meta["skipped_steps"])
    engine.optimizer.load_state_dict(meta["optimizer_state"])
    if engine.lr_scheduler is not None:
        if meta["lr_scheduler"] is None:
            raise CheckpointError(f"{path} has no lr scheduler state but this engine has a scheduler")
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if engine.scaler is not None and meta["loss_scaler"] is not None:
        engine.scaler.load_state_dict(meta["loss_scaler"])
    _set_rng_state(meta["rng"])
