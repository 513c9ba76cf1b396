"""zero-offload bench prefetch: real steps per depth -> table, JSON, PNG, recommendation."""
import json
import subprocess
import sys


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
    assert record["recommended_depth"] in (0, 2)
    for res in record["results"]:
        assert len(res["step_time_s"]["all"]) == 2 and res["step_time_s"]["median"] > 0
        # params live on the CPU, optimizer state on NVMe: every step moves bytes on those hops
        assert res["bytes_per_step"].get("cpu->gpu", 0) > 0 or res["bytes_per_step"].get("nvme->cpu", 0) > 0
        assert res["peak_bytes"]["cpu"] > 0
