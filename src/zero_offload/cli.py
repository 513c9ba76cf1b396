"""The ``zero-offload`` command: ``train`` | ``bench prefetch|adam|io`` | ``info``.

    zero-offload train                      # tiny GPT on the shipped text, params on the CPU,
                                            # optimizer state in an NVMe swap dir (temporary)
    zero-offload train --resume --steps 400 # continue the checkpoint in ./zero_offload_ckpt
    zero-offload bench prefetch --depths 0,1,2,4,8 --out bench/
    zero-offload info --json

Exit codes: ``EXIT_HELP`` below; every failure is one line on stderr, ``zero-offload: error:
<problem and fix>`` (see [Note: exit codes] at ``_exit_codes``).

[Note: config precedence] built-in defaults < the checkpoint's settings (``train --resume``) <
``--config FILE`` < flags; each layer sets only the fields it names. The command's defaults
are params=cpu, optimizer=nvme, dtype bf16 on CUDA / fp32 on CPU, then ``OffloadConfig``'s. A
resume continues with the settings saved beside its checkpoint (model, data, placement, dtype,
optimizer hyperparameters); a file or flag that changes one is reported in one line, and one
that changes the model (preset, hf_config) is refused. A config file's optional ``"train"``
section sets the flags of the command (``{"train": {"preset": "small", "steps": 100}}``) and its
``"optim"`` section the optimizer. A DeepSpeed config (``"zero_optimization"``) is translated
whole: what it leaves out has DeepSpeed's meaning (no ``bf16`` section: fp32).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import errno
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

if TYPE_CHECKING:  # annotations only: torch is imported where it is used ([Note: torch after parsing])
    import torch

# [Note: torch after parsing] Importing torch takes 3-30 s (CUDA libraries, a cold page cache);
# a usage error must not wait for it. So this module, run_settings, presets and the parsers of
# the benchmarks import no torch at module level: the commands import it when they run, and the
# failure mapping (_exit_codes) imports the torch-side error types only for a failure that is not
# a usage error. tests/test_cli_errors.py checks that a usage error leaves torch unimported.
from .run_settings import (EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED, STATE_FILE, UsageError,
                           Interrupted, Parser, positive_int, nonneg_int, positive_float, one_line,
                           is_temp_swap, flag_name, resolve, build_model, describe_model, human_bytes,
                           batch_generator, remove_dead_runs_spaces)


class _StopOnSigint:
    """First Ctrl-C or SIGTERM: finish the current step, save, exit 128 + the signal (130, 143).
    Second: stop at once (the engine's checkpoints are atomic, so the last one stays whole).
    ``quiet``: say nothing on the first (ranks other than 0: rank 0 speaks for all).
    Left on an error, it keeps the signals until ``main`` returns (which restores them): the
    command is stopping already, and a signal then (torchrun stops every rank once one fails)
    must not print "interrupted" over the error's one line; a second one stops at once."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, quiet: bool = False):
        self.requested = False
        self.signum: Optional[int] = None
        self.quiet = quiet
        self._previous: dict = {}

    @property
    def what(self) -> str:
        return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name

    def _handler(self, signum, frame):
        if self.requested:
            raise Interrupted(signum)
        self.requested, self.signum = True, signum
        if not self.quiet:
            print(f"\nzero-offload: {self.what}: stopping after this step and saving a checkpoint "
                  f"(Ctrl-C or SIGTERM again stops at once; the last checkpoint stays whole)",
                  file=sys.stderr, flush=True)

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handler) for s in self._SIGNALS}
        return self

    def _while_failing(self, signum, frame):
        if self.requested:
            raise Interrupted(signum)
        self.requested, self.signum = True, signum

    def __exit__(self, exc_type, exc, tb):
        failing = exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)
        for s, previous in self._previous.items():
            signal.signal(s, self._while_failing if failing else previous)


def _saved_offload(cfg) -> dict:
    """The offload settings a resumed run starts from: the temporary swap directory (gone at exit)
    is recorded as None, so a resume makes a new one."""
    d = cfg.to_dict()
    if is_temp_swap(d.get("nvme_dir")):
        d["nvme_dir"] = None
    return d


def _apply_spec(engine, spec) -> None:
    """Set the optimizer hyperparameters of every param group to ``spec``'s: after
    ``load_checkpoint`` (which restores the saved ones) so that a resume's overrides take effect."""
    for group in engine.optimizer.param_groups:
        group.update(spec.hyperparameters())


class _StateFile(NamedTuple):
    """What ``--out``'s train_state.json holds, checked before anything uses it."""

    path: Path
    present: bool
    state: Optional[dict]
    """Its contents when zero_offload can use them, else None."""
    problem: Optional[str]
    """Why it cannot be used, after its path ("is missing", "is not JSON (...)"); None when it can."""
    ours: bool
    """zero_offload wrote it (its "writer" field, or the shape of an older zero_offload's): it may
    be replaced. A file that is not (not JSON, or another program's) is never replaced."""


_STATE_WRITER = "zero_offload train"  # the state file's proof that zero_offload wrote it
_STEP_DIR = re.compile(r"step_\d{7}")
_STEP_TEMP = re.compile(r"\.step_\d{7}\.(tmp|old)-\d+-\d+")


def _count(value, minimum: int = 0) -> bool:
    return type(value) is int and value >= minimum


def _state_problem(state: dict) -> Optional[str]:
    """Why a state file's object cannot be resumed from (a field missing or of the wrong type)."""
    if not _count(state.get("step")):
        return f"has no step count (\"step\": {_short_json(state.get('step'))})"
    entries = state.get("checkpoints")
    if entries is None and state.get("checkpoint") is not None:  # an older zero_offload's
        entries = [{"name": state["checkpoint"], "step": state["step"]}]
    if not isinstance(entries, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and _STEP_DIR.fullmatch(c["name"])
            and _count(c.get("step")) for c in entries):
        return f"has no valid list of checkpoints (\"checkpoints\": {_short_json(entries)})"
    for key in ("settings", "offload", "optim"):
        if not isinstance(state.get(key, {}), dict):
            return f"has no valid \"{key}\" (an object expected, got {_short_json(state[key])})"
    if "world" in state and not _count(state["world"], 1):
        return f"has no valid world size (\"world\": {_short_json(state['world'])})"
    return None


def _short_json(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read_state(out: Path) -> _StateFile:
    path = out / STATE_FILE
    if not path.exists():
        return _StateFile(path, False, None, "is missing", True)
    try:
        state = json.loads(path.read_text())
    except UnicodeDecodeError:
        return _StateFile(path, True, None, "is not JSON (not UTF-8 text)", False)
    except json.JSONDecodeError as e:
        return _StateFile(path, True, None, f"is not JSON ({e.msg} at line {e.lineno})", False)
    except OSError as e:
        raise UsageError(f"{path} is unreadable ({e.strerror}); fix its permissions or pass another "
                         f"--out") from None
    if not isinstance(state, dict):
        return _StateFile(path, True, None, f"holds a JSON {type(state).__name__}, not an object", False)
    problem = _state_problem(state)
    if "writer" in state:
        if state["writer"] != _STATE_WRITER:
            return _StateFile(path, True, None, f"has \"writer\": {_short_json(state['writer'])}, not "
                                                f"{json.dumps(_STATE_WRITER)}", False)
    elif problem is not None:  # nothing shows an older zero_offload wrote it
        return _StateFile(path, True, None, f"has no \"writer\": {json.dumps(_STATE_WRITER)} field", False)
    return _StateFile(path, True, None if problem else state, problem, True)


def _not_ours(sf: _StateFile, newest: Optional[str] = None) -> UsageError:
    """A state file nothing shows zero_offload wrote: never used, never replaced."""
    then = (f" (--resume then continues from {newest}, the newest whole checkpoint there, which "
            f"holds its settings)" if newest else "")
    return UsageError(f"{sf.path} {sf.problem}: not a state file zero_offload wrote, so it is left "
                      f"alone; move it out of --out{then}, or pass another --out")


def _write_state(out: Path, state: dict) -> None:
    tmp = out / (STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / STATE_FILE)  # atomic: the state always names a whole checkpoint


def _checkpoints(state: Optional[dict]) -> list:
    """The state file's checkpoints, oldest first: [{"name", "step"}] (a state file of an older
    zero_offload names one)."""
    if not state:
        return []
    if "checkpoints" in state:
        return list(state["checkpoints"])
    return [{"name": state["checkpoint"], "step": state["step"]}] if state.get("checkpoint") else []


_RUN_STATE_KEYS = ("writer", "run", "settings", "offload", "optim", "world", "step")
"""What each checkpoint the command saves holds of the state file (``client_state``): a resume
finds its settings there when train_state.json is missing or damaged."""


class _Resume(NamedTuple):
    """Where ``--resume`` starts: the checkpoints to try, newest first ({"name", "step"}), the
    settings of the newest (its run state, or the state file's), what was passed over, and the
    line to say when the settings come from a checkpoint (the state file unusable)."""

    candidates: list
    saved: dict
    skipped: list
    note: Optional[str]


def _inspect(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the run state stored in checkpoint ``path`` or {}, None) when its files pass the cheap
    check (sizes, engine.pt's checksum); (None, why not) otherwise."""
    from .runtime.checkpoint import CheckpointError, read_client_state
    if not path.exists() and not any(path.parent.glob(f".{path.name}.old-*")):
        return None, f"{path.name} is missing"
    try:
        return read_client_state(path) or {}, None
    except CheckpointError as e:
        return None, f"{path.name}: {one_line(e)}"


def _run_of(name: str, run_state: dict) -> Optional[str]:
    """The run id of a checkpoint this command saved under its own name, else None (a copy under
    another name, another program's client state)."""
    if run_state.get("writer") != _STATE_WRITER or run_state.get("step") != int(name[5:]) \
            or not isinstance(run_state.get("settings"), dict):
        return None
    return run_state.get("run") if isinstance(run_state.get("run"), str) else None


def _plan_resume(out: Path, sf: _StateFile) -> _Resume:
    """The newest whole checkpoint in ``out`` and the ones before it: those the state file names
    and the step_* directories of the same run (each with its run state); without a usable state
    file, those of the run that saved last. Raises UsageError when there is none to try."""
    on_disk = sorted(e.name for e in out.iterdir() if _STEP_DIR.fullmatch(e.name)) if out.is_dir() else []
    if sf.state is not None:
        named = {c["name"]: c["step"] for c in _checkpoints(sf.state)}
        run = sf.state.get("run")
    else:
        named, run = {}, None
    from .runtime.checkpoint import is_zero_offload_checkpoint
    found, skipped = [], []
    for name in sorted(set(on_disk) | set(named)):
        run_state, why = _inspect(out / name)
        of_run = _run_of(name, run_state or {})
        entry = {"name": name, "step": named.get(name, int(name[5:])), "run_state": run_state}
        if name in named or (of_run is not None and (sf.state is None or of_run == run)):
            (found if why is None else skipped).append((entry, why))
        elif why is not None and sf.state is None and is_zero_offload_checkpoint(out / name):
            skipped.append((entry, why))  # a damaged one of ours, of which run cannot be told
    if sf.state is None and found:  # the run of the newest save; its run state says which
        last = max(found, key=lambda f: (f[0]["run_state"].get("saved_at", 0), f[0]["step"]))
        run = _run_of(last[0]["name"], last[0]["run_state"])
        found = [f for f in found if _run_of(f[0]["name"], f[0]["run_state"]) == run]
    found.sort(key=lambda f: f[0]["step"], reverse=True)
    skipped.sort(key=lambda f: f[0]["step"], reverse=True)
    newest = found[0][0] if found else None
    if not sf.ours:
        raise _not_ours(sf, newest and newest["name"])
    if newest is None:
        if sf.state is not None:  # the state names checkpoints, none of them is whole
            from .runtime.checkpoint import CheckpointCorrupt
            raise CheckpointCorrupt(f"no whole checkpoint in {out}: " + ("; ".join(why for _, why in skipped)
                                    or f"{STATE_FILE} names none") + " (no earlier one to fall back "
                                    "to); start again with --overwrite")
        if not sf.present and not on_disk:
            raise UsageError(f"--resume: no checkpoint in {out} (no {STATE_FILE}); run without "
                             f"--resume first, or pass the --out of an earlier run")
        raise UsageError(f"--resume: {sf.path} {sf.problem}, and no checkpoint in {out} holds the run's "
                         f"settings (step_* directories this zero_offload saved, whole); restore "
                         f"{STATE_FILE}, start again with --overwrite, or pass another --out")
    note = None if sf.state is not None else (
        f"zero-offload: {sf.path} {sf.problem}; resuming from {out / newest['name']} (step "
        f"{newest['step']}), the newest whole checkpoint, with the settings saved in it")
    saved = newest["run_state"] if newest["run_state"].get("settings") else sf.state
    return _Resume([{"name": f[0]["name"], "step": f[0]["step"]} for f in found], saved,
                   [why for entry, why in skipped if entry["step"] > newest["step"]], note)


def _refuse_to_replace(out: Path, sf: _StateFile) -> None:
    """A new run without --overwrite: --out must hold no run of zero_offload's (its first save
    removes the checkpoints of an older one), and no state file of someone else's."""
    if not sf.ours:
        raise _not_ours(sf)
    if sf.present:
        what = f"a checkpoint (step {sf.state['step']})" if sf.state else f"a run ({sf.path} {sf.problem})"
    else:
        from .runtime.checkpoint import is_zero_offload_checkpoint
        ours = sorted(e.name for e in out.iterdir() if _STEP_DIR.fullmatch(e.name)
                      and is_zero_offload_checkpoint(e)) if out.is_dir() else []
        if not ours:
            return
        what = f"checkpoints ({', '.join(ours[-2:])}; no {STATE_FILE})"
    raise UsageError(f"{out} already holds {what}; pass --resume to continue it, --overwrite to "
                     f"replace it, or another --out")


def _check_run_dir(out: Path, sf: _StateFile, *, replacing: bool, start: int, steps: int, every: int) -> None:
    """--out may hold the user's files; zero_offload replaces only a state file it wrote (one of
    an older zero_offload, without the writer field, can still be resumed)."""
    if replacing and not sf.ours:
        raise _not_ours(sf)
    if replacing and sf.state is not None and sf.state.get("writer") != _STATE_WRITER:
        raise UsageError(f"{sf.path} was not written by this zero_offload (no "
                         f"\"writer\": \"{_STATE_WRITER}\"); remove it yourself or pass another --out")
    # Checkpoints are saved as out/step_NNNNNNN at the save points after ``start``: one there that
    # save_checkpoint would refuse (not ours, or holding a file of someone's) is named now, not
    # after the steps ran.
    from .runtime.checkpoint import replaceable
    for entry in sorted(out.iterdir()) if out.is_dir() else ():
        n = int(entry.name[5:]) if _STEP_DIR.fullmatch(entry.name) else 0
        if n > start and (n == steps or _periodic_save(n, steps, every)) and not replaceable(entry):
            raise UsageError(f"--out {out} holds {entry.name}, which zero_offload did not write (or "
                             f"which holds files it did not write), and this run saves a checkpoint "
                             f"under that name; move it out or pass another --out")


def _periodic_save(step: int, steps: int, every: int) -> bool:
    """Whether step ``step`` of a ``steps``-step run saves with ``--save-every every`` (the last
    step always saves, apart from this rule)."""
    return every > 0 and 0 < step < steps and step % every == 0


def _clean_run_dir(out: Path, referenced: set) -> None:
    """Remove what zero_offload wrote in ``out`` and no state file names: step_* checkpoints of
    older runs or of killed saves, and their temp dirs. Only directories carrying the checkpoint
    marker go (checkpoint.remove_checkpoint); a temp dir of a save still running is kept."""
    from .runtime import checkpoint
    for entry in out.iterdir():
        if _STEP_DIR.fullmatch(entry.name) and entry.name not in referenced:
            checkpoint.remove_checkpoint(entry)
        elif _STEP_TEMP.fullmatch(entry.name) and not checkpoint.save_in_progress(entry.name):
            checkpoint.remove_checkpoint(entry)


def _save(engine, out: Path, step: int, state: dict, keep: int = 2, *, lead: bool = True) -> None:
    """Engine checkpoint into out/step_NNNNNNN, then point the state file at it (and the
    ``keep - 1`` before it), then remove what no state file names any more. A crash anywhere
    leaves the state file naming whole checkpoints: an older run's checkpoints (--overwrite) go
    only once this run's first one is whole. With several ranks only rank 0 (``lead``) touches
    files; the others take part in the engine's collective save."""
    name = f"step_{step:07d}"
    run_state = {**{k: state[k] for k in _RUN_STATE_KEYS if k in state}, "writer": _STATE_WRITER,
                 "step": step, "saved_at": time.time()}
    if not lead:
        engine.save_checkpoint(str(out / name), client_state=run_state)
        state.update(step=step, checkpoint=name)
        return
    ours = [c for c in _checkpoints(state) if c["name"] != name]
    on_disk = _read_state(out).state
    theirs = [c for c in _checkpoints(on_disk) if c not in ours]
    if any(c["name"] == name for c in theirs):  # an older run's checkpoint is about to be replaced
        theirs = [c for c in theirs if c["name"] != name]
        last = theirs[-1] if theirs else {"name": None, "step": 0}
        _write_state(out, {**on_disk, "checkpoints": theirs, "checkpoint": last["name"], "step": last["step"]})
    _clean_run_dir(out, {c["name"] for c in ours + theirs})  # room first: nothing named is touched
    engine.save_checkpoint(str(out / name), client_state=run_state)
    ours = (ours + [{"name": name, "step": step}])[-keep:]
    state.update(writer=_STATE_WRITER, step=step, checkpoint=name, checkpoints=ours)
    _write_state(out, state)
    _clean_run_dir(out, {c["name"] for c in ours})


def _start_ranks(stack) -> tuple[int, int]:
    """(rank, world size): under torchrun (WORLD_SIZE > 1) the default process group is set up
    here (NCCL with CUDA, each rank on GPU LOCAL_RANK; gloo on the CPU) and torn down at exit."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world == 1:
        return 0, 1
    import torch
    from .runtime.distributed import start_default_group
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available()
              else torch.device("cpu"))
    try:
        started = start_default_group("train", device, fix="unset WORLD_SIZE to train in one process")
    except (RuntimeError, ValueError) as e:
        raise UsageError(one_line(e)) from None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    if started:
        stack.callback(dist.destroy_process_group)
    return dist.get_rank(), dist.get_world_size()


def _resume(engine, out: Path, plan: _Resume, say) -> dict:
    """Load the newest whole checkpoint of ``plan``; one passed over (missing, incomplete, or
    failing a checksum here) is named in one line with the one used. Returns the entry loaded
    ({"name", "step"})."""
    from .runtime.checkpoint import CheckpointCorrupt
    if plan.note:
        say(plan.note, file=sys.stderr, flush=True)
    skipped = list(plan.skipped)
    for entry in plan.candidates:
        try:
            engine.load_checkpoint(str(out / entry["name"]))
        except CheckpointCorrupt as e:  # the engine is unchanged: try the one before
            skipped.append(f"{entry['name']}: {one_line(e)}")
            continue
        if skipped:
            say(f"zero-offload: the newest checkpoint cannot be resumed ({'; '.join(skipped)}); resuming "
                f"from the previous whole one, {out / entry['name']} (step {entry['step']})",
                file=sys.stderr, flush=True)
        return entry
    raise CheckpointCorrupt(f"no whole checkpoint in {out}: " + "; ".join(skipped) +
                            " (no earlier one to fall back to); start again with --overwrite")


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        raise UsageError("the progress bar needs tqdm: `pip install tqdm` (or `pip install "
                         "zero_offload[cli]`), or pass --no-progress") from None
    return tqdm


_BAR_WINDOW = 20
"""The progress bar's tokens/s is the median of this many last steps (the final line: all)."""


def _bar_postfix(bar, engine, loss: float, tokens_per_s: float) -> None:
    resident = engine.stats().bytes_held  # tier -> bytes the store holds now
    bar.set_postfix_str(f"loss={loss:.3f} tokens/s={tokens_per_s:,.0f} " +
                        " ".join(f"{t}={human_bytes(b)}" for t, b in resident.items()), refresh=False)


def _gather(value, world: int) -> list:
    """``value`` of every rank, in rank order (a collective: every rank calls it)."""
    if world == 1:
        return [value]
    import torch.distributed as dist

    values = [None] * world
    dist.all_gather_object(values, value)
    return values


def _swap_where(dirs: list) -> Optional[str]:
    """Where the run swaps, for the banner: ``dirs`` is every rank's nvme_dir (None: no swap).
    With several ranks the engine swaps into nvme_dir/rank<r>: one shared --nvme-dir is named
    once as DIR/rank{0..N-1}; temporary ones (one per rank) are each named."""
    if dirs[0] is None:
        return None
    temp = " (temporary)" if is_temp_swap(dirs[0]) else ""
    if len(dirs) == 1:
        return dirs[0] + temp
    if len(set(dirs)) == 1:
        return os.path.join(dirs[0], f"rank{{0..{len(dirs) - 1}}}") + temp
    return ", ".join(os.path.join(d, f"rank{r}") for r, d in enumerate(dirs)) + temp


def _engine_exit(engine):
    """``train``'s exit for its engine (an ``ExitStack.push`` callback). Finished: close, writing
    the trained values back. A failure (or Ctrl-C / SIGTERM) in flight: close without writing
    back (it runs collectives, and after one rank failed the others are elsewhere: a hang, or the
    wrong chunks gathered), and a close error is noted on that failure, never raised over it: the
    failure is the one line the command prints."""
    def exit_(exc_type, exc, tb):
        if exc is None:
            engine.close()
            return False
        try:
            engine.close(write_back=False)
        except Exception as e:  # noqa: BLE001 - noted on the failure being reported
            exc.add_note(f"engine.close failed too: {type(e).__name__}: {e}")
        return False
    return exit_


def cmd_train(args) -> int:
    import torch

    import zero_offload
    from .data import CharCorpus
    from .models import generate

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory; pass a directory for the checkpoints "
                         f"(it is created if missing)")
    with contextlib.ExitStack() as stack:
        rank, world = _start_ranks(stack)  # torchrun: one process per GPU, rank 0 reports
        say = print if rank == 0 else (lambda *a, **k: None)
        defaults = dict(preset="tiny", hf_config=None, steps=300, batch_size=16, seq_len=None,
                        seed=0, lr=None, save_every=100, sample_tokens=200)
        state_file = _read_state(out)
        plan = _plan_resume(out, state_file) if args.resume else None
        # Flags and --config next (they need the settings --resume found): a bad value is
        # reported before anything else about --out.
        cfg, spec, settings, extras = resolve(args, defaults=defaults, temp_dirs=stack,
                                              saved=plan.saved if plan else None, world=world, report=say)
        if not args.resume and not args.overwrite:
            _refuse_to_replace(out, state_file)
        start = plan.candidates[0]["step"] if plan else 0
        if start >= settings.steps:
            raise UsageError(f"--resume: the checkpoint is at step {start} already; pass --steps "
                             f"larger than {start}")
        torch.manual_seed(settings.seed)
        model, seq_len = build_model(settings)
        corpus = CharCorpus.default()
        if rank == 0:  # before the engine measures the free space
            remove_dead_runs_spaces(cfg.nvme_dir, say)
        where = _swap_where(_gather(cfg.nvme_dir, world))
        n_params = sum(p.numel() for p in model.parameters())
        say(f"zero-offload train: {describe_model(settings)} ({n_params / 1e6:.2f}M params), "
            f"device {'cuda' if torch.cuda.is_available() else 'cpu'}" +
            (f" x {world} ranks" if world > 1 else "") + f", params on {cfg.params}, "
            f"optimizer on {cfg.optimizer}" + (f" (swap: {where})" if where else "") +
            f", dtype {cfg.dtype}, prefetch depth {cfg.prefetch_depth}", flush=True)

        meta = any(p.is_meta for p in model.parameters())
        engine = zero_offload.initialize(model, optimizer=spec, config=cfg,
                                         init=getattr(model, "init_param", None) if meta else None)
        stack.push(_engine_exit(engine))
        device = engine.device
        every = extras.get("save_every") or 0
        check = dict(replacing=not args.resume, steps=settings.steps, every=every)
        _check_run_dir(out, state_file, start=start, **check)
        resumed = None
        if args.resume:
            resumed = _resume(engine, out, plan, say)
            _apply_spec(engine, spec)  # the checkpoint's hyperparameters, or the overrides reported above
            if resumed["step"] < start:  # fell back: the save points from there on are checked too
                start = resumed["step"]
                _check_run_dir(out, state_file, start=start, **check)
            say(f"resumed from step {start} ({out / resumed['name']})", flush=True)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        run = plan.saved.get("run") if plan else None
        state = {"writer": _STATE_WRITER, "run": run if isinstance(run, str) else uuid.uuid4().hex,
                 "settings": dataclasses.asdict(settings), "offload": _saved_offload(cfg),
                 "optim": spec.to_dict(), "world": world, "step": start,
                 "checkpoint": resumed["name"] if resumed else None,
                 "checkpoints": [c for c in plan.candidates[::-1] if c["step"] <= start] if resumed else []}
        state["settings"].update(seq_len=seq_len, **extras)

        accum = cfg.grad_accum  # micro-batches per step, each rank: the global batch is world x batch x accum
        tokens_per_step = settings.batch_size * seq_len * accum

        def tokens_per_s(times: list) -> float:
            """Tokens per second of all ranks together (each trains its own batches), from the
            median of ``times``: the progress bar's figure and the final line's."""
            return world * tokens_per_step / statistics.median(times) if times else float("nan")

        losses, step_times = [], []
        bar = None if args.no_progress or rank else _tqdm()(
            total=settings.steps, initial=start, desc="train", unit="step", file=sys.stderr,
            dynamic_ncols=True, mininterval=0.5)
        step = start
        with _StopOnSigint(quiet=rank != 0) as stop:
            say("training started", flush=True)  # from here a signal stops after a step and saves
            stopping = False
            while step < settings.steps and not stopping:
                t0 = time.perf_counter()
                loss_value = 0.0
                for micro in range(accum):
                    # each micro-batch of each rank its own batch (the same on a resumed run, and
                    # where world x accum is the same, the same global batch whatever the split)
                    x, y = corpus.batch(batch_size=settings.batch_size, seq_len=seq_len,
                                        generator=batch_generator(settings.seed + 7919 * (rank * accum + micro), step),
                                        device=device)
                    loss = engine(x, y)
                    engine.backward(loss / accum)  # the mean over the window, as one big batch
                    engine.step()  # the update: at the window's last micro-batch
                    loss_value += float(loss.detach().float().item()) / accum
                step_times.append(time.perf_counter() - t0)
                losses.append(loss_value)
                step += 1
                if not math.isfinite(loss_value):
                    raise RuntimeError(f"loss is {loss_value} at step {step}; lower --lr (now {spec.lr})")
                if bar is not None:
                    _bar_postfix(bar, engine, loss_value, tokens_per_s(step_times[-_BAR_WINDOW:]))
                    bar.update(1)
                # every rank stops at the same step (a signal may reach them at different ones)
                stopping = stop.requested if world == 1 else not engine.shard.agree(not stop.requested)
                if _periodic_save(step, settings.steps, every) and not stopping:
                    _save(engine, out, step, state, args.keep, lead=rank == 0)
            if bar is not None:  # it ends on the whole run's figure, the one of the line below
                _bar_postfix(bar, engine, losses[-1], tokens_per_s(step_times))
                bar.close()
            _save(engine, out, step, state, args.keep, lead=rank == 0)
        median = statistics.median(step_times) if step_times else float("nan")
        say(f"step {step}: loss {losses[-1]:.4f} (first {losses[0]:.4f}), median step "
            f"{median * 1e3:.1f} ms, {tokens_per_s(step_times):,.0f} tokens/s"
            + (f" (all {world} ranks)" if world > 1 else ""), flush=True)
        if stopping:  # one line (rank 0's), whichever rank the signal reached
            what = stop.what if stop.signum else "a signal to another rank"
            say(f"zero-offload: stopped by {what} at step {step}; checkpoint saved at "
                f"{out / state['checkpoint']}; resume with --resume --out {out}", file=sys.stderr, flush=True)
            return 128 + (stop.signum or signal.SIGTERM)
        say(f"checkpoint: {out / state['checkpoint']} (continue with --resume --out {out})", flush=True)
        n_sample = extras.get("sample_tokens") or 0
        if n_sample:
            prompt = corpus.encode("\n").view(1, -1).to(device)
            ids = generate(engine, prompt, max_new_tokens=n_sample, seq_len=seq_len,
                           temperature=0.8, top_k=40, generator=torch.Generator().manual_seed(settings.seed))
            say("sample:\n" + corpus.decode(ids[0, 1:].cpu()), flush=True)
    return EXIT_OK


# ----------------------------------------------------------------------------------- bench

_BENCH_SCRIPTS = {"adam": "CPU-Adam throughput vs torch's Adam and DeepSpeedCPUAdam",
                  "io": "swap I/O engine vs the disk at the same queue depth (fio or a plain probe)"}


def cmd_bench_script(which: str, argv: list[str]) -> int:
    """Runs the packaged benchmark ``which`` (a key of ``_BENCH_SCRIPTS``) with its own flags."""
    if which == "adam":
        from .bench import cpu_adam as bench
    else:
        from .bench import io as bench
    try:
        return int(bench.main(argv, prog=f"zero-offload bench {which}") or 0)
    except SystemExit as e:  # argparse inside the benchmark (--help, a bad flag), or a failed check
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(f"zero-offload bench {which}: error: {e.code}", file=sys.stderr)
        return EXIT_FAILURE


# ------------------------------------------------------------------------------------ info

def _bandwidth(src: torch.Tensor, dst: torch.Tensor, *, repeat: int = 3) -> float:
    """Best-of-``repeat`` bytes per second of dst.copy_(src)."""
    import torch

    cuda = src.is_cuda or dst.is_cuda
    best = float("inf")
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / best


def gather_info(nvme_dir: str, *, measure: bool = True) -> dict:
    """What the engine sees: devices, memory, the swap directory, the CPU-Adam path, bandwidths."""
    import resource

    import psutil
    import torch

    import zero_offload

    info: dict[str, Any] = {"zero_offload": zero_offload.__version__, "torch": torch.__version__,
                            "python": platform.python_version()}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "count": torch.cuda.device_count(),
                       "memory_total_bytes": total, "memory_free_bytes": free,
                       "capability": f"{props.major}.{props.minor}"}
    else:
        info["gpu"] = None
    vm = psutil.virtual_memory()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    as_int = lambda v: None if v == resource.RLIM_INFINITY else v  # noqa: E731
    info["host"] = {
        "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "ram_total_bytes": vm.total, "ram_available_bytes": vm.available,
        "memlock_limit_bytes": as_int(soft), "memlock_hard_limit_bytes": as_int(hard),
        # cudaHostRegister pins through the driver, outside RLIMIT_MEMLOCK: what can be pinned is
        # bounded by available RAM (minus what the OS and the process need)
        "pinnable_bytes_estimate": vm.available,
    }
    nvme: dict[str, Any] = {"directory": os.path.abspath(nvme_dir)}
    try:
        from .runtime.swap_io import SwapSpace, swap_dir_problem

        probe_dir = Path(nvme_dir)
        existing = probe_dir
        while not existing.exists():
            existing = existing.parent
        nvme["exists"] = existing == probe_dir
        nvme["free_bytes"] = shutil.disk_usage(existing).free
        mounts = [p for p in psutil.disk_partitions(all=True) if str(existing.resolve()).startswith(p.mountpoint)]
        if mounts:
            m = max(mounts, key=lambda p: len(p.mountpoint))
            nvme.update(filesystem=m.fstype, device=m.device, mountpoint=m.mountpoint)
        problem = swap_dir_problem(nvme_dir)
        if problem is not None:
            raise ValueError(f"{problem}; pass a directory as --nvme-dir")
        if not nvme["exists"]:  # info only looks: it creates nothing
            raise FileNotFoundError("does not exist (a run creates it, mode 0700; nothing to check yet)")
        # [Note: info looks only] remove_stale=False: the stale spaces are reported, not removed.
        space = SwapSpace(nvme_dir, capacity_bytes=1 << 20, remove_stale=False)
        try:
            nvme["o_direct"] = bool(space.direct)
        finally:
            space.close()
    except Exception as e:  # report, don't fail: info is a diagnostic
        nvme["error"] = one_line(e)
    try:
        from .runtime.swap_io import find_all_spaces

        spaces = find_all_spaces(nvme_dir)  # with rank<r>/ and temporary swap dirs
        nvme["swap_spaces"] = [{"path": f.path, "bytes": f.nbytes, "pid": f.owner.pid, "hostname": f.owner.hostname,
                                "owner": f.state.value, "stale": f.stale,
                                "created": datetime.datetime.fromtimestamp(f.owner.created).isoformat(timespec="seconds")}
                               for f in spaces]
        stale = [f for f in spaces if f.stale]
        nvme["stale_bytes"] = sum(f.nbytes for f in stale)
        nvme["clean_command"] = _clean_command(nvme_dir) if stale else None
    except Exception as e:
        nvme["swap_spaces_error"] = one_line(e)
    info["nvme"] = nvme
    try:
        from .ops import cpu_adam

        info["cpu_adam_isa"] = cpu_adam.isa()
    except Exception as e:
        info["cpu_adam_isa"] = None
        info["cpu_adam_error"] = one_line(e)
    if measure:
        nbytes = 256 << 20
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.zeros_like(a)
        bw = {"cpu_copy_bytes_per_s": _bandwidth(a, b)}
        if torch.cuda.is_available():
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            bw["h2d_pinned_bytes_per_s"] = _bandwidth(pinned, dev)
            bw["d2h_pinned_bytes_per_s"] = _bandwidth(dev, pinned)
            bw["h2d_pageable_bytes_per_s"] = _bandwidth(a, dev)
            bw["d2h_pageable_bytes_per_s"] = _bandwidth(dev, b)
            del pinned, dev
        info["bandwidth"] = bw
    return info


def _format_info(info: dict) -> str:
    gb = lambda n: "n/a" if n is None else f"{n / 2**30:.1f} GiB"  # noqa: E731
    lines = [f"zero_offload {info['zero_offload']}, torch {info['torch']}, python {info['python']}"]
    g = info["gpu"]
    lines.append("GPU:          " + (f"{g['name']} x{g['count']} (sm {g['capability']}), "
                                     f"{gb(g['memory_free_bytes'])} free of {gb(g['memory_total_bytes'])}"
                                     if g else "none (the compute device is the CPU)"))
    h = info["host"]
    memlock = "unlimited" if h["memlock_limit_bytes"] is None else human_bytes(h["memlock_limit_bytes"])
    lines.append(f"host RAM:     {gb(h['ram_available_bytes'])} available of {gb(h['ram_total_bytes'])}; "
                 f"pinnable ~{gb(h['pinnable_bytes_estimate'])}; RLIMIT_MEMLOCK {memlock}")
    lines.append(f"CPU:          {h['cpus']} cores ({h['cpus_usable']} usable), torch threads {h['torch_threads']}")
    n = info["nvme"]
    if "error" in n:
        lines.append(f"swap dir:     {n['directory']}: {n['error']}")
    else:
        fs = f" [{n.get('filesystem')} on {n.get('device')}]" if n.get("filesystem") else ""
        lines.append(f"swap dir:     {n['directory']}{fs}: {gb(n.get('free_bytes'))} free, "
                     f"O_DIRECT {'yes' if n.get('o_direct') else 'no (buffered fallback)'}")
    spaces = n.get("swap_spaces") or []
    if "swap_spaces_error" in n:
        lines.append(f"swap spaces:  cannot list: {n['swap_spaces_error']}")
    elif spaces:
        stale = [sp for sp in spaces if sp["stale"]]
        lines.append(f"swap spaces:  {len(spaces)} ({len(stale)} stale: {human_bytes(n['stale_bytes'])} left by "
                     f"dead processes)" if stale else f"swap spaces:  {len(spaces)}, none stale")
        for sp in spaces:
            who = {"alive": "running", "dead": "dead: stale",
                   "unknown": "another host or PID namespace: cannot tell"}[sp["owner"]]
            lines.append(f"  {sp['path']}  {human_bytes(sp['bytes'])}  pid {sp['pid']} on {sp['hostname']} "
                         f"({who}), created {sp['created']}")
        if n.get("clean_command"):
            lines.append(f"  remove the stale ones with: {n['clean_command']}")
    isa = info["cpu_adam_isa"]
    lines.append("CPU-Adam:     " + (f"{isa} path" if isa else f"unavailable ({info.get('cpu_adam_error')})"))
    ranks = g["count"] if g else 2
    lines.append(f"several GPUs: torchrun --nproc-per-node {ranks} $(which zero-offload) train ...: each rank "
                 f"holds 1/{ranks} of every chunk (params, grads, fp32 master and moments), so the node holds "
                 f"the ~16 B/param of bf16 training with the optimizer on the CPU once; CPU-Adam "
                 f"{max(1, h['cpus_usable'] // ranks - (1 if g else 0))} threads per rank")
    for key, value in info.get("bandwidth", {}).items():
        label = key.replace("_bytes_per_s", "").replace("_", " ")
        lines.append(f"bandwidth:    {label}: {value / 1e9:.1f} GB/s")
    return "\n".join(lines)


def cmd_info(args) -> int:
    from .runtime.swap_io import default_swap_location

    info = gather_info(args.nvme_dir or default_swap_location(), measure=not args.no_measure)
    print(json.dumps(info, indent=1) if args.json else _format_info(info))
    return EXIT_OK


def _clean_command(directory) -> str:
    """The ``zero-offload clean`` line that removes the dead runs' swap spaces of ``directory``."""
    from .runtime.swap_io import default_swap_location

    directory = os.path.abspath(directory)
    if directory == os.path.abspath(default_swap_location()):
        return "zero-offload clean"
    return f"zero-offload clean --nvme-dir {shlex.quote(directory)}"


def cmd_clean(args) -> int:
    """Remove the dead runs' swap spaces in --nvme-dir (default: the temporary location), with
    its rank<r>/ and temporary swap directories (see swap_io [Note: swap locations])."""
    from .runtime.swap_io import default_swap_location, find_all_spaces, remove_dead_spaces, swap_dir_problem

    directory = os.path.abspath(args.nvme_dir or default_swap_location())
    problem = swap_dir_problem(directory)
    if problem is not None:
        raise UsageError(f"--nvme-dir {directory} {problem}; pass the swap directory your runs used")
    if not os.path.isdir(directory):
        raise UsageError(f"--nvme-dir {directory} does not exist; pass the swap directory your runs used")
    results = remove_dead_spaces(directory, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    freed, kept, spaces, temps = 0, 0, 0, 0
    for space, reason in results:
        kind = "temporary swap directory, " if space.temp_dir else f"{human_bytes(space.nbytes)}, "
        what = f"{space.path} ({kind}pid {space.owner.pid} on {space.owner.hostname}, dead)"
        if reason is None:
            freed += space.nbytes
            temps += space.temp_dir
            spaces += not space.temp_dir
            print(f"{verb} {what}")
        else:
            kept += 1
            print(f"kept {what}: {reason}")
    others = [f for f in find_all_spaces(directory) if not f.stale]
    print(f"{verb} {spaces} stale swap space(s), {human_bytes(freed)}"
          + (f", and {temps} temporary swap director{'y' if temps == 1 else 'ies'}" if temps else "")
          + (f"; {kept} kept (see above)" if kept else "")
          + (f"; left alone {len(others)} of running processes or other hosts" if others else ""))
    return EXIT_FAILURE if kept else EXIT_OK


# ---------------------------------------------------------------------------------- parser

def _add_run_flags(p: argparse.ArgumentParser, *, what: str) -> None:
    from .presets import PRESETS

    m = p.add_argument_group("model and data")
    m.add_argument("--preset", choices=list(PRESETS), help=f"GPT preset (default: {what})")
    m.add_argument("--hf-config", metavar="CONFIG",
                   help="a Hugging Face architecture instead: config.json path, directory or hub name "
                        "(randomly initialized; needs transformers)")
    m.add_argument("--steps", type=positive_int, help="training steps")
    m.add_argument("--batch-size", type=positive_int)
    m.add_argument("--seq-len", type=positive_int, help="default: the model's")
    m.add_argument("--lr", type=positive_float, help="learning rate (AdamW; default 1e-2)")
    m.add_argument("--seed", type=nonneg_int, help="model init and batch order (default 0)")
    o = p.add_argument_group("offload (flags override --config, which overrides a resumed checkpoint)")
    o.add_argument("--config", metavar="FILE",
                   help="JSON: OffloadConfig fields (or a DeepSpeed config), optional \"optim\" "
                        "{type, lr, ...} and \"train\" {preset, steps, ...} sections")
    o.add_argument("--params", choices=["gpu", "cpu", "nvme", "auto"],
                   help="home tier of the params (default cpu)")
    o.add_argument("--optimizer", choices=["cpu", "nvme", "auto"],
                   help="home tier of master weights and Adam moments (default nvme)")
    o.add_argument("--nvme-dir", metavar="DIR",
                   help="swap directory (default: a temporary directory, removed at the end)")
    o.add_argument("--prefetch-depth", type=nonneg_int, metavar="N",
                   help="chunks in flight ahead of use per hop (default 2)")
    o.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="working precision (default bf16 on CUDA, fp32 on CPU)")


PRECEDENCE_HELP = """\
settings, lowest to highest precedence (each layer sets only the fields it names):
  1. defaults: params cpu, optimizer nvme (temporary swap dir), dtype bf16 on CUDA / fp32 on CPU
  2. the checkpoint's settings (train --resume): model, data, placement, dtype, optimizer
  3. --config FILE: its OffloadConfig fields, "optim" and "train" sections
  4. flags
On --resume, each setting a file or flag changes is reported in one line; a change of model
(--preset, --hf-config) is refused."""

EXIT_HELP = """\
exit codes: 0 done, 1 runtime failure, 2 bad flag or config value, 130 Ctrl-C, 143 SIGTERM
(train stops after the current step and saves). A failure is one line on stderr; --debug adds
the traceback."""


def _add_debug_flag(p: argparse.ArgumentParser) -> None:
    # also after the command; SUPPRESS keeps the main parser's value when it is not given here
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="print the traceback of a failure too")


def build_parser() -> argparse.ArgumentParser:
    import zero_offload

    parser = Parser(prog="zero-offload", description="Offload training engine: train, benchmark, inspect.",
                     epilog=EXIT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"zero-offload {zero_offload.__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of a failure too")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")

    t = sub.add_parser("train", help="train a GPT on the shipped text with params and optimizer offloaded",
                       description="Train (by default the tiny GPT on the shipped public-domain text, about "
                                   "a minute on 2 CPU cores) with params on the CPU and optimizer state in "
                                   "an NVMe swap space; saves a checkpoint and prints a sample.",
                       epilog=PRECEDENCE_HELP + "\n\n" + EXIT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_flags(t, what="tiny")
    c = t.add_argument_group("checkpoint")
    c.add_argument("--out", default="zero_offload_ckpt", metavar="DIR", help="checkpoint directory (default ./zero_offload_ckpt)")
    c.add_argument("--resume", action="store_true", help="continue the newest whole checkpoint in --out up to "
                   "--steps, with its saved settings (flags and --config override them, each override "
                   "reported; on another number of ranks, grad_accum keeps the global batch where it can)")
    c.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out (only "
                   "what zero_offload wrote there goes, once the new run's first checkpoint is whole)")
    c.add_argument("--keep", type=positive_int, default=2, metavar="N",
                   help="checkpoints kept in --out (default 2; --resume falls back to an older one when "
                        "the newest is missing or damaged)")
    c.add_argument("--save-every", type=nonneg_int, metavar="N",
                   help="also save every N steps (default 100; 0: only at the end)")
    c.add_argument("--sample-tokens", type=nonneg_int, metavar="N",
                   help="characters of text to generate at the end (default 200; 0: none)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_debug_flag(t)
    t.set_defaults(func=cmd_train)

    b = sub.add_parser("bench", help="benchmarks: prefetch depth, CPU-Adam, NVMe I/O")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=Parser, metavar="BENCH")
    from .bench import prefetch as bench_prefetch

    bp = bsub.add_parser("prefetch", help=bench_prefetch.HELP, description=bench_prefetch.DESCRIPTION,
                         epilog=PRECEDENCE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_prefetch.add_arguments(bp)
    _add_run_flags(bp, what="small on CPU, 1.3b on CUDA")
    _add_debug_flag(bp)
    bp.set_defaults(func=bench_prefetch.run)
    for which, what in _BENCH_SCRIPTS.items():
        bsub.add_parser(which, add_help=False, help=f"{what} (own flags: bench {which} --help)")

    i = sub.add_parser("info", help="GPU, host and pinnable memory, swap dir (O_DIRECT), CPU-Adam path, bandwidths")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("--nvme-dir", metavar="DIR", help="swap directory to check (default: the temp dir)")
    i.add_argument("--no-measure", action="store_true", help="skip the bandwidth measurements")
    i.set_defaults(func=cmd_info)
    cl = sub.add_parser("clean", help="remove swap spaces left by killed runs (dead owner, this host)",
                        description="Removes the swap spaces (zero_offload-* directories with an owner file) "
                                    "whose process died on this host without removing them, in --nvme-dir, "
                                    "its rank<r>/ subdirectories and the temporary swap directories "
                                    "(zero_offload_swap_*) there, and those temporary directories once "
                                    "empty. Nothing else is touched: not the spaces of running processes "
                                    "or other hosts, not files zero_offload did not write.")
    cl.add_argument("--nvme-dir", metavar="DIR",
                    help="the swap directory to clean (default: the temp dir, where runs without "
                         "--nvme-dir swap)")
    cl.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    cl.set_defaults(func=cmd_clean)
    return parser


def _exit_codes():
    """[Note: exit codes] The one mapping from what a command raised to its exit code, first match
    wins: a bad flag or config value exits 2, a failure while running exits 1. Every failure is
    one line on stderr; ``--debug`` prints the traceback before it. Yields (types, code) in
    order; the torch-side error types are imported only past the usage errors ([Note: torch after
    parsing])."""
    yield UsageError, EXIT_USAGE              # flags, --config, --resume/--out misuse
    from .runtime.checkpoint import CheckpointError
    from .runtime.pipeline import PipelineError
    from .runtime.placement import FitError
    from .runtime.store import BudgetError, StoreError

    yield from (
        (FitError, EXIT_FAILURE),             # budgets cannot hold the model (a ValueError: before it)
        (CheckpointError, EXIT_FAILURE),      # missing, corrupted or mismatched checkpoint
        (BudgetError, EXIT_FAILURE),          # a tier ran out of its budget while running
        ((StoreError, PipelineError), EXIT_FAILURE),
        (OSError, EXIT_FAILURE),              # swap/checkpoint directory: read-only, full, in the way
        (ValueError, EXIT_USAGE),             # a config value the API refused
        (RuntimeError, EXIT_FAILURE),         # the engine (e.g. a non-finite loss)
    )


_OS_FIXES = {
    errno.ENOSPC: "the disk is full; free space, or pass an --out/--nvme-dir on another disk",
    errno.EDQUOT: "the disk quota is exceeded; free space, or pass an --out/--nvme-dir elsewhere",
    errno.EROFS: "the file system is read-only; choose a writable directory",
    errno.EACCES: "permission denied; choose a directory you can write, or change its permissions",
    errno.EPERM: "operation not permitted; choose a directory you can write",
    errno.EEXIST: "a file is in the way where a directory is needed; pass a directory path",
    errno.ENOTDIR: "a file is in the way where a directory is needed; pass a directory path",
}


def _describe(e: BaseException, args) -> str:
    """The one line for a failure: the message, with an OSError's path named by its flag."""
    if isinstance(e, OSError) and e.errno is not None and e.strerror:
        path = e.filename if e.filename is not None else ""
        where = Path(os.path.abspath(os.fsdecode(path))) if path else None
        for flag in ("nvme_dir", "out"):
            value = getattr(args, flag, None)
            root = Path(os.path.abspath(value)) if value else None
            if root is not None and where is not None and (where == root or root in where.parents):
                path = f"{flag_name(flag)} {value}" + ("" if where == root else f" ({path})")
                break
        fix = _OS_FIXES.get(e.errno, f"{e.strerror}; check the path")
        return f"{path}: {e.strerror} ({fix})" if path else f"{e.strerror} ({fix})"
    return one_line(e) or type(e).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = None
    restore_signals = False

    def on_sigterm(signum, frame):
        raise Interrupted(signum)

    try:
        try:
            args, rest = parser.parse_known_args(argv)
        except SystemExit as e:  # --help, --version
            return int(e.code or 0)
        if threading.current_thread() is threading.main_thread():
            # SIGTERM unwinds like Ctrl-C (engine closed, temporary swap removed); `train` stops
            # after its current step instead (_StopOnSigint, which may leave both set: restored here)
            previous_sigint = signal.getsignal(signal.SIGINT)
            previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
            restore_signals = True
        if args.command == "bench" and args.bench in _BENCH_SCRIPTS:
            return cmd_bench_script(args.bench, rest)
        if rest:
            raise UsageError(f"unrecognized arguments: {' '.join(rest)} (see `zero-offload {args.command} --help`)")
        return args.func(args)
    except KeyboardInterrupt as e:
        code = getattr(e, "exit_code", EXIT_INTERRUPTED)
        print(f"zero-offload: interrupted ({'Ctrl-C' if code == EXIT_INTERRUPTED else 'SIGTERM'})", file=sys.stderr)
        return code
    except Exception as e:
        debug = bool(getattr(args, "debug", False))
        if debug:
            traceback.print_exc()
        for types, code in _exit_codes():
            if isinstance(e, types):
                print(f"zero-offload: error: {_describe(e, args)}", file=sys.stderr, flush=True)
                return code
        hint = "" if debug else " (run with --debug for the traceback)"
        print(f"zero-offload: error: {type(e).__name__}: {_describe(e, args)}{hint}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    finally:
        if restore_signals:
            signal.signal(signal.SIGTERM, previous_sigterm or signal.SIG_DFL)
            if previous_sigint is not None:  # (None: a handler not installed from Python)
                signal.signal(signal.SIGINT, previous_sigint)


if __name__ == "__main__":
    sys.exit(main())
