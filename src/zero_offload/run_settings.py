"""Run settings shared by ``zero-offload train`` and ``zero-offload bench prefetch``: exit codes,
flag parsers, the precedence of defaults / checkpoint / --config / flags (``resolve``, see
[Note: config precedence] in cli.py), and the model a run builds. The CLI and the benchmark both
import it, so neither imports the other. No torch at import: the parser's flag types live here
(cli.py [Note: torch after parsing]).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: torch is imported where it is used ([Note: torch after parsing])
    import torch

from .runtime.vocab import human_bytes

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

STATE_FILE = "train_state.json"
"""In the checkpoint directory: which engine checkpoint is the latest, and the run's settings."""


class UsageError(Exception):
    """A bad flag or config value: reported as one line on stderr, exit code 2."""


class Interrupted(KeyboardInterrupt):
    """A signal that stops the command at once: Ctrl-C (exit 130) or SIGTERM (exit 143)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's errors become our one-line usage errors
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# --------------------------------------------------------------------------------- flag types

def number_type(convert, ok, what: str):
    """An argparse type: ``convert(text)`` where ``ok`` holds of it; anything else is "expected {what}".
    It also takes a number (of a --config "train" section or a checkpoint): an int, or a float
    where ``convert`` is float; never a bool."""
    def parse(text):
        try:
            value = convert(text) if type(text) in (str, int, convert) else None
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


positive_int = number_type(int, lambda v: v >= 1, "a positive integer")
nonneg_int = number_type(int, lambda v: v >= 0, "an integer >= 0")
positive_float = number_type(float, lambda v: math.isfinite(v) and v > 0, "a positive number")


def depth_list(text: str) -> list[int]:
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        depths = []
    if not depths or any(d < 0 for d in depths) or len(set(depths)) != len(depths):
        raise argparse.ArgumentTypeError(
            f"expected distinct integers >= 0 separated by commas, e.g. 0,1,2,4,8; got {text!r}")
    return sorted(depths)


# ----------------------------------------------------------------------------- run settings

@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the model/data flags of ``train`` and ``bench prefetch`` resolve to."""

    preset: Optional[str]
    """GPT preset name (zero_offload.models.PRESETS), or None when hf_config is set."""
    hf_config: Optional[str]
    """Hugging Face architecture: a config.json path, a directory or hub name."""
    steps: int
    batch_size: int
    seq_len: Optional[int]
    """Training sequence length; None = the model's."""
    seed: int
    lr: Optional[float]
    """Overrides the optimizer spec's lr; None keeps it."""


TRAIN_KEYS = {f.name for f in dataclasses.fields(RunSettings)} | {"save_every", "sample_tokens"}
"""Keys allowed in the ``"train"`` section of a --config file."""

_RUN_TYPES = {"steps": positive_int, "batch_size": positive_int, "seq_len": positive_int, "seed": nonneg_int,
              "lr": positive_float, "save_every": nonneg_int, "sample_tokens": nonneg_int}
"""The number settings, each checked by its flag's type whichever layer set it."""

_PLACEMENT_FLAGS = ("params", "optimizer", "nvme_dir", "prefetch_depth", "dtype")


def _default_dtype() -> str:
    import torch

    # bf16 is the GPU recipe of BASELINES.md; on a CPU, fp32 matmuls are the fast path.
    return "bf16" if torch.cuda.is_available() else "fp32"


def _read_config_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise UsageError(f"cannot read --config {path}: {e.strerror}; pass an existing JSON file") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--config {path} is not valid JSON ({e.msg} at line {e.lineno}); fix the file") from None
    if not isinstance(obj, dict):
        raise UsageError(f"--config {path} must hold a JSON object, got {type(obj).__name__}")
    return obj


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


_MODEL_KEYS = ("preset", "hf_config")
"""Settings a resumed run cannot change: they decide which parameters exist."""

def is_temp_swap(nvme_dir: Optional[str]) -> bool:
    """Whether ``nvme_dir`` is the temporary swap directory ``resolve`` made (removed at exit)."""
    from .runtime.swap_io import TEMP_DIR_PREFIX, default_swap_location
    return bool(nvme_dir) and Path(nvme_dir).parent == Path(default_swap_location()) \
        and Path(nvme_dir).name.startswith(TEMP_DIR_PREFIX)


def remove_dead_runs_spaces(nvme_dir: Optional[str], say) -> None:
    """At a run's start: remove the swap spaces (and temporary swap directories) that dead runs
    left in the swap location of ``nvme_dir`` (the default temporary one for a temporary swap
    directory; nothing without one) and ``say`` so in one line with the bytes freed; see swap_io
    [Note: swap locations]. Never fails the run: what it cannot remove is named in that line."""
    if not nvme_dir:
        return
    from .runtime.swap_io import default_swap_location, remove_dead_spaces

    directory = default_swap_location() if is_temp_swap(nvme_dir) else nvme_dir
    try:
        results = remove_dead_spaces(directory)
    except OSError as e:  # e.g. an unreadable directory: the run reports its own problem with it
        say(f"could not look for dead runs' swap spaces in {directory}: {one_line(e)}", flush=True)
        return
    spaces = [f for f, reason in results if reason is None and not f.temp_dir]
    temps = [f for f, reason in results if reason is None and f.temp_dir]
    kept = [(f, reason) for f, reason in results if reason is not None]
    if spaces or temps or kept:
        say(f"removed {len(spaces)} swap space(s) of dead runs ({human_bytes(sum(f.nbytes for f in spaces))}) "
            f"in {directory}" + (f" and {len(temps)} of their temporary swap directories" if temps else "")
            + (f"; kept {len(kept)}, e.g. {kept[0][0].path}: {kept[0][1]}" if kept else ""), flush=True)


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def _layer(merged: dict, source: dict, name: str, values: dict) -> None:
    """Apply one precedence layer: its values win over the layers below (see [Note: config
    precedence] in the module docstring); ``source`` records which layer set each key."""
    for key, value in values.items():
        merged[key] = value
        source[key] = name


def resolve(args, *, defaults: dict, temp_dirs: contextlib.ExitStack, saved: Optional[dict] = None,
            world: int = 1, report=print):
    """Flags + --config file (+ the settings of the checkpoint being resumed) -> (OffloadConfig,
    optimizer spec, RunSettings, extra train keys).

    ``saved`` is the resumed run's state (``{"settings", "offload", "optim", "world"}``, each
    optional); every value that a file or flag changes against it is reported in one line on
    stdout (through ``report``, a ``print``; with several ranks only rank 0's prints), and a change
    of model (preset, hf_config) is refused. Resumed on another number of ranks (``world``), the
    run keeps its global batch where it can ([Note: global batch]). Raises UsageError for any bad
    value (config.py's messages name the field and the fix).
    """
    from . import config as zc

    saved = saved or {}
    file_cfg = _read_config_file(args.config) if args.config else {}
    file_name = f"--config {args.config}"
    train_section = file_cfg.pop("train", {}) or {}
    if not isinstance(train_section, dict):
        raise UsageError(f"{file_name}: \"train\" must be an object of flag names")
    unknown = set(train_section) - TRAIN_KEYS
    if unknown:
        raise UsageError(f"{file_name}: unknown \"train\" key(s) {sorted(unknown)}; "
                         f"valid keys: {', '.join(sorted(TRAIN_KEYS))}")

    # settings: defaults < checkpoint < file "train" section < flags
    run, run_source = {}, {}
    _layer(run, run_source, "default", defaults)
    # the checkpoint's lr is in its optimizer spec ("optim"), which the file's "optim" may override
    skip = {"lr"} if saved.get("optim") else set()
    _layer(run, run_source, "checkpoint", {k: v for k, v in (saved.get("settings") or {}).items()
                                           if k in TRAIN_KEYS and k not in skip})
    _layer(run, run_source, file_name, train_section)
    _layer(run, run_source, "flag", {k: getattr(args, k) for k in TRAIN_KEYS if getattr(args, k, None) is not None})
    for key, parse in _RUN_TYPES.items():
        if run.get(key) is not None:
            try:
                run[key] = parse(run[key])
            except argparse.ArgumentTypeError as e:
                raise UsageError(f"{key} from {run_source[key]}: {e}") from None
    if run.get("hf_config"):
        if getattr(args, "preset", None) is not None or train_section.get("preset"):
            if run_source["hf_config"] == "checkpoint":
                raise UsageError(f"--resume: the checkpoint is of the HF model {run['hf_config']}, a preset "
                                 f"cannot load its weights; drop --preset, or pass another --out")
            raise UsageError("both a preset and an HF config are given: pass --preset or --hf-config, not both")
        run["preset"] = None  # the default preset gives way to the HF architecture
    extras = {k: run.pop(k) for k in ("save_every", "sample_tokens") if k in run}
    try:
        settings = RunSettings(**run)
    except TypeError as e:
        raise UsageError(f"bad \"train\" settings: {one_line(e)}") from None
    from .presets import PRESETS

    if settings.preset is not None and settings.preset not in PRESETS:
        raise UsageError(f"unknown model preset {settings.preset!r}; choose one of {', '.join(PRESETS)}")

    # offload config: the command's placement defaults < checkpoint < file < flags. A DeepSpeed
    # file is translated whole (its absent sections have DeepSpeed's meaning, e.g. no bf16 = fp32).
    flags = {k: getattr(args, k) for k in _PLACEMENT_FLAGS if getattr(args, k, None) is not None}
    base, base_source = {}, {}
    _layer(base, base_source, "default", {"params": "cpu", "optimizer": "nvme", "dtype": _default_dtype()})
    saved_offload = dict(saved.get("offload") or {})
    if is_temp_swap(saved_offload.get("nvme_dir")):  # a state file written before _saved_offload
        saved_offload["nvme_dir"] = None  # that run's temporary swap is gone: make a new one
    _layer(base, base_source, "checkpoint", saved_offload)
    optim, optim_source = None, "default"
    if saved.get("optim"):
        optim, optim_source = saved["optim"], "checkpoint"
    try:
        if "zero_optimization" in file_cfg:  # a DeepSpeed config
            ds_cfg, ds_spec = zc.load_config(file_cfg)
            _layer(base, base_source, file_name, ds_cfg.to_dict())
            if ds_spec is not None:
                optim, optim_source = ds_spec.to_dict(), file_name
        else:
            if "optim" in file_cfg:
                optim, optim_source = file_cfg.pop("optim"), file_name
            _layer(base, base_source, file_name, file_cfg)
        _layer(base, base_source, "flag", flags)
        wants_nvme = "nvme" in (str(base.get("params", "")).lower(), str(base.get("optimizer", "")).lower())
        if wants_nvme and not base.get("nvme_dir"):
            from .runtime.swap_io import temp_swap_dir  # with an owner file: [Note: swap locations]
            base["nvme_dir"] = temp_dirs.enter_context(temp_swap_dir())
        cfg, _ = zc.load_config(base)
        # the default lr is tuned on the tiny char model: 3e-3 plateaus at ~3.3
        spec = zc.AdamW(lr=1e-2, weight_decay=0.0) if optim is None else zc.spec_from_dict(optim)
    except (ValueError, TypeError) as e:
        raise UsageError(one_line(e)) from None
    if settings.lr is not None:
        spec = dataclasses.replace(spec, lr=settings.lr)
    if saved:
        _report_overrides(saved, settings=settings, run_source=run_source, cfg=cfg,
                          base_source=base_source, spec=spec, optim_source=optim_source, say=report)
        chosen = run_source["batch_size"] not in ("default", "checkpoint") or \
            base_source.get("grad_accum") not in (None, "default", "checkpoint")
        cfg = _keep_global_batch(saved, cfg, batch=settings.batch_size, world=world, chosen=chosen, say=report)
    return cfg, spec, settings, extras


def _keep_global_batch(saved: dict, cfg, *, batch: int, world: int, chosen: bool, say=print):
    """[Note: global batch] A step of ``train`` trains on world x batch x grad_accum sequences.
    Resumed on another number of ranks, the checkpoint's global batch is kept by the gradient
    accumulation where it divides evenly (2 ranks x 16 x 1 -> 1 x 16 x 2; the micro-batches are
    then the very batches the ranks drew), unless a file or flag set --batch-size or grad_accum;
    either way one line on stdout says what the global batch is. Returns the config to run."""
    old_world = saved.get("world")
    old_batch = (saved.get("settings") or {}).get("batch_size")
    old_accum = (saved.get("offload") or {}).get("grad_accum", 1)
    if not all(type(v) is int and v >= 1 for v in (old_world, old_batch, old_accum)) or old_world == world:
        return cfg  # the same world, or a state file that does not say (written before it did)
    old = old_world * old_batch * old_accum
    was = f"{old} ({old_world} rank(s) x batch {old_batch} x grad_accum {old_accum})"
    if not chosen and old % (world * batch) == 0:
        accum = old // (world * batch)
        say(f"--resume: the checkpoint's global batch {was} is kept on {world} rank(s) by "
              f"grad_accum {accum}: {world} x batch {batch} x grad_accum {accum}", flush=True)
        return cfg.replace(grad_accum=accum)
    new = world * batch * cfg.grad_accum
    if new != old:
        keep = (f"--batch-size {old // world // cfg.grad_accum}" if old % (world * cfg.grad_accum) == 0
                else f"a --batch-size and grad_accum (--config) whose product is {old // world}"
                if old % world == 0 else f"a number of ranks that divides {old}")
        say(f"--resume: the global batch changes from the checkpoint's {was} to {new} ({world} "
              f"rank(s) x batch {batch} x grad_accum {cfg.grad_accum}); to keep it, pass {keep}",
              flush=True)
    return cfg


def _report_overrides(saved: dict, *, settings: RunSettings, run_source: dict, cfg, base_source: dict,
                      spec, optim_source: str, say=print) -> None:
    """One line on stdout per setting of the resumed run that a file or flag changes; UsageError
    for a change of model (its parameters would not match the checkpoint's)."""
    def who(source: str, key: str, value) -> str:
        return f"{flag_name(key)} {value}" if source == "flag" else f"{key} {value} from {source}"

    def report(source: str, key: str, new, old) -> None:
        say(f"--resume: {who(source, key, new)} overrides the checkpoint's {old}", flush=True)

    old_settings = saved.get("settings") or {}
    for key in _MODEL_KEYS:
        new, old = getattr(settings, key), old_settings.get(key)
        if key in old_settings and new != old:
            was = f"hf:{old_settings['hf_config']}" if old_settings.get("hf_config") else old_settings.get("preset")
            raise UsageError(f"--resume: {who(run_source[key], key, new)} differs from the checkpoint's "
                             f"model {was}, whose weights it cannot load; drop it, or pass another --out "
                             f"to start a new run")
    for key in ("steps", "batch_size", "seq_len", "seed"):
        new, old = getattr(settings, key), old_settings.get(key)
        if key in old_settings and new is not None and new != old:
            report(run_source[key], key, new, old)
    new_offload = cfg.to_dict()
    for key, old in (saved.get("offload") or {}).items():
        new = new_offload.get(key)
        if base_source.get(key) not in (None, "default", "checkpoint") and new != old:
            report(base_source[key], key, new, old)
    for key, new in spec.to_dict().items():
        old = (saved.get("optim") or {}).get(key)
        if old is not None and new != old:
            source = run_source["lr"] if key == "lr" and settings.lr is not None else optim_source
            report(source, key, new, old)


# --------------------------------------------------------------------------------- models

def build_model(settings: RunSettings):
    """The model the settings name and its seq_len: an HF model on the CPU in fp32 (the engine
    takes it over), a preset GPT on the meta device (the engine fills it chunk by chunk with
    ``GPT.init_param``: no full copy in host memory, whatever its size)."""
    from . import models

    if settings.hf_config:
        try:
            model = models.from_hf(settings.hf_config)
        except ImportError as e:
            raise UsageError(one_line(e)) from None
        except (OSError, ValueError) as e:
            raise UsageError(f"--hf-config {settings.hf_config}: {one_line(e)}; pass a config.json "
                             f"path or a directory holding one") from None
        if model.vocab_size < 256:
            raise UsageError(f"--hf-config vocab_size is {model.vocab_size}, smaller than the byte "
                             f"vocabulary (256); set vocab_size >= 256 in the config")
        max_len = model.seq_len
    else:
        cfg = models.preset(settings.preset)
        model = models.GPT(cfg, device="meta")
        max_len = cfg.seq_len
    seq_len = settings.seq_len or max_len
    if seq_len > max_len:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's maximum {max_len}; pass a smaller --seq-len")
    return model, seq_len


def describe_model(settings: RunSettings) -> str:
    return f"hf:{settings.hf_config}" if settings.hf_config else settings.preset


# ---------------------------------------------------------------------------- engine stats

# ------------------------------------------------------------------------------------ train

def batch_generator(seed: int, step: int) -> torch.Generator:
    import torch

    # one generator per step: a resumed run draws the same batches as an uninterrupted one
    return torch.Generator().manual_seed(seed * 1_000_003 + step)
