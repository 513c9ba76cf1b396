"""The update-rule interface (runtime/update_rule.py, [Note: update rules]): a rule written here, in
a few lines of torch, runs through the real engine -> ChunkGroup -> StepPipeline path (its CPU
job on the worker, its device step for the GPU share, its state payloads placed, paged to NVMe,
checkpointed) and equals torch.optim.SGD; a rule that is not elementwise sees only whole
parameters ([Note: whole parameters] in runtime/partition.py); the shard cutter the data-parallel
code calls for such rules cuts at parameter boundaries."""
import itertools
import math
import time
from dataclasses import dataclass, field

import pytest
import torch

import zero_offload as zo
from _dist_util import run_ranks, values
from _engine_util import (DEVICE, SMALL_CHUNK_MB, Reference, assert_params_close, config, gpt_batches,
                          gpt_loss, micro_gpt, mlp, mlp_batches, mlp_loss, train_engine)
from zero_offload.config import OptimizerSpec
from zero_offload.runtime.shards import Shards
from zero_offload.runtime.checkpoint import CheckpointError, chunk_state
from zero_offload.runtime.partition import partition_parameters, shard_spans, update_spans
from zero_offload.runtime.store import Tier
from zero_offload.runtime.update_rule import AdamRule, Done, StateSpec, UpdateRule


# ---- a test rule: SGD with momentum (torch.optim.SGD, dampening 0, no Nesterov) -------------------


@dataclass(frozen=True)
class SGDArgs:
    lr: float
    momentum: float
    weight_decay: float
    grad_scale: float


def _sgd_args(group, grad_scale):
    return SGDArgs(float(group["lr"]), float(group["momentum"]), float(group["weight_decay"]), grad_scale)


@dataclass(frozen=True)
class SGDRule:
    name = "SGD"
    elementwise = True
    state_keys = ("momentum_buffer",)
    hyper_keys = ("lr", "momentum", "weight_decay")

    def payloads(self, numel, shapes=()):
        return {"momentum_buffer": StateSpec(numel, torch.float32)}

    def args(self, group, *, grad_scale=1.0):
        return _sgd_args(group, grad_scale)

    def _update(self, bufs, segments):
        for seg in segments:
            a, sl = seg.args, slice(seg.start, seg.stop)
            p, buf = bufs.param[sl], bufs.state["momentum_buffer"][sl]
            d_p = bufs.grad[sl].float() / a.grad_scale
            if a.weight_decay:
                d_p = d_p.add(p, alpha=a.weight_decay)
            if seg.step == 1:
                buf.copy_(d_p)
            else:
                buf.mul_(a.momentum).add_(d_p)
            p.add_(buf, alpha=-a.lr)
            if bufs.lowp is not None:
                bufs.lowp[sl].copy_(p)

    def cpu_job(self, bufs, segments, *, threads=None):
        return [Done.timing(self._update, bufs, segments)]

    def device_step(self, bufs, segments):
        self._update(bufs, segments)


@dataclass(frozen=True, kw_only=True)
class SGD(OptimizerSpec):
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0

    def rule(self, config):
        return SGDRule()

    def hyperparameters(self):
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}

    def to_dict(self):
        return {"type": "test-sgd", **self.hyperparameters()}


SPEC = SGD(lr=0.05, momentum=0.9, weight_decay=0.01)


def _torch_sgd(params, spec=SPEC):
    return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay,
                           foreach=False)


def _reference(model, **kw) -> Reference:
    """_engine_util's Reference (the engine's recipe: clipping, accumulation, bf16 masters) with
    torch.optim.SGD in place of Adam."""
    ref = Reference(model, zo.AdamW(), **kw)
    ref.opt = _torch_sgd([m for m in ref.masters if m.requires_grad])
    return ref


def test_the_rules_satisfy_the_protocol():
    assert isinstance(SGDRule(), UpdateRule) and isinstance(AdamRule(), UpdateRule)
    assert not isinstance(object(), UpdateRule)
    with pytest.raises(TypeError, match="rule must be an UpdateRule"):
        from zero_offload.runtime.chunk_group import ChunkGroup
        ChunkGroup(None, hyper=None, rule=object(), payloads=None, owner="test")


@pytest.mark.parametrize("kw", [
    dict(),
    dict(grad_accum=2),
    dict(grad_clip=0.05),
    dict(dtype="bf16"),
    dict(params="gpu", optimizer="auto", gpu_budget=250_000),    # the GPU share: device_step
    dict(params="gpu", optimizer="auto", gpu_budget=1_000_000, grad_accum=2),
    dict(optimizer="nvme"),                                      # state paged: read ahead, written behind
], ids=["plain", "accum", "clip", "bf16", "share-partial", "share-whole-accum", "nvme"])
def test_sgd_rule_trains_like_torch_sgd(kw, tmp_path):
    accum = kw.get("grad_accum", 1)
    if kw.get("optimizer") == "nvme":
        kw = dict(kw, nvme_dir=str(tmp_path / "swap"))
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=config(**kw), device=DEVICE)
    try:
        assert engine.rule == SGDRule() and tuple(engine.group.state_names) == ("master", "momentum_buffer")
        if kw.get("params") == "gpu":
            on_gpu = engine.plan.count(optimizer=Tier.GPU)
            assert on_gpu > 0, "no chunk in the GPU share: the device step is not exercised"
        lowp = torch.bfloat16 if kw.get("dtype") == "bf16" else torch.float32
        ref = _reference(micro_gpt(), accum=accum, grad_clip=kw.get("grad_clip"), dtype=lowp)
        batches = gpt_batches(4 * accum)
        for b in batches:
            ref.step(b, gpt_loss)
        train_engine(engine, batches, gpt_loss, accum=accum)
        # bf16: the same recipe, but the bf16 rounding of forward and backward drifts apart (the
        # Adam tests allow 3e-2); what the rule writes is held exactly below
        tol = 1e-5 if lowp is torch.float32 else 1e-2
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=tol)
        if lowp is torch.bfloat16:  # the rule wrote the updated masters, rounded, into the bf16 params
            for c in engine.group.chunks:
                if c.layout.trainable:
                    work, master = (engine.group.read(c, n) for n in ("params", "master"))
                    assert torch.equal(work, master.to(torch.bfloat16))
        # the rule's state payload is torch's momentum buffer, slot by slot
        masters = dict(zip((n for n, _ in ref.work.named_parameters()), ref.masters))
        for layout in engine.partition.chunks:
            if not layout.trainable:
                continue
            state = chunk_state(engine.group, layout)
            for s in layout.slots:
                want = ref.opt.state[masters[s.name]]["momentum_buffer"].reshape(-1).cpu()
                got = state["momentum_buffer"][s.offset:s.end]
                assert (got - want).norm() <= tol * want.norm() + 1e-12, s.name
    finally:
        engine.close()


@dataclass(frozen=True)
class LaggedSGDRule(SGDRule):
    """SGDRule whose job runs only when its ticket is waited for, with ``lag`` 2: the step
    pipeline starts two more jobs before it completes one ([Note: jobs in flight] in pipeline.py;
    Muon's pipelined job is the real user)."""
    lag = 2
    log: list = field(default_factory=list, compare=False, hash=False)

    def cpu_job(self, bufs, segments, *, threads=None):
        if not self.log:  # the first job: the rest of its step's jobs are queued meanwhile
            time.sleep(0.5)
        self.log.append(("start", bufs.cid))
        return [_Later(self, bufs, segments)]


class _Later:
    def __init__(self, rule, bufs, segments):
        self.rule, self.bufs, self.segments, self.start, self.seconds = rule, bufs, segments, None, None

    def wait(self):
        if self.seconds is None:
            done = Done.timing(self.rule._update, self.bufs, self.segments)
            self.start, self.seconds = done.start, done.seconds
            self.rule.log.append(("done", self.bufs.cid))
        return self.seconds


@dataclass(frozen=True, kw_only=True)
class LaggedSGD(SGD):
    log: list = field(default_factory=list, compare=False, hash=False)

    def rule(self, config):
        return LaggedSGDRule(log=self.log)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(grad_clip=0.05),
    dict(grad_accum=2),
    dict(host_grads="window", grads_window=1),  # backward waits for the one slot a job in flight holds
    dict(optimizer="nvme"),
], ids=["plain", "clip", "accum", "window-1", "nvme"])
def test_a_rule_with_a_lag_completes_each_job_after_later_starts_and_trains_like_torch(kw, tmp_path):
    accum = kw.get("grad_accum", 1)
    if kw.get("optimizer") == "nvme":
        kw = dict(kw, nvme_dir=str(tmp_path / "swap"))
    spec = LaggedSGD(lr=SPEC.lr, momentum=SPEC.momentum, weight_decay=SPEC.weight_decay)
    engine = zo.initialize(micro_gpt(), optimizer=spec, config=config(**kw), device=DEVICE)
    try:
        assert engine.rule.lag == 2 and len(engine.group.chunks) >= 4
        ref = _reference(micro_gpt(), accum=accum, grad_clip=kw.get("grad_clip"))
        batches = gpt_batches(3 * accum)
        for b in batches:
            ref.step(b, gpt_loss)
        train_engine(engine, batches, gpt_loss, accum=accum)
        engine.synchronize()
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
        log = spec.log
        starts = [i for i, e in enumerate(log) if e[0] == "start"]
        assert len(starts) == sum(e[0] == "done" for e in log) > 0  # every job completed
        # jobs started between a job's start and its completion: at most the lag, and the lag
        # itself where jobs were queued behind a job (the first one's start waits for that);
        # with one grads-window slot none (the next grads land only once the job in flight frees
        # the slot: it completes as nothing can start)
        lags = [sum(1 for j in starts if i < j < log.index(("done", cid), i)) for i, (kind, cid) in enumerate(log)
                if kind == "start"]
        assert max(lags) == (0 if kw.get("grads_window") == 1 else 2), log
    finally:
        engine.close()


def test_sgd_rule_state_goes_through_a_checkpoint(tmp_path):
    """Saved by rule state key, loaded into a new engine: the run goes on as if uninterrupted."""
    batches = gpt_batches(5)
    whole = zo.initialize(micro_gpt(), optimizer=SPEC, config=config(), device=DEVICE)
    first = zo.initialize(micro_gpt(), optimizer=SPEC, config=config(), device=DEVICE)
    second = zo.initialize(micro_gpt(seed=3), optimizer=SPEC, config=config(chunk_mb=2 * SMALL_CHUNK_MB),
                           device=DEVICE)
    adam = zo.initialize(micro_gpt(), optimizer=zo.AdamW(), config=config(), device=DEVICE)
    try:
        train_engine(whole, batches, gpt_loss)
        train_engine(first, batches[:3], gpt_loss)
        first.save_checkpoint(tmp_path / "ckpt")
        with pytest.raises(CheckpointError, match="holds the state of optimizer 'test-sgd', this engine runs 'adamw'"):
            adam.load_checkpoint(tmp_path / "ckpt")
        second.load_checkpoint(tmp_path / "ckpt")
        train_engine(second, batches[3:], gpt_loss)
        assert_params_close(second.state_dict(), whole.state_dict(), rtol=1e-6)
    finally:
        for e in (whole, first, second, adam):
            e.close()


def test_param_groups_and_a_scheduler_reach_the_rule():
    """The rule's own hyperparameter keys (momentum) are what param groups may set; a scheduler
    drives its lr through engine.optimizer."""
    model = mlp()
    groups = [{"params": [model.fc1.weight], "momentum": 0.5, "lr": 0.2}]
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    engine = zo.initialize(model, optimizer=SPEC, config=config(), device=DEVICE, param_groups=groups,
                           lr_scheduler=sched)
    try:
        ref_model = mlp()
        others = [p for n, p in ref_model.named_parameters() if n != "fc1.weight"]
        opt = torch.optim.SGD([{"params": others}, {"params": [ref_model.fc1.weight], "momentum": 0.5, "lr": 0.2}],
                              lr=SPEC.lr, momentum=SPEC.momentum, weight_decay=SPEC.weight_decay, foreach=False)
        ref_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for b in mlp_batches(3):
            mlp_loss(ref_model, b).backward()
            opt.step()
            opt.zero_grad()
            ref_sched.step()
        train_engine(engine, mlp_batches(3), mlp_loss)
        assert_params_close(engine.state_dict(), dict(ref_model.named_parameters()), rtol=1e-5)
        with pytest.raises(ValueError, match="a group may set only lr, momentum, weight_decay"):
            zo.initialize(mlp(), optimizer=SPEC, config=config(), device=DEVICE,
                          param_groups=[{"params": [model.fc1.weight], "betas": (0.9, 0.9)}])
    finally:
        engine.close()


# ---- two ranks (gloo): the sharded engine with the test rule ------------------------------------


def _sgd_rank(rank, world):
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=config(prefetch_depth=1), device="cpu")
    assert engine.shard.world == world
    for x, y in gpt_batches(3, batch=2 * world):
        loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
    sd = engine.state_dict()
    engine.close()
    return sd


def _whole_params_rank(rank, world):
    log: list = []
    engine = zo.initialize(mlp(hidden=40), optimizer=NormSGD(lr=0.05, log=log), config=config(), device="cpu")
    for x, y in mlp_batches(3, batch=8 * world):
        loss = mlp_loss(engine, (x[8 * rank:8 * rank + 8], y[8 * rank:8 * rank + 8]))
        engine.backward(loss)
        engine.step()
    sd = engine.state_dict()  # (waits for the updates: the log is whole after it)
    slots = {s.name: (s.chunk, s.offset, tuple(s.shape)) for s in engine.partition.slots}
    chunks = [(c.numel, [(s.name, s.offset) for s in c.slots]) for c in engine.partition.chunks]
    engine.close()
    return sd, [(cid, lo, hi, tuple(shape)) for cid, lo, hi, shape in log], slots, chunks


def test_two_ranks_with_the_sgd_rule_train_like_one_torch_process(tmp_path, monkeypatch):
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")
    out = values(run_ranks(_sgd_rank, 2, tmp_path, timeout_s=120))
    ref = _reference(micro_gpt())
    for b in gpt_batches(3, batch=4):
        ref.step(b, gpt_loss)
    for sd in out:
        assert_params_close(sd, ref.master_state(), rtol=1e-5)


def test_two_ranks_with_a_rule_that_is_not_elementwise_cut_shards_at_parameter_boundaries(tmp_path, monkeypatch):
    """Each rank updates whole params only (the chunks are laid out for the ranks: [Note: whole
    parameters] in partition.py), every param exactly once a step between them, and the result
    equals one torch process on the whole batch."""
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")
    out = values(run_ranks(_whole_params_rank, 2, tmp_path, timeout_s=120))
    ref_model = mlp(hidden=40)
    for b in mlp_batches(3, batch=16):
        mlp_loss(ref_model, b).backward()
        with torch.no_grad():
            for p in ref_model.parameters():
                p.sub_(0.05 * p.grad / p.grad.norm().clamp_min(1e-12))
                p.grad = None
    want = {n: p.detach() for n, p in ref_model.named_parameters()}
    (sd0, log0, slots, chunks), (sd1, log1, _, _) = out
    for sd in (sd0, sd1):
        assert_params_close(sd, want, rtol=1e-5)
    whole = {(c, lo, lo + math.prod(shape), shape) for c, lo, shape in slots.values()}
    assert log0 and log1, "a rank updated nothing: the shards are not balanced"
    # (the ranks' logs hold offsets in their own shards; rank r's shard starts at r * k)
    ks = {cid: numel // 2 for cid, (numel, _) in enumerate(chunks)}
    seen = [(cid, lo + r * ks[cid], hi + r * ks[cid], shape) for r, log in enumerate((log0, log1))
            for cid, lo, hi, shape in log]
    assert sorted(seen) == sorted(list(whole) * 3)  # each param whole, once a step, on one rank


# ---- a rule that is not elementwise -----------------------------------------------------------------


@dataclass(frozen=True)
class NormSGDRule:
    """p -= lr * g / ||g|| per parameter: the norm of a whole parameter, so a segment that spans
    two parameters, or half of one, gives another result. Records every segment it is given."""

    log: list = field(default=None, compare=False)
    name = "NormSGD"
    elementwise = False
    state_keys = ()
    hyper_keys = ("lr",)

    def payloads(self, numel, shapes=()):
        return {}

    def args(self, group, *, grad_scale=1.0):
        return (float(group["lr"]), grad_scale)

    def _update(self, bufs, segments):
        for seg in segments:
            if self.log is not None:
                self.log.append((bufs.cid, seg.start, seg.stop, seg.shape))
            (lr, scale), sl = seg.args, slice(seg.start, seg.stop)
            g = bufs.grad[sl].float() / scale
            bufs.param[sl].sub_(lr * g / g.norm().clamp_min(1e-12))
            if bufs.lowp is not None:
                bufs.lowp[sl].copy_(bufs.param[sl])

    def cpu_job(self, bufs, segments, *, threads=None):
        return [Done.timing(self._update, bufs, segments)]

    def device_step(self, bufs, segments):
        self._update(bufs, segments)


@dataclass(frozen=True, kw_only=True)
class NormSGD(OptimizerSpec):
    lr: float = 0.05
    log: list = field(default=None, compare=False)

    def rule(self, config):
        return NormSGDRule(log=self.log)

    def hyperparameters(self):
        return {"lr": self.lr}

    def to_dict(self):
        return {"type": "test-normsgd", "lr": self.lr}


# share-partial: this rule keeps no state, so only grads held for the window's decision (a clip that
# never acts) give its GPU share bytes to run out of ([Note: share grads] in runtime/placement.py)
@pytest.mark.parametrize("kw", [dict(), dict(params="gpu", optimizer="auto", gpu_budget=220_000, grad_clip=1e6),
                                dict(grad_accum=2, grad_clip=0.5)],
                         ids=["host", "share-partial", "accum-clip"])
def test_a_rule_that_is_not_elementwise_sees_whole_parameters_only(kw):
    log: list = []
    accum = kw.get("grad_accum", 1)
    model = mlp(hidden=40)  # fc2.weight (1600) is larger than a chunk (1024): a chunk of its own
    engine = zo.initialize(model, optimizer=NormSGD(lr=0.05, log=log), config=config(**kw), device=DEVICE)
    try:
        part = engine.partition
        whole = {(s.chunk, s.offset, s.end, tuple(s.shape)) for s in part.slots if s.trainable}
        assert any(len(c.slots) > 1 for c in part.chunks), "no chunk holds two params: nothing to merge"
        assert any(s.numel > 1024 for s in part.slots)
        for c in part.chunks:  # chunks never split a parameter
            assert all(s.end <= c.numel for s in c.slots)
        assert sorted(s.index for s in part.slots) == list(range(len(list(model.parameters()))))
        if "gpu_budget" in kw:
            assert 0 < engine.plan.count(optimizer=Tier.GPU) < len(part.chunks)
        ref_model = mlp(hidden=40).to(DEVICE)
        batches = mlp_batches(3 * accum)
        train_engine(engine, batches, mlp_loss, accum=accum)
        for i in range(3):
            for b in batches[i * accum:(i + 1) * accum]:
                (mlp_loss(ref_model, b) / accum).backward()
            params = list(ref_model.parameters())
            if "grad_clip" in kw:
                torch.nn.utils.clip_grad_norm_(params, kw["grad_clip"])
            with torch.no_grad():
                for p in params:
                    p.sub_(0.05 * p.grad / p.grad.norm().clamp_min(1e-12))
                    p.grad = None
        # the last step's updates may still run on the worker when step() returns: the state
        # dict waits for them, before the log is read
        got = engine.state_dict()
        # every segment the rule got is one whole parameter, with its shape; each param once a step
        seen = [(cid, lo, hi, tuple(shape) if shape is not None else None) for cid, lo, hi, shape in log]
        assert set(seen) == whole and len(seen) == 3 * len(whole), (sorted(set(seen) - whole), len(seen))
        assert all(math.prod(shape) == hi - lo for _, lo, hi, shape in seen)
        assert_params_close(got, {n: p.detach().cpu() for n, p in ref_model.named_parameters()}, rtol=1e-5)
    finally:
        engine.close()


@dataclass(frozen=True)
class _NormSGDWithNorms(NormSGDRule):
    """NormSGD with a state sized by the params' shapes, not by the chunk's elements (one fp32
    per parameter, as Adafactor's factors are sized by rows and columns): placement must ask
    the rule with the chunk's shapes, and the store must hold what it answered."""

    state_keys = ("norms",)

    def payloads(self, numel, shapes=()):
        assert shapes, "a rule that is not elementwise was not given the params' shapes"
        return {"norms": StateSpec(len(shapes), torch.float32, tuple((i, i + 1) for i in range(len(shapes))))}


@dataclass(frozen=True, kw_only=True)
class _NormsSpec(NormSGD):
    def rule(self, config):
        return _NormSGDWithNorms()


@pytest.mark.parametrize("kw", [dict(), dict(params="gpu", optimizer="auto", gpu_budget=220_000)],
                         ids=["host", "share-partial"])
def test_a_rule_sizes_its_state_by_the_params_shapes(kw):
    model = mlp(hidden=40)
    engine = zo.initialize(model, optimizer=_NormsSpec(lr=0.05), config=config(**kw), device=DEVICE)
    try:
        part, request = engine.partition, engine.plan.request
        for c in part.chunks:
            if not c.trainable:
                continue
            assert request.chunks[c.index].shapes == tuple(tuple(s.shape) for s in c.slots)
            spec = engine.store.payload_spec(c.index, "norms")
            assert (spec.numel, spec.dtype) == (len(c.slots), torch.float32)
            assert engine.plan.payloads(c.index)["norms"].home is engine.plan.homes[c.index].optimizer
        if "gpu_budget" in kw:
            assert 0 < engine.plan.count(optimizer=Tier.GPU) < len(part.chunks)
        ref_model = mlp(hidden=40).to(DEVICE)
        batches = mlp_batches(2)
        train_engine(engine, batches, mlp_loss)
        for b in batches:
            mlp_loss(ref_model, b).backward()
            with torch.no_grad():
                for p in ref_model.parameters():
                    p.sub_(0.05 * p.grad / p.grad.norm().clamp_min(1e-12))
                    p.grad = None
        assert_params_close(engine.state_dict(), {n: p.detach().cpu() for n, p in ref_model.named_parameters()},
                            rtol=1e-5)
    finally:
        engine.close()


# ---- the partition's part: update spans and shard spans -----------------------------------------------


def test_update_spans_cover_padding_only_for_elementwise_rules():
    part = partition_parameters(mlp(), chunk_numel=1024)
    for c in part.chunks:
        exact = update_spans(c, align_to_params=True)
        padded = update_spans(c, align_to_params=False)
        assert exact == tuple((s.offset, s.end) for s in c.slots)
        assert [lo for lo, _ in padded] == [s.offset for s in c.slots]
        assert [hi for _, hi in padded] == [s.offset for s in c.slots[1:]] + [c.numel]  # touching
    assert any(hi != c.numel for c in part.chunks for _, hi in update_spans(c, align_to_params=True))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_equal_shard_spans_are_the_chunk_shards_of_shards_py(world):
    def rank(r):
        sh = Shards()  # one rank, placed as rank r of ``world`` (Shards.span reads only these)
        sh.rank, sh.world = r, world
        return sh
    for n in (1, 5, 64, 1000, 1025):
        spans, k = shard_spans([0, n], world, align_to_params=False)
        assert k == rank(0).span(n)[2]
        assert spans == tuple(rank(r).span(n)[:2] for r in range(world))


def _best_max(pieces, world):
    """The smallest largest shard of any cut at piece boundaries (brute force)."""
    n, best = len(pieces), sum(pieces)
    for cuts in itertools.combinations_with_replacement(range(n + 1), world - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(pieces[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_aligned_shard_spans_cut_only_at_parameter_boundaries_and_balance(world):
    g = torch.Generator().manual_seed(0)
    cases = [[640], [64, 64], [1024, 64, 64, 64], [64, 64, 64, 1024], [128, 4096, 192, 64, 64]]
    cases += [[64 * int(x) for x in torch.randint(1, 12, (int(m),), generator=g)]
              for m in torch.randint(1, 7, (12,), generator=g)]
    for pieces in cases:
        bounds = [0, *itertools.accumulate(pieces)]
        spans, k = shard_spans(bounds, world, align_to_params=True)
        assert len(spans) == world
        assert spans[0][0] == 0 and spans[-1][1] == bounds[-1]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, in rank order
        assert all(lo in bounds and hi in bounds and lo <= hi for lo, hi in spans)  # never inside a param
        assert k == max(hi - lo for lo, hi in spans) == _best_max(pieces, world), (pieces, spans)


def test_shard_spans_refuse_bad_bounds():
    with pytest.raises(ValueError, match="bounds must rise strictly from 0"):
        shard_spans([0, 64, 64, 128], 2, align_to_params=True)
    with pytest.raises(ValueError, match="bounds must rise strictly from 0"):
        shard_spans([64, 128], 2, align_to_params=True)
    with pytest.raises(ValueError, match="world must be a positive int"):
        shard_spans([0, 64], 0, align_to_params=False)
