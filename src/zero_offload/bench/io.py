"""How close does the swap I/O engine come to the disk? Ours vs a plain reader/writer with the
same number of requests in flight, one run.

Writes then reads a region (default 2 GiB) of a preallocated file: through SwapSpace with its
default engine (what the store uses: the headline), through AioEngine for a set of (threads,
block_size, queue_depth) settings, and, as the ceiling of each, through a plain reference with
the same block size and the same number of requests in flight (an AioEngine has
min(threads, queue_depth) in flight): fio (direct=1, libaio, iodepth N) when it is on PATH, else
the ceiling probe here, N Python threads each doing os.pwrite/os.preadv of one block at a time on
the O_DIRECT file from page-aligned buffers. Each setting is reported beside its matched ceiling.
`dd` with O_DIRECT and 16 MiB blocks (one request in flight) stays as a labelled reference, not
a ceiling. Everything is interleaved per repeat, in a shuffled order; medians. The data the
engine reads back is checked against what it wrote.

    zero-offload bench io --dir /tmp/zo_bench --size-gib 2          # default subset
    zero-offload bench io --dir /nvme/zo_bench --size-gib 4 --full  # full sweep

Results: <out>.md (+ .json) with --out (records: benchmarks/results/io_<hardware>_<date>).
In a source checkout, `python benchmarks/bench_io.py ARGS` runs the same main.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import itertools
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import torch

from ..runtime.swap_io import AioEngine, SwapSpace, aligned_empty
from . import command_line, cpu_model, publish

MIB = 1 << 20
DD_BLOCK = 16 * MIB
DEFAULT_SETTINGS = [  # (threads, block_size, queue_depth)
    (1, 16 * MIB, 1),
    (2, 4 * MIB, 2),
    (4, 1 * MIB, 4),
    (4, 4 * MIB, 16),
    (8, 1 * MIB, 8),
    (8, 2 * MIB, 8),
    (8, 4 * MIB, 8),
    (8, 16 * MIB, 32),
]
FULL_SETTINGS = [(t, b, q) for t, b, q in itertools.product(
    (1, 2, 4, 8), (256 << 10, 1 * MIB, 4 * MIB, 16 * MIB), (1, 4, 16, 32)) if q >= t or q == 1]


@dataclasses.dataclass(kw_only=True)
class Result:
    """One row of the report: how to move the whole region each way, and the seconds each took."""

    name: str
    write: Callable[[], object]
    read: Callable[[], object]
    in_flight: Optional[int] = None
    """Requests the disk sees at once."""
    block: Optional[int] = None
    ceiling: Optional[tuple] = None
    """The key of this row's matched ceiling (an engine row): (block, in_flight)."""
    kind: str = "engine"
    """"engine", "ceiling" or "reference" (dd)."""
    write_s: list = dataclasses.field(default_factory=list)
    read_s: list = dataclasses.field(default_factory=list)


class CeilingProbe:
    """The plain reference: ``in_flight`` threads, each moving one ``block`` at a time with
    os.pwrite / os.preadv on ``fd`` (opened O_DIRECT by the caller when the disk allows it) from
    its own page-aligned buffer (an anonymous mmap); thread i moves blocks i, i + n, i + 2n, ... of
    the region, so the disk sees ``in_flight`` requests at once, as from an AioEngine with
    min(threads, queue_depth) = ``in_flight``. Nothing of zero_offload's engine is in the path."""

    def __init__(self, fd: int, *, size: int, block: int, in_flight: int):
        if size % block:
            raise ValueError(f"the region ({size} bytes) is not a whole number of {block}-byte blocks")
        self.fd, self.size, self.block, self.in_flight = fd, size, block, in_flight
        self.name = (f"probe: {in_flight} thread{'s' if in_flight > 1 else ''} x os.pwrite/os.preadv, "
                     f"block {block // 1024}K")
        self.buffers = [mmap.mmap(-1, block) for _ in range(in_flight)]
        for i, buf in enumerate(self.buffers):
            buf.write(bytes([i % 251 + 1]) * block)  # each lane's own pattern (what tests check)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=in_flight)

    def _lane(self, i: int, write: bool) -> None:
        buf, block = self.buffers[i], self.block
        for offset in range(i * block, self.size, self.in_flight * block):
            n = os.pwrite(self.fd, buf, offset) if write else os.preadv(self.fd, [buf], offset)
            if n != block:
                raise OSError(f"ceiling probe: {'wrote' if write else 'read'} {n} of {block} bytes at "
                              f"offset {offset}")

    def move(self, write: bool) -> None:
        for f in [self.pool.submit(self._lane, i, write) for i in range(self.in_flight)]:
            f.result()

    def write(self) -> None:
        self.move(True)

    def read(self) -> None:
        self.move(False)

    def close(self) -> None:
        self.pool.shutdown()
        for buf in self.buffers:
            buf.close()


class FioCeiling:
    """The reference by fio: one job, libaio, ``iodepth`` = ``in_flight``, ``bs`` = ``block``,
    direct=1 when the disk allows O_DIRECT, over the first ``size`` bytes of ``path`` (the
    benchmark's own file: fio may not create or lay out another). Its time is fio's own
    (io_bytes / bw_bytes of its JSON report), so fio's start-up is not counted against the disk."""

    def __init__(self, fio: str, path: str, *, size: int, block: int, in_flight: int, direct: bool):
        self.block, self.in_flight = block, in_flight
        self.name = f"fio: libaio iodepth={in_flight}, bs={block // 1024}K{', direct=1' if direct else ''}"
        self.command = [fio, "--name=ceiling", f"--filename={path}", f"--size={size}", f"--bs={block}",
                        f"--iodepth={in_flight}", "--ioengine=libaio", f"--direct={int(direct)}", "--numjobs=1",
                        "--allow_file_create=0", "--fallocate=none", "--output-format=json"]

    def _run(self, rw: str) -> float:
        r = subprocess.run([*self.command, f"--rw={rw}"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"fio failed ({' '.join(self.command)} --rw={rw}): "
                               f"{' '.join((r.stderr or r.stdout).split())[:300]}; pass --ceiling probe")
        job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0][rw]
        if not job.get("bw_bytes"):
            raise RuntimeError(f"fio reported no {rw} bandwidth; pass --ceiling probe")
        return job["io_bytes"] / job["bw_bytes"]

    def write(self) -> float:
        return self._run("write")

    def read(self) -> float:
        return self._run("read")

    def close(self) -> None:
        pass


def measure(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took: the wall time, or the float it returns (a tool's own timing)."""
    start = time.perf_counter()
    ret = fn()
    elapsed = time.perf_counter() - start
    return ret if isinstance(ret, float) else elapsed


def machine() -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu, "kernel": platform.release()}


def fs_info(directory: str) -> str:
    fs = subprocess.run(["stat", "-f", "-c", "%T", directory], capture_output=True, text=True).stdout.strip()
    dev = subprocess.run(["df", "--output=source", directory], capture_output=True, text=True).stdout.split()[-1:]
    return f"{fs} on {dev[0] if dev else '?'}"


def move_chunks(submit, fd, ring, size, path) -> None:
    """Moves ``size`` bytes in ring-buffer-sized chunks, ``len(ring)`` in flight: a buffer is
    reused only once the transfer that last used it has ended."""
    chunk = ring[0].numel()
    pending = [None] * len(ring)
    for i, offset in enumerate(range(0, size, chunk)):
        k = i % len(ring)
        if pending[k] is not None:
            pending[k].wait()
        pending[k] = submit(fd, ring[k], offset=offset, nbytes=min(chunk, size - offset), path=path)
    for h in pending:
        if h is not None:
            h.wait()


def engine_name(engine: AioEngine) -> str:
    return f"threads={engine.threads} block={engine.block_size // 1024}K qd={engine.queue_depth}"


def in_flight(engine: AioEngine) -> int:
    """Requests an engine has at the disk at once (see AioEngine)."""
    return min(engine.threads, engine.queue_depth)


def main(argv=None, *, prog: str = "python -m zero_offload.bench.io") -> int:
    """Runs the benchmark with command-line arguments ``argv`` (default ``sys.argv[1:]``); ``prog``
    is how it was invoked, shown in ``--help`` and recorded as the command in the results."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/zo_bench_io", help="directory on the disk to measure")
    p.add_argument("--size-gib", type=float, default=2.0, help="region size in GiB (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per setting; medians are reported")
    p.add_argument("--full", action="store_true", help="full sweep of threads x block size x queue depth")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop repeating once this much time has passed (at least one repeat runs)")
    p.add_argument("--ring", default="64x4", metavar="MIBxN",
                   help="chunked-read row: chunk MiB x buffers in flight (default 64x4, as the store "
                        "stages NVMe chunks through a few reused pinned buffers)")
    p.add_argument("--ceiling", default="auto", choices=["auto", "fio", "probe"],
                   help="the reference at each setting's block size and requests in flight: fio (libaio, "
                        "direct=1), the probe (threads doing os.pwrite/os.preadv), or auto: fio when it is on "
                        "PATH, else the probe")
    p.add_argument("--hardware", default=None, help="label for the results file name (default: hostname)")
    p.add_argument("--out", default=None, help="write <out>.md and <out>.json")
    args = p.parse_args(argv)

    size = int(args.size_gib * (1 << 30)) // DD_BLOCK * DD_BLOCK
    if size <= 0:
        p.error("--size-gib is too small")
    settings = FULL_SETTINGS if args.full else DEFAULT_SETTINGS
    if shutil.which("dd") is None:
        p.error("dd not found on PATH")
    fio = shutil.which("fio") if args.ceiling != "probe" else None
    if args.ceiling == "fio" and fio is None:
        p.error("--ceiling fio: fio not found on PATH; install fio, or pass --ceiling probe")
    os.makedirs(args.dir, exist_ok=True)

    # reference data: a random 1 MiB tile repeated, so the check is cheap and meaningful
    buf = aligned_empty(size)
    tile = torch.randint(0, 256, (MIB,), dtype=torch.uint8)
    buf.view(-1, MIB).copy_(tile.expand(size // MIB, MIB))
    out = aligned_empty(size)
    out.fill_(0)  # touch every page before timing

    with SwapSpace(args.dir, capacity_bytes=size) as space, contextlib.ExitStack() as closing:
        mode = space.mode.value
        path = space.path  # preallocated, private; the benchmark file for everything below
        is_direct, default_engine = space.direct, engine_name(space.engine)
        fd = os.open(path, os.O_RDWR | (os.O_DIRECT if space.direct else 0))
        closing.callback(os.close, fd)
        ceilings: dict[tuple, Result] = {}

        def ceiling_of(block: int, n: int) -> tuple:
            if (block, n) not in ceilings:
                if fio:
                    ref = FioCeiling(fio, path, size=size, block=block, in_flight=n, direct=space.direct)
                else:
                    ref = CeilingProbe(fd, size=size, block=block, in_flight=n)
                closing.callback(ref.close)
                ceilings[(block, n)] = Result(name=f"ceiling {n} in flight ({ref.name})", write=ref.write,
                                              read=ref.read, in_flight=n, block=block, kind="ceiling")
            return (block, n)

        def engine_row(name: str, engine: AioEngine, write, read) -> Result:
            n = in_flight(engine)
            return Result(name=name, write=write, read=read, in_flight=n, block=engine.block_size,
                          ceiling=ceiling_of(engine.block_size, n))

        def dd(*operands: str, direct_flag: str) -> Callable[[], object]:
            direct = [f"{direct_flag}=direct"] if space.direct else []
            count = f"count={size // DD_BLOCK}"
            return lambda: subprocess.run(["dd", *operands, *direct, f"bs={DD_BLOCK}", count, "status=none"],
                                          check=True)

        slot = space.alloc(size)
        results = {"space": engine_row(f"SwapSpace default engine ({default_engine})", space.engine,
                                       write=lambda: space.write(slot, buf).wait(),
                                       read=lambda: space.read(slot, out).wait())}
        engines = {}
        for t, b, q in settings:
            engine = engines[(t, b, q)] = AioEngine(threads=t, block_size=b, queue_depth=q)
            closing.callback(engine.close)
            results[(t, b, q)] = engine_row(f"engine {engine_name(engine)}", engine,
                                            write=lambda e=engine: e.write(fd, buf, offset=0, path=path).wait(),
                                            read=lambda e=engine: e.read(fd, out, offset=0, path=path).wait())
        ring_mib, ring_n = (int(v) for v in args.ring.lower().split("x"))
        ring = [aligned_empty(ring_mib * MIB) for _ in range(ring_n)]
        for r in ring:
            r.fill_(0)  # touch every page before timing
        ring_engine = AioEngine(threads=4, block_size=MIB, queue_depth=16)
        closing.callback(ring_engine.close)
        results["ring"] = engine_row(f"engine {engine_name(ring_engine)}, {ring_mib} MiB chunks into {ring_n} "
                                     "reused buffers (the store's staging pattern)", ring_engine,
                                     write=lambda: move_chunks(ring_engine.write, fd, ring, size, path),
                                     read=lambda: move_chunks(ring_engine.read, fd, ring, size, path))
        results.update(ceilings)
        results["dd"] = Result(name=f"dd bs=16M {'O_DIRECT' if space.direct else 'buffered'}, 1 request in flight "
                                    "(a reference, not the disk's ceiling)",
                               write=dd("if=/dev/zero", f"of={path}", "conv=notrunc", direct_flag="oflag"),
                               read=dd(f"if={path}", "of=/dev/null", direct_flag="iflag"),
                               in_flight=1, block=DD_BLOCK, kind="reference")
        checked = set(engines) | {"space"}

        started = time.perf_counter()
        repeats = 0
        for rep in range(args.repeats):
            # [Note: fairness] a VM disk's host cache and the neighbours' load drift over a run,
            # so each repeat runs the settings, their ceilings and dd in a different (seeded) order
            order = list(results)
            random.Random(rep).shuffle(order)
            for key in order:
                r = results[key]
                r.write_s.append(measure(r.write))
                if key in checked:
                    out.view(-1, MIB)[:, :8].zero_()  # so a read that moved nothing cannot pass
                r.read_s.append(measure(r.read))
                if key in checked and (not torch.equal(out[: 64 * MIB], buf[: 64 * MIB])
                                       or not torch.equal(out[-MIB:], buf[-MIB:])
                                       or not bool((out.view(-1, MIB)[:, :8] == tile[:8]).all())):
                    raise RuntimeError(f"data read back differs from data written ({r.name})")
            repeats += 1
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
            if args.max_seconds is not None and time.perf_counter() - started > args.max_seconds:
                break

    gb = size / 1e9
    gbps = {key: (gb / statistics.median(r.write_s), gb / statistics.median(r.read_s)) for key, r in results.items()}
    rows = []
    for key, r in results.items():  # the SwapSpace row first
        w, rd = gbps[key]
        row = {"setting": r.name, "kind": r.kind, "in_flight": r.in_flight, "block_bytes": r.block,
               "write_GBps": round(w, 3), "read_GBps": round(rd, 3)}
        if r.ceiling is not None:
            cw, cr = gbps[r.ceiling]
            row.update({"ceiling": results[r.ceiling].name, "write_vs_ceiling": round(w / cw, 3),
                        "read_vs_ceiling": round(rd / cr, 3)})
        rows.append({**row, "write_s": r.write_s, "read_s": r.read_s})
    head = rows[0]  # the SwapSpace row: what the engine uses

    info = machine()
    hw = args.hardware or platform.node()
    date = datetime.date.today().isoformat()
    tool = "fio" if fio else "the ceiling probe"
    lines = [
        f"# Swap I/O engine vs the disk at matched queue depth ({'O_DIRECT' if is_direct else 'buffered'}), "
        f"{hw}, {date}",
        "",
        f"- Machine: {info['cpu']}, {info['cores']} cores, GPU {info['gpu']}, kernel {info['kernel']}",
        f"- Directory: `{args.dir}` ({fs_info(args.dir)}), swap mode `{mode}`",
        f"- Region: {size / (1 << 30):.2f} GiB, write then read, {repeats} repeats (order shuffled per repeat); medians",
        f"- Command: `{command_line(prog, argv)}`",
        f"- Ceiling of each setting: {tool} with the same block size and the same requests in flight "
        "(an engine has min(threads, queue depth) in flight). GB = 1e9 bytes.",
        "",
        f"**Default setting (SwapSpace, what the store uses: {default_engine}, {head['in_flight']} in "
        f"flight): write {head['write_GBps']:.3f} GB/s = {head['write_vs_ceiling']:.0%} of the ceiling at "
        f"{head['in_flight']} in flight ({gbps[results['space'].ceiling][0]:.3f} GB/s), read {head['read_GBps']:.3f} "
        f"GB/s = {head['read_vs_ceiling']:.0%} of it ({gbps[results['space'].ceiling][1]:.3f} GB/s).**",
        "",
        "| setting | in flight | write GB/s | read GB/s | ceiling write GB/s | ceiling read GB/s | write / ceiling | read / ceiling |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in zip(results, rows):
        if r["kind"] != "engine":
            continue
        cw, cr = gbps[results[key].ceiling]
        lines.append(f"| {r['setting']} | {r['in_flight']} | {r['write_GBps']:.3f} | {r['read_GBps']:.3f} | "
                     f"{cw:.3f} | {cr:.3f} | {r['write_vs_ceiling']:.2f} | {r['read_vs_ceiling']:.2f} |")
    lines += ["", "| reference | in flight | write GB/s | read GB/s |", "|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "engine":
            lines.append(f"| {r['setting']} | {r['in_flight']} | {r['write_GBps']:.3f} | {r['read_GBps']:.3f} |")
    record = {"machine": info, "hardware": hw, "date": date, "directory": args.dir, "mode": mode,
              "size_bytes": size, "repeats": repeats, "ceiling_tool": "fio" if fio else "probe",
              "headline": {k: head[k] for k in ("setting", "in_flight", "write_GBps", "read_GBps", "ceiling",
                                                 "write_vs_ceiling", "read_vs_ceiling")},
              "rows": rows}
    publish("\n".join(lines) + "\n", record, md_path=args.out and args.out + ".md",
            json_path=args.out and args.out + ".json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
