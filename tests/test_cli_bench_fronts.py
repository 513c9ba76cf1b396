"""bench adam / bench io: the packaged benchmarks (zero_offload.bench), arguments passed through,
runnable from an installed package with no repository next to it. The installed-package and
repository-script tests run processes (the package copy, the scripts are the point); the bad-flag
test runs the command in-process (_cli_util)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import zero_offload

from _cli_util import in_process

REPO = Path(__file__).resolve().parents[1]


def run(*argv, cwd, pythonpath=None, timeout=180):
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", "zero_offload", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def installed_copy(tmp_path) -> Path:
    """The package as a wheel installs it: zero_offload/ alone in a site directory, no benchmarks/
    anywhere above it."""
    site = tmp_path / "site"
    shutil.copytree(Path(zero_offload.__file__).parent, site / "zero_offload",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def test_installed_package_runs_bench_adam_outside_the_repo(tmp_path):
    site, work = installed_copy(tmp_path), tmp_path / "work"
    work.mkdir()
    r = run("bench", "adam", "--help", cwd=work, pythonpath=site)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: zero-offload bench adam") and "--sizes" in r.stdout
    r = run("bench", "adam", "--threads", "1", "--sizes", "2K", "--repeats", "1", "--rmw-gib", "0.001",
            "--gap-ms", "0", "--no-foreach", "--json-out", "adam.json", "--md-out", "adam.md",
            cwd=work, pythonpath=site)
    assert r.returncode == 0, r.stderr
    assert "parity check: ok" in r.stdout
    record = json.loads((work / "adam.json").read_text())
    assert record["meta"]["command"].startswith("zero-offload bench adam --threads 1 --sizes 2K")
    impls = {(x["case"], x["impl"]) for x in record["results"] if x["numel"] == 2000}
    assert {("a", "zero_offload CPUAdam"), ("a", "torch Adam fused"), ("b", "zero_offload adam_step"),
            ("b", "torch composite")} <= impls
    assert all(len(x["seconds"]) == 1 and x["median_s"] > 0 for x in record["results"] if x["note"] is None)
    assert "| a | 0.002M | zero_offload CPUAdam |" in (work / "adam.md").read_text()


def test_installed_package_runs_bench_io_outside_the_repo(tmp_path):
    site, work = installed_copy(tmp_path), tmp_path / "work"
    work.mkdir()
    r = run("bench", "io", "--dir", str(tmp_path / "disk"), "--size-gib", "0.016", "--repeats", "1",
            "--ring", "1x2", "--hardware", "testbox", "--out", "io", cwd=work, pythonpath=site)
    assert r.returncode == 0, r.stderr
    record = json.loads((work / "io.json").read_text())
    assert record["hardware"] == "testbox" and record["size_bytes"] == 16 << 20
    assert record["rows"][0]["setting"].startswith("SwapSpace default engine") and record["rows"][0]["ceiling"]
    # SwapSpace, 8 engine settings, the chunked ring, a ceiling per (block, in flight) of them (8), dd
    assert len(record["rows"]) == 19
    assert all(row["write_GBps"] > 0 and row["read_GBps"] > 0 for row in record["rows"])
    assert "- Command: `zero-offload bench io --dir" in (work / "io.md").read_text()


def test_bad_flag_reaches_the_benchmark_parser(capfd, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    r = in_process(capfd, "bench", "io", "--size-gib", "0")
    assert r.returncode == 2
    assert "zero-offload bench io: error: --size-gib is too small" in r.stderr


def test_repository_scripts_run_the_same_main(tmp_path):
    """`python benchmarks/bench_*.py` (what gpu_session.sh runs) still takes the same flags."""
    for script, flag in (("bench_cpu_adam.py", "--sizes"), ("bench_io.py", "--size-gib")):
        r = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True,
                           text=True, timeout=120, cwd=REPO)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"usage: python benchmarks/{script}") and flag in r.stdout


def test_wheel_contains_every_subpackage():
    """pyproject's package list, as setuptools expands it, holds every package under src/ (a
    subpackage missing from it is missing from the wheel: `bench adam` would fail installed)."""
    from setuptools.config.pyprojecttoml import read_configuration

    packages = read_configuration(REPO / "pyproject.toml", expand=True)["tool"]["setuptools"]["packages"]
    on_disk = {".".join(p.parent.relative_to(REPO / "src").parts) for p in (REPO / "src").rglob("__init__.py")}
    assert "zero_offload.bench" in on_disk
    assert on_disk <= set(packages)
