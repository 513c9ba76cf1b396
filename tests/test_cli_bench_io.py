"""bench io: the headline is the default SwapSpace setting, every setting is reported beside a
ceiling with its block size and requests in flight (the probe, or fio when asked), and dd (one
request in flight) is a labelled reference. 16 MiB regions; the command runs in-process."""
import json
import os
import stat
import statistics
import sys
import threading

import pytest

from zero_offload.bench import io as bench_io
from zero_offload.bench.io import CeilingProbe

from _cli_util import in_process

SMALL = ["--size-gib", "0.016", "--repeats", "1", "--ring", "1x2"]


def bench(capfd, tmp_path, *flags):
    r = in_process(capfd, "bench", "io", "--dir", str(tmp_path / "disk"), *SMALL, *flags,
                   "--out", str(tmp_path / "io"))
    assert r.returncode == 0, r.stderr
    return json.loads((tmp_path / "io.json").read_text()), (tmp_path / "io.md").read_text()


def test_headline_is_the_default_setting_against_the_ceiling_at_its_queue_depth(capfd, tmp_path):
    record, md = bench(capfd, tmp_path, "--ceiling", "probe")
    rows = {r["setting"]: r for r in record["rows"]}
    head = record["headline"]
    assert head["setting"] == "SwapSpace default engine (threads=4 block=1024K qd=16)" and head["in_flight"] == 4
    assert head["ceiling"] == "ceiling 4 in flight (probe: 4 threads x os.pwrite/os.preadv, block 1024K)"
    assert "**Default setting (SwapSpace, what the store uses: threads=4 block=1024K qd=16, 4 in flight): write " in md
    assert "of the ceiling at 4 in flight" in md and "best" not in md.lower()
    engine_rows = [r for r in record["rows"] if r["kind"] == "engine"]
    assert len(engine_rows) == 10  # SwapSpace, the 8 settings, the chunked ring
    for r in engine_rows:
        threads, qd = (int(x) for x in (r["setting"].split("threads=")[1].split()[0],
                                        r["setting"].split("qd=")[1].split(",")[0].split(")")[0]))
        ceiling = rows[r["ceiling"]]
        assert ceiling["kind"] == "ceiling" and ceiling["in_flight"] == r["in_flight"] == min(threads, qd)
        assert ceiling["block_bytes"] == r["block_bytes"]
        ratio = statistics.median(ceiling["write_s"]) / statistics.median(r["write_s"])
        assert r["write_vs_ceiling"] == pytest.approx(ratio, abs=1e-3)
        assert f"| {r['setting']} | {r['in_flight']} | {r['write_GBps']:.3f} |" in md
    (dd,) = [r for r in record["rows"] if r["kind"] == "reference"]
    assert dd["in_flight"] == 1 and "1 request in flight (a reference, not the disk's ceiling)" in dd["setting"]
    assert "ceiling" not in dd  # nothing is reported as a fraction of dd
    assert record["ceiling_tool"] == "probe"


def test_ceiling_probe_has_n_requests_in_flight_and_moves_every_block(tmp_path, monkeypatch):
    block, n, blocks = 4096, 3, 8
    path = tmp_path / "f"
    path.write_bytes(bytes(block * blocks))
    fd = os.open(path, os.O_RDWR)
    probe = CeilingProbe(fd, size=block * blocks, block=block, in_flight=n)
    # every lane's first request waits until all n are in flight at once (a barrier, no timing)
    barrier, real = threading.Barrier(n, timeout=30), (os.pwrite, os.preadv)
    first = threading.local()

    def gate(fn):
        def call(*args):
            if not getattr(first, "done", False):
                first.done = True
                barrier.wait()
            return fn(*args)
        return call

    monkeypatch.setattr(bench_io.os, "pwrite", gate(real[0]))
    probe.write()
    data = path.read_bytes()
    for k in range(blocks):
        assert data[k * block:(k + 1) * block] == bytes([k % n + 1]) * block, k
    monkeypatch.setattr(bench_io.os, "preadv", real[1])
    path.write_bytes(b"".join(bytes([100 + k]) * block for k in range(blocks)))
    probe.read()
    for i, buf in enumerate(probe.buffers):  # each lane's last block: the largest k = i mod n
        assert buf[:] == bytes([100 + max(k for k in range(blocks) if k % n == i)]) * block
    probe.close()
    os.close(fd)


FAKE_FIO = """#!{python}
import json, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)
with open({log!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
rw = args["rw"]
print("fio-3.33 note: a line before the JSON")
print(json.dumps({{"jobs": [{{rw: {{"io_bytes": int(args["size"]), "bw_bytes": 10**9}}}}]}}))
"""


def test_fio_is_the_ceiling_at_the_same_block_and_queue_depth(capfd, tmp_path, monkeypatch):
    bin_dir, log = tmp_path / "bin", tmp_path / "fio.log"
    bin_dir.mkdir()
    fio = bin_dir / "fio"
    fio.write_text(FAKE_FIO.format(python=sys.executable, log=str(log)))
    fio.chmod(fio.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    record, md = bench(capfd, tmp_path)  # --ceiling auto: fio is on PATH
    assert record["ceiling_tool"] == "fio"
    head = record["headline"]
    assert head["ceiling"].startswith("ceiling 4 in flight (fio: libaio iodepth=4, bs=1024K")
    runs = log.read_text().splitlines()
    assert any("--bs=1048576" in run and "--iodepth=4" in run and "--rw=write" in run for run in runs)
    assert all("--ioengine=libaio" in run and "--allow_file_create=0" in run for run in runs)
    # fio's own timing (io_bytes / bw_bytes) is the ceiling's: 1 GB/s exactly
    ceilings = [r for r in record["rows"] if r["kind"] == "ceiling"]
    assert ceilings and all(r["write_GBps"] == r["read_GBps"] == 1.0 for r in ceilings)
    assert "Ceiling of each setting: fio with the same block size" in md


def test_ceiling_fio_without_fio_is_one_line(capfd, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink("/usr/bin/dd" if os.path.exists("/usr/bin/dd") else "/bin/dd", bin_dir / "dd")
    monkeypatch.setenv("PATH", str(bin_dir))
    r = in_process(capfd, "bench", "io", "--dir", str(tmp_path / "disk"), *SMALL, "--ceiling", "fio")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "zero-offload bench io: error: --ceiling fio: fio not found on PATH; install fio, or pass --ceiling probe")
    assert not (tmp_path / "disk").exists()  # refused before anything was made
