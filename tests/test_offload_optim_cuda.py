"""OffloadAdamW on CUDA params: grads stream on side streams during backward, CPU-Adam on the
worker, params copied back; equal to torch.optim.AdamW on the GPU."""
import pytest
import torch

from _offload_optim_util import batches, make_model, max_rel_diff, train
from zero_offload.offload_optim import OffloadAdam, OffloadAdamW

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("state", ["cpu", "nvme"])
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_fp32_parity(overlap, state, tmp_path):
    model, reference = make_model("cuda"), make_model("cuda")
    opt = OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, chunk_mb=0.02, overlap=overlap,
                       state=state, nvme_dir=tmp_path if state == "nvme" else None)
    data = batches(20, device="cuda")
    losses = train(model, opt, data)
    ref_losses = train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1), data)
    assert max_rel_diff(model, reference) < 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert opt.stats.d2h_bytes == opt.stats.h2d_bytes == 20 * 4 * sum(p.numel() for p in model.parameters())
    opt.close()


def test_cuda_bf16_params_follow_fp32_master():
    """bf16 model on the GPU: the fp32 master equals torch.optim.AdamW run on an fp32 copy fed
    the same bf16 grads, and each param is the bf16 rounding of its master."""
    model = make_model("cuda", dtype=torch.bfloat16)
    master = make_model("cuda", dtype=torch.bfloat16).float()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, chunk_mb=0.02, overlap=False)
    ref = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for x, y in batches(10, device="cuda"):
        model(x, y).backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        # the next forward reads params without any host synchronisation from step()
    sd = opt.state_dict()["state"]
    start = make_model("cuda", dtype=torch.bfloat16)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))
    for i, (p, q) in enumerate(zip(model.parameters(), master.parameters())):
        torch.testing.assert_close(sd[i]["master"], q.detach().cpu(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach().cpu(), sd[i]["master"].bfloat16())
    opt.close()


# ---- [Note: forward overlap] and [Note: copy-back source] on CUDA --------------------------

HOOKS = torch.nn.modules.module._global_forward_pre_hooks


@pytest.fixture
def slow_h2d(monkeypatch):
    """The param copies of every chunk start ~1 ms late on the H2D stream (a sleep kernel before
    them): the next forward, the next update and the store's buffer reuse all run ahead of
    them unless they are ordered after them."""
    from zero_offload.runtime.chunk_group import ChunkGroup  # the worker's copy into the params
    original = ChunkGroup._write_back

    def write_back(self, cid):
        with torch.cuda.stream(self.store._streams.h2d):
            torch.cuda._sleep(2_000_000)
        original(self, cid)
    monkeypatch.setattr(ChunkGroup, "_write_back", write_back)


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.2},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-2}]


@pytest.mark.parametrize("state", ["cpu", "nvme"])
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_overlap_forward_parity(overlap, state, tmp_path, slow_h2d):
    model, reference = make_model("cuda"), make_model("cuda")
    for m in (model, reference):
        m.wpe.weight.requires_grad_(False)
    hooks_before = len(HOOKS)
    opt = OffloadAdamW(_groups(model), lr=2e-3, chunk_mb=0.02, overlap=overlap, overlap_forward=True,
                       state=state, nvme_dir=tmp_path if state == "nvme" else None)
    data = batches(12, device="cuda")
    losses = train(model, opt, data)
    opt.synchronize()
    assert len(HOOKS) == hooks_before
    ref_losses = train(reference, torch.optim.AdamW(_groups(reference), lr=2e-3), data)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(model, reference) < 1e-5
    assert torch.equal(model.wpe.weight, make_model("cuda").wpe.weight)
    opt.close()


@pytest.mark.parametrize("state", ["cpu", "nvme"])
def test_cuda_copy_back_outlives_slow_h2d(state, tmp_path, slow_h2d):
    """fp32 params: the copies back read the host master. With NVMe state the pipeline writes it
    home and evicts it before those copies ran; the store keeps its memory (EVICTING) until they
    are done, and frees it after."""
    from zero_offload.store import Residency

    model, reference = make_model("cuda"), make_model("cuda")
    opt = OffloadAdamW(model.parameters(), lr=3e-3, chunk_mb=0.02, state=state,
                       nvme_dir=tmp_path if state == "nvme" else None)
    ref = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    for x, y in batches(8, device="cuda"):
        for m, o in ((model, opt), (reference, ref)):
            m(x, y).backward()
            o.step()
            o.zero_grad()
        assert max_rel_diff(model, reference) < 1e-5  # read on the current stream: ordered
    opt.state_dict()  # waits for the copies
    if state == "nvme":
        opt._store.synchronize()
        assert all(opt._store.state(c.cid, n, "cpu") is Residency.ABSENT
                   for c in opt._chunks for n in opt._group.names(c).values())
    opt.close()


def test_cuda_bf16_overlap_forward_params_follow_master(slow_h2d):
    """bf16 model, update in backward and overlapping the next forward: every param ends as the
    bf16 rounding of its fp32 master, which matches torch.optim.AdamW on fp32 copies fed the
    same bf16 grads (the fp32 parity test above is the one that catches a stale forward)."""
    model = make_model("cuda", dtype=torch.bfloat16)
    master = make_model("cuda", dtype=torch.bfloat16).float()
    grads = {}
    for p in model.parameters():  # runs before the optimizer's hook, which consumes the grad
        p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(p, p.grad.float()))
    opt = OffloadAdamW(model.parameters(), lr=1e-3, chunk_mb=0.02, overlap_forward=True)
    ref = torch.optim.AdamW(master.parameters(), lr=1e-3)
    for x, y in batches(8, device="cuda"):
        model(x, y).backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad = grads[p]
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    opt.synchronize()
    sd = opt.state_dict()["state"]
    for i, (p, q) in enumerate(zip(model.parameters(), master.parameters())):
        torch.testing.assert_close(sd[i]["master"], q.detach().cpu(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach().cpu(), sd[i]["master"].bfloat16())
    opt.close()
