"""zero-offload: every bad flag or config value -> one line on stderr naming the fix, exit 2."""
import json
import subprocess
import sys

import pytest

from zero_offload.cli import main


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def run(capsys):
    """The command in-process (fast); test_subprocess_exit_code checks the real entry point."""
    def _run(*argv):
        code = main(list(argv))
        out, err = capsys.readouterr()
        return Result(code, out, err)
    return _run


def test_subprocess_exit_code():
    r = subprocess.run([sys.executable, "-m", "zero_offload", "train", "--steps", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "positive integer" in r.stderr


@pytest.mark.parametrize("argv, code", [
    (["train", "--bogus"], 2),
    (["train", "--steps", "-1"], 2),
    (["train", "--preset", "70b"], 2),
    (["bench", "prefetch", "--depths", "1,x"], 2),
    (["train", "--help"], 0),
])
def test_usage_errors_answer_before_torch_is_imported(argv, code):
    # torch takes 3-30 s to import: the real entry point answers a usage error (and --help)
    # without it (cli.py [Note: torch after parsing]); -X importtime lists every module imported
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "zero_offload", *argv],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "zero_offload.cli" in imported  # the parse did happen here
    assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy")}, sorted(imported)
    errors = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert len(errors) == (code != 0) and all(line.startswith("zero-offload: error:") for line in errors)


@pytest.mark.parametrize("argv, fix", [
    (["train", "--steps", "0"], "expected a positive integer"),
    (["train", "--steps", "ten"], "expected a positive integer"),
    (["train", "--prefetch-depth", "-1"], "integer >= 0"),
    (["train", "--lr", "nan"], "positive number"),
    (["train", "--preset", "70b"], "invalid choice"),
    (["train", "--params", "disk"], "choose from"),
    (["train", "--bogus"], "unrecognized arguments"),
    (["bench", "prefetch", "--depths", "1,x"], "e.g. 0,1,2,4,8"),
    (["bench", "prefetch", "--depths", "2,2"], "distinct"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_bad_flag_exits_2_with_one_line(run, argv, fix):
    r = run(*argv)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("zero-offload: error:") and fix in lines[0]
    assert "--help" in lines[0]


def test_bad_config_values_exit_2_with_one_line(run, tmp_path):
    cases = {
        "bad_dtype.json": ({"dtype": "fp8"}, "dtype"),
        "typo.json": ({"prefetch_dept": 2}, "did you mean 'prefetch_depth'"),
        "train_typo.json": ({"train": {"stepz": 3}}, "valid keys"),
        "bad_preset.json": ({"train": {"preset": "huge"}}, "choose one of"),
        "bad_steps.json": ({"train": {"steps": -3}}, "positive integer"),
        "not_object.json": ([1, 2], "JSON object"),
    }
    for name, (content, fix) in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(content))
        r = run("train", "--config", str(path), "--out", str(tmp_path / "ckpt"))
        assert r.returncode == 2, (name, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and fix in lines[0], (name, r.stderr)
    (tmp_path / "broken.json").write_text("{not json")
    # A checkpoint already in --out (CI runs `zero-offload train` in the checkout first) must not
    # hide a bad --config: flags and config are checked first.
    (tmp_path / "ckpt" / "train_state.json").parent.mkdir(exist_ok=True)
    (tmp_path / "ckpt" / "train_state.json").write_text(json.dumps({"step": 3, "checkpoint": None}))
    r = run("train", "--config", str(tmp_path / "broken.json"), "--out", str(tmp_path / "ckpt"))
    assert r.returncode == 2 and "not valid JSON" in r.stderr
    r = run("train", "--config", str(tmp_path / "missing.json"), "--out", str(tmp_path / "ckpt"))
    assert r.returncode == 2 and "pass an existing JSON file" in r.stderr


@pytest.mark.parametrize("train, fix", [
    ({"save_every": "often"}, "save_every"),
    ({"seq_len": 0}, "seq_len"),
    ({"sample_tokens": -1}, "sample_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"batch_size": True}, "batch_size"),
    ({"lr": "fast"}, "lr"),
])
def test_bad_train_section_values_exit_2_naming_the_key(run, tmp_path, train, fix):
    # each "train" value is checked as its flag is (it used to crash later, exit 1, or pass unnoticed)
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"train": train}))
    r = run("train", "--config", str(path), "--steps", "1", "--no-progress", "--out", str(tmp_path / "ckpt"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fix in lines[0] and "expected" in lines[0] and str(path) in lines[0], r.stderr


def test_resume_without_checkpoint_names_the_fix(run, tmp_path):
    r = run("train", "--resume", "--out", str(tmp_path / "nothing"))
    assert r.returncode == 2
    assert "run without --resume first" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_help_exits_0(run):
    for argv in (["--help"], ["train", "--help"], ["bench", "prefetch", "--help"], ["info", "--help"]):
        r = run(*argv)
        assert r.returncode == 0 and "usage: zero-offload" in r.stdout, argv
