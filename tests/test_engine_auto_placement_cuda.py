"""optimizer="auto" on real GPUs ([Note: measured share] in runtime/placement.py): the first step
measures the CUDA allocator and grows the GPU share by what it leaves free, within gpu_budget;
with 2 GPUs (NCCL) each rank's shard of the state is on its GPU; a nearly full device trains
without running out of memory; parity with torch AdamW."""
import warnings

import pytest
import torch

import zero_offload as zo
from zero_offload.models import GPT, GPTConfig
from zero_offload.runtime.store import Tier
from _dist_util import run_ranks, values
from _engine_util import Reference, assert_params_close, gpt_batches, gpt_loss, micro_gpt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)
CHUNK_MB = 2 * 4096 / 2**20
"""8 KiB chunks (2048 fp32 elements): the micro GPT (about 7k params) spans several."""


def _config(**kw):
    return zo.OffloadConfig(**{**dict(params="auto", optimizer="auto", dtype="fp32", chunk_mb=CHUNK_MB,
                                      threads=2, prefetch_depth=2), **kw})


def _on_gpu(engine):
    return [engine.store.payload_spec(c.cid, "grads").home is Tier.GPU
            for c in engine.group.chunks if c.layout.trainable]


def _train(engine, batches, device, *, rank=0):
    for x, y in batches:
        sl = slice(2 * rank, 2 * rank + 2)
        engine.backward(engine(x[sl].to(device), y[sl].to(device)))
        engine.step()


def test_the_first_step_grows_the_share_on_one_gpu():
    """A first plan that leaves almost the whole budget to activations holds no state on the
    device; the first step measures the allocator and the share grows to every chunk."""
    device = torch.device("cuda", 0)
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, device=device,
                           config=_config(gpu_budget=1 << 26, activation_reserve=(1 << 26) - (1 << 17)))
    try:  # 128 KiB for the params (40 KiB) and the window (80 KiB) and no chunk's state (24 KiB)
        assert all(h.params is Tier.GPU for h in engine.plan.homes) and not any(_on_gpu(engine))
        batches = gpt_batches(3, batch=2)
        _train(engine, batches[:1], device)
        assert all(_on_gpu(engine)) and engine.plan.measured is not None
        report = engine.stats().placement
        assert report["grown"] == len(_on_gpu(engine)) and report["measured"]["device_peak"] > 0
        assert report["tiers"]["cpu"]["optimizer"] == 0
        _train(engine, batches[1:], device)
        ref = Reference(micro_gpt(), SPEC)
        for b in batches:
            ref.step(b, gpt_loss)
        assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-4)
    finally:
        engine.close()


@pytest.mark.parametrize("dtype,spec", [("fp32", SPEC), ("bf16", SPEC), ("fp32", zo.Adafactor(lr=0.01))],
                         ids=["fp32", "bf16", "adafactor"])
def test_the_share_never_makes_the_host_wait_for_the_device(dtype, spec):
    """The GPU share's updates (torch's fused Adam per chunk, in backward) queue work without a
    host sync (a step count made with torch.tensor(x, device=) waited for the stream once per
    chunk: the host then fell behind the device, measured on 4 H100s in session 17), so forward
    and backward after the first step run under ``set_sync_debug_mode("error")``. Adafactor's
    too (its norms were read with ``.item()``, twice per param)."""
    device = torch.device("cuda", 0)
    engine = zo.initialize(micro_gpt(), optimizer=spec, device=device, config=_config(dtype=dtype))
    try:
        batches = [(x.to(device), y.to(device)) for x, y in gpt_batches(3, batch=2)]
        _train(engine, batches[:1], device)
        assert all(_on_gpu(engine))
        for x, y in batches[1:]:
            torch.cuda.set_sync_debug_mode("error")
            try:
                engine.backward(engine(x, y))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            engine.step()
        if dtype == "fp32" and spec is SPEC:  # (Adafactor's parity: tests/test_rules.py)
            ref = Reference(micro_gpt(), SPEC)
            for b in gpt_batches(3, batch=2):
                ref.step(b, gpt_loss)
            assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-4)
    finally:
        engine.close()


def test_a_nearly_full_gpu_trains_without_running_out_of_memory():
    """Another tenant holds all but 12 GiB of the card: "auto" budgets what is free, the first
    step measures, the share grows only by what the step leaves, and the steps after it run."""
    device = torch.device("cuda", 0)
    free, total = torch.cuda.mem_get_info(device)
    blocker = torch.empty(max(0, free - (12 << 30)), dtype=torch.uint8, device=device)
    try:
        cfg = GPTConfig(vocab_size=32000, n_layer=8, n_head=16, d_model=1024, seq_len=512)
        torch.manual_seed(0)
        model = GPT(cfg)  # about 0.17B params: 2 GB of fp32 state, more than fits at first
        engine = zo.initialize(model, optimizer=SPEC, device=device,
                               config=zo.OffloadConfig(params="auto", optimizer="auto", dtype="bf16"))
        try:
            g = torch.Generator().manual_seed(0)
            for _ in range(4):
                ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=g).to(device)
                engine.backward(engine(ids[:, :-1], ids[:, 1:]))
                engine.step()
            engine.synchronize()
            report = engine.stats().placement
            assert engine.plan.measured is not None and report["share"]["chunks"] > 0, report
            assert torch.cuda.max_memory_reserved(device) <= report["measured"]["device_limit"]
        finally:
            engine.close()
    finally:
        del blocker
        torch.cuda.empty_cache()  # (the allocator would keep the card's memory from the tests after)


def _rank(rank, world):
    device = torch.device("cuda", rank)
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(), device=device)
    first = _on_gpu(engine)
    _train(engine, gpt_batches(3, batch=2 * world), device, rank=rank)
    report = engine.stats().placement
    sd = engine.state_dict()
    engine.close()
    return first, report, sd


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_two_gpus_hold_their_shards_of_the_state(tmp_path):
    """Before: with ranks "auto" kept the whole optimizer on the host."""
    out = values(run_ranks(_rank, 2, tmp_path, backend="nccl", timeout_s=300))
    ref = Reference(micro_gpt(), SPEC)
    for b in gpt_batches(3, batch=4):
        ref.step(b, gpt_loss)
    for rank, (first, report, sd) in enumerate(out):
        assert first and all(first), (rank, report["why"])
        assert report["rank"] == rank and report["tiers"]["cpu"]["optimizer"] == 0
        assert_params_close(sd, ref.master_state(), rtol=1e-4)


def _plan(engine):
    return [(h.params.value, None if h.optimizer is None else h.optimizer.value) for h in engine.plan.homes]


def _unequal_rank(rank, world):
    """Rank 0 takes its whole GPU ("auto"), rank 1 gives 64 MiB and leaves all but 120 KiB of it
    to activations: every rank plans with rank 1's budget and reserve (the params shards, the
    window of whole chunks and 2 of the 6 chunks' state: a partial share)."""
    device = torch.device("cuda", rank)
    kw = dict(gpu_budget="auto") if rank == 0 else dict(gpu_budget=1 << 26,
                                                         activation_reserve=(1 << 26) - (120 << 10))
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(**kw), device=device)
    first, budget = _plan(engine), engine.plan.budgets.gpu
    _train(engine, gpt_batches(3, batch=2 * world), device, rank=rank)
    grown, report = _plan(engine), engine.stats().placement
    sd = engine.state_dict()
    engine.close()
    return first, grown, budget, report, sd


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
def test_two_gpus_with_different_budgets_plan_alike(tmp_path):
    """[Note: ranks agree on placement]: the ranks' first plans, budgets and grown shares are
    the same (before: rank 0 planned every chunk's state on its GPU, rank 1 two of them), and
    training equals torch."""
    out = values(run_ranks(_unequal_rank, 2, tmp_path, backend="nccl", timeout_s=300))
    (first0, grown0, budget0, report0, _), (first1, grown1, budget1, report1, _) = out
    assert budget0 == budget1 == 1 << 26, (budget0, budget1)
    assert first0 == first1 and 0 < sum(o == "gpu" for _, o in first0) < len(first0), (first0, first1)
    assert grown0 == grown1 and report0["grown"] == report1["grown"] > 0, (report0["why"], report1["why"])
    ref = Reference(micro_gpt(), SPEC)
    for b in gpt_batches(3, batch=4):
        ref.step(b, gpt_loss)
    for *_, sd in out:
        assert_params_close(sd, ref.master_state(), rtol=1e-4)


def test_a_memory_fraction_bounds_the_auto_budget_and_the_measured_limit():
    """set_per_process_memory_fraction holds "auto" to the script's share of the card."""
    from zero_offload.runtime.placement import measure_device
    from zero_offload.runtime.store import StoreConfig, resolve_budgets
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    try:
        assert measure_device("cuda:0").device_limit <= int(0.25 * total)
        assert 0 < resolve_budgets(StoreConfig(device="cuda:0"))[Tier.GPU] <= int(0.25 * total)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def test_a_first_step_that_would_run_out_of_memory_beside_the_share_trains():
    """[Note: unmeasured share] in runtime/placement.py. A first plan that puts the whole state on
    the card beside a small activation_reserve, on a card with room for the step's activations
    but not for both: the share gives its room back (the forward run again, or moved before
    backward) and the steps train as the host-only engine does. The card is sized from that
    engine's measured step. Before: a CUDA out-of-memory error in the first step."""
    device = torch.device("cuda", 0)
    cfg = GPTConfig(vocab_size=32000, n_layer=4, n_head=16, d_model=1024, seq_len=1024)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=g) for _ in range(3)]

    def run(config):
        torch.manual_seed(0)
        engine = zo.initialize(GPT(cfg), optimizer=SPEC, device=device, config=config)
        losses = []
        try:
            for ids in batches:
                ids = ids.to(device)
                loss = engine(ids[:, :-1], ids[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            return losses, engine.plan
        finally:
            engine.close(write_back=False)

    base = dict(params="gpu", dtype="fp32")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_reserved(device)
    host_losses, _ = run(zo.OffloadConfig(**base, optimizer="cpu"))
    step_peak = torch.cuda.max_memory_reserved(device) - held  # params, activations, windows
    torch.cuda.empty_cache()
    n = sum(p.numel() for p in GPT(cfg, device="meta").parameters())
    free, _ = torch.cuda.mem_get_info(device)
    room = step_peak + 6 * n + (1 << 30)  # the step and half of the 12 B/param state, and a margin
    blocker = torch.empty(max(0, free - room), dtype=torch.uint8, device=device)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses, plan = run(zo.OffloadConfig(**base, optimizer="auto", gpu_budget="auto",
                                                activation_reserve=1 << 28))
        first = plan.evicted + tuple(i for i, h in enumerate(plan.homes) if h.optimizer is Tier.GPU)
        assert plan.evicted and len(set(first)) == sum(c.trainable for c in plan.request.chunks), (
            "the first plan should hold every chunk's state", plan.why, [str(w.message) for w in caught])
        assert losses == pytest.approx(host_losses, rel=1e-4)
    finally:
        del blocker
        torch.cuda.empty_cache()


def test_a_peak_from_before_the_engine_does_not_empty_the_share():
    """The first step's reach is measured from its own start: a large allocation freed before
    ``initialize`` (an earlier model, another test's blocker) leaves the allocator's peak high, and
    that peak once made the first backward move the whole share to the host (session 20's GPU
    tests: the park tests that followed a blocker), and the measured step never grew it back."""
    device = torch.device("cuda", 0)
    free, _ = torch.cuda.mem_get_info(device)
    blocker = torch.empty(free // 2, dtype=torch.uint8, device=device)
    del blocker
    torch.cuda.empty_cache()
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, device=device, config=_config())
    try:
        first = _on_gpu(engine)
        assert all(first)
        _train(engine, gpt_batches(2, batch=2), device)
        assert engine.plan.evicted == () and _on_gpu(engine) == first, engine.plan.why
    finally:
        engine.close()
