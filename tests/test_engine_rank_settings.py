"""``zo.initialize`` compares the ranks' settings (2 CPU processes, gloo): a config field, the
optimizer, the param groups or the model differing between the ranks raises on every rank one
line naming it, the values and the ranks (not a collective mismatch or a timeout later); the
fields each rank sets for itself (swap directory, budgets, threads, I/O) may differ."""
import os

import pytest
import torch

import zero_offload as zo
from _dist_util import run_ranks, values
from _engine_util import SMALL_CHUNK_MB, Reference, assert_params_close, gpt_batches, gpt_loss, micro_gpt

WORLD = 2
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.fixture(autouse=True)
def _reference_on_the_cpu(monkeypatch):
    """The ranks compute on the CPU (gloo), so the torch reference does too (ZO_TEST_DEVICE)."""
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")


def _config(**kw):
    return zo.OffloadConfig(**{**dict(params="cpu", optimizer="cpu", dtype="fp32", chunk_mb=SMALL_CHUNK_MB,
                                      gpu_budget=1 << 22, cpu_budget=1 << 26, threads=1, prefetch_depth=1),
                               **kw})


def _vectors(model):
    return [n for n, p in model.named_parameters() if p.dim() < 2]


# case -> (initialize's arguments on rank r, the line every rank raises)
CASES = {
    "chunk_mb": (lambda r: dict(config=_config(chunk_mb=SMALL_CHUNK_MB * (1 + r))),
                 "zero_offload.initialize: ranks disagree on OffloadConfig.chunk_mb: rank 0 has "
                 "0.00390625, rank 1 has 0.0078125; pass the same settings on every rank"),
    "dtype": (lambda r: dict(config=_config(dtype=("fp32", "bf16")[r])),
              "zero_offload.initialize: ranks disagree on OffloadConfig.dtype: rank 0 has 'fp32', "
              "rank 1 has 'bf16'; pass the same settings on every rank"),
    "grad_clip": (lambda r: dict(config=_config(grad_clip=(None, 1.0)[r])),
                  "zero_offload.initialize: ranks disagree on OffloadConfig.grad_clip: rank 0 has None, "
                  "rank 1 has 1.0; pass the same settings on every rank"),
    "lr": (lambda r: dict(optimizer=zo.AdamW(lr=(3e-3, 1e-3)[r], weight_decay=0.1)),
           "zero_offload.initialize: ranks disagree on the optimizer: rank 0 has {'type': 'adamw', "
           "'lr': 0.003, 'betas': [0.9, 0.999], 'eps': 1e-08, 'weight_decay': 0.1}, rank 1 has "
           "{'type': 'adamw', 'lr': 0.001, 'betas': [0.9, 0.999], 'eps': 1e-08, 'weight_decay': 0.1}; "
           "pass the same settings on every rank"),
    "param_groups": (lambda r: dict(param_groups=(None, [{"params": _vectors(micro_gpt()), "weight_decay": 0.0}])[r]),
                     "zero_offload.initialize: ranks disagree on param_groups' hyperparameters: rank 0 has "
                     "[], rank 1 has [{'weight_decay': 0.0}]; pass the same settings on every rank"),
    "model": (lambda r: dict(model=micro_gpt(d_model=(16, 32)[r])),
              "zero_offload.initialize: ranks disagree on the model's parameters (name, shape, "
              "trainable): entry 0: rank 0 has ('wte.weight', (64, 16), True), rank 1 has "
              "('wte.weight', (64, 32), True); pass the same settings on every rank"),
}


def _mismatch_rank(rank, world):
    said = {}
    for case, (args, _) in CASES.items():
        kw = {**dict(model=micro_gpt(), optimizer=SPEC, config=_config(), device="cpu"), **args(rank)}
        try:
            zo.initialize(kw.pop("model"), **kw)
        except ValueError as e:
            said[case] = str(e)
        else:  # (no close: a collective between mismatched engines could hang)
            said[case] = "no error"
    return said


def test_ranks_with_different_settings_raise_one_line_naming_them_on_every_rank(tmp_path):
    said = values(run_ranks(_mismatch_rank, WORLD, tmp_path, timeout_s=120, collective_timeout_s=20))
    for case, (_, line) in CASES.items():
        assert [s[case] for s in said] == [line, line], case


def _per_rank_rank(rank, world, swap):
    cfg = _config(nvme_dir=os.path.join(swap, f"mine{rank}"), cpu_budget=(1 << 26) + rank * (1 << 20),
                  gpu_budget=(1 << 22) + rank, threads=1 + rank, io_threads=2 + rank)
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=cfg, device="cpu")
    for x, y in gpt_batches(2, batch=2 * world):
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()
    sd = engine.state_dict()
    engine.close()
    return sd


def test_fields_each_rank_sets_for_itself_may_differ(tmp_path):
    out = values(run_ranks(_per_rank_rank, WORLD, tmp_path, str(tmp_path / "swap"), timeout_s=120))
    ref = Reference(micro_gpt(), SPEC)
    for b in gpt_batches(2, batch=2 * WORLD):
        ref.step(b, gpt_loss)
    for sd in out:
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
