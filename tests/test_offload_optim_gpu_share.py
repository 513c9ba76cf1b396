"""OffloadAdamW(state="auto", gpu_budget=...): the GPU share of the optimizer for scripts that
keep their own loop. The first chunks' fp32 master, moments and a flat grads buffer are homed on
the params' device (within gpu_budget) and updated there by torch's fused AdamW; the rest by
CPU-Adam in host RAM, and with nvme_dir what does not fit cpu_budget on NVMe. Checked against
torch.optim.AdamW on the same model (CPU as the device in CI: the GPU tier is then host memory,
the same code path; ZO_TEST_DEVICE=cuda runs it on the GPU)."""
import copy
import os

import pytest
import torch

from _offload_optim_util import assert_moved, batches, make_model, max_rel_diff, train
from zero_offload.offload_optim import OffloadAdam, OffloadAdamW
from zero_offload.runtime.store import Tier

DEVICE = os.environ.get("ZO_TEST_DEVICE", "cpu")
CHUNK_MB = 0.02  # ~5k fp32 params per chunk: the tiny GPT spans several chunks
HP = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
PARTIAL = 200_000
"""gpu_budget (bytes) that holds some of the tiny GPT's chunks (16 bytes per fp32 param)."""


def _homes(opt) -> list:
    return [opt._store.payload_spec(c.cid, "master").home for c in opt._chunks]


@pytest.mark.parametrize("kw", [dict(), dict(overlap=False), dict(overlap_forward=True),
                                dict(grad_accum=2)], ids=["overlap", "no-overlap", "forward", "accum"])
@pytest.mark.parametrize("budget", [PARTIAL, 1 << 30], ids=["partial", "whole"])
def test_gpu_share_trains_like_torch(kw, budget):
    model, reference = make_model(DEVICE), make_model(DEVICE)
    start = copy.deepcopy(reference)
    opt = OffloadAdamW(model.parameters(), **HP, chunk_mb=CHUNK_MB, threads=1, state="auto",
                       gpu_budget=budget, **kw)
    homes = _homes(opt)
    if budget == PARTIAL:
        k = homes.count(Tier.GPU)
        assert 0 < k < len(homes) and homes == [Tier.GPU] * k + [Tier.CPU] * (len(homes) - k)
        assert 0 < opt._store.bytes("gpu") <= PARTIAL
    else:
        assert set(homes) == {Tier.GPU}
    opt.reset_stats()  # (the initial state went up to the share)
    accum = kw.get("grad_accum", 1)
    data = batches(8, device=DEVICE)
    losses = train(model, opt, data, accum=accum)
    if kw.get("overlap_forward"):
        opt.synchronize()
    ref_losses = train(reference, torch.optim.AdamW(reference.parameters(), **HP), data, accum=accum)
    assert max_rel_diff(model, reference) < 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_moved(reference, start)
    if budget != PARTIAL:  # nothing goes down to the host
        assert opt.stats.d2h_bytes == 0 and opt.stats.h2d_bytes == 0
    opt.close()


def test_gpu_share_state_dict_moves_between_placements():
    """state_dict of the share equals torch's; it loads into a host-only optimizer (and back)
    and training goes on as torch's."""
    model, reference = make_model(DEVICE), make_model(DEVICE)
    data = batches(6, device=DEVICE)
    opt = OffloadAdamW(model.parameters(), **HP, chunk_mb=CHUNK_MB, threads=1, state="auto",
                       gpu_budget=PARTIAL)
    ref = torch.optim.AdamW(reference.parameters(), **HP)
    train(model, opt, data[:3])
    train(reference, ref, data[:3])
    sd, want = opt.state_dict(), ref.state_dict()
    assert sorted(sd["state"]) == sorted(want["state"])
    for i, entry in want["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            got = sd["state"][i][k].to(entry[k].device)
            assert (got - entry[k]).abs().max() <= 1e-5 * entry[k].abs().max(), (i, k)
        assert float(sd["state"][i]["step"]) == float(entry["step"])
    opt.close()
    host = OffloadAdamW(model.parameters(), **HP, chunk_mb=CHUNK_MB, threads=1)
    host.load_state_dict(sd)
    train(model, host, data[3:5])
    train(reference, ref, data[3:5])
    back = OffloadAdamW(model.parameters(), **HP, chunk_mb=CHUNK_MB, threads=1, state="auto",
                        gpu_budget=PARTIAL)
    back.load_state_dict(host.state_dict())
    host.close()
    train(model, back, data[5:])
    train(reference, ref, data[5:])
    assert max_rel_diff(model, reference) < 1e-5
    back.close()


def test_gpu_share_with_bf16_params_rounds_from_the_fp32_master():
    """bf16 params: the share updates the fp32 master and writes its rounding into the params,
    the same values the host path (CPU-Adam) gives."""
    share, host = make_model(DEVICE, dtype=torch.bfloat16), make_model(DEVICE, dtype=torch.bfloat16)
    data = batches(5, device=DEVICE)
    a = OffloadAdamW(share.parameters(), **HP, chunk_mb=CHUNK_MB, threads=1, state="auto", gpu_budget=1 << 30)
    b = OffloadAdamW(host.parameters(), **HP, chunk_mb=CHUNK_MB, threads=1)
    assert not any(a._store.has_payload(c.cid, "params") for c in a._chunks)  # no host copy of the params
    train(share, a, data)
    train(host, b, data)
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    for i in sb:
        assert torch.allclose(sa[i]["master"].cpu(), sb[i]["master"].cpu(), rtol=1e-5, atol=1e-7), i
    for s in (s for c in a._chunks for s in c.slots):  # the params: the master's rounding
        assert torch.equal(s.param.detach().reshape(-1)[s.start:s.start + s.count],
                           sa[s.index]["master"].reshape(-1)[s.start:s.start + s.count]
                           .to(s.param.device).bfloat16())
    assert max_rel_diff(share, host) < 2e-2
    a.close()
    b.close()


def test_auto_spills_to_nvme_past_the_host_budget(tmp_path):
    model, reference = make_model(DEVICE), make_model(DEVICE)
    opt = OffloadAdamW(model.parameters(), **HP, chunk_mb=CHUNK_MB, threads=1, state="auto",
                       gpu_budget=PARTIAL, cpu_budget=400_000, nvme_dir=str(tmp_path))
    homes = _homes(opt)
    assert homes[0] is Tier.GPU and Tier.CPU in homes and homes[-1] is Tier.NVME, homes
    data = batches(6, device=DEVICE)
    train(model, opt, data)
    train(reference, torch.optim.AdamW(reference.parameters(), **HP), data)
    assert max_rel_diff(model, reference) < 1e-5
    read, written = opt.nvme_bytes()
    assert read > 0 and written > 0
    opt.close()


def test_gpu_share_settings_are_checked_before_anything_changes():
    model = make_model(DEVICE)
    with pytest.raises(ValueError, match=r"OffloadAdamW: state='auto' needs gpu_budget="):
        OffloadAdamW(model.parameters(), state="auto")
    with pytest.raises(ValueError, match=r"gpu_budget='8GiB' applies to state='auto' only"):
        OffloadAdamW(model.parameters(), gpu_budget="8GiB")
    with pytest.raises(ValueError, match=r"gpu_budget"):
        OffloadAdam(model.parameters(), state="auto", gpu_budget="lots")
    with pytest.raises(ValueError, match=r"use 'cpu' \(host RAM\), 'nvme' .* or 'auto'"):
        OffloadAdamW(model.parameters(), state="gpu")
    assert all(not p._backward_hooks and p.grad is None for p in model.parameters())
    # gpu_budget=0: every chunk on the host, as state="cpu"
    opt = OffloadAdamW(model.parameters(), state="auto", gpu_budget=0, chunk_mb=CHUNK_MB, threads=1)
    assert set(_homes(opt)) == {Tier.CPU}
    assert "state='auto'" in repr(opt)
    opt.close()


def test_auto_with_nvme_dir_takes_no_disk_when_the_state_fits(tmp_path):
    """nvme_dir is a place to spill, not a reservation: when every chunk fits the GPU share and
    the host budget, no swap file is made; a group added later that would need NVMe is refused
    (the swap space is sized by the constructor's params) and nothing changes."""
    model = make_model(DEVICE)
    opt = OffloadAdamW(model.parameters(), **HP, chunk_mb=CHUNK_MB, threads=1, state="auto",
                       gpu_budget=PARTIAL, cpu_budget=1 << 20, nvme_dir=str(tmp_path))
    assert Tier.NVME not in _homes(opt) and Tier.CPU in _homes(opt)
    # 192 KiB of state: NVMe (its grads and the NVMe staging fit what the host budget has left)
    big = torch.nn.Parameter(torch.zeros(1 << 14, device=DEVICE))
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match=r"the swap space was sized for the params given to the "
                                         r"constructor and has 0 bytes left"):
        opt.add_param_group({"params": [big]})
    assert len(opt.param_groups) == groups
    train(model, opt, batches(2, device=DEVICE))
    assert not list(tmp_path.iterdir())  # no swap space was made
    opt.close()
