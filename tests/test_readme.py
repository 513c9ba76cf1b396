"""Every ```python snippet of README.md and docs/engine.md runs as written (CPU, in a fresh
directory)."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "docs" / "engine.md"]
SNIPPETS = [textwrap.dedent(s) for doc in DOCS for s in  # (a snippet inside a list item is indented)
            re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)]


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 6


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs_as_written(index, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    r = subprocess.run([sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"snippet {index} (README.md, then docs/engine.md) failed:\n{SNIPPETS[index]}\n{r.stderr[-3000:]}"
