"""Resident chunks ([Note: resident chunks] in runtime/prefetch.py): a chunk whose params are on
the device anyway (homed there with one rank, its replica kept with ranks) stays mapped from its
first use in a pass until backward ends, and its module calls get no backward holds ([Note:
backward hooks] in module_hooks.py) nor saved-parameter views ([Note: saved parameter views] in
param_guard.py). Trained against torch AdamW: with ``engine.backward`` and with
``loss.backward()`` called directly, with activation checkpointing (whose recompute calls the
modules inside backward), on one and two ranks; and the chunks that are not resident still take
the holds."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zero_offload as zo
from zero_offload import module_hooks
from _dist_util import run_ranks, values
from _engine_util import (MLP, Reference, assert_losses_close, assert_params_close, auto_config, config,
                          gpt_batches, gpt_loss, micro_gpt, mlp, mlp_batches)

SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
ALL = dict(gpu_budget=1 << 22)
"""A device tier that holds every chunk's params and state: every chunk is resident."""


@pytest.fixture(autouse=True)
def _reference_on_the_cpu(monkeypatch):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")


class _Count:
    """How many ``_PostBackward`` nodes (backward holds) the module hooks made."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = module_hooks._PostBackward.apply

        def counted(*args):
            self.n += 1
            return real(*args)
        monkeypatch.setattr(module_hooks._PostBackward, "apply", counted)


def _train(engine, batches, *, direct: bool):
    losses = []
    for b in batches:
        loss = gpt_loss(engine, b)
        if direct:
            loss.backward()  # the engine enters backward from its hooks
        else:
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("direct", [False, True], ids=["engine.backward", "loss.backward"])
@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_resident_chunks_train_as_torch_without_backward_holds(monkeypatch, checkpointing, direct, device):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", device)
    count = _Count(monkeypatch)
    model = micro_gpt()
    ref = Reference(model, SPEC)
    model.set_activation_checkpointing(checkpointing)
    engine = zo.initialize(model, optimizer=SPEC, config=auto_config(**ALL), device=device)
    rtol = 1e-5 if device == "cpu" else 1e-4
    try:
        batches = [(x.to(device), y.to(device)) for x, y in gpt_batches(4)]
        loss = gpt_loss(engine, batches[0])
        cids = [c.cid for c in engine.group.chunks]
        assert all(engine.prefetcher.resident(c) for c in cids), "every chunk is resident"
        assert all(engine.group.chunks[c].buffer is not None for c in cids), "and stays mapped"
        engine.backward(loss)
        engine.step()
        assert not any(engine.prefetcher.resident(c) for c in cids), "let go when backward ended"
        losses = [loss.item()] + _train(engine, batches[1:], direct=direct)
        ref_losses = [ref.step(b, gpt_loss) for b in batches]
        assert_losses_close(losses, ref_losses, rtol=rtol)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=rtol)
        assert count.n == 0, f"{count.n} backward holds for resident chunks"
    finally:
        engine.close()


class _Checkpointed(MLP):
    """The whole forward checkpointed: ``loss.backward()`` reaches a recompute (module calls
    inside backward) before any parameter's grad lands."""

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


def test_loss_backward_enters_backward_before_a_recompute():
    torch.manual_seed(0)
    model = _Checkpointed()
    ref = Reference(mlp(), SPEC)
    assert_params_close(model.state_dict(), ref.master_state(), rtol=0)
    engine = zo.initialize(model, optimizer=SPEC, config=auto_config(**ALL), device="cpu")
    try:
        losses = []
        for x, y in mlp_batches(3):
            loss = F.mse_loss(engine(x), y)
            assert all(engine.prefetcher.resident(c.cid) for c in engine.group.chunks)
            loss.backward()
            engine.step()
            losses.append(loss.item())
        ref_losses = [ref.step(b, lambda m, b: F.mse_loss(m(b[0]), b[1])) for b in mlp_batches(3)]
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()


def test_chunks_paged_from_the_host_still_take_backward_holds(monkeypatch):
    count = _Count(monkeypatch)
    model = micro_gpt()
    ref = Reference(model, SPEC)
    engine = zo.initialize(model, optimizer=SPEC, config=config(gpu_budget=48 << 10), device="cpu")
    try:
        batches = gpt_batches(3)
        losses = _train(engine, batches, direct=True)
        assert not any(engine.prefetcher.resident(c.cid) for c in engine.group.chunks)
        assert count.n > 0
        assert_losses_close(losses, [ref.step(b, gpt_loss) for b in batches], rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()


def _rank(rank, world):
    model = micro_gpt()
    model.set_activation_checkpointing(True)
    engine = zo.initialize(model, optimizer=SPEC, config=auto_config(**ALL), device="cpu")
    try:
        resident = []
        for x, y in gpt_batches(3, batch=2 * world):
            sl = slice(2 * rank, 2 * rank + 2)
            loss = engine(x[sl], y[sl])
            resident.append(all(engine.prefetcher.resident(c.cid) for c in engine.group.chunks))
            loss.backward()
            engine.step()
        return engine.state_dict(), resident, engine.plan.report()["replicas"]
    finally:
        engine.close()


def test_replicas_are_resident_on_two_ranks(tmp_path):
    ref = Reference(micro_gpt(), SPEC)
    for b in gpt_batches(3, batch=4):
        ref.step(b, gpt_loss)
    for sd, resident, replicas in values(run_ranks(_rank, 2, tmp_path, timeout_s=120)):
        assert replicas
        assert all(resident), resident
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
