"""Suite-wide: no test leaves a zero_offload swap space behind in the default temporary location.

The default temporary location ($TMPDIR, tempfile.gettempdir(): where runs given no swap
directory swap) is a directory of this pytest run's own for the whole session, inherited by the
subprocesses the tests start. So two suite runs sharing the machine never see each other's
spaces there, and whatever is found there was made by this process or its children. After each
test, a swap space there whose owner died (nothing will ever remove it: a killed run's) or a dead
run's temporary swap directory fails that test; at the end of the session, any space left there
at all does (after garbage collection has closed the engines nobody closed).
"""
import gc
import os
import tempfile

import pytest

from zero_offload.runtime import swap_io


def _leftovers(location, *, dead_only: bool) -> list[str]:
    spaces = [f"{f.path} (pid {f.owner.pid}, {f.state.value})" for f in swap_io.find_all_spaces(location)
              if f.stale or not dead_only]
    temps = [f"{f.path} (temporary swap directory, pid {f.owner.pid}, dead)"
             for f, _ in swap_io.remove_dead_spaces(location, dry_run=True) if f.temp_dir]
    return spaces + temps


@pytest.fixture(scope="session", autouse=True)
def _session_tmpdir(tmp_path_factory):
    location = str(tmp_path_factory.mktemp("TMPDIR"))
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = location
    try:
        yield location
        gc.collect()
        left = _leftovers(location, dead_only=False)
        assert not left, f"the suite left zero_offload swap spaces in the temporary directory: {left}"
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env


@pytest.fixture(autouse=True)
def _no_swap_space_left_behind(_session_tmpdir):
    yield
    location = tempfile.gettempdir()  # a test may point it elsewhere (monkeypatch, undone by now)
    left = _leftovers(location, dead_only=True)
    assert not left, (f"this test left swap spaces of dead processes in the temporary directory {location}: "
                      f"{left}; pass --nvme-dir to runs it kills, or check that the next run removes them")
