"""nvme_dir set-up through the API: created 0700, one-line errors naming nvme_dir and the fix,
raised before anything changes, and untouched when no state lives on NVMe."""
import errno
import os
import stat

import pytest
import torch

import zero_offload as zo
from zero_offload import swap_io
from zero_offload.offload_optim import OffloadAdamW
from zero_offload.swap_io import SwapSpace, prepare_swap_dir

from _engine_util import mlp


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(8, 8))]


def test_missing_nvme_dir_is_created_0700(tmp_path):
    nvme = tmp_path / "a" / "b"
    engine = zo.initialize(mlp(), optimizer=zo.AdamW(lr=1e-3), config=zo.OffloadConfig(params="cpu", optimizer="nvme", nvme_dir=str(nvme),
                                                            chunk_mb=4096 / 2**20))
    try:
        assert mode(tmp_path / "a") == 0o700 and mode(nvme) == 0o700
    finally:
        engine.close()
    opt_dir = tmp_path / "opt" / "swap"
    opt = OffloadAdamW(params(), state="nvme", nvme_dir=str(opt_dir))
    assert mode(tmp_path / "opt") == 0o700 and mode(opt_dir) == 0o700
    opt.close()


def test_existing_dir_keeps_its_mode(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o755)
    SwapSpace(d, capacity_bytes=4096).close()
    OffloadAdamW(params(), state="nvme", nvme_dir=str(d)).close()
    assert mode(d) == 0o755
    assert prepare_swap_dir(d) == str(d) and mode(d) == 0o755


@pytest.mark.parametrize("below", [False, True])
def test_nvme_dir_that_is_a_file(tmp_path, below):
    f = tmp_path / "file"
    f.write_bytes(b"mine")
    nvme = str(f / "sub" if below else f)
    with pytest.raises(ValueError, match=r"OffloadConfig\.nvme_dir='.*' (is|cannot be created: .* is) a regular "
                                         r"file.*; set nvme_dir to a directory path") as e:
        zo.OffloadConfig(optimizer="nvme", nvme_dir=nvme)
    assert "\n" not in str(e.value)
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"nvme_dir='.*' .*regular file"):
        zo.initialize(model, optimizer=zo.AdamW(lr=1e-3), config={"params": "cpu", "optimizer": "nvme", "nvme_dir": nvme})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ps = params()
    with pytest.raises(ValueError, match=r"OffloadAdamW: nvme_dir='.*' .*regular file.*pass a directory path as "
                                         r"nvme_dir"):
        OffloadAdamW(ps, state="nvme", nvme_dir=nvme)
    assert all(not p._post_accumulate_grad_hooks for p in ps)  # no hook left on the params
    with pytest.raises(NotADirectoryError, match="regular file"):
        SwapSpace(nvme, capacity_bytes=4096)
    assert f.read_bytes() == b"mine"


def test_cpu_state_never_touches_nvme_dir(tmp_path):
    missing = tmp_path / "missing"
    ps = params()
    opt = OffloadAdamW(ps, state="cpu", nvme_dir=str(missing))
    ps[0].grad = torch.ones_like(ps[0])
    ps[1].grad = torch.ones_like(ps[1])
    opt.step()
    opt.synchronize()
    opt.close()
    assert not missing.exists()
    f = tmp_path / "file"
    f.write_bytes(b"x")
    OffloadAdamW(params(), state="cpu", nvme_dir=str(f))  # unused: not even checked


def _fake_unwritable(monkeypatch, target, readonly: bool):
    """What a read-only mount (EROFS) or a directory without write permission (EACCES) looks like
    to prepare_swap_dir; real permission bits do not bind root, so the checks are patched."""
    target = os.path.abspath(target)
    real_access, real_statvfs = os.access, os.statvfs

    def access(path, how, *a, **kw):
        if os.path.abspath(path) == target and how & os.W_OK:
            return False
        return real_access(path, how, *a, **kw)

    class RO:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(os, "access", access)
    if readonly:
        monkeypatch.setattr(os, "statvfs", lambda p: RO() if os.path.abspath(p) == target else real_statvfs(p))


@pytest.mark.parametrize("readonly", [True, False], ids=["erofs", "eacces"])
def test_unwritable_nvme_dir(tmp_path, monkeypatch, readonly):
    d = tmp_path / "swap"
    d.mkdir()
    _fake_unwritable(monkeypatch, d, readonly)
    want = (r"read-only file system; use a directory on a writable local disk" if readonly else
            r"not writable by this user \(permission denied\); use a directory you can write to")
    err = errno.EROFS if readonly else errno.EACCES
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OSError, match=rf"OffloadConfig\.nvme_dir '{d}' (is )?.*{want}") as e:
        zo.initialize(model, optimizer=zo.AdamW(lr=1e-3), config={"params": "cpu", "optimizer": "nvme", "nvme_dir": str(d)})
    assert e.value.errno == err and "\n" not in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ps = params()
    with pytest.raises(OSError, match=rf"OffloadAdamW nvme_dir '{d}' (is )?.*{want}") as e:
        OffloadAdamW(ps, state="nvme", nvme_dir=str(d))
    assert e.value.errno == err
    assert all(not p._post_accumulate_grad_hooks for p in ps)


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES])
def test_swap_file_creation_refused(tmp_path, monkeypatch, err):
    """The directory looks writable but creating the space fails (a mount turned read-only, an
    ACL): still one line naming the directory and the fix."""
    def refuse(*a, **kw):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(swap_io.tempfile, "mkdtemp", refuse)
    with pytest.raises(OSError, match=rf"swap directory '{tmp_path}' .*; use a") as e:
        SwapSpace(tmp_path, capacity_bytes=4096)
    assert e.value.errno == err and "\n" not in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits; the patched variant above covers it")
def test_real_read_only_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match=r"OffloadAdamW nvme_dir .*not writable by this user"):
        OffloadAdamW(params(), state="nvme", nvme_dir=str(d))
