"""engine.close() (and leaving a ``with`` block) writes the trained values back into the model's
parameters, on the device and dtype they had at initialize (issue 10: they were NaN), so the
model runs plainly or trains on with a new engine; an engine that cannot read its values leaves
parameters that raise, and says why; a model an open engine holds is refused by initialize."""
import copy

import pytest
import torch

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_params_close, config, gpt_batches, gpt_loss,
                          micro_gpt, rel_err, torch_optimizer, train_engine)
from _offload_optim_util import batches as optim_batches, make_model, max_rel_diff, train

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


def _params(model) -> dict:
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}


def test_close_writes_values_back_and_a_new_engine_trains_on():
    model = micro_gpt()
    ref = Reference(model, SPEC)
    batches = gpt_batches(6)
    with zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE) as engine:
        train_engine(engine, batches[:3], gpt_loss)
    for b in batches[:3]:
        ref.step(b, gpt_loss)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    assert_params_close(_params(model), ref.master_state(), rtol=1e-5)
    # Plain forward after close equals the reference's.
    idx, tgt = batches[3]
    with torch.no_grad():
        got = model(idx, tgt).item()
        want = gpt_loss(ref.work, ref.cast(batches[3])).item()
    assert got == pytest.approx(want, rel=1e-5)
    # A new engine continues from the trained values (Adam state starts afresh: so does the
    # reference's optimizer here).
    ref.opt = torch_optimizer(SPEC, [m for m in ref.masters if m.requires_grad])
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    train_engine(engine, batches[3:], gpt_loss)
    for b in batches[3:]:
        ref.step(b, gpt_loss)
    engine.close()
    engine.close()  # idempotent
    assert_params_close(_params(model), ref.master_state(), rtol=1e-5)


def test_close_bf16_writes_the_fp32_masters_back():
    model = micro_gpt()
    engine = zo.initialize(model, optimizer=SPEC, config=config(dtype="bf16"), device=DEVICE)
    train_engine(engine, gpt_batches(2), gpt_loss)
    masters = engine.state_dict()
    engine.close()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.device.type == "cpu"
        assert torch.equal(p.detach(), masters[name]), name


def test_close_without_readable_values_leaves_params_that_raise():
    model = micro_gpt()
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    train_engine(engine, gpt_batches(1), gpt_loss)

    def broken(*a, **k):
        raise OSError("simulated I/O error")

    engine.store.use = broken  # the values can no longer be read
    with pytest.raises(RuntimeError, match="could not write the trained values back.*simulated"):
        engine.close()
    w = model.blocks[0].attn.qkv.weight
    assert w.untyped_storage().nbytes() == 0  # raises on use, never NaN
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.attn\.qkv\.weight' was read \(t\) "
                                           r"after its engine was closed"):
        w.t()
    with pytest.raises(RuntimeError, match="after its engine was closed"):
        w * 2  # element-wise: once a null-pointer read
    engine.close()  # idempotent after the failure


def test_with_block_failing_write_back_warns_and_keeps_the_error():
    model = micro_gpt()
    with pytest.raises(KeyError, match="user error"):
        with pytest.warns(RuntimeWarning, match="could not write the trained values back"):
            with zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE) as engine:
                engine.store.use = lambda *a, **k: (_ for _ in ()).throw(OSError("io"))
                raise KeyError("user error")


def test_initialize_refuses_a_model_an_open_engine_holds():
    model = micro_gpt()
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    try:
        for target in (model, model.blocks[0], torch.nn.Sequential(model)):
            with pytest.raises(ValueError, match=r"already managed by an open zero_offload engine; "
                                                 r"call engine\.close\(\) first"):
                zo.initialize(target, optimizer=SPEC, config=config(), device=DEVICE)
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # unchanged
        train_engine(engine, gpt_batches(1), gpt_loss)  # the open engine is untouched
    finally:
        engine.close()
    zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE).close()


def test_offload_adamw_close_keeps_trained_params():
    """OffloadAdamW keeps the user's params where they are: after close they equal torch's."""
    model, ref = make_model(), make_model()
    start = copy.deepcopy(model)
    data = optim_batches(4)
    opt = zo.OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, chunk_mb=0.01, threads=1)
    train(model, opt, data)
    opt.close()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    train(ref, ref_opt, data)
    assert max_rel_diff(model, start) > 1e-3
    assert max_rel_diff(model, ref) < 1e-5
    assert all(torch.isfinite(p).all() for p in model.parameters())
