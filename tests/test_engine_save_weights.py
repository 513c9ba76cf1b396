"""Engine.save_weights: the model's weights as safetensors shards in the Hugging Face layout,
chunk by chunk (host memory: one shard and one chunk), renamed into place when whole. Checked
against engine.state_dict(), by loading them back with initialize(weights=...), in bf16, and
for the failures: a directory in the way, bad settings, a write that fails half-way."""
import json
import os

import pytest
import torch

import zero_offload as zo
import zero_offload.weights as weights_mod
from _engine_util import DEVICE, config, gpt_batches, gpt_loss, micro_gpt, train_engine

safetensors_torch = pytest.importorskip("safetensors.torch")
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


def _trained(**kw):
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=config(**kw), device=DEVICE)
    train_engine(engine, gpt_batches(2), gpt_loss)
    return engine


def _load_dir(path) -> dict:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(safetensors_torch.load_file(os.path.join(path, f)))
    return out


def test_shards_hold_the_state_dict_and_load_back(tmp_path):
    engine = _trained(dtype="bf16")
    try:
        want = engine.state_dict()
        out = tmp_path / "export"
        files = engine.save_weights(out, shard_size=8_000)
        names = sorted(os.listdir(out))
        n = len(names) - 1
        assert n > 2 and names == sorted([f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
                                         + ["model.safetensors.index.json"])
        assert sorted(files) == sorted(str(out / f) for f in names)
        got = _load_dir(out)
        # every tensor once: the tied lm_head is written under its first name only
        assert set(got) == set(want) - {"lm_head.weight"}
        for k, v in got.items():
            assert v.dtype is torch.float32 and torch.equal(v, want[k]), k
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(got)
        assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in got.values())
        for f in os.listdir(out):  # no shard over the size unless one tensor is bigger
            if f.endswith(".safetensors"):
                part = safetensors_torch.load_file(str(out / f))
                sizes = [v.numel() * 4 for v in part.values()]
                assert sum(sizes) <= 8_000 or len(sizes) == 1
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp dir left
        # loads back: a model built on meta, filled from the export, equals the engine's values
        with torch.device("meta"):
            fresh = micro_gpt()
        again = zo.initialize(fresh, optimizer=SPEC, config=config(), device=DEVICE, weights=str(out))
        back = again.state_dict()
        again.close()
        for k, v in want.items():
            assert torch.equal(back[k], v), k
    finally:
        engine.close()


def test_one_shard_and_bf16(tmp_path):
    engine = _trained()
    try:
        want = engine.state_dict()
        files = engine.save_weights(tmp_path / "w", dtype=torch.bfloat16)
        assert [os.path.basename(f) for f in files] == ["model.safetensors"]
        got = safetensors_torch.load_file(files[0])
        for k, v in got.items():
            assert v.dtype is torch.bfloat16 and torch.equal(v, want[k].bfloat16()), k
        (tmp_path / "empty").mkdir()
        engine.save_weights(tmp_path / "empty")  # an empty directory is taken
        assert os.listdir(tmp_path / "empty") == ["model.safetensors"]
    finally:
        engine.close()


def test_refusals_and_a_failed_write_leave_nothing(tmp_path, monkeypatch):
    engine = _trained()
    try:
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "notes.txt").write_text("the user's")
        with pytest.raises(ValueError, match=r"mine exists and is not an empty directory; pass a new "
                                             r"directory \(an export never replaces files\)"):
            engine.save_weights(mine)
        with pytest.raises(ValueError, match=r"dtype=torch.int8 is not supported"):
            engine.save_weights(tmp_path / "a", dtype=torch.int8)
        with pytest.raises(ValueError, match=r"shard_size"):
            engine.save_weights(tmp_path / "a", shard_size=0)
        assert sorted(os.listdir(tmp_path)) == ["mine"] and os.listdir(mine) == ["notes.txt"]

        real, calls = weights_mod.ShardedWriter._flush, []

        def failing(self):
            calls.append(1)
            if len(calls) == 2:
                raise OSError(28, "No space left on device (simulated)")
            real(self)

        monkeypatch.setattr(weights_mod.ShardedWriter, "_flush", failing)
        with pytest.raises(OSError, match="simulated"):
            engine.save_weights(tmp_path / "b", shard_size=8_000)
        assert len(calls) == 2
        assert sorted(os.listdir(tmp_path)) == ["mine"]  # no partial export, no temp dir
        train_engine(engine, gpt_batches(1), gpt_loss)  # the engine trains on
    finally:
        engine.close()


def test_an_engine_over_a_hugging_face_model_exports_what_from_pretrained_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    engine = zo.initialize(transformers.GPT2LMHeadModel(cfg), optimizer=SPEC, config=config(), device=DEVICE)
    try:
        x = torch.randint(0, 64, (2, 16))
        for _ in range(2):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        want = engine.state_dict()
        engine.save_weights(tmp_path / "export")
        assert sorted(os.listdir(tmp_path / "export")) == ["config.json", "generation_config.json",
                                                           "model.safetensors"]
    finally:
        engine.close()
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "export")).state_dict()
    assert set(back) == set(want)
    for k, v in want.items():
        assert torch.equal(back[k], v), k
