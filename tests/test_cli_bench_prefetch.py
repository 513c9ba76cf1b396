"""zero-offload bench prefetch: real steps per depth -> table, JSON, PNG, recommendation."""
import json
import os
import re
import subprocess
import sys


def expected_depth(record: dict) -> int:
    """The smallest depth whose median step time is within the tolerance of the best."""
    medians = {res["depth"]: res["step_time_s"]["median"] for res in record["results"]}
    best = min(medians.values())
    return min(d for d, m in medians.items() if m <= best * (1 + record["tolerance"]))


def test_bench_prefetch_writes_json_png_and_recommends(tmp_path):
    r = subprocess.run([sys.executable, "-m", "zero_offload", "bench", "prefetch", "--depths", "0,2",
                        "--preset", "tiny", "--steps", "2", "--warmup", "1", "--batch-size", "4",
                        "--seq-len", "64", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "step ms (median)" in r.stdout and "recommended prefetch depth:" in r.stdout
    (js,) = tmp_path.glob("prefetch_*.json")
    (png,) = tmp_path.glob("prefetch_*.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    record = json.loads(js.read_text())
    assert [res["depth"] for res in record["results"]] == [0, 2]
    # the smallest depth whose median is within the tolerance of the best, marked in the table
    expected = expected_depth(record)
    assert record["recommended_depth"] == expected
    assert f"recommended prefetch depth: {expected} " in r.stdout
    assert re.search(rf"^\s*{expected} \*\s", r.stdout, re.M), r.stdout
    for res in record["results"]:
        assert len(res["step_time_s"]["all"]) == 2 and res["step_time_s"]["median"] > 0
        # params live on the CPU, optimizer state on NVMe: every step moves bytes on those hops
        assert res["bytes_per_step"].get("cpu->gpu", 0) > 0 or res["bytes_per_step"].get("nvme->cpu", 0) > 0
        assert res["peak_bytes"]["cpu"] > 0


def test_bench_prefetch_without_matplotlib_still_recommends(tmp_path):
    blocker = tmp_path / "no_matplotlib"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "zero_offload", "bench", "prefetch", "--depths", "0,1",
                        "--preset", "tiny", "--steps", "1", "--warmup", "1", "--batch-size", "2",
                        "--seq-len", "32", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "step ms (median)" in r.stdout and "recommended prefetch depth:" in r.stdout
    (js,) = out.glob("prefetch_*.json")
    assert not list(out.glob("*.png"))
    note = [line for line in r.stdout.splitlines() if "no PNG" in line]
    assert len(note) == 1 and "pip install matplotlib" in note[0] and js.name in note[0]
    record = json.loads(js.read_text())
    assert record["recommended_depth"] == expected_depth(record)
    assert f"recommended prefetch depth: {expected_depth(record)} " in r.stdout
