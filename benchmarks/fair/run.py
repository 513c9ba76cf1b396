"""The fair harness's driver: every (case, N) of a plan in its own torchrun process group, in
shuffled order, inside a wall-clock deadline; one JSON row per case appended to OUT/rows.jsonl
as it finishes, OUT/summary.md rewritten after each.

    python benchmarks/fair/run.py --plan n1 --out OUT --deadline 480
    python benchmarks/fair/run.py --plan "ddp@1 engine@1 ds-zero3:prefetch=5e7,reduce=5e8@4" --out OUT

Fairness it enforces: one process group per case (no heap carried from an earlier case), order
shuffled by --seed, the same threads per rank for every case at one N (OMP_NUM_THREADS and
case.py's --threads: --threads-per-rank, default cores // N), the same init file (written once by
make_init.py) or, with ``--init seeded:SEED``, no file: every case draws GPT.init_weights' values
after torch.manual_seed(SEED) itself (case.py [Note: seeded init]; the way to 14B-30B, where the
fp32 file alone would be 56-120 GB), and the same data seed, model / batch / seq / warm-up /
steps / checkpointing.

Deadline: before a case, its expected time (fairplan.expected_seconds, scaled by the model's
params and FLOPs per step [Note: estimates scale with the model], corrected by how long the
cases so far took against their estimates) must fit what is left of --deadline; otherwise the
row says "not run: deadline". A case gets at most --case-timeout seconds (default: twice its
estimate, at least 300 s) and never more than is left; case.py is told its budget and cuts timed steps (not below 5) to end inside it; a case
that still overruns is killed (its process group) and its row says so. The device machine kills
a call at 10 minutes: give --deadline well inside it (device.sh does).

Exit status: 0 when every case that ran wrote a row without error, 1 otherwise, 2 for a bad
command line; each failure is one line on stderr.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import sys
import tarfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from fairplan import (CASES, PLANS, case_timeout, expected_seconds, parse_plan, recipe, step_flops,  # noqa: E402
                      threads_for)
from summarize import markdown  # noqa: E402

GiB = float(2 ** 30)
DEVICE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
              "PYTHONUNBUFFERED": "1"}
"""Set for every case: the device machines need NVLink multicast off (device README, KINDS.md)."""
RESERVE_S = 8.0  # what the driver keeps back at the end: the last summary and log tarball


def _preset(model: str, seq: int):
    """The preset's GPTConfig at ``seq``, from zero_offload/presets.py loaded alone (no torch
    import in the driver: the package's __init__ imports torch)."""
    import importlib.util
    presets = sys.modules.get("_fair_presets")
    if presets is None:
        spec = importlib.util.spec_from_file_location("_fair_presets",
                                                      os.path.join(REPO, "src", "zero_offload", "presets.py"))
        presets = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = presets  # (dataclasses looks its module up)
        spec.loader.exec_module(presets)
    cfg = presets.preset(model)
    return presets.preset(model, seq_len=seq) if seq != cfg.seq_len else cfg


def item_threads(item, rule: int) -> int:
    """Threads per rank of one item: its ``threads=`` knob (a sweep point, at most the rule's
    count), else the run's rule."""
    knob = dict(item.knobs).get("threads")
    if knob is None:
        return rule
    if not str(knob).isdigit() or not 1 <= int(knob) <= rule:
        raise ValueError(f"{item.label}@{item.world}: threads={knob} must be an integer from 1 to "
                         f"{rule} (cores // N: no case gets more than the rule gives every case)")
    return int(knob)


def tree_commit(src: str) -> str:
    """The commit a ``.trees/NAME`` copy was made from (its COMMIT file, written by tree.sh)."""
    try:
        with open(os.path.join(os.path.dirname(src), "COMMIT")) as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


def item_tree(item) -> str | None:
    """The ``src`` directory of an item's ``tree=`` knob (``.trees/NAME/src``, or under
    ``$FAIR_TREES``), None without one;
    ValueError (one line) when that tree is not there."""
    name = dict(item.knobs).get("tree")
    if name is None:
        return None
    src = os.path.join(os.environ.get("FAIR_TREES") or os.path.join(REPO, ".trees"), str(name), "src")
    if not name.replace("-", "").replace("_", "").isalnum() or not os.path.isdir(os.path.join(src, "zero_offload")):
        raise ValueError(f"{item.label}@{item.world}: tree={name}: no {src}/zero_offload (make it with "
                         f"benchmarks/fair/tree.sh {name} <commit>)")
    return src


ANCHORS = ("engine", "ddp")
"""Cases whose rows every other row of the same N is compared with ([Note: anchors run whatever
the order])."""


def anchor_keep_s(order: list, n: int, *, cost, scale: float, settle: float) -> float:
    """Seconds item ``order[n]`` must leave for the anchors after it: 0 for an anchor itself,
    else the scaled expected time of every anchor still to run."""
    if order[n].case in ANCHORS and not order[n].knobs:
        return 0.0
    return sum(cost(i) * scale * 1.1 + settle for i in order[n + 1:] if i.case in ANCHORS and not i.knobs)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class NodeMemory(threading.Thread):
    """The node's MemAvailable every ``period`` s; ``window()`` opens a new minimum."""

    def __init__(self, period: float = 0.05):
        super().__init__(daemon=True, name="fair-node-mem")
        self.period = period
        self.low = mem_available()
        self._stop = threading.Event()

    def run(self):
        while not self._stop.wait(self.period):
            self.low = min(self.low, mem_available())

    def window(self) -> int:
        now = mem_available()
        self.low = now
        return now

    def stop(self):
        self._stop.set()


def git_commit() -> str:
    """ZO_FAIR_COMMIT, else the checkout's commit (+dirty), else a hash of the source files (a
    device machine's copy of the tree has no .git)."""
    if os.environ.get("ZO_FAIR_COMMIT"):
        return os.environ["ZO_FAIR_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    h = hashlib.sha256()
    for top in ("src", "csrc", os.path.join("benchmarks", "fair")):
        for root, dirs, files in sorted(os.walk(os.path.join(REPO, top))):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".py", ".cpp", ".h", ".sh")):
                    path = os.path.join(root, name)
                    h.update(os.path.relpath(path, REPO).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return f"no git; source tree sha256 {h.hexdigest()[:16]}"


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for ln in out.stdout.splitlines() if ln.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def tail(path: str, n: int = 25) -> list:
    try:
        with open(path, errors="replace") as f:
            return [ln.rstrip("\n")[:400] for ln in f.readlines()[-n:]]
    except OSError:
        return []


def last_error_line(lines: list) -> str:
    """The most telling line of a log tail: the last one naming an error, else the last line."""
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "Killed" in ln:
            return ln.strip()[:400]
    return (lines[-1].strip() if lines else "no output")[:400]


def descendants(pid: int) -> list:
    """Every live process below ``pid`` (torchrun's workers: each in its own session, so a
    signal to torchrun's process group does not reach them)."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _signal_all(pids: list, sig) -> None:
    for p in pids:
        for kill in (lambda: os.killpg(os.getpgid(p), sig), lambda: os.kill(p, sig)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass


def kill_case(proc: subprocess.Popen) -> None:
    """End a case that overran: SIGTERM to torchrun and every process below it (found before any
    signal, by pid: all started by this driver), then SIGKILL whatever is left after 15 s."""
    pids = [proc.pid] + descendants(proc.pid)
    _signal_all(pids, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        pass
    _signal_all([p for p in pids if os.path.exists(f"/proc/{p}")], signal.SIGKILL)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


class Driver:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.out = os.path.abspath(args.out)
        self.log_dir = os.path.abspath(args.log_dir or os.path.join(self.out, "logs"))
        os.makedirs(self.out, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        self.rows_path = os.path.join(self.out, "rows.jsonl")
        self.run_id = f"{datetime.datetime.now():%Y-%m-%dT%H%M%S}-s{args.seed}"
        self.commit = git_commit()
        self.cores = args.cores or len(os.sched_getaffinity(0))
        self.gpus = gpu_count() if args.device == "cuda" else 0
        self.ratios: list = []  # actual / expected seconds of the cases run so far
        self.rows: list = []
        self.mem = NodeMemory(args.mem_period)
        # the estimates and every row's params: the preset's closed form (presets.py has no torch)
        cfg = _preset(args.model, args.seq)
        self.params = cfg.num_params()
        self.flops = step_flops(cfg.flops_per_token(args.seq), batch=args.batch, seq=args.seq,
                                checkpointing=args.checkpointing)

    def left(self) -> float:
        if not self.args.deadline:
            return float("inf")
        return self.args.deadline - (time.monotonic() - self.t0)

    def ensure_init(self) -> None:
        a = self.args
        if a.init.startswith("seeded") or os.path.isfile(a.init):
            return
        cmd = [a.python, os.path.join(HERE, "make_init.py"), "--model", a.model, "--seq", str(a.seq),
               "--out", a.init] + (["--init-std", str(a.init_std)] if a.init_std else [])
        log = os.path.join(self.log_dir, "make_init.log")
        with open(log, "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                               timeout=max(30.0, min(900.0, self.left())))
        if r.returncode != 0 or not os.path.isfile(a.init):
            raise RuntimeError(f"make_init.py failed ({last_error_line(tail(log))}); see {log}")
        print(tail(log, 1)[0] if tail(log, 1) else "[make_init] done", flush=True)

    def record(self, row: dict) -> None:
        row.setdefault("error", None)
        self.rows.append(row)
        with open(self.rows_path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.write_summary()
        if self.args.log_tar:
            self.tar_logs()

    def write_summary(self) -> None:
        from summarize import read_rows
        tmp = os.path.join(self.out, ".summary.md.tmp")
        with open(tmp, "w") as f:
            f.write(markdown(read_rows(self.rows_path)))
        os.replace(tmp, os.path.join(self.out, "summary.md"))

    def tar_logs(self) -> None:
        tmp = self.args.log_tar + ".tmp"
        with tarfile.open(tmp, "w:gz") as t:
            t.add(self.log_dir, arcname="logs")
        os.replace(tmp, self.args.log_tar)

    def base_row(self, item, order: int) -> dict:
        a = self.args
        return {"run_id": self.run_id, "order": order, "label": item.label, "case": item.case,
                "world": item.world, "knobs": dict(item.knobs), "model": a.model, "batch_per_rank": a.batch,
                "seq": a.seq, "checkpointing": a.checkpointing, "device": a.device,
                "threads": item_threads(item, threads_for(item.world, self.cores, a.threads_per_rank)),
                "threads_policy": (f"auto: cores {self.cores} // N" if a.threads_per_rank == "auto"
                                   else a.threads_per_rank),
                "recipe": recipe(item.case, dict(item.knobs)), "zero_offload_commit": self.commit,
                "params": self.params or None, "init_arg": a.init}

    def run_item(self, item, order: int, params: int, *, keep_s: float = 0.0) -> dict:
        """Run one case; ``keep_s``: expected seconds of the anchors still to run after it
        ([Note: anchors run whatever the order]), which this case may not eat into."""
        a = self.args
        row = self.base_row(item, order)
        info = CASES[item.case]
        if info.gpu_only and a.device != "cuda":
            row["skipped"] = f"needs CUDA: {item.case} runs on GPUs only (run it on the GPU machine)"
            return row
        if info.max_world and item.world > info.max_world:
            row["skipped"] = f"{item.case} runs on at most {info.max_world} GPU(s)"
            return row
        if a.device == "cuda" and item.world > self.gpus:
            row["not_run"] = f"needs {item.world} GPUs, this machine has {self.gpus}"
            return row
        guess = self.expect(item)
        if self.ratios:
            guess *= min(3.0, max(0.5, sorted(self.ratios)[len(self.ratios) // 2]))
        left = self.left() - RESERVE_S
        row["expected_s"] = round(guess, 1)
        if guess * 1.1 > left - keep_s:
            row["not_run"] = (f"deadline (expected {guess:.0f} s, {max(0.0, left):.0f} s left"
                              + (f", {keep_s:.0f} s of them kept for the engine and ddp rows still to run"
                                 if keep_s else "") + ")")
            return row
        limit = a.case_timeout if a.case_timeout else case_timeout(guess)
        timeout = min(limit, left)
        row["case_timeout_s"] = round(limit, 1)
        json_out = os.path.join(self.log_dir, f"{order:02d}_{item.slug}.json")
        log = os.path.join(self.log_dir, f"{order:02d}_{item.slug}.log")
        for stale in [json_out] + [f"{json_out}.rank{r}" for r in range(item.world)]:
            if os.path.exists(stale):
                os.unlink(stale)  # ours: written by an earlier run into our own log dir
        cmd = [a.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(item.world),
               os.path.join(HERE, "case.py"), "--case", item.case, "--model", a.model, "--batch", str(a.batch),
               "--seq", str(a.seq), "--warmup", str(a.warmup), "--steps", str(a.steps),
               "--threads", str(row["threads"]), "--init", a.init, "--json-out", json_out,
               "--device", a.device, "--data-seed", str(a.data_seed),
               "--time-budget", f"{max(1.0, timeout - 5):.0f}"] + item.case_args()
        if a.checkpointing and not any(k == "checkpointing" for k, _ in item.knobs):  # (the item's own wins)
            cmd.append("--checkpointing")
        if a.init_std and a.init.startswith("seeded"):  # a file carries its own
            cmd += ["--init-std", str(a.init_std)]
        swap = None
        if a.nvme_dir:  # a directory of the case's own, made here (so ours to remove after it)
            os.makedirs(a.nvme_dir, exist_ok=True)
            swap = tempfile.mkdtemp(prefix=f"{order:02d}_{item.slug}_", dir=a.nvme_dir)
            cmd += ["--nvme-dir", swap]
        env = {**os.environ, **DEVICE_ENV, "OMP_NUM_THREADS": str(row["threads"]),
               "MKL_NUM_THREADS": str(row["threads"]), "ZO_FAIR_COMMIT": self.commit,
               "FAIR_MEM_PERIOD": str(a.mem_period)}
        tree = item_tree(item)
        if tree is not None:  # another commit's source first on the path; the row names it
            env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            env["ZO_FAIR_COMMIT"] = row["zero_offload_commit"] = tree_commit(tree)
        row["command"] = " ".join(cmd)
        time.sleep(a.settle)  # the previous case's memory is back with the node
        before = self.mem.window()
        t0 = time.monotonic()
        with open(log, "w") as f:
            f.write(f"# {row['command']}\n# OMP_NUM_THREADS={row['threads']}\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                kill_case(proc)
                code, timed_out = proc.returncode, True
            except BaseException:  # the driver itself is stopped (SIGTERM, ^C): the case goes too
                kill_case(proc)
                raise
            finally:
                if swap is not None:  # what the case left there (DeepSpeed's swap files): the disk is shared
                    shutil.rmtree(swap, ignore_errors=True)
        elapsed = time.monotonic() - t0
        low = self.mem.low
        self.ratios.append(elapsed / max(1.0, row["expected_s"]))
        row.update(elapsed_s=round(elapsed, 1), exit_code=code, log=os.path.basename(log),
                   driver_memavail_before_gib=before / GiB, driver_memavail_min_gib=low / GiB,
                   driver_memavail_drop_gib=(before - low) / GiB)
        case_row = None
        if os.path.isfile(json_out):
            with open(json_out) as f:
                case_row = json.load(f)
        rank_errors = []
        for r in range(item.world):
            p = f"{json_out}.rank{r}"
            if os.path.isfile(p):
                with open(p) as f:
                    rank_errors.append(json.load(f))
        lines = tail(log)
        if case_row is not None:
            row.update(case_row)
        if timed_out:
            row["error"] = (f"timeout: killed after {elapsed:.0f} s (case timeout {limit:.0f} s "
                            f"or the deadline)")
        elif code != 0 and not row.get("error"):
            first = min(rank_errors, key=lambda e: e.get("failed_unix", 0), default=None)
            row["error"] = (f"rank {first['rank']}: {first['error']}" if first else
                            f"exit {code}: {last_error_line(lines)}")
        elif case_row is None and not row.get("error"):
            row["error"] = f"exit {code} but case.py wrote no row: {last_error_line(lines)}"
        if row.get("error"):
            row["log_tail"] = lines
        if row.get("params"):
            # the host_bytes_per_param: the node's MemAvailable before the launch minus its
            # minimum during the case (every rank from its start), per param; rank 0's own
            # from-its-start figure stays as case_host_bytes_per_param
            if "host_bytes_per_param" in row:
                row["case_host_bytes_per_param"] = row["host_bytes_per_param"]
            row["driver_host_bytes_per_param"] = row["host_bytes_per_param"] = (before - low) / row["params"]
        return row

    def expect(self, item) -> float:
        """fairplan.expected_seconds of ``item`` at this run's model, batch, seq and checkpointing."""
        a = self.args
        return expected_seconds(item, params=self.params, warmup=a.warmup, steps=a.steps,
                                cuda=a.device == "cuda", flops=self.flops)

    def run(self) -> int:
        a = self.args
        items = parse_plan(a.plan)
        params = self.params
        cuda = a.device == "cuda"

        def cost(item) -> float:  # 0 for what will not launch (skipped, too few GPUs)
            info = CASES[item.case]
            if (info.gpu_only and not cuda) or (info.max_world and item.world > info.max_world) or \
                    (cuda and item.world > self.gpus):
                return 0.0
            return self.expect(item)
        if not a.dry_run:
            self.mem.start()
            self.ensure_init()
        # [Note: plan order is priority] When the plan's expected total exceeds what is left of the
        # deadline, its last items are not run (rows say so); the rest run in shuffled order.
        chosen, dropped, total = [], [], 0.0
        budget = self.left() - RESERVE_S
        for item in items:
            c = cost(item) * 1.1 + a.settle
            if total + c > budget:
                dropped.append(item)
            else:
                chosen.append(item)
                total += c
        order = list(chosen)
        random.Random(a.seed).shuffle(order)
        print(f"[fair] run {self.run_id}: {len(order)} cases in this order: "
              + ", ".join(f"{i.label}@{i.world}" for i in order)
              + (f"; deadline {a.deadline:.0f} s, expected {total:.0f} s" if a.deadline else "")
              + ("; not run (the plan's last items, past the deadline): "
                 + " ".join(f"{i.label}@{i.world}" for i in dropped) if dropped else ""), flush=True)
        if a.dry_run:
            for i in order:
                print(f"  {i.label}@{i.world}: expected {cost(i):.0f} s")
            return 0
        for k, item in enumerate(dropped):
            self.record({**self.base_row(item, len(order) + k), "expected_s": round(cost(item), 1),
                         "not_run": f"deadline: the plan's items are in priority order and this one's "
                                    f"{cost(item):.0f} s did not fit after the items before it"})
        # [Note: anchors run whatever the order] The engine and ddp rows of every N are what the
        # other rows are compared with (ratios within one call only): the shuffled order may put
        # them last, so a case that runs before them may not use the time they are expected to
        # need (scaled like every estimate by how long the cases so far took).
        failed = []
        for n, item in enumerate(order):
            scale = min(3.0, max(0.5, sorted(self.ratios)[len(self.ratios) // 2])) if self.ratios else 1.0
            try:
                row = self.run_item(item, n, params,
                                    keep_s=anchor_keep_s(order, n, cost=cost, scale=scale, settle=a.settle))
            except KeyboardInterrupt as e:  # SIGTERM / ^C: this case's row says so, then stop
                row = {**self.base_row(item, n), "error": f"driver stopped ({e or 'interrupt'}) in this case"}
                self.record(row)
                print(f"[fair {n + 1}/{len(order)}] {item.label}@{item.world}: {row['error']}", flush=True)
                raise
            self.record(row)
            status = (f"error: {row['error']}" if row.get("error") else f"not run: {row['not_run']}"
                      if row.get("not_run") else f"skipped: {row['skipped']}" if row.get("skipped") else
                      f"{row['median_s']:.3f} s/step [{row['p25_s']:.3f}-{row['p75_s']:.3f}], "
                      f"{row['tokens_per_s']:,.0f} tok/s, loss0 {row['step0_loss']:.4f}, "
                      f"PSS/rank {max(row['pss_peak_per_rank_gib']):.1f} GiB")
            print(f"[fair {n + 1}/{len(order)}] {item.label}@{item.world}"
                  + (f" ({row['elapsed_s']:.0f} s)" if "elapsed_s" in row else "") + f": {status}", flush=True)
            if row.get("error"):
                failed.append(f"{item.label}@{item.world}")
        self.mem.stop()
        print(f"[fair] rows: {self.rows_path}; summary: {os.path.join(self.out, 'summary.md')}"
              + (f"; {len(failed)} failed: {', '.join(failed)}" if failed else ""), flush=True)
        return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", required=True,
                    help=f"a named plan ({', '.join(PLANS)}; join with '+') or items 'case[:knob=v,...]@N' "
                         f"separated by spaces or ';'")
    ap.add_argument("--out", required=True, help="rows.jsonl and summary.md go here")
    ap.add_argument("--model", default="1.3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--threads-per-rank", default="auto",
                    help="'auto' (cores // N) or an integer, for every case")
    ap.add_argument("--cores", type=int, default=None,
                    help="cores of the node (default: this process's affinity)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed")
    ap.add_argument("--data-seed", type=int, default=1234)
    ap.add_argument("--deadline", type=float, default=0.0, help="wall seconds for the whole driver (0: none)")
    ap.add_argument("--case-timeout", type=float, default=None,
                    help="seconds a case may run (default: twice its estimate, at least 300)")
    ap.add_argument("--init", default=None,
                    help="init state dict (default /dev/shm/zo_fair_init_<model>_s<seq>.pt; written by "
                         "make_init.py when missing), or seeded:SEED: no file, every case draws "
                         "GPT.init_weights' values after torch.manual_seed(SEED) (large models)")
    ap.add_argument("--init-std", type=float, default=None,
                    help="make_init.py --init-std, or case.py's with --init seeded (tests)")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if shutil.which("nvidia-smi") else "cpu")
    ap.add_argument("--nvme-dir", default=None,
                    help="engine-auto, engine:optimizer=nvme, ds-zero3:nvme=1: each case's swap directory is "
                         "made under it and removed after the case")
    ap.add_argument("--log-dir", default=None, help="per-case logs and case JSONs (default OUT/logs)")
    ap.add_argument("--log-tar", default=None, help="rewrite this .tar.gz of the log dir after every case")
    ap.add_argument("--mem-period", type=float, default=0.05, help="PSS / MemAvailable sampling period, s")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds between cases before MemAvailable is read")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--dry-run", action="store_true", help="print the shuffled order and estimates only")
    args = ap.parse_args(argv)
    if args.init is None:
        args.init = f"/dev/shm/zo_fair_init_{args.model}_s{args.seq}.pt"
    try:
        cores = args.cores or len(os.sched_getaffinity(0))
        for item in parse_plan(args.plan):
            item_threads(item, threads_for(item.world, cores, args.threads_per_rank))
            item_tree(item)
    except ValueError as e:
        print(f"run.py: {e}", file=sys.stderr)
        return 2
    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, stop)
    try:
        return Driver(args).run()
    except (RuntimeError, OSError) as e:
        print(f"run.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"run.py: stopped by {e or 'interrupt'}; the rows so far are in {args.out}/rows.jsonl",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
