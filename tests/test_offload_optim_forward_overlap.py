"""overlap_forward=True: step() returns before the updates are done and each module's forward
waits for its own params (see [Note: forward overlap]); the result equals torch's.

A slow write-back (a sleep on the worker before each chunk's param copies) makes the forward
outrun the updates, so a missing wait shows up as a wrong loss instead of passing by luck."""
import threading
import time

import pytest
import torch
from torch.nn.modules import module as torch_module

from _offload_optim_util import assert_moved, batches, make_model, max_rel_diff, train
from zero_offload import cpu_adam
from zero_offload.offload_optim import OffloadAdam, OffloadAdamW
from zero_offload.pipeline import PipelineError, Trace

CHUNK_MB = 0.02  # several chunks for the tiny GPT
HOOKS = torch_module._global_forward_pre_hooks


@pytest.fixture
def slow_write_back(monkeypatch):
    from zero_offload.runtime.chunk_group import ChunkGroup  # the worker's copy into the params
    original = ChunkGroup._write_back

    def write_back(self, cid):
        time.sleep(0.003)
        original(self, cid)
    monkeypatch.setattr(ChunkGroup, "_write_back", write_back)


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.2},
            {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2}]


@pytest.mark.parametrize("state", ["cpu", "nvme"])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("ours, ref", [(OffloadAdamW, torch.optim.AdamW), (OffloadAdam, torch.optim.Adam)])
def test_fp32_parity_groups_and_frozen(ours, ref, overlap, state, tmp_path, slow_write_back):
    model, reference = make_model(), make_model()
    for m in (model, reference):
        m.wpe.weight.requires_grad_(False)
    hooks_before = len(HOOKS)
    opt = ours(_groups(model), lr=2e-3, chunk_mb=CHUNK_MB, threads=1, overlap=overlap, overlap_forward=True,
               state=state, nvme_dir=tmp_path if state == "nvme" else None)
    assert len(opt._chunks) > 3
    data = batches(10)
    losses = train(model, opt, data)
    assert len(HOOKS) == hooks_before + 1  # the last step's updates are not synced yet
    opt.synchronize()
    assert len(HOOKS) == hooks_before
    ref_losses = train(reference, ref(_groups(reference), lr=2e-3), data)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(model, reference) < 1e-5
    assert_moved(reference, make_model())
    assert torch.equal(model.wpe.weight, make_model().wpe.weight)  # frozen: untouched
    opt.close()


def test_bf16_params_follow_fp32_master(slow_write_back):
    """bf16 model: at each forward, every param is the bf16 rounding of an fp32 master that
    equals torch.optim.AdamW's, run on an fp32 copy fed the same bf16 grads (caught by a hook
    that runs before the optimizer's, which consumes them). fused=True: same formula and
    operation order as CPU-Adam, so the masters agree bit for bit and so do their roundings."""
    model = make_model(dtype=torch.bfloat16)
    master = make_model(dtype=torch.bfloat16).float()
    grads = {}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(p, p.grad.float()))
    opt = OffloadAdamW(model.parameters(), lr=1e-3, chunk_mb=CHUNK_MB, threads=1, overlap_forward=True)
    ref = torch.optim.AdamW(master.parameters(), lr=1e-3, fused=True)
    hooks_before = len(HOOKS)
    for i, (x, y) in enumerate(batches(8)):
        loss = model(x, y)
        # the forward waited for every param it used: all synced, the hook is gone
        assert len(HOOKS) == hooks_before
        for p, q in zip(model.parameters(), master.parameters()):
            assert torch.equal(p.detach(), q.detach().bfloat16()), i
        loss.backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad = grads[p]
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    opt.synchronize()
    for p, q in zip(model.parameters(), master.parameters()):
        assert torch.equal(p.detach(), q.detach().bfloat16())
    assert max_rel_diff(model, make_model(dtype=torch.bfloat16)) > 1e-3
    sd = opt.state_dict()["state"]
    for i, q in enumerate(master.parameters()):
        torch.testing.assert_close(sd[i]["master"], q.detach(), rtol=1e-5, atol=1e-7)
    opt.close()


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_params_final_after_step_or_synchronize(overlap_forward, slow_write_back):
    """Right after step() (overlap_forward=False) or after synchronize() (True), the params are
    torch's: lockstep, every step. overlap=False: step() hands over every chunk at once."""
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, chunk_mb=CHUNK_MB, threads=1, overlap=False,
                       overlap_forward=overlap_forward)
    ref = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    for x, y in batches(5):
        for m, o in ((model, opt), (reference, ref)):
            m(x, y).backward()
            o.step()
            o.zero_grad()
        if overlap_forward:
            opt.synchronize()
        assert max_rel_diff(model, reference) < 1e-5
    opt.close()


class _WithAux(torch.nn.Module):
    """The tiny GPT plus a layer called only in some steps (``use_aux``) and a param read
    outside its module (``ghost``: multiplied by zero, so a stale read changes nothing)."""

    def __init__(self):
        super().__init__()
        self.gpt = make_model()
        torch.manual_seed(2)
        self.aux = torch.nn.Linear(32, 32, bias=False)
        self.ghost = torch.nn.Linear(4, 4)
        self.use_aux = True

    def forward(self, x, y):
        loss = self.gpt(x, y)
        if self.use_aux:
            h = self.gpt.wte(x)
            loss = loss + self.aux(h).square().mean()
        return loss + 0.0 * self.ghost.weight.sum()


def test_chunks_not_used_by_a_forward(slow_write_back):
    """A chunk the next forward does not use stays unsynced (the hook stays installed) until a
    later forward uses it, the next backward stages its grads (``ghost``, read outside its
    module), or synchronize(); the result still equals torch's."""
    model, reference = _WithAux(), _WithAux()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, chunk_mb=0.002, threads=1, overlap_forward=True)
    ref = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    hooks_before = len(HOOKS)
    aux_chunk = opt._chunk_of[model.aux.weight]
    for i, (x, y) in enumerate(batches(6)):
        for m, o in ((model, opt), (reference, ref)):
            m.use_aux = i % 3 == 0
            m(x, y).backward()
            o.step()
            o.zero_grad()
        if i % 3 == 1:  # aux was updated at step i-1 and not used by forward i
            assert aux_chunk.phase.name == "QUEUED" and len(HOOKS) == hooks_before + 1
    opt.synchronize()
    assert len(HOOKS) == hooks_before
    assert max_rel_diff(model, reference) < 1e-5
    opt.close()


def test_global_hook_removed_by_forward_and_close():
    model = make_model()
    hooks_before = len(HOOKS)
    opt = OffloadAdamW(model.parameters(), chunk_mb=CHUNK_MB, threads=1, overlap_forward=True)
    (x, y), = batches(1)
    model(x, y).backward()
    assert len(HOOKS) == hooks_before  # installed by step(), not before
    opt.step()
    assert len(HOOKS) == hooks_before + 1
    model(x, y)
    assert len(HOOKS) == hooks_before  # every chunk synced by the forward
    model(x, y).backward()
    opt.step()
    assert len(HOOKS) == hooks_before + 1
    opt.close()
    assert len(HOOKS) == hooks_before


def _break_the_kernel(monkeypatch, error, gate=None):
    """The CPU-Adam kernel raises ``error`` (once ``gate`` is set, if given)."""
    def broken(*args, **kwargs):
        if gate is not None:
            gate.wait()
        raise error
    for name in ("adam_step", "adam_step_async"):  # whichever the pipeline calls
        monkeypatch.setattr(cpu_adam, name, broken)


def test_worker_error_surfaces_at_the_next_forward(monkeypatch):
    model = make_model()
    opt = OffloadAdamW(model.parameters(), chunk_mb=CHUNK_MB, threads=1, overlap=False, overlap_forward=True)
    hooks_before = len(HOOKS)
    gate = threading.Event()
    _break_the_kernel(monkeypatch, ValueError("kernel exploded"), gate)
    (x, y), = batches(1)
    model(x, y).backward()
    opt.step()  # returns before the first update fails
    gate.set()
    with pytest.raises(RuntimeError, match=r"OffloadAdamW: the AdamW update of chunk \d+ failed") as info:
        model(x, y)
    assert isinstance(info.value.__cause__, PipelineError)
    assert isinstance(info.value.__cause__.__cause__, ValueError)
    for call in (opt.synchronize, opt.step):
        with pytest.raises(RuntimeError, match=r"OffloadAdamW: the AdamW update of chunk \d+ failed"):
            call()
    opt.close()  # does not raise; removes the hook
    assert len(HOOKS) == hooks_before


def test_worker_error_surfaces_at_step_without_forward_overlap(monkeypatch):
    model = make_model()
    opt = OffloadAdamW(model.parameters(), chunk_mb=CHUNK_MB, threads=1, overlap=False)
    _break_the_kernel(monkeypatch, ZeroDivisionError("kernel exploded"))
    (x, y), = batches(1)
    model(x, y).backward()
    with pytest.raises(RuntimeError, match=r"OffloadAdamW: the AdamW update of chunk \d+ failed") as info:
        opt.step()
    assert isinstance(info.value.__cause__.__cause__, ZeroDivisionError)
    opt.close()


def test_state_dict_waits_for_the_updates(slow_write_back):
    """state_dict() right after an overlapped step() equals torch's (it synchronizes)."""
    model, reference = make_model(), make_model()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, chunk_mb=CHUNK_MB, threads=1, overlap=False,
                       overlap_forward=True)
    ref = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    data = batches(3)
    train(model, opt, data)
    train(reference, ref, data)
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    for k, entry in theirs.items():
        for name, t in entry.items():
            torch.testing.assert_close(ours[k][name], t, rtol=1e-5, atol=1e-9)
    assert max_rel_diff(model, reference) < 1e-5
    opt.close()


def test_stats_and_trace():
    model = make_model()
    opt = OffloadAdamW(model.parameters(), chunk_mb=CHUNK_MB, threads=1, overlap_forward=True)
    with pytest.raises(TypeError, match="Trace or None"):
        opt.trace = "yes"
    opt.trace = Trace()
    n = sum(p.numel() for p in model.parameters())
    train(model, opt, batches(2))
    opt.synchronize()
    s = opt.stats
    assert s.steps == 2 and s.d2h_bytes == s.h2d_bytes == 2 * 4 * n
    assert 0 < s.adam_s <= s.worker_s
    names = {e[0] for e in opt.trace.events}
    assert {"GradJob", "adam"} <= names
    opt.reset_stats()
    assert opt.stats == type(s)()
    opt.close()


def test_update_order_follows_the_forward_not_the_param_groups():
    """[Note: update order]: after a step, the chunk the forward uses first (the first layer's)
    has the best priority, even when the param groups list it last."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 2))
    layers = [model[0], model[2], model[4]]
    groups = [{"params": list(m.parameters())} for m in reversed(layers)]  # last layer first
    opt = OffloadAdamW(groups, lr=1e-3, chunk_mb=1e-4, threads=1, overlap_forward=True)
    x = torch.randn(4, 8)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
    opt.synchronize()
    chunk_of = {id(s.param): c for c in opt._chunks for s in c.slots}
    rank = [min(chunk_of[id(p)].priority for p in m.parameters()) for m in layers]
    assert rank == sorted(rank) and rank[0] == 0
    opt.close()
