"""Parameters read outside the module holding them (issue 10: a tied head in the parent's forward
trained on NaN): the engine records such reads on the first forward and fetches them with the
reading module, so training equals plain torch; a read outside the engine raises, never computes
with garbage. See [Note: external parameters] and [Note: parameter data] in param_guard.py."""
import pytest
import torch
import torch.nn.functional as F

import zero_offload as zo
from zero_offload.runtime.placement import PARKED_CHUNKS
from _engine_util import (DEVICE, Reference, assert_losses_close, assert_params_close, config,
                          train_engine)
import _external_util as ext

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
STEPS = 4


def _run(model, *, steps=STEPS, accum=1, cfg=None, spec=SPEC):
    ref = Reference(model, spec, accum=accum)
    engine = zo.initialize(model, optimizer=spec, config=cfg or config(grad_accum=accum),
                           device=DEVICE)
    try:
        # Many more chunks than the parked ones: the read chunk really is released in between.
        assert len(engine.partition.chunks) >= PARKED_CHUNKS + 4
        batches = ext.batches(steps)
        losses = train_engine(engine, batches, ext.loss_fn, accum=accum)
        ref_losses = [ref.step(b, ext.loss_fn) for b in batches]
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        return engine
    finally:
        engine.close()


@pytest.mark.parametrize("reads", [("tied",), ("function",), ("shared",), ("bias",),
                                   ("tied", "function", "shared", "bias")],
                         ids=lambda r: "+".join(r))
def test_outside_reads_match_torch(reads):
    engine = _run(ext.model(reads))
    externals = {type(r.module).__name__: [s.name for s in r.external]
                 for r in engine._hooks.records.values() if r.external}
    if "tied" in reads:
        assert "tok.weight" in externals["ExternalReads"]
    if "shared" in reads:
        assert externals["Borrower"] == ["blocks.1.weight"]


PLACEMENTS = [("cpu", "cpu"), ("gpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme")]


@pytest.mark.parametrize("params,optimizer", PLACEMENTS, ids=[f"{p}-{o}" for p, o in PLACEMENTS])
def test_tied_head_every_placement(params, optimizer, tmp_path):
    cfg = config(params=params, optimizer=optimizer,
                 nvme_dir=str(tmp_path) if "nvme" in (params, optimizer) else None)
    _run(ext.model(("tied", "function")), cfg=cfg)


def test_tied_head_grad_accumulation():
    _run(ext.model(("tied", "bias")), steps=6, accum=2)


def test_tied_head_recomputed_by_activation_checkpointing():
    _run(ext.model(("tied",), checkpoint_head=True))


def test_frozen_external_param():
    model = ext.model(("tied",))
    model.tok.weight.requires_grad_(False)
    _run(model)


def test_no_grad_first_forward_then_training():
    """An eval forward first (recorded too), then training: same as torch."""
    model = ext.model(("tied", "shared"))
    ref = Reference(model, SPEC)
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    try:
        b = ext.batches(1, seed=7)[0]
        with torch.no_grad():
            got = engine(*b).item()
            want = ext.loss_fn(ref.work, ref.cast(b)).item()
        assert got == pytest.approx(want, rel=1e-6)
        batches = ext.batches(3)
        assert_losses_close(train_engine(engine, batches, ext.loss_fn),
                            [ref.step(x, ext.loss_fn) for x in batches], rtol=1e-5)
    finally:
        engine.close()


def test_read_outside_the_engine_raises_not_garbage():
    model = ext.model(("tied",))
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    try:
        train_engine(engine, ext.batches(1), ext.loss_fn)
        w = model.blocks[0].weight
        # Metadata stays right; the storage has no bytes, and any read raises naming the param
        # (element-wise reads too: tests/test_engine_guard.py).
        assert w.shape == (ext.WIDTH, ext.WIDTH) and w.dtype == torch.float32
        assert w.device.type == torch.device(DEVICE).type and w.untyped_storage().nbytes() == 0
        with pytest.raises(RuntimeError, match=r"'blocks\.0\.weight' was read \(linear\) outside"):
            F.linear(torch.ones(2, ext.WIDTH, device=DEVICE), w)
        with pytest.raises(RuntimeError, match=r"'blocks\.0\.weight' was read \(__getitem__\)"):
            w[0]
    finally:
        engine.close()
