"""``zo.initialize`` under a launcher's environment (WORLD_SIZE > 1, as torchrun sets it) with no
process group: it starts the default group from the environment (gloo on the CPU) and says so on
rank 0, so the ranks train together (2 CPU processes); an incomplete environment is refused in
one line before anything changes, instead of each process training alone."""
import contextlib
import io

import pytest
import torch
import torch.distributed as dist

import zero_offload as zo
from _dist_util import run_ranks, values
from _engine_util import SMALL_CHUNK_MB, Reference, assert_params_close, gpt_batches, gpt_loss, micro_gpt

WORLD = 2
STEPS = 2
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
CONFIG = zo.OffloadConfig(params="cpu", optimizer="cpu", dtype="fp32", chunk_mb=SMALL_CHUNK_MB,
                          gpu_budget=1 << 22, cpu_budget=1 << 26, threads=1, prefetch_depth=1)
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


@pytest.fixture(autouse=True)
def _reference_on_the_cpu(monkeypatch):
    """The ranks compute on the CPU (gloo), so the torch reference does too (ZO_TEST_DEVICE)."""
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")


def _launched_rank(rank, world):
    assert not dist.is_initialized()  # the environment only, as torchrun leaves it
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=CONFIG, device="cpu")
    assert engine.shard.world == world and engine.shard.rank == rank
    for x, y in gpt_batches(STEPS, batch=2 * world):
        sl = slice(2 * rank, 2 * rank + 2)  # this rank's half of the global batch
        engine.backward(engine(x[sl], y[sl]))
        engine.step()
    sd = engine.state_dict()
    engine.close()
    return sd, dist.get_backend(), said.getvalue()


def test_ranks_launched_without_a_group_start_it_and_train_together(tmp_path):
    out = values(run_ranks(_launched_rank, WORLD, tmp_path, timeout_s=120, init_group=False))
    ref = Reference(micro_gpt(), SPEC)
    for b in gpt_batches(STEPS, batch=2 * WORLD):
        ref.step(b, gpt_loss)
    for sd, backend, _ in out:
        assert backend == "gloo"
        assert_params_close(sd, ref.master_state(), rtol=1e-5)  # one run on the global batch
    said = [text for _, _, text in out]
    assert said[0].count("\n") == 1 and "started the default one from the environment (gloo)" in said[0]
    assert said[1] == ""  # rank 0 reports


def test_an_incomplete_launch_environment_is_refused_before_anything_changes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    model = micro_gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"^zero_offload.initialize: WORLD_SIZE=2 but MASTER_ADDR, "
                                         r"MASTER_PORT are not set, .*torchrun.*process_group=None"):
        zo.initialize(model, optimizer=SPEC, config=CONFIG, device="cpu")
    assert not dist.is_initialized()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    engine = zo.initialize(model, optimizer=SPEC, config=CONFIG, device="cpu", process_group=None)
    assert engine.shard.world == 1 and not dist.is_initialized()  # alone, as asked
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.close()
