"""initialize on a model built on the meta device (no memory), filled chunk by chunk by an init
function, by the modules' reset_parameters(), or from safetensors files (one file or HF-style
shards with an index); the auto host budget counting the model's own copy as freed; the host
peak of initialize from a meta model (no second full copy of the model). Every way is checked
against the values the same init gives a CPU-built model and against torch training from them."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import zero_offload as zo
from zero_offload.models import GPT
from _engine_util import (DEVICE, MICRO_GPT, MLP, Reference, assert_params_close, config,
                          gpt_batches, gpt_loss, init_weights_reference, micro_gpt, mlp_batches, mlp_loss,
                          train_engine)

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


def _meta_gpt():
    with torch.device("meta"):
        return GPT(MICRO_GPT)


def _train_and_compare(engine, ref_model, batches, loss_fn):
    ref = Reference(ref_model, SPEC)
    for b in batches:
        ref.step(b, loss_fn)
    train_engine(engine, batches, loss_fn)
    assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)


def test_meta_gpt_with_init_param_gets_init_weights_values_and_trains_like_torch():
    model = _meta_gpt()
    torch.manual_seed(7)
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE, init=model.init_param)
    expect = init_weights_reference(MICRO_GPT, 7)
    got = engine.state_dict()
    for k, v in expect.state_dict().items():
        assert torch.equal(got[k], v), k  # the same values, RNG stream included
    _train_and_compare(engine, expect, gpt_batches(3), gpt_loss)
    engine.close()
    assert model.wte.weight.device.type == "cpu" and model.lm_head.weight is model.wte.weight


def test_meta_model_without_init_runs_each_modules_reset_parameters():
    with torch.device("meta"):
        model = MLP()
    torch.manual_seed(3)
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE)
    torch.manual_seed(3)
    expect = MLP()  # nn.Linear's own init, module by module in the same order
    got = engine.state_dict()
    for k, v in expect.state_dict().items():
        assert torch.equal(got[k], v), k
    _train_and_compare(engine, expect, mlp_batches(3), mlp_loss)
    engine.close()


def _save_shards(model, path):
    """HF save_pretrained-style: two shards and model.safetensors.index.json, the tied head
    stored once (under wte.weight)."""
    from safetensors.torch import save_file
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    keys = sorted(sd)
    half = len(keys) // 2
    os.makedirs(path, exist_ok=True)
    wmap = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, os.path.join(path, name))
        wmap.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)


@pytest.mark.parametrize("layout", ["index", "dir", "file"])
def test_weights_from_safetensors_fill_the_tiers_and_train_like_torch(layout, tmp_path):
    from safetensors.torch import save_file
    source = micro_gpt(seed=11)
    if layout == "file":
        path = str(tmp_path / "model.safetensors")
        save_file({k: v.detach().clone() for k, v in source.state_dict().items() if k != "lm_head.weight"}, path)
    else:
        path = str(tmp_path / "ckpt")
        _save_shards(source, path)
        if layout == "dir":
            os.remove(os.path.join(path, "model.safetensors.index.json"))
    model = _meta_gpt()
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE, weights=path)
    got = engine.state_dict()
    for k, v in source.state_dict().items():
        assert torch.equal(got[k], v), k
    _train_and_compare(engine, source, gpt_batches(3), gpt_loss)
    engine.close()


def test_bad_weights_and_uninitializable_meta_models_are_refused_before_anything_changes(tmp_path):
    from safetensors.torch import save_file
    source = micro_gpt(seed=1)
    sd = {k: v.detach().clone() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    missing = dict(sd)
    missing.pop("blocks.1.mlp.fc.weight")
    save_file(missing, str(tmp_path / "missing.safetensors"))
    wrong = dict(sd, **{"wpe.weight": torch.zeros(3, 3)})
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    os.makedirs(tmp_path / "empty")
    cases = [
        (dict(weights=str(tmp_path / "missing.safetensors")), r"no tensor for 1 parameter\(s\).*'blocks.1.mlp.fc.weight'"),
        (dict(weights=str(tmp_path / "wrong.safetensors")), r"wrong shape: wpe.weight: \(3, 3\) in the file"),
        (dict(weights=str(tmp_path / "empty")), r"holds no .safetensors file"),
        (dict(weights=str(tmp_path / "nothing-here")), r"does not exist"),
        (dict(init="normal"), r"init must be a callable \(name, tensor\)"),
    ]
    for kw, match in cases:
        model = _meta_gpt()
        with pytest.raises((ValueError, TypeError), match=match):
            zo.initialize(model, optimizer=SPEC, config=config(), device="cpu", **kw)
        assert all(p.is_meta for p in model.parameters())  # nothing changed

    class Raw(nn.Module):  # a parameter with no module init: needs init= or weights=
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.scale

    with torch.device("meta"):
        raw = Raw()
    with pytest.raises(ValueError, match=r"'scale' is on the meta device and its module \(Raw\) has no "
                                         r"reset_parameters\(\); pass initialize\(..., init=fn\)"):
        zo.initialize(raw, optimizer=SPEC, config=config(), device="cpu")

    class WithBuffer(MLP):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.ones(4))

    with torch.device("meta"):
        buffered = WithBuffer()
    with pytest.raises(ValueError, match=r"buffer 'mask' is on the meta device and no weights file holds it"):
        zo.initialize(buffered, optimizer=SPEC, config=config(), device="cpu")


def test_meta_buffers_come_from_the_weights(tmp_path):
    from safetensors.torch import save_file

    class WithBuffer(MLP):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.ones(4))

    torch.manual_seed(5)
    source = WithBuffer()
    source.mask.mul_(3.0)
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.detach().clone() for k, v in source.state_dict().items()}, path)
    with torch.device("meta"):
        model = WithBuffer()
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE, weights=path)
    try:
        got = engine.state_dict()
        for k, v in source.state_dict().items():
            assert torch.equal(got[k], v), k
    finally:
        engine.close()
    assert torch.equal(model.mask, source.mask)


def test_auto_host_budget_counts_the_models_own_copy_as_freed():
    from zero_offload.initial_values import handed_over_bytes as _handed_over
    from zero_offload.runtime.partition import partition_parameters
    model = micro_gpt()
    part = partition_parameters(model, chunk_numel=1024)
    assert _handed_over(part) == sum(p.numel() * 4 for p in model.parameters())
    kept = model.state_dict()  # the caller keeps references: that memory is not freed
    assert _handed_over(part) == 0
    del kept
    assert _handed_over(part) > 0
    assert _handed_over(partition_parameters(_meta_gpt(), chunk_numel=1024)) == 0


_PEAK = textwrap.dedent("""
    import psutil, torch, zero_offload as zo
    from zero_offload.models import GPT, GPTConfig

    def hwm():  # peak RSS since the last reset (Linux: VmHWM, reset by clear_refs 5)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))

    cfg = GPTConfig(vocab_size=4096, n_layer=8, n_head=8, d_model=512, seq_len=256, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = psutil.Process().memory_info().rss
    assert hwm() < before + (16 << 20)
    engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-3), device="cpu", init=model.init_param,
                           config=zo.OffloadConfig(params="cpu", optimizer="cpu", dtype="fp32",
                                                   chunk_mb=4, cpu_budget="4GiB", gpu_budget="1GiB",
                                                   threads=1))
    print(n, (hwm() - before) / n)
""")


def test_initialize_from_meta_never_holds_a_second_copy_of_the_model():
    """fp32, params and optimizer on the CPU: the homes are 16 B/param (params, grads, master
    = params in fp32, two moments); a second full fp32 copy would add 4 B/param."""
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    n, per_param = out.stdout.split()
    assert int(n) > 20_000_000
    assert float(per_param) < 16 + 1.5, per_param
