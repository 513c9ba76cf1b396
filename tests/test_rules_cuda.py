"""The rules beyond Adam on CUDA: Muon's Newton-Schulz iterations run on the GPU for a matrix whose
momentum lives in host memory (the worker's CPU job takes it there and back, pipelined with the
native host passes: runtime/rules.py, [Note: where each rule runs] and [Note: Muon's pipeline])
or in the GPU share, and equal ``torch.optim.Muon`` on the GPU; the other rules' host and device
steps equal torch's on the same GPU."""
import math
import threading

import pytest
import torch

import zero_offload as zo
from _engine_util import Reference, assert_params_close, config, gpt_batches, gpt_loss, micro_gpt, train_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _matrices_only(model):
    for n, p in model.named_parameters():
        if not (n.startswith("blocks.") and p.dim() == 2):
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("kw", [dict(), dict(params="gpu", optimizer="auto", gpu_budget=1 << 22)],
                         ids=["host-state", "gpu-share"])
def test_muon_on_cuda_equals_torch(kw, monkeypatch):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cuda")
    engine = zo.initialize(_matrices_only(micro_gpt()), optimizer=zo.Muon(lr=0.01, momentum=0.9),
                           config=config(**kw), device="cuda")
    try:
        ref = Reference(_matrices_only(micro_gpt()), zo.AdamW())
        ref.opt = torch.optim.Muon([m for m in ref.masters if m.requires_grad], lr=0.01, momentum=0.9)
        batches = gpt_batches(3)
        for b in batches:
            ref.step(b, gpt_loss)
        train_engine(engine, batches, gpt_loss)
        # (the host's add and lerp may differ from the GPU's in the last bit: a few steps only,
        # test_rules.py's [Note: Muon is chaotic in its last bits])
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["sgd", "lion", "adafactor"])
def test_offloaded_rules_on_a_cuda_model_equal_torch(name):
    from _offload_optim_util import batches, make_model, max_rel_diff, train
    from test_rules_offload_optim import ours, theirs
    model, reference = make_model("cuda"), make_model("cuda")
    for kw in (dict(), dict(state="auto", gpu_budget=200_000)):
        opt, ref = ours(name, model, **kw), theirs(name, reference)
        data = batches(4, device="cuda")
        train(model, opt, data)
        train(reference, ref, data)
        assert max_rel_diff(model, reference) < 1e-5, kw
        opt.close()


# ---- Muon's pipeline ([Note: Muon's pipeline] in runtime/rules.py) --------------------------------

PIPELINE_SHAPES = [(96, 64), (64, 96), (33, 70), (256, 128), (70, 33), (1, 64), (64, 1), (512, 384)]
"""More matrices than slots (each slot reused), tall and wide ones (Newton-Schulz transposes), a
row and a column, and a last one larger than the rest (the slots grow mid-run in the second job)."""


def _muon_chunk(shapes, seed):
    from zero_offload.runtime.rules import MuonRule
    from zero_offload.runtime.update_rule import Segment, StepBuffers
    gen = torch.Generator().manual_seed(seed)
    numel = sum(math.prod(s) for s in shapes)
    bufs = StepBuffers(cid=0, param=torch.randn(numel, generator=gen), grad=torch.empty(numel, dtype=torch.bfloat16),
                       state={"momentum_buffer": torch.randn(numel, generator=gen)},
                       lowp=torch.empty(numel, dtype=torch.bfloat16), device=torch.device("cuda", 0))
    rule = MuonRule()
    args = rule.args({"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                      "ns_coefficients": (3.4445, -4.7750, 2.0315), "eps": 1e-7, "ns_steps": 5,
                      "adjust_lr_fn": None}, grad_scale=2.0)
    segments, start = [], 0
    for s in shapes:
        segments.append(lambda step, lo=start, hi=start + math.prod(s), s=s: Segment(lo, hi, step, args, shape=s))
        start += math.prod(s)
    return rule, bufs, segments


def _clone(bufs):
    from zero_offload.runtime.update_rule import StepBuffers
    return StepBuffers(cid=bufs.cid, param=bufs.param.clone(), grad=bufs.grad.clone(), lowp=bufs.lowp.clone(),
                       state={k: v.clone() for k, v in bufs.state.items()}, device=bufs.device)


def _run_pipeline(rule, bufs, segments, steps, seed, check=None):
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        bufs.grad.copy_(torch.randn(bufs.grad.numel(), generator=gen) * 2)
        segs = [make(step) for make in segments]
        # two jobs, the second started before the first is waited for (as the step pipeline
        # does: the first's apply passes run after the second's momentum passes)
        jobs = [rule.cpu_job(bufs, part, threads=2) for part in (segs[:3], segs[3:])]
        for tickets in jobs:
            for t in tickets:
                t.wait()
        if check is not None:
            check(step, segs)


def test_muon_pipeline_equals_the_op_for_op_path_bit_for_bit():
    """The pipelined native job against MuonRule's torch op chain with Newton-Schulz on the same
    GPU (the path it replaced): the same bf16 input reaches the same iterations, so every bit of
    the params, the momentum and the copy-out agrees, step after step."""
    rule, ours, segments = _muon_chunk(PIPELINE_SHAPES, seed=0)
    theirs = _clone(ours)

    def check(step, segs):
        theirs.grad.copy_(ours.grad)
        rule._step(theirs, segs, torch.device("cuda", 0))
        for name, a, b in (("param", ours.param, theirs.param), ("lowp", ours.lowp, theirs.lowp),
                           ("momentum_buffer", ours.state["momentum_buffer"], theirs.state["momentum_buffer"])):
            assert torch.equal(a, b), f"step {step}: {name}"

    _run_pipeline(rule, ours, segments, 4, seed=1, check=check)
    from zero_offload.runtime import rules
    assert rules._staging(1, torch.device("cuda", 0)).buffer.is_pinned()


def test_muon_pipeline_equals_torch_muon_on_cuda():
    """Against torch.optim.Muon stepping the same matrices on the GPU (its lerp and add there may
    round differently in the last bit: a few steps, rtol 1e-5)."""
    rule, ours, segments = _muon_chunk(PIPELINE_SHAPES, seed=2)
    start = ours.param.clone()
    params, momenta, offset = [], [], 0
    for s in PIPELINE_SHAPES:
        n = math.prod(s)
        params.append(ours.param[offset:offset + n].view(s).clone().cuda().requires_grad_(True))
        momenta.append(ours.state["momentum_buffer"][offset:offset + n].view(s).clone())
        offset += n
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)

    def check(step, segs):
        for p, m, seg in zip(params, momenta, segs):
            grad = ours.grad[seg.start:seg.stop].float().view(seg.shape) / 2.0
            p.grad = grad.cuda()
            if step == 1:  # torch's buffer starts at zero; give it ours (random) before its first step
                opt.state[p]["momentum_buffer"] = m.cuda()
        opt.step()

    _run_pipeline(rule, ours, segments, 3, seed=3, check=check)
    offset = 0
    for p, s in zip(params, PIPELINE_SHAPES):
        n = math.prod(s)
        got = ours.param[offset:offset + n].view(s)
        assert ((got.double() - p.detach().cpu().double()).norm() / p.detach().double().norm()).item() <= 1e-5, s
        offset += n
    assert (ours.param - start).norm() / start.norm() > 1e-3


def test_muon_pipelines_of_two_workers_do_not_share_slots():
    """Two worker threads (two engines' pipelines) run their jobs at once: each has its own slots."""
    results, errors = {}, []

    def work(seed):
        try:
            rule, ours, segments = _muon_chunk(PIPELINE_SHAPES, seed=seed)
            theirs = _clone(ours)

            def check(step, segs):
                theirs.grad.copy_(ours.grad)
                rule._step(theirs, segs, torch.device("cuda", 0))

            _run_pipeline(rule, ours, segments, 3, seed=seed + 1, check=check)
            results[seed] = torch.equal(ours.param, theirs.param) and torch.equal(ours.lowp, theirs.lowp)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (10, 20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {10: True, 20: True}


def test_offload_muon_on_a_cuda_model_equals_torch():
    """The torch.optim front end (state in host memory: the pipelined job) on a CUDA model."""
    from _offload_optim_util import batches, make_model, max_rel_diff, train
    from zero_offload.offload_optim import OffloadMuon

    def matrices(model):
        mats = []
        for n, p in model.named_parameters():
            if n.startswith("blocks.") and p.dim() == 2:
                mats.append(p)
            else:
                p.requires_grad_(False)
        return mats

    model, reference = make_model("cuda"), make_model("cuda")
    opt = OffloadMuon(matrices(model), lr=0.01, momentum=0.9, chunk_mb=0.02, threads=2)
    ref = torch.optim.Muon(matrices(reference), lr=0.01, momentum=0.9)
    try:
        data = batches(3, device="cuda")
        train(model, opt, data)
        train(reference, ref, data)
        assert max_rel_diff(model, reference) < 1e-5
    finally:
        opt.close()
