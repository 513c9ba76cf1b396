"""OffloadAdamW on several ranks (2 CPU processes, gloo): with DDP each rank keeps and updates
only its shard of every chunk and step() all-gathers the updated params (ZeRO-2 + offload); with
FSDP2 (DTensor params) each rank updates its local shards. Checked against torch.optim.AdamW on
the same global batch (DDP: one process, no wrapper; FSDP2: the same wrapped model), the
gathered state dict, resuming from it, and a rank that dies."""
import os

import pytest
import torch

from _dist_util import error_after_a_rank_dies, run_ranks, values
from _offload_optim_util import CFG, batches, make_model, max_rel_diff

WORLD = 2
STEPS = 4
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-2}]


def _ddp_rank(rank, world, state, nvme_dir, resume_at, overlap_forward):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zero_offload import OffloadAdamW

    model = make_model()
    ddp = DDP(model)
    kw = dict(lr=3e-3, chunk_mb=0.01, threads=1, state=state, overlap_forward=overlap_forward,
              nvme_dir=None if nvme_dir is None else os.path.join(nvme_dir, f"r{rank}"))
    if state == "auto":  # the GPU share: each rank's shards of the first chunks on its device
        kw["gpu_budget"] = 100_000
    opt = OffloadAdamW(_groups(model), **kw)
    if state == "auto":
        homes = [opt._store.payload_spec(c.cid, "master").home.value for c in opt._chunks]
        assert homes[0] == "gpu" and homes[-1] == "cpu", homes
    shard_numel = sum(c.numel for c in opt._chunks)
    per = batches(STEPS, batch=2 * world)[0][0].shape[0] // world
    losses = []
    for i, (x, y) in enumerate(batches(STEPS, batch=2 * world)):
        if i == resume_at:  # the gathered state dict, loaded by a fresh optimizer, continues exactly
            sd = opt.state_dict()
            opt.close()
            opt = OffloadAdamW(_groups(model), **kw)
            opt.load_state_dict(sd)
        loss = ddp(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    sd = opt.state_dict()
    opt.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, sd, shard_numel


def _reference():
    model = make_model()
    opt = torch.optim.AdamW(_groups(model), lr=3e-3)
    for x, y in batches(STEPS, batch=2 * WORLD):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt.state_dict()


@pytest.mark.parametrize("state,resume_at,overlap_forward",
                         [("cpu", None, False), ("cpu", 2, True), ("nvme", 3, True), ("auto", 2, True)])
def test_ddp_each_rank_updates_its_shard_and_matches_torch(state, resume_at, overlap_forward, tmp_path):
    """overlap_forward: the shards are all-gathered by the next forward's hooks (module by
    module), the last ones by state_dict()."""
    nvme = str(tmp_path / "swap") if state == "nvme" else None
    out = values(run_ranks(_ddp_rank, WORLD, tmp_path, state, nvme, resume_at, overlap_forward,
                           timeout_s=120))
    ref, ref_sd = _reference()
    total = sum(p.numel() for p in ref.parameters())
    for params, sd, shard_numel in out:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6)
        # host state of one rank: about half of the model's (each chunk split in two)
        assert total / WORLD <= shard_numel <= total / WORLD + len(sd["state"])
        assert set(sd["state"]) == set(ref_sd["state"])
        for i, entry in ref_sd["state"].items():
            assert float(sd["state"][i]["step"]) == float(entry["step"])
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(sd["state"][i][k], entry[k], rtol=1e-4, atol=1e-9)
    assert max_rel_diff(ref, ref) == 0.0


def _fsdp_rank(rank, world, state):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zero_offload import OffloadAdamW

    mesh = init_device_mesh("cpu", (world,))
    probe = make_model()
    fully_shard(probe, mesh=mesh)
    try:
        OffloadAdamW(probe.parameters(), overlap_forward=True)
        refused = "accepted"
    except ValueError as e:
        refused = str(e)
    models = []
    for _ in range(2):
        m = make_model()
        for block in m.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh, reshard_after_forward=True)
        models.append(m)
    ours, ref = models
    share = dict(state="auto", gpu_budget=50_000) if state == "auto" else {}
    opts = [OffloadAdamW(_groups(ours), lr=3e-3, chunk_mb=0.01, threads=1, **share),
            torch.optim.AdamW(_groups(ref), lr=3e-3)]
    if state == "auto":
        homes = [opts[0]._store.payload_spec(c.cid, "master").home.value for c in opts[0]._chunks]
        assert homes[0] == "gpu" and homes[-1] == "cpu", homes
    per = 2
    for x, y in batches(STEPS, batch=2 * world):
        for m, o in zip(models, opts):
            m(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
            o.step()
            o.zero_grad()
    local_numel = sum(c.numel for c in opts[0]._chunks)
    sd = opts[0].state_dict()
    ref_sd = opts[1].state_dict()
    opts[0].close()
    full = lambda m: {n: p.full_tensor().detach().clone() for n, p in m.named_parameters()}  # noqa: E731
    state_ok = all(torch.allclose(sd["state"][i]["exp_avg"], e["exp_avg"].to_local(), rtol=1e-4, atol=1e-9)
                   for i, e in ref_sd["state"].items())
    return full(ours), full(ref), local_numel, state_ok, refused


@pytest.mark.parametrize("state", ["cpu", "auto"])
def test_fsdp2_local_shards_match_torch_adamw_on_the_same_wrapped_model(state, tmp_path):
    """state="auto": the first chunks of each rank's local shards are updated on its device."""
    out = values(run_ranks(_fsdp_rank, WORLD, tmp_path, state, timeout_s=120))
    total = sum(p.numel() for p in make_model().parameters())
    for ours, ref, local_numel, state_ok, refused in out:
        # overlap_forward is refused: FSDP2 gathers a whole unit before its modules' hooks run
        assert "overlap_forward=True does not work with FSDP2 params" in refused
        assert ours.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(ours[n], ref[n], rtol=1e-5, atol=1e-6)
        assert local_numel < 0.6 * total  # each rank: its shards only
        assert state_ok
    start = make_model()
    moved = max((ours[n] - p.detach()).abs().max().item() for n, p in start.named_parameters())
    assert moved > 1e-3  # training changed the params


def _dies_rank(rank, world):
    from zero_offload import OffloadAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = OffloadAdamW(model.parameters(), threads=1)
    for step in range(3):
        if rank == 1 and step == 1:
            os._exit(3)  # killed between steps
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    return "finished"


def test_a_dead_rank_makes_the_other_raise_one_clear_error(tmp_path):
    err = error_after_a_rank_dies(_dies_rank, WORLD, tmp_path)
    assert "rank 0 of 2: the all-gather of the updated params failed" in err, err
    assert "rank 1, the other rank, has probably died" in err and "restart from the last checkpoint" in err
    assert CFG.vocab_size == 64  # the shared test config is untouched by the ranks


def _linear(out_features=8):
    torch.manual_seed(0)
    return torch.nn.Linear(8, out_features)


# case -> (the params and options on rank r, the line every rank raises)
SETTINGS_CASES = {
    "chunk_mb": (lambda r: ([*_linear().parameters()], dict(chunk_mb=(0.01, 0.02)[r])),
                 "OffloadAdamW: ranks disagree on chunk_mb: rank 0 has 0.01, rank 1 has 0.02"),
    "lr": (lambda r: ([*_linear().parameters()], dict(lr=(1e-3, 3e-3)[r])),
           "OffloadAdamW: ranks disagree on lr, betas, eps, weight_decay: rank 0 has (0.001, 0.9, "
           "0.999, 1e-08, 0.01), rank 1 has (0.003, 0.9, 0.999, 1e-08, 0.01)"),
    "overlap_forward": (lambda r: ([*_linear().parameters()], dict(overlap_forward=bool(r))),
                        "OffloadAdamW: ranks disagree on overlap_forward: rank 0 has False, rank 1 has True"),
    "group": (lambda r: ([{"params": [*_linear().parameters()], "weight_decay": (0.1, 0.0)[r]}], {}),
              "OffloadAdamW: ranks disagree on the param groups' options: rank 0 has "
              "[{'weight_decay': 0.1}], rank 1 has [{'weight_decay': 0.0}]"),
    "params": (lambda r: ([*_linear((8, 4)[r]).parameters()], {}),
               "OffloadAdamW: ranks disagree on the params (group, shape, dtype, requires_grad): rank 0 "
               "has [(0, (8, 8), torch.float32, True), (0, (8,), torch.float32, True)], rank 1 has "
               "[(0, (4, 8), torch.float32, True), (0, (4,), torch.float32, True)]"),
}


def _settings_rank(rank, world):
    from zero_offload import OffloadAdamW

    said = {}
    for case, (args, _) in SETTINGS_CASES.items():
        params, kw = args(rank)
        try:
            OffloadAdamW(params, threads=1, **kw)
        except ValueError as e:
            said[case] = str(e)
        else:
            said[case] = "no error"
    return said


def test_ranks_with_different_settings_raise_one_line_naming_them_on_every_rank(tmp_path):
    """Chunks, hyperparameters and params are compared at construction (not a mismatched
    all-gather at the first step); threads, paths and budgets are each rank's own."""
    said = values(run_ranks(_settings_rank, WORLD, tmp_path, timeout_s=120, collective_timeout_s=20))
    for case, (_, line) in SETTINGS_CASES.items():
        assert [s[case] for s in said] == [f"{line}; pass the same settings on every rank"] * WORLD, case
