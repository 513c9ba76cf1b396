"""benchmarks/bench_init.py on the CPU with the tiny preset: one process per case, rows with the
fields the issue asks for (params, world, seconds per billion, close and exit seconds, host bytes
per param), the values checked against the reference init (meta) and the file (weights), an
engine left open at exit, and the driver's exit status."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_init.py"


def test_bench_init_smoke(tmp_path):
    out = tmp_path / "init.json"
    r = subprocess.run([sys.executable, str(BENCH), "--model", "tiny", "--steps", "1", "--seq", "16",
                        "--cases", "meta-cpu,weights-cpu,meta-auto-open,pin-probe", "--probe-gib", "0.05",
                        "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["failed"] == []
    rows = {row["case"]: row for row in report["rows"]}
    assert set(rows) == {"meta-cpu", "weights-cpu", "meta-auto-open", "pin-probe"}
    for case in ("meta-cpu", "weights-cpu", "meta-auto-open"):
        row = rows[case]
        assert row["params"] == 842_496 and row["world"] == 1
        assert row["init_s"] > 0 and abs(row["init_s_per_b"] - row["init_s"] / (row["params"] / 1e9)) < 1e-6
        assert row["exit_s"] > 0 and row["host_bytes_per_param"] > 0
        assert row["check"]["equal"] and len(row["check"]["params_compared"]) == 3
        assert row["profile_top"] and {"function", "calls", "own_s", "cumulative_s"} <= set(row["profile_top"][0])
        assert len(row["step_s"]) == 1
    assert rows["meta-cpu"]["closed"] and rows["meta-cpu"]["close_s"] > 0
    assert not rows["meta-auto-open"]["closed"] and rows["meta-auto-open"]["close_s"] is None
    assert rows["weights-cpu"]["source"] == "weights" and report["weights_written_s"] > 0
    ways = rows["pin-probe"]["ways"]  # every way twice; cudaHostAlloc has nothing to say without CUDA
    assert "fill" in ways and "populate-8" in ways and all(len(rounds) == 2 for rounds in ways.values())
    for way, rounds in ways.items():
        for got in rounds:
            assert got == {} if way == "host-alloc" else (got["touch_gib_s"] > 0 and got["how"] in ("fill", "populate"))
    assert "s/B" in r.stdout and "values equal" in r.stdout
