"""SwapSpace removes what it created (close, interpreter exit) and nothing else."""
import os
import subprocess
import sys
import textwrap

import pytest

from _aio_util import random_buffer
from zero_offload.swap_io import SwapSpace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_close_removes_only_its_files(tmp_path):
    foreign = tmp_path / "zero_offload-1-foreign"
    foreign.mkdir()
    (foreign / "swap.bin").write_bytes(b"not ours")
    (tmp_path / "user.txt").write_bytes(b"keep")
    space = SwapSpace(tmp_path, capacity_bytes=1 << 20)
    slot = space.alloc(4096)
    space.write(slot, random_buffer(4096))  # not waited for: close() waits
    space.close()
    space.close()  # idempotent
    assert sorted(os.listdir(tmp_path)) == ["user.txt", "zero_offload-1-foreign"]
    assert (foreign / "swap.bin").read_bytes() == b"not ours"
    with pytest.raises(ValueError, match="closed"):
        space.alloc(4096)


def test_close_keeps_a_file_someone_put_in_its_directory(tmp_path):
    space = SwapSpace(tmp_path, capacity_bytes=4096)
    stray = os.path.join(space.directory, "stray")
    open(stray, "wb").close()
    space.close()
    assert os.path.exists(stray) and not os.path.exists(space.path)


@pytest.mark.parametrize("ending", ["return", "sys.exit(3)", "raise RuntimeError('boom')"])
def test_interpreter_exit_removes_files(tmp_path, ending):
    script = textwrap.dedent(f"""
        import sys, torch
        from zero_offload.swap_io import SwapSpace, aligned_empty
        def main():
            space = SwapSpace({str(tmp_path)!r}, capacity_bytes=8 << 20)
            slot = space.alloc(8 << 20)
            space.write(slot, aligned_empty(8 << 20))  # in flight at exit
            print(space.path, flush=True)
            {ending}
        keep = main()
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("swap.bin"), out.stderr
    assert os.listdir(tmp_path) == []


def test_garbage_collected_space_removes_files(tmp_path):
    space = SwapSpace(tmp_path, capacity_bytes=4096)
    path = space.path
    del space
    import gc
    gc.collect()
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
