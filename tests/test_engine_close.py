"""engine.close() (and leaving a ``with`` block) writes the trained values back into the model's
parameters, on the device and dtype they had at initialize (issue 10: they were NaN), so the
model runs plainly or trains on with a new engine; an engine that cannot read its values leaves
parameters that raise, and says why; a model an open engine holds is refused by initialize."""
import copy
import gc
import os

import pytest
import torch

import zero_offload as zo
from _engine_util import (DEVICE, Reference, assert_params_close, config, gpt_batches, gpt_loss,
                          micro_gpt, torch_optimizer, train_engine)
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


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/self/status has no {key}")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_close_frees_each_chunk_as_its_values_go_back(optimizer, tmp_path):
    # The 12.75B run was OOM-killed in close: 51 GB of fp32 values written back beside ~95 GB of
    # state. Each chunk's memory is now freed as its values go back, so host memory during close
    # never rises above what it held before (the state is 16 B/param, the values 4).
    torch.manual_seed(0)
    width, depth = 2048, 8
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
    cfg = zo.OffloadConfig(params="cpu", optimizer=optimizer, dtype="fp32", chunk_mb=4,
                           gpu_budget=1 << 28, cpu_budget=1 << 30, nvme_budget=1 << 30,
                           nvme_dir=str(tmp_path), threads=1)
    engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-3), config=cfg, device="cpu")
    x = torch.randn(4, width)
    for _ in range(2):
        engine.backward(engine(x).square().mean())
        engine.step()
    want = {n: v.clone() for n, v in engine.state_dict().items()}
    engine.synchronize()
    gc.collect()
    chunk = width * width * 4  # a Linear's weight, one chunk (128 MiB of values in all)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current RSS
    before = _proc_status("VmRSS:")
    engine.close()
    rise = _proc_status("VmHWM:") - before
    # at most one chunk's copy in flight, with slack (the whole model's values before: +4 chunks)
    assert rise <= chunk + (8 << 20), f"close raised host memory by {rise / 2**20:.1f} MiB"
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[name]), name


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


def test_close_without_write_back_frees_everything_and_the_params_say_so():
    # e.g. after save_weights, for a model whose fp32 copy the host need not hold
    model = micro_gpt()
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    train_engine(engine, gpt_batches(1), gpt_loss)
    with pytest.raises(TypeError, match=r"close\(write_back=...\) takes True or False, got 'no'"):
        engine.close(write_back="no")
    engine.close(write_back=False)
    engine.close()  # idempotent: closed already, nothing is written back later
    w = model.blocks[0].attn.qkv.weight
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"'blocks\.0\.attn\.qkv\.weight' was read \(t\) after its engine "
                                           r"was closed without writing its values back"):
        w.t()
