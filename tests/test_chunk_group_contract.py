"""The chunk group's contract, driven by a fake front end (a few plain tensors, the TENSORS sink:
updated params land in them), on one rank and on two gloo ranks, with both ways grads are staged
(DEVICE: each rank's own grads, reduced across the ranks by the group; DIRECT: grads the ranks
share already): grads in -> params out equal to ``torch.optim.AdamW`` given the ranks' mean
grads, over several windows, with accumulation (host "accum" payload, and the device window),
clipping by the global norm, an fp16 overflow that skips a window, a chunk of the GPU share, and
the optimizer state by name (compared with torch's, and loaded into a fresh group that then goes
on exactly as the first one)."""
import pytest
import torch

from _dist_util import run_ranks, values
from zero_offload.runtime.chunk_group import ChunkGroup, GroupSlot, ParamSink, Staging
from zero_offload.runtime.pipeline import PipelinePayloads
from zero_offload.runtime.shards import Shards
from zero_offload.runtime.store import ChunkStore, PayloadSpec, StoreConfig, Tier
from zero_offload.runtime.update_rule import AdamRule

SHAPES = [(5, 3), (7,), (4, 4), (3,), (6, 2)]
CHUNKS = [(0, 1), (2, 3), (4,)]
"""Params per chunk (chunk 0 is the GPU share when asked: its state homed on the "GPU" tier,
which is plain memory on a CPU-only store)."""
GROUPS = [dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
          dict(lr=3e-2, betas=(0.8, 0.999), eps=1e-6, weight_decay=0.0)]
"""Param i is in group i % 2 (hyperparameters read when each update is queued)."""

SCENARIOS = {
    # name: (windows, micro-batches per window, options)
    "plain": (3, 1, dict(share=True)),
    "accum": (2, 3, dict(host_accum=True)),
    "accum-device-window": (2, 3, dict(host_accum=False)),
    "clip": (3, 1, dict(clip=0.05, share=True)),
    "overflow": (3, 2, dict(scale=8.0, inf_at=(1, 1), host_accum=True)),
}


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _rank_grads(w: int, m: int, r: int) -> list:
    """Rank r's grads of micro-batch m of window w."""
    g = torch.Generator().manual_seed(1000 * w + 10 * m + r + 1)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _mean_grads(w: int, m: int, world: int) -> list:
    per = [_rank_grads(w, m, r) for r in range(world)]
    return [sum(gs) / world for gs in zip(*per)]


class _Scaler:
    """A loss scaler as the group sees one: the grads are ``scale`` times the true ones."""

    def __init__(self, scale: float):
        self.scale = scale
        self.found: list = []

    def update(self, found_inf: bool) -> None:
        self.found.append(found_inf)


class Front:
    """The least a front end does: pack params into chunks, hand their grads to the group
    (DEVICE: after ``expect``ing them, as module hooks do), end passes and windows, read the
    params back."""

    def __init__(self, params, *, staging, shards, window=1, host_accum=True, clip=None, scale=None,
                 share=False):
        self.param_groups = [dict(g) for g in GROUPS]  # the hyperparameter owner (torch style)
        self.staging, self.params = staging, params
        self.scaler = _Scaler(scale) if scale is not None else None
        accum = "accum" if window > 1 and host_accum else None
        payloads = PipelinePayloads(grads="grads", master="master", lowp=None, accum=accum)
        self.store = ChunkStore(StoreConfig(device="cpu", budgets={Tier.GPU: 1 << 22, Tier.CPU: 1 << 22}))
        self.group = ChunkGroup(self.store, hyper=self, rule=AdamRule(adamw=True), payloads=payloads, shards=shards,
                                staging=staging, sink=ParamSink.TENSORS, window=window,
                                overlap=clip is None and scale is None, clip=clip, scaler=self.scaler,
                                owner="front", threads=1)
        self.slots = []
        for ci, run in enumerate(CHUNKS):
            slots, lo = [], 0
            for i in run:
                n = params[i].numel()
                pad = 1 if staging is Staging.DEVICE else 0  # padded spans, as the engine's
                slots.append(GroupSlot(lo=lo, numel=n, end=lo + n + pad, group=i % 2, name=f"p{i}",
                                       index=i, param=params[i]))
                lo += n + pad
            k = shards.span(lo)[2]
            home = Tier.GPU if share and ci == 0 else Tier.CPU
            specs = {n: PayloadSpec(k, torch.float32, home)
                     for n in ("grads", "master", "exp_avg", "exp_avg_sq") + ((accum,) if accum else ())}
            chunk = self.group.add_chunk(specs, slots, whole=lo)

            def fill(key, buf, spans, chunk=chunk):  # master = the params, moments = 0
                if key == "master":
                    for s in chunk.slots:
                        buf[s.lo:s.lo + s.numel].copy_(s.param.reshape(-1))
            self.group.load_state(chunk, fill)
            self.slots.extend(chunk.slots)

    def micro_batch(self, grads) -> object:
        """One micro-batch: its grads (DEVICE: last param first, as backward runs; DIRECT: in
        param order, as OffloadAdam's step() stages them), then step()."""
        if self.staging is Staging.DEVICE:
            for s in self.slots:
                self.group.expect(s)
        for s in reversed(self.slots) if self.staging is Staging.DEVICE else self.slots:
            self.group.grad(s, grads[s.index])
        self.group.end_backward()
        return self.group.end_window() if self.group.end_micro_batch() else None

    def finish(self) -> list:
        self.group.gather_updates()
        self.group.drain()
        return [p.clone() for p in self.params]

    def state(self) -> dict:
        """name -> {"step", "exp_avg", "exp_avg_sq", "master"} (collective)."""
        out = {}
        for chunk in self.group.chunks:
            whole = self.group.state(chunk)
            for s, step in zip(chunk.slots, whole["steps"]):
                sl = slice(s.lo, s.lo + s.numel)
                out[s.name] = {"step": step, **{k: whole[k][sl].view(s.param.shape).clone()
                                                for k in ("master", "exp_avg", "exp_avg_sq")}}
        return out

    def load(self, state: dict) -> None:
        for chunk in self.group.chunks:
            def fill(key, buf, spans, chunk=chunk):
                for s in chunk.slots:
                    buf[s.lo:s.lo + s.numel].copy_(state[s.name][key].reshape(-1))
            self.group.load_state(chunk, fill, [state[s.name]["step"] for s in chunk.slots])

    def close(self) -> None:
        self.group.close()
        self.store.close()


def _train(staging, shards, name: str) -> dict:
    """One scenario on this rank: the params after each window, the decisions, the state."""
    windows, window, opts = SCENARIOS[name]
    opts = dict(opts)
    inf_at = opts.pop("inf_at", None)
    world, rank = shards.world, shards.rank
    front = Front(_params(), staging=staging, shards=shards, window=window, **opts)
    try:
        out = {"params": [], "decisions": []}
        for w in range(windows):
            for m in range(window):
                if staging is Staging.DEVICE:  # each rank's own grads: the group takes the mean
                    grads = _rank_grads(w, m, rank)
                else:  # the ranks' mean already (DDP's)
                    grads = _mean_grads(w, m, world)
                if (w, m) == inf_at and rank == 0:
                    grads[2] = grads[2].clone()
                    grads[2][1, 1] = float("inf")
                if front.scaler is not None:
                    grads = [g * front.scaler.scale for g in grads]
                decision = front.micro_batch(grads)
                assert (decision is None) == (m < window - 1)
            out["decisions"].append((decision.updated, decision.skipped, decision.norm))
            out["params"].append(front.finish())
        out["state"] = front.state()
        out["found_inf"] = None if front.scaler is None else front.scaler.found
        return out
    finally:
        front.close()


def _round_trip(staging, shards) -> tuple:
    """Two windows, the state by name into a fresh group (from the params as they are), then
    both train one more window on the same grads."""
    world, rank = shards.world, shards.rank
    fronts = [Front(_params(), staging=staging, shards=shards, share=True)]
    try:
        def grads(w):
            return _rank_grads(w, 0, rank) if staging is Staging.DEVICE else _mean_grads(w, 0, world)
        for w in range(2):
            fronts[0].micro_batch(grads(w))
        fronts[0].finish()
        state = fronts[0].state()
        fronts.append(Front([p.clone() for p in fronts[0].params], staging=staging, shards=shards))
        fronts[1].load(state)
        for f in fronts:
            f.micro_batch(grads(2))
        return fronts[0].finish(), fronts[1].finish(), fronts[1].state()
    finally:
        for f in fronts:
            f.close()


def _reference(name: str, world: int) -> dict:
    """torch.optim.AdamW on the ranks' mean grads, summed over each window's micro-batches."""
    windows, window, opts = SCENARIOS[name]
    params = [p.clone().requires_grad_() for p in _params()]
    opt = torch.optim.AdamW([{"params": [p for i, p in enumerate(params) if i % 2 == g], **GROUPS[g]}
                             for g in range(2)], foreach=False)
    out = {"params": [], "norms": [], "skipped": []}
    for w in range(windows):
        for p in params:
            p.grad = None
        for m in range(window):
            for p, g in zip(params, _mean_grads(w, m, world)):
                p.grad = g.clone() if p.grad is None else p.grad + g
        if opts.get("inf_at", (None,))[0] == w:
            out["skipped"].append(w)
        else:
            if "clip" in opts:
                out["norms"].append(torch.nn.utils.clip_grad_norm_(params, opts["clip"]).item())
            opt.step()
        out["params"].append([p.detach().clone() for p in params])
    by_param = {id(p): i for i, p in enumerate(params)}
    out["state"] = {f"p{by_param[id(p)]}": {"step": int(st["step"]), "exp_avg": st["exp_avg"],
                                            "exp_avg_sq": st["exp_avg_sq"]}
                    for p, st in opt.state.items()}
    return out


def _check(name: str, got: dict, world: int) -> None:
    ref = _reference(name, world)
    windows = SCENARIOS[name][0]
    for w in range(windows):
        for i, (a, b) in enumerate(zip(got["params"][w], ref["params"][w])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"window {w}, p{i}: {m}")
        updated, skipped, norm = got["decisions"][w]
        assert skipped == (w in ref["skipped"]) and updated == (not skipped), (w, got["decisions"][w])
    if "clip" in SCENARIOS[name][2]:
        assert [d[2] for d in got["decisions"]] == pytest.approx(ref["norms"], rel=1e-5)
    if got["found_inf"] is not None:
        assert got["found_inf"] == [w in ref["skipped"] for w in range(windows)]
    for n, st in ref["state"].items():  # state by name, as torch's (a skipped window is no step)
        mine = got["state"][n]
        assert mine["step"] == st["step"], (n, mine["step"], st["step"])
        torch.testing.assert_close(mine["exp_avg"], st["exp_avg"], rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(mine["exp_avg_sq"], st["exp_avg_sq"], rtol=1e-4, atol=1e-12)
        torch.testing.assert_close(mine["master"], got["params"][-1][int(n[1:])], rtol=0, atol=0)


def _check_round_trip(out) -> None:
    first, second, state = out
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert all(st["step"] == 3 for st in state.values())


def _scenarios(staging) -> list:
    """DIRECT staging has no device window (a window's grads are summed on the host)."""
    return [n for n in SCENARIOS if staging is Staging.DEVICE or n != "accum-device-window"]


@pytest.mark.parametrize("staging,name", [(s, n) for s in Staging for n in _scenarios(s)],
                         ids=lambda v: getattr(v, "name", v))
def test_one_rank_trains_like_torch_adamw(staging, name):
    _check(name, _train(staging, Shards(), name), world=1)


def test_direct_staging_refuses_a_window_without_an_accumulation_payload():
    with pytest.raises(ValueError, match=r"front: DIRECT staging sums a window's grads in the accumulation payload"):
        Front(_params(), staging=Staging.DIRECT, shards=Shards(), window=2, host_accum=False)


@pytest.mark.parametrize("staging", list(Staging), ids=lambda s: s.name)
def test_one_rank_state_by_name_round_trip(staging):
    _check_round_trip(_round_trip(staging, Shards()))


def _ranks(rank, world, staging_name):
    import torch.distributed as dist
    staging = Staging[staging_name]
    shards = Shards(dist.group.WORLD, owner="front", device=torch.device("cpu"))
    return {name: _train(staging, shards, name) for name in _scenarios(staging)}, _round_trip(staging, shards)


@pytest.mark.parametrize("staging", list(Staging), ids=lambda s: s.name)
def test_two_gloo_ranks_train_like_torch_adamw_on_the_mean_grads(staging, tmp_path):
    """DEVICE: each rank gives its own grads (the group reduce-scatters their mean); DIRECT: both
    give the mean. Either way every rank ends with the same params, torch's."""
    for scenarios, round_trip in values(run_ranks(_ranks, 2, tmp_path, staging.name, timeout_s=240)):
        for name, got in scenarios.items():
            _check(name, got, world=2)
        _check_round_trip(round_trip)
