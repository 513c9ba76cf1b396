"""Every read of a managed parameter is correct or loud (issue 10 §1): an element-wise kernel fed
a zero-byte placeholder (``w * 2``, ``w.sum()``, ``print(w)``) read a null pointer (segfault on
the CPU, illegal address on CUDA). Now each parameter's class checks every torch call taking it:
inside the engine the chunk is fetched on the spot, outside it the call raises naming the
parameter. Crashing cases run in a subprocess, so a crash fails the test instead of pytest.
See [Note: parameter data] in param_guard.py."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import zero_offload as zo
from _engine_util import DEVICE, Reference, assert_params_close, config, train_engine
import _external_util as ext

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
TESTS = pathlib.Path(__file__).parent

PRELUDE = """
import torch, zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          train_engine)
import _external_util as ext
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
"""


def _script(body: str, device: str = DEVICE) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        ZO_TEST_DEVICE=device)
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def _assert_clean(proc: subprocess.CompletedProcess, rc: int = 0) -> None:
    assert proc.returncode == rc, (f"exit {proc.returncode} (negative: killed by that signal)\n"
                                   f"{proc.stdout}\n{proc.stderr[-3000:]}")


READS = {"print": "print(w)", "mul": "w * 2", "sum": "w.sum()", "data_norm": "w.data.norm()",
         "linear": "torch.nn.functional.linear(torch.ones(2, ext.WIDTH, device=DEVICE), w)",
         "state_dict_save": "import io; torch.save(model.state_dict(), io.BytesIO())"}


@pytest.mark.parametrize("read", list(READS), ids=list(READS))
def test_idle_read_raises_naming_the_parameter(read):
    proc = _script(f"""
        model = ext.model(("tied",))
        engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
        train_engine(engine, ext.batches(1), ext.loss_fn)
        w = model.blocks[0].bias
        assert w.shape == (ext.WIDTH,) and isinstance(w, torch.nn.Parameter)
        {READS[read]}
        print("NO ERROR")
    """)
    _assert_clean(proc, rc=1)
    assert "NO ERROR" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    name = "tok.weight" if read == "state_dict_save" else "blocks.0.bias"  # the first one read
    assert last.startswith(f"RuntimeError: parameter '{name}' was read") and "outside the engine" in last
    assert "engine.gathered()" in last and "engine.close()" in last


def test_gathered_and_metadata_reads_stay_allowed():
    model = ext.model(("tied",))
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    try:
        train_engine(engine, ext.batches(1), ext.loss_fn)
        w = model.blocks[0].weight
        # Metadata, hooks, grads: no values read.
        assert w.shape == (ext.WIDTH, ext.WIDTH) and w.numel() == ext.WIDTH ** 2 and w.dim() == 2
        assert w.dtype == torch.float32 and w.requires_grad and w.is_leaf and w.grad is None
        assert w.device.type == torch.device(DEVICE).type and len(w) == ext.WIDTH and hash(w) == id(w)
        assert isinstance(w, nn.Parameter) and w in set(model.parameters())
        sd = engine.state_dict()
        with engine.gathered():
            assert torch.equal(w * 1, sd["blocks.0.weight"]) and "tensor(" in repr(w)
            assert type(w * 1) is torch.Tensor
    finally:
        engine.close()


def _train_late(late: str, steps: int = 5, switch: int = 2) -> None:
    """Body of a script: a branch first taken at step ``switch`` reads a parameter outside its
    module; training equals torch, and the read is fetched with the parent from then on."""
    return f"""
        model = ext.model(("tied",))
        ref = Reference(model, SPEC)
        engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
        slow = []
        guard = engine._guard  # param_guard.py: a read that must fetch takes its slow path
        read_slow = guard._read_slow
        guard._read_slow = lambda slot, chunk, func: (slow.append(slot.name), read_slow(slot, chunk, func))
        batches = ext.batches({steps})
        losses, ref_losses, late_reads = [], [], []
        for i, b in enumerate(batches):
            if i == {switch}:
                setattr(model, {late!r}, True); setattr(ref.work, {late!r}, True)
            slow.clear()
            losses += train_engine(engine, [b], ext.loss_fn)
            ref_losses.append(ref.step(b, ext.loss_fn))
            late_reads.append(slow.count("blocks.0.bias") + slow.count("blocks.0.weight"))
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        assert late_reads[{switch}] > 0, late_reads          # fetched on the spot
        assert late_reads[{switch} + 1:] == [0] * ({steps} - {switch} - 1), late_reads  # prefetched
        root = engine._hooks.records[model]
        assert any(s.name.startswith("blocks.0.") for s in root.external), root.external
        engine.close()
        print("OK")
    """


@pytest.mark.parametrize("late", ["late_scale", "late"])
def test_branch_first_taken_later_trains_like_torch(late):
    proc = _script(_train_late(late))
    _assert_clean(proc)
    assert "OK" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_branch_first_taken_later_trains_like_torch_cuda():
    proc = _script(_train_late("late_scale"), device="cuda")
    _assert_clean(proc)
    assert "OK" in proc.stdout


def test_custom_function_reading_ctx_attribute_in_backward():
    proc = _script("""
        model = ext.model(("tied", "ctx"))
        ref = Reference(model, SPEC)
        engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
        batches = ext.batches(4)
        losses = train_engine(engine, batches, ext.loss_fn)
        ref_losses = [ref.step(b, ext.loss_fn) for b in batches]
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        engine.close()
        print("OK")
    """)
    _assert_clean(proc)
    assert "OK" in proc.stdout


def test_close_restores_the_class_and_values():
    model = ext.model(("tied", "bias"))
    classes = {n: type(p) for n, p in model.named_parameters()}
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    train_engine(engine, ext.batches(2), ext.loss_fn)
    assert all(type(p) is not nn.Parameter and isinstance(p, nn.Parameter)
               for p in model.parameters())
    sd = engine.state_dict()
    engine.close()
    for name, p in model.named_parameters():
        assert type(p) is classes[name] is nn.Parameter, name
        assert torch.equal(p.detach().cpu(), sd[name]), name
    assert type(model.blocks[0].bias * 2) is torch.Tensor


def test_outputs_are_plain_tensors_inside_forward():
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x) * self.lin.weight.sum()
            seen.append(type(y))
            return y.pow(2).mean()

    model = Probe()
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    try:
        engine.backward(engine(torch.randn(3, 4)))
        engine.step()
        assert seen == [torch.Tensor]
    finally:
        engine.close()
