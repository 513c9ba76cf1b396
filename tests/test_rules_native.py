"""The host jobs of Adafactor and Muon (runtime/rules.py ``cpu_job``) on the native passes
(ops/cpu_rules.py) equal the torch op chains they replaced (the rules' ``device_step``, which stays
the GPU share's step and the host's fallback): Muon bit for bit, Adafactor within its fp64 sums
(test_cpu_rules_whole.py); through the engine they train like torch.optim.Adafactor /
torch.optim.Muon on a model whose params are read outside their modules (a tied head in the
parent's forward, a weight through an autograd.Function, one weight shared by two modules), with
accumulation and clipping; a failing kernel names its rule's update. One and two ranks, the
checkpoint resume, NVMe and the GPU share: test_rules.py and test_rules_offload_optim.py, which
run the same native jobs; the GPU pipeline: test_rules_cuda.py."""
from __future__ import annotations

import math

import pytest
import torch

import zero_offload as zo
import _external_util as ext
from _engine_util import Reference, assert_losses_close, assert_params_close, config, rel_err, train_engine
from zero_offload.ops import cpu_rules as native_ops
from zero_offload.ops.cpu_adam import KernelTicket
from zero_offload.runtime import rules
from zero_offload.runtime.rules import AdafactorRule, MuonRule
from zero_offload.runtime.update_rule import Done, Segment, StepBuffers


def _chunk(rule, shapes, *, seed=0, lowp=torch.bfloat16):
    """Flat buffers of one chunk holding params of ``shapes`` (as the pipeline hands them to a
    rule) and their segments' spans."""
    gen = torch.Generator().manual_seed(seed)
    numel = sum(math.prod(s) for s in shapes)
    specs = rule.payloads(numel, shapes)
    state = {k: torch.zeros(spec.numel) for k, spec in specs.items()}
    if isinstance(rule, MuonRule):
        state["momentum_buffer"].normal_(generator=gen)
    bufs = StepBuffers(cid=0, param=torch.randn(numel, generator=gen), grad=torch.empty(numel, dtype=torch.bfloat16),
                       state=state, lowp=None if lowp is None else torch.empty(numel, dtype=lowp))
    bounds, start = [], 0
    for i, s in enumerate(shapes):
        spans = {k: spec.spans[i] for k, spec in specs.items() if spec.spans is not None} or None
        bounds.append((start, start + math.prod(s), s, spans))
        start += math.prod(s)
    return bufs, bounds


def _clone(bufs: StepBuffers) -> StepBuffers:
    return StepBuffers(cid=bufs.cid, param=bufs.param.clone(), grad=bufs.grad, lowp=None if bufs.lowp is None
                       else bufs.lowp.clone(), state={k: v.clone() for k, v in bufs.state.items()})


def _segments(bounds, step, args):
    return [Segment(lo, hi, step, args, shape=shape, spans=spans) for lo, hi, shape, spans in bounds]


def _wait(tickets) -> None:
    for t in tickets:
        t.wait()


ADAFACTOR_SHAPES = [(33, 70), (70,), (3, 5, 17), (1,), (64, 48), (1, 9)]
MUON_SHAPES = [(33, 70), (70, 33), (64, 48), (1, 9), (9, 1), (48, 64)]


def test_adafactor_cpu_job_equals_the_torch_ops():
    rule = AdafactorRule()
    ours, bounds = _chunk(rule, ADAFACTOR_SHAPES)
    theirs = _clone(ours)
    start = ours.param.clone()
    args = rule.args({"lr": 0.01, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0, "weight_decay": 0.01},
                     grad_scale=4.0)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 11):
        ours.grad.copy_(torch.randn(ours.grad.numel(), generator=gen) * 4)
        tickets = rule.cpu_job(ours, _segments(bounds, step, args), threads=2)
        assert len(tickets) == len(bounds) and all(isinstance(t, KernelTicket) for t in tickets)  # native
        _wait(tickets)
        rule.device_step(theirs, _segments(bounds, step, args))
    for lo, hi, shape, spans in bounds:
        assert rel_err(ours.param[lo:hi], theirs.param[lo:hi]) <= 1e-6, shape
        for k, (a, b) in spans.items():
            assert rel_err(ours.state[k][a:b], theirs.state[k][a:b]) <= 1e-6, (shape, k)
    assert torch.equal(ours.lowp, ours.param.bfloat16())
    assert rel_err(ours.param, start) > 1e-3


@pytest.mark.parametrize("nesterov,ns_steps", [(True, 5), (False, 5), (True, 0)])
def test_muon_host_job_equals_the_torch_ops_bit_for_bit(nesterov, ns_steps):
    """No GPU: the native passes around torch's Newton-Schulz on the host, against MuonRule's
    torch op chain ([Note: Muon is chaotic in its last bits] in test_rules.py: bit for bit)."""
    rule = MuonRule()
    ours, bounds = _chunk(rule, MUON_SHAPES, seed=2)
    theirs = _clone(ours)
    start = ours.param.clone()
    args = rule.args({"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": nesterov,
                      "ns_coefficients": rules.MUON_NS, "eps": 1e-7, "ns_steps": ns_steps,
                      "adjust_lr_fn": "match_rms_adamw"}, grad_scale=2.0)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 6):
        ours.grad.copy_(torch.randn(ours.grad.numel(), generator=gen) * 2)
        tickets = rule.cpu_job(ours, _segments(bounds, step, args), threads=2)
        assert tickets and all(isinstance(t, KernelTicket) for t in tickets)  # native
        _wait(tickets)
        rule.device_step(theirs, _segments(bounds, step, args))
        for name, a, b in (("param", ours.param, theirs.param), ("lowp", ours.lowp, theirs.lowp),
                           ("momentum_buffer", ours.state["momentum_buffer"], theirs.state["momentum_buffer"])):
            assert torch.equal(a, b), f"step {step}: {name}"
    assert rel_err(ours.param, start) > 1e-3


@pytest.mark.parametrize("rule", [AdafactorRule(), MuonRule()], ids=lambda r: r.name)
def test_without_the_native_module_the_host_job_runs_the_torch_ops(rule, monkeypatch):
    shapes = ADAFACTOR_SHAPES if isinstance(rule, AdafactorRule) else MUON_SHAPES
    ours, bounds = _chunk(rule, shapes, seed=4)
    theirs = _clone(ours)
    group = ({"lr": 0.01, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0, "weight_decay": 0.0}
             if isinstance(rule, AdafactorRule) else
             {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_coefficients": rules.MUON_NS,
              "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None})
    args = rule.args(group)
    ours.grad.normal_(generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(rules, "_native", lambda: None)
    tickets = rule.cpu_job(ours, _segments(bounds, 1, args))
    assert len(tickets) == 1 and isinstance(tickets[0], Done)
    rule.device_step(theirs, _segments(bounds, 1, args))
    assert torch.equal(ours.param, theirs.param) and torch.equal(ours.lowp, theirs.lowp)


def test_muon_job_refuses_a_param_that_is_not_a_matrix_before_it_queues_anything():
    rule = MuonRule()
    bufs, bounds = _chunk(rule, [(4, 5), (20,)])
    before = bufs.param.clone()
    args = rule.args({"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                      "ns_coefficients": rules.MUON_NS, "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None})
    with pytest.raises(ValueError, match=r"Muon updates 2-D params only, got one of shape \(20,\)"):
        rule.cpu_job(bufs, _segments(bounds, 1, args))
    assert torch.equal(bufs.param, before)


# ---- through the engine ---------------------------------------------------------------------------


def _muon_groups(model):
    """torch's recipe: Muon on the hidden matrices, AdamW on the rest."""
    hidden = [n for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    rest = [n for n, _ in model.named_parameters() if n not in hidden]
    return hidden, rest


def _torch_opt(name, names, masters):
    trainable = [(n, m) for n, m in zip(names, masters) if m.requires_grad]
    if name == "adafactor":
        return torch.optim.Adafactor([m for _, m in trainable], lr=0.01, weight_decay=0.01, foreach=False)
    hidden = {n for n, m in trainable if n.startswith("blocks.") and m.dim() == 2}
    from test_rules import Both
    # fused AdamW: CPU-Adam's order, bit for bit ([Note: Muon is chaotic in its last bits], test_rules.py)
    return Both(torch.optim.Muon([m for n, m in trainable if n in hidden], lr=0.01, momentum=0.9),
                torch.optim.AdamW([m for n, m in trainable if n not in hidden], lr=3e-3, fused=True))


@pytest.mark.parametrize("case", ["plain", "accum-clip"])
@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_params_read_outside_their_modules_train_like_torch(name, case):
    """A tied head in the parent's forward, a weight through an autograd.Function, a weight two
    modules share, a parent reading a child's bias (tests/_external_util.py)."""
    accum, clip, steps = (1, None, 6) if case == "plain" else (2, 0.05, 3)
    reads = ("tied", "function", "shared", "bias")
    model = ext.model(reads)
    spec = zo.Adafactor(lr=0.01, weight_decay=0.01) if name == "adafactor" else zo.Muon(lr=0.01, momentum=0.9)
    groups = None
    if name == "muon":
        groups = [{"params": _muon_groups(model)[1], "optimizer": zo.AdamW(lr=3e-3)}]
    ref = Reference(ext.model(reads), zo.AdamW(), accum=accum, grad_clip=clip)
    ref.opt = _torch_opt(name, [n for n, _ in ref.work.named_parameters()], ref.masters)
    engine = zo.initialize(model, optimizer=spec, config=config(grad_accum=accum, grad_clip=clip), device="cpu",
                           param_groups=groups)
    try:
        batches = ext.batches(steps * accum)
        losses = train_engine(engine, batches, ext.loss_fn, accum=accum)
        ref_losses = [ref.step(b, ext.loss_fn) for b in batches]
        if clip is not None:
            assert max(ref.norms) > clip, "clipping never acted"
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        assert rel_err(ref.master_state()["blocks.0.weight"], ext.model(reads).blocks[0].weight.detach()) > 1e-3
    finally:
        engine.close()


@pytest.mark.parametrize("name,kernel", [("adafactor", "adafactor_step_async"), ("muon", "muon_apply_async"),
                                         ("muon", "muon_momentum_async")])
def test_a_failing_kernel_names_its_rule(name, kernel, monkeypatch):
    from test_rules import engine_for
    from _engine_util import gpt_batches, gpt_loss

    def broken(*args, **kwargs):
        raise ValueError("kernel exploded")

    monkeypatch.setattr(native_ops, kernel, broken)
    engine = engine_for(name)
    rule = "Adafactor" if name == "adafactor" else "Muon"
    try:
        with pytest.raises(RuntimeError, match=rf"the {rule} update of chunk \d+ failed \(ValueError\('kernel "
                                               rf"exploded'\)\); the optimizer state is no longer consistent") as info:
            train_engine(engine, gpt_batches(2), gpt_loss)
            engine.synchronize()
        assert "CPU-Adam" not in str(info.value)
    finally:
        engine.close(write_back=False)  # (the state is lost: nothing to write back)


class _HostEvent:
    def __init__(self, **flags):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def host_gpu(monkeypatch):
    """The host standing in for the GPU in Muon's pipelined job: copies are no-ops, events
    complete at once, staging is unpinned (no CUDA here); returns the sizes the staging grew to."""
    import contextlib
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(rules, "_side_stream", lambda device: _HostEvent())
    grown = []

    def unpinned(numel):
        grown.append(numel)
        return torch.empty(numel, dtype=torch.bfloat16)

    monkeypatch.setattr(rules, "_pinned_bf16", unpinned)
    monkeypatch.setattr(rules, "_SLOT_GRAIN", 1)
    monkeypatch.setattr(rules, "_SLOTS", rules._Slots())
    return grown


def _staged_muon(shapes, *, seed):
    """A Muon chunk of ``shapes`` whose buffers name a "device" (the pipelined job runs), its
    clone for the op-for-op path, the matrices' bounds and torch's default arguments."""
    rule = MuonRule()
    ours, bounds = _chunk(rule, shapes, seed=seed)
    ours = StepBuffers(cid=0, param=ours.param, grad=ours.grad, state=ours.state, lowp=ours.lowp,
                       device=torch.device("cpu"))
    args = rule.args({"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                      "ns_coefficients": rules.MUON_NS, "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None})
    return rule, ours, _clone(ours), bounds, args


def test_muon_pipeline_logic_with_the_host_standing_in_for_the_gpu(host_gpu):
    """[Note: Muon's pipeline]'s bookkeeping (three staging buffers taken in turn; a job's
    stages advanced by the next jobs' starts or by its own ticket; every apply pass reading its
    own matrix's result) on a machine without a GPU: the "device" is the host (copies are
    no-ops, events complete at once), so the job runs the pipelined code and must equal the
    op-for-op path bit for bit. Its GPU run: test_rules_cuda.py."""
    grown = host_gpu
    shapes = [(9, 7), (7, 9), (33, 70), (1, 9), (9, 1), (64, 48), (70, 33), (128, 96)]
    rule, ours, theirs, bounds, args = _staged_muon(shapes, seed=6)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, 4):
        ours.grad.copy_(torch.randn(ours.grad.numel(), generator=gen))
        segs = _segments(bounds, step, args)
        # three jobs, each started before the ones before it are waited for (the step pipeline
        # keeps two Muon jobs in flight): starting the third queues the first's apply passes and
        # issues the second's iterations
        jobs = [rule.cpu_job(ours, part, threads=2) for part in (segs[:3], segs[3:6], segs[6:])]
        for tickets in jobs:
            _wait(tickets)
        rule.device_step(theirs, segs)
        for name, a, b in (("param", ours.param, theirs.param), ("lowp", ours.lowp, theirs.lowp),
                           ("momentum_buffer", ours.state["momentum_buffer"], theirs.state["momentum_buffer"])):
            assert torch.equal(a, b), f"step {step}: {name}"
    sizes = [sum(math.prod(s) for s in part) for part in (shapes[:3], shapes[3:6], shapes[6:])]
    assert grown == sizes  # (the thread's three buffers, taken in turn: each job's own size fits)


def test_a_failed_apply_pass_fails_its_own_job_only(host_gpu, monkeypatch):
    """Three staged Muon jobs in flight, the second's apply pass raising: its ticket raises (the
    same error when waited for again), the first and third complete as the op-for-op path does,
    and a fourth job reuses the staging as usual."""
    shapes = [(9, 7), (33, 70), (64, 48), (7, 9), (48, 64), (70, 33)]
    rule, ours, theirs, bounds, args = _staged_muon(shapes, seed=3)
    ours.grad.copy_(torch.randn(ours.grad.numel(), generator=torch.Generator().manual_seed(4)))
    segs = _segments(bounds, 1, args)
    bad = segs[2]
    real_apply = MuonRule._apply

    def apply(native, bufs, seg, ortho, threads):
        if seg is bad:
            raise ValueError("apply exploded")
        return real_apply(native, bufs, seg, ortho, threads)

    monkeypatch.setattr(MuonRule, "_apply", staticmethod(apply))
    parts = (segs[:2], segs[2:4], segs[4:])
    jobs = [rule.cpu_job(ours, part, threads=2) for part in parts]
    _wait(jobs[0])
    for _ in range(2):
        with pytest.raises(ValueError, match="apply exploded"):
            _wait(jobs[1])
    _wait(jobs[2])
    rule.device_step(theirs, list(parts[0]) + list(parts[2]))
    for seg in list(parts[0]) + list(parts[2]):
        sl = slice(seg.start, seg.stop)
        assert torch.equal(ours.param[sl], theirs.param[sl]), seg.shape
        assert torch.equal(ours.lowp[sl], theirs.lowp[sl]), seg.shape
    _wait(rule.cpu_job(ours, segs[:2], threads=2))  # the first job's staging, taken again
