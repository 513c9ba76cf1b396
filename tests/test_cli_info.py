"""zero-offload info: text and --json describe this machine. The command runs in-process
(_cli_util)."""
import json

import psutil
import pytest
import torch

from _cli_util import in_process


@pytest.fixture
def run(capfd):
    return lambda *argv: in_process(capfd, "info", *argv)


def test_info_json_parses_and_matches_the_machine(run, tmp_path):
    (tmp_path / "swap").mkdir()
    r = run("--json", "--nvme-dir", str(tmp_path / "swap"))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["torch"] == torch.__version__
    assert (info["gpu"] is None) == (not torch.cuda.is_available())
    host = info["host"]
    assert host["cpus"] >= 1 and 0 < host["ram_available_bytes"] <= host["ram_total_bytes"] == psutil.virtual_memory().total
    nvme = info["nvme"]
    assert "error" not in nvme, nvme
    assert nvme["free_bytes"] > 0 and isinstance(nvme["o_direct"], bool)
    assert list((tmp_path / "swap").iterdir()) == [], "the O_DIRECT probe must remove its files"
    assert info["cpu_adam_isa"] in ("avx512", "avx2", "scalar")
    bw = info["bandwidth"]["cpu_copy_bytes_per_s"]
    assert 1e8 < bw < 1e12  # 0.1 GB/s .. 1 TB/s: a measurement, not a constant


def test_info_text(run, tmp_path):
    r = run("--no-measure", "--nvme-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for label in ("GPU:", "host RAM:", "RLIMIT_MEMLOCK", "swap dir:", "O_DIRECT", "CPU-Adam:"):
        assert label in r.stdout
    assert "bandwidth" not in r.stdout
    # how to launch on several devices and what each rank holds (no GPU here: 2 CPU processes)
    line = next(l for l in r.stdout.splitlines() if l.startswith("several GPUs:"))
    assert "torchrun --nproc-per-node 2" in line and "holds 1/2 of every chunk" in line
