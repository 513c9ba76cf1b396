"""bench adam / bench io: run the repository's benchmark scripts, arguments passed through."""
import os
import subprocess
import sys


def run(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "zero_offload", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_front_calls_main_with_the_arguments(tmp_path):
    (tmp_path / "bench_io.py").write_text(
        "import sys\n"
        "def main(argv):\n"
        "    print('ARGV', argv, 'SYSARGV', sys.argv[1:])\n"
        "    return 3\n")
    r = run("bench", "io", "--size-gib", "0.5", "--full", env={"ZERO_OFFLOAD_BENCHMARKS": str(tmp_path)})
    assert r.returncode == 3, r.stderr
    assert "ARGV ['--size-gib', '0.5', '--full'] SYSARGV ['--size-gib', '0.5', '--full']" in r.stdout


def test_missing_benchmarks_dir_names_the_fix(tmp_path):
    r = run("bench", "adam", env={"ZERO_OFFLOAD_BENCHMARKS": str(tmp_path / "none")})
    assert r.returncode == 2
    assert "source checkout" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_real_bench_io_help_passes_through():
    r = run("bench", "io", "--help")
    assert r.returncode == 0, r.stderr
    assert "--size-gib" in r.stdout
