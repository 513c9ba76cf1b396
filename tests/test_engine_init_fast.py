"""initialize at memory speed ([Note: fill at memory speed] in initial_values.py) gives exactly the
values of the serial path: a meta model's ``init`` and ``reset_parameters()`` draws on several
threads equal a CPU-built model's, with the global generator left where the serial init leaves
it; a safetensors file read in pieces on several threads (a bf16 file into the fp32 master too)
equals the file; with two ranks each rank's shard is right (each rank reads only its own part of
the weights). A truncated or corrupt weights file is refused before anything changes."""
import json
import os
import struct

import pytest
import torch
from torch import nn

import zero_offload as zo
from zero_offload import initial_values
from zero_offload.models import GPT, GPTConfig
from _dist_util import run_ranks, values
from _engine_util import DEVICE, init_weights_reference

SPEC = zo.AdamW(lr=1e-3)
# Big enough that its large parameters are drawn in slices (ops/rng.py: >= 2 x 256K elements):
# wte is 8192 x 128 = 1M elements.
WIDE_GPT = GPTConfig(vocab_size=8192, n_layer=2, n_head=2, d_model=128, seq_len=64, bias=True)


def _config(**kw):
    base = dict(params="cpu", optimizer="cpu", dtype="bf16", chunk_mb=1, gpu_budget=1 << 26,
                cpu_budget=1 << 28, threads=2)
    base.update(kw)
    return zo.OffloadConfig(**base)


@pytest.fixture
def sliced(monkeypatch):
    """Elements each initialize drew in slices (so a test knows the threads were used)."""
    counts = []

    class Counting(initial_values.ParallelDraws):
        def close(self):
            counts.append(self.drawn)
            super().close()

    monkeypatch.setattr(initial_values, "ParallelDraws", Counting)
    return counts


def _assert_values(engine, reference):
    got = engine.state_dict()
    for k, v in reference.state_dict().items():
        assert torch.equal(got[k], v), k


def test_meta_gpt_drawn_on_threads_equals_the_serial_init_and_leaves_the_generator_alike(sliced):
    with torch.device("meta"):
        model = GPT(WIDE_GPT)
    torch.manual_seed(11)
    engine = zo.initialize(model, optimizer=SPEC, config=_config(), device=DEVICE, init=model.init_param)
    after = torch.get_rng_state()
    try:
        reference = init_weights_reference(WIDE_GPT, 11)
        assert torch.equal(after, torch.get_rng_state())  # the next draw is the serial init's next
        _assert_values(engine, reference)
        assert sliced and sliced[0] >= 8192 * 128
    finally:
        engine.close()


class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1024, 1024)  # kaiming_uniform_ over 1M elements: drawn in slices
        self.b = nn.Linear(1024, 8)

    def forward(self, x):
        return self.b(self.a(x))


def test_reset_parameters_drawn_on_threads_equals_torch(sliced):
    with torch.device("meta"):
        model = _Wide()
    torch.manual_seed(4)
    engine = zo.initialize(model, optimizer=SPEC, config=_config(), device=DEVICE)
    after = torch.get_rng_state()
    try:
        torch.manual_seed(4)
        reference = _Wide()
        assert torch.equal(after, torch.get_rng_state())
        _assert_values(engine, reference)
        assert sliced and sliced[0] >= 1024 * 1024
    finally:
        engine.close()


def _save(model, path, dtype=None):
    from safetensors.torch import save_file
    sd = {k: (v if dtype is None else v.to(dtype)).detach().clone().contiguous()
          for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, path)
    return sd


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_weights_read_in_pieces_on_threads_equal_the_file(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(initial_values, "_PIECE", 64 << 10)  # many pieces per tensor
    source = init_weights_reference(WIDE_GPT, 2)
    path = str(tmp_path / "model.safetensors")
    saved = _save(source, path, dtype)
    with torch.device("meta"):
        model = GPT(WIDE_GPT)
    engine = zo.initialize(model, optimizer=SPEC, config=_config(dtype="fp32"), device=DEVICE, weights=path)
    try:
        got = engine.state_dict()
        for k, v in saved.items():
            assert torch.equal(got[k], v.float()), k
    finally:
        engine.close()


def test_a_truncated_or_corrupt_weights_file_is_refused_before_anything_changes(tmp_path):
    source = init_weights_reference(WIDE_GPT, 2)
    path = str(tmp_path / "model.safetensors")
    _save(source, path)
    cut = str(tmp_path / "cut.safetensors")
    with open(path, "rb") as f, open(cut, "wb") as g:
        g.write(f.read()[:-4096])
    bad = str(tmp_path / "bad.safetensors")
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    with open(bad, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(16))
    for file, match in ((cut, r"cut.safetensors' is not a readable safetensors file \(tensor '.*': bytes "
                              r"\[\d+, \d+\) do not hold torch.float32 \[.*\] inside the file\)"),
                        (bad, r"bad.safetensors' is not a readable safetensors file \(tensor 'w': bytes "
                              r"\[0, 12\) do not hold torch.float32 \[4\]")):
        with torch.device("meta"):
            model = GPT(WIDE_GPT)
        with pytest.raises(ValueError, match=match):
            zo.initialize(model, optimizer=SPEC, config=_config(), device="cpu", weights=file)
        assert all(p.is_meta for p in model.parameters())


def _normed(model):
    """GPT's init, then wte scaled by its own norm: an init that reads its whole parameter."""
    def init(name, t):
        model.init_param(name, t)
        if name == "wte.weight":
            t.div_(t.norm())
    return init


def _rank_init(rank, world, path):
    """Every rank builds the wide GPT on meta and fills its shards (no training); with "init"
    each rank draws only the slices it keeps ([Note: kept draws] in ops/rng.py)."""
    skipped = []

    class Counting(initial_values.ParallelDraws):
        def close(self):
            skipped.append(self.skipped)
            super().close()

    initial_values.ParallelDraws = Counting
    out = {}
    for source in ("init", "normed", "weights"):
        with torch.device("meta"):
            model = GPT(WIDE_GPT)
        torch.manual_seed(11)
        kw = ({"init": model.init_param} if source == "init" else {"init": _normed(model)} if source == "normed"
              else {"weights": path})
        engine = zo.initialize(model, optimizer=SPEC, config=_config(chunk_mb=0.5), device="cpu", **kw)
        out[source] = engine.state_dict()
        out[source + "_rng"] = torch.get_rng_state()
        engine.close()
    out["skipped"] = skipped
    return out


def test_two_ranks_fill_their_shards_with_the_serial_values(tmp_path):
    reference = init_weights_reference(WIDE_GPT, 11)
    after = torch.get_rng_state()
    path = str(tmp_path / "model.safetensors")
    _save(reference, path)
    normed = {k: v.clone() for k, v in reference.state_dict().items()}
    for k in ("wte.weight", "lm_head.weight"):
        normed[k] = normed[k] / reference.wte.weight.norm()
    for sd in values(run_ranks(_rank_init, 2, tmp_path / "ranks", path, timeout_s=240)):
        assert sd["skipped"][0] > 0, sd["skipped"]  # this rank drew only what it keeps
        assert torch.equal(sd["init_rng"], after) and torch.equal(sd["normed_rng"], after)
        for source, expect in (("init", reference.state_dict()), ("normed", normed), ("weights", reference.state_dict())):
            for k, v in expect.items():
                assert torch.equal(sd[source][k], v), (source, k)



def test_init_seconds_say_where_initialize_spent_its_time_and_the_homes_come_from_the_thread(monkeypatch):
    """``Engine.init_seconds``: the plan, the homes, the values and the rest add up to the total;
    every host home was made ahead on the homes thread ([Note: homes ahead]), in the order the
    store asked for them (none fell back)."""
    from zero_offload.runtime import pinned_pool, store as store_mod
    made = []

    class Recording(pinned_pool.HomesAhead):
        def __init__(self, sizes, **kw):
            super().__init__(sizes, **kw)
            made.append(self)
            self.sizes = list(sizes)

    monkeypatch.setattr(store_mod, "HomesAhead", Recording)
    with torch.device("meta"):
        model = GPT(WIDE_GPT)
    torch.manual_seed(11)
    engine = zo.initialize(model, optimizer=SPEC, config=_config(), device=DEVICE, init=model.init_param)
    try:
        parts = engine.init_seconds
        assert set(parts) == {"plan", "homes", "values", "rest", "total", "homes_touch", "homes_pin"}
        assert all(v >= 0 for v in parts.values()), parts
        assert parts["total"] == pytest.approx(parts["plan"] + parts["homes"] + parts["values"] + parts["rest"])
        (ahead,) = made
        assert ahead.ended == "closed" and ahead.taken == len(ahead.sizes) > 0, (ahead.ended, ahead.taken)
        _assert_values(engine, init_weights_reference(WIDE_GPT, 11))
    finally:
        engine.close()
