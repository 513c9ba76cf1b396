"""The rules beyond Adam (runtime/rules.py) through the engine: ``zo.SGD``, ``zo.Lion``,
``zo.Adafactor`` and ``zo.Muon`` (on the hidden matrices, AdamW on the rest by a param group, as
torch's recipe) train like plain torch with ``torch.optim.SGD`` / ``torch.optim.Adafactor`` /
``torch.optim.Muon`` + ``AdamW`` (Lion: its published update written below with torch ops), on the
engine's recipe (_engine_util.Reference: clipping, accumulation, bf16 masters): every placement
the CPU runs (host, NVMe, the GPU share's device step), clipping with accumulation, a frozen
param, tied params (the GPT's head is its embedding), a checkpoint resume, and two gloo ranks
(the rules that are not elementwise on shards cut at parameter boundaries), whose checkpoint
resumes on one. The torch.optim front end: test_rules_offload_optim.py.

[Note: Muon is chaotic in its last bits] torch's Muon orthogonalises in bf16: an input that
differs from torch's in its last fp32 bit flips a few bf16 roundings, whose effect on the params
feeds back through the next grads and compounds: a 1e-8 difference is 1e-2 within five steps.
So the grads Muon sees must be torch's bit for bit, and they are wherever the engine's recipe is
torch's: the AdamW reference of the mixed recipe is torch's fused AdamW (CPU-Adam's operation
order, bit for bit), and the two-rank reference averages the ranks' half-batch grads as DDP
does. Global-norm clipping is the exception: the engine's norm (float64, over chunks) and
``clip_grad_norm_``'s (fp32, per tensor) differ in the last bit, so with clipping Muon is held
to torch for the first windows only, before the flips compound."""
from __future__ import annotations

import pytest
import torch

import zero_offload as zo
from _dist_util import run_ranks, values
from _engine_util import (SMALL_CHUNK_MB, Reference, assert_params_close, config, gpt_batches, gpt_loss,
                          micro_gpt, rel_err, train_engine)
from zero_offload.runtime.checkpoint import CheckpointError, chunk_spans
from zero_offload.runtime.store import Tier

STEPS = 20
"""The headline comparison (fp32, "plain"); the other cases run fewer windows (the suite's time)."""
CHUNK_MB = 2 * SMALL_CHUNK_MB
"""About 2k fp32 elements per chunk: the micro GPT spans several chunks."""


class LionRef(torch.optim.Optimizer):
    """Lion as published (Chen et al. 2023, Algorithm 2; decoupled weight decay), torch ops."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m, g = state["exp_avg"], p.grad
                update = (b1 * m + (1 - b1) * g).sign()  # c = b1*m + (1-b1)*g
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)                # p = p*(1 - lr*wd) - lr*sign(c)
                m.mul_(b2).add_(g, alpha=1 - b2)         # m = b2*m + (1-b2)*g


class Both:
    """Two torch optimizers stepped as one (torch's Muon recipe: Muon + AdamW)."""

    def __init__(self, *opts):
        self.opts = opts
        self.param_groups = [g for o in opts for g in o.param_groups]

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def hidden(name: str, shape) -> bool:
    """Muon's params in torch's recipe: the hidden matrices (not embeddings, norms or the head)."""
    return name.startswith("blocks.") and len(shape) == 2


RULES = {
    "sgd": (zo.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
            lambda named: torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9, nesterov=True,
                                          weight_decay=0.01, foreach=False)),
    "lion": (zo.Lion(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1),
             lambda named: LionRef([p for _, p in named], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
    "adafactor": (zo.Adafactor(lr=0.01, weight_decay=0.01),
                  lambda named: torch.optim.Adafactor([p for _, p in named], lr=0.01, weight_decay=0.01,
                                                      foreach=False)),
    "muon": (zo.Muon(lr=0.01, momentum=0.9),
             lambda named: Both(torch.optim.Muon([p for n, p in named if hidden(n, p.shape)], lr=0.01, momentum=0.9),
                                # fused: CPU-Adam's order, bit for bit ([Note: Muon is chaotic in its last bits])
                                torch.optim.AdamW([p for n, p in named if not hidden(n, p.shape)], lr=3e-3,
                                                  fused=True))),
}


def groups_of(name: str, model) -> list | None:
    """The engine's param groups of a rule: Muon's recipe gives the non-matrices to AdamW."""
    if name != "muon":
        return None
    return [{"params": [n for n, p in model.named_parameters() if not hidden(n, p.shape)],
             "optimizer": zo.AdamW(lr=3e-3)}]


def reference(name: str, model, **kw) -> Reference:
    """_engine_util's Reference (the engine's recipe) with the rule's torch optimizer."""
    ref = Reference(model, zo.AdamW(), **kw)
    names = [n for n, _ in ref.work.named_parameters()]
    ref.opt = RULES[name][1]([(n, m) for n, m in zip(names, ref.masters) if m.requires_grad])
    return ref


def engine_for(name: str, model=None, **kw):
    model = micro_gpt() if model is None else model
    return zo.initialize(model, optimizer=RULES[name][0], config=config(**{"chunk_mb": CHUNK_MB, **kw}),
                         device="cpu", param_groups=groups_of(name, model))


CASES = {  # (config, windows)
    "plain": (dict(), STEPS),
    "clip-accum": (dict(grad_clip=0.05, grad_accum=2), 3),  # (3: [Note: Muon is chaotic in its last bits])
    "bf16": (dict(dtype="bf16"), 3),  # (bf16 forward/backward drift apart; Muon compounds it)
    "nvme-frozen": (dict(optimizer="nvme"), 4),
    "share": (dict(params="gpu", optimizer="auto", gpu_budget=400_000), 4),  # the GPU share: device_step
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(RULES))
def test_engine_trains_like_torch(name, case, tmp_path):
    kw, steps = dict(CASES[case][0]), CASES[case][1]
    accum = kw.get("grad_accum", 1)
    frozen = case == "nvme-frozen"
    if frozen:
        kw["nvme_dir"] = str(tmp_path / "swap")
    model, ref_model = micro_gpt(), micro_gpt()
    if frozen:
        for m in (model, ref_model):
            m.wpe.weight.requires_grad_(False)
    engine = engine_for(name, model, **kw)
    try:
        if case == "share":
            assert 0 < engine.plan.count(optimizer=Tier.GPU), "no chunk in the GPU share: device_step untested"
        lowp = torch.bfloat16 if case == "bf16" else torch.float32
        ref = reference(name, ref_model, accum=accum, grad_clip=kw.get("grad_clip"), dtype=lowp)
        batches = gpt_batches(steps * accum)
        for b in batches:
            ref.step(b, gpt_loss)
        train_engine(engine, batches, gpt_loss, accum=accum)
        if "grad_clip" in kw:
            assert max(ref.norms) > kw["grad_clip"], "clipping never acted"
        # bf16: the same recipe, but bf16 rounding of forward and backward drifts apart (as for
        # Adam); what the rule writes is held exactly below
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5 if lowp is torch.float32 else 3e-2)
        if lowp is torch.bfloat16:  # the rule wrote the updated masters, rounded, into the bf16 params
            for c in engine.group.chunks:
                if c.layout.trainable:
                    work, master = (engine.group.read(c, n) for n in ("params", "master"))
                    assert torch.equal(work, master.to(torch.bfloat16))
        if frozen:
            assert torch.equal(engine.state_dict()["wpe.weight"], micro_gpt().wpe.weight)
        moved = rel_err(ref.master_state()["blocks.0.mlp.fc.weight"], micro_gpt().blocks[0].mlp.fc.weight.detach())
        assert moved > 1e-3, "training did not move the params: the comparison would prove nothing"
    finally:
        engine.close()


def test_adafactor_on_the_device_keeps_its_scalars_there(monkeypatch):
    """On CUDA the GPU share's Adafactor forms its two norms' scale on the device (no ``.item()``,
    no host sync); that path, run here on the CPU, trains like torch.optim.Adafactor too."""
    from zero_offload.runtime import rules
    seen = []
    monkeypatch.setattr(rules, "_host_scalars", lambda t: seen.append(t.device.type) or False)
    test_engine_trains_like_torch("adafactor", "share", None)
    assert seen  # the share's device_step took that path


def test_the_chunks_follow_the_rules():
    """Muon's and AdamW's params never share a chunk; every trainable chunk has its rule's state
    (Adafactor: factors sized by the params' shapes) and no other."""
    engine = engine_for("muon")
    try:
        for layout in engine.partition.chunks:
            if not layout.trainable:
                continue
            muon = {hidden(s.name, s.shape) for s in layout.slots}
            assert len(muon) == 1
            want = ("momentum_buffer",) if muon == {True} else ("exp_avg", "exp_avg_sq")
            assert tuple(chunk_spans(engine.group, layout)) == ("master", *want)
        assert engine.optimizer.param_groups[1]["optimizer"] == "adamw"
    finally:
        engine.close()
    engine = engine_for("adafactor")
    try:
        for layout in engine.partition.chunks:
            rows = sum(s.shape[0] for s in layout.slots if len(s.shape) == 2)
            cols = sum(s.shape[1] for s in layout.slots if len(s.shape) == 2)
            vec = sum(s.numel for s in layout.slots if len(s.shape) == 1)
            got = {k: engine.store.payload_spec(layout.index, k).numel for k in ("row_var", "col_var", "variance")}
            assert got == {"row_var": max(1, rows), "col_var": max(1, cols), "variance": max(1, vec)}
    finally:
        engine.close()


def test_a_muon_group_refuses_a_param_that_is_not_a_matrix():
    with pytest.raises(ValueError, match=r"parameter 'blocks.0.ln1.weight' of shape \(16,\)") as info:
        zo.initialize(micro_gpt(), optimizer=zo.Muon(), config=config(), device="cpu")
    assert "Muon updates 2-D params only" in str(info.value) and "'optimizer': zo.AdamW" in str(info.value)
    with pytest.raises(ValueError, match="a group may set only lr, betas, eps, weight_decay"):
        zo.initialize(micro_gpt(), optimizer=zo.Muon(), config=config(), device="cpu",
                      param_groups=[{"params": ["ln_f.weight"], "optimizer": zo.AdamW(), "momentum": 0.5}])
    with pytest.raises(TypeError, match=r"\['optimizer'\] must be a zero_offload optimizer spec"):
        zo.initialize(micro_gpt(), optimizer=zo.Muon(), config=config(), device="cpu",
                      param_groups=[{"params": ["ln_f.weight"], "optimizer": torch.optim.AdamW}])


@pytest.mark.parametrize("name", list(RULES))
def test_checkpoint_resume(name, tmp_path):
    """Saved mid-run, loaded into a new engine with another chunk size: the run goes on as if
    uninterrupted (state sized by shapes included); another optimizer's checkpoint is refused."""
    batches = gpt_batches(6)
    whole, first = engine_for(name), engine_for(name)
    second = engine_for(name, micro_gpt(seed=3), chunk_mb=2 * SMALL_CHUNK_MB)
    try:
        train_engine(whole, batches, gpt_loss)
        train_engine(first, batches[:3], gpt_loss)
        first.save_checkpoint(tmp_path / "ckpt")
        second.load_checkpoint(tmp_path / "ckpt")
        train_engine(second, batches[3:], gpt_loss)
        assert_params_close(second.state_dict(), whole.state_dict(), rtol=1e-6)
    finally:
        for e in (whole, first, second):
            e.close()
    other = "adafactor" if name != "adafactor" else "lion"
    wrong = engine_for(other)
    try:
        with pytest.raises(CheckpointError, match="holds the state of optimizer|saved with 2 optimizer param group"):
            wrong.load_checkpoint(tmp_path / "ckpt")
    finally:
        wrong.close()


# ---- two ranks (gloo) -----------------------------------------------------------------------------


def _two_rank_rules(rank, world, ckpt_dir):
    import _engine_util
    _engine_util.DEVICE = "cpu"
    out = {}
    for name in RULES:
        engine = engine_for(name, prefetch_depth=1)
        assert engine.shard.world == world
        for x, y in gpt_batches(3, batch=2 * world):
            loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
            engine.backward(loss)
            engine.step()
        if name in ("adafactor", "muon"):  # rules that are not elementwise: whole params per rank
            mine = [s for c in engine.group.chunks if c.layout.trainable and not c.rule.elementwise
                    for s in c.slots if s.held]
            assert all(s.whole for s in mine)
            held = [(s.name, s.numel) for s in mine]
            out[f"{name}-held"] = held
            engine.save_checkpoint(f"{ckpt_dir}/{name}")
        out[name] = engine.state_dict()
        engine.close()
    return out


def test_two_ranks_train_like_one_torch_process_and_resume_on_one(tmp_path, monkeypatch):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")
    out = values(run_ranks(_two_rank_rules, 2, tmp_path / "ranks", str(tmp_path), timeout_s=300))
    for name in RULES:
        ref = reference(name, micro_gpt(), accum=2)  # the mean of the ranks' grads, as DDP's
        for x, y in gpt_batches(3, batch=4):
            for r in range(2):
                ref.step((x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]), gpt_loss)
        for sd in (out[0][name], out[1][name]):
            assert_params_close(sd, ref.master_state(), rtol=1e-5)
    for name in ("adafactor", "muon"):
        mine = [dict(o[f"{name}-held"]) for o in out]
        assert mine[0] and mine[1], f"{name}: a rank holds no param: the shards are not balanced"
        assert not set(mine[0]) & set(mine[1])  # each param on one rank, whole
        # the checkpoint of two ranks resumes on one: the same run as one process throughout
        # (accumulating the two halves of each batch: the mean of the ranks' grads)
        one, whole = engine_for(name, grad_accum=2), engine_for(name, grad_accum=2)
        try:
            one.load_checkpoint(tmp_path / name)
            halves = [(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]) for x, y in gpt_batches(5, batch=4) for r in range(2)]
            train_engine(whole, halves, gpt_loss, accum=2)
            train_engine(one, halves[6:], gpt_loss, accum=2)
            assert_params_close(one.state_dict(), whole.state_dict(), rtol=1e-5)
        finally:
            one.close()
            whole.close()
