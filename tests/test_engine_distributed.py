"""The engine on several ranks (2 CPU processes, gloo): every chunk split between the ranks
(params, grads, master, moments), the params all-gathered for use, the grads reduce-scattered
(mean), each rank's CPU-Adam on its shard. Checked against single-process torch AdamW on the same
global batch for params and optimizer on cpu / nvme, clipping, accumulation, a tied head read
functionally, bf16; checkpoints written by the ranks together and loaded by 2 ranks and by one
process; a rank that dies."""
import os

import pytest
import torch

import zero_offload as zo
from zero_offload.runtime.store import Tier
from _dist_util import error_after_a_rank_dies, run_ranks, values
from _engine_util import (SMALL_CHUNK_MB, Reference, assert_params_close, gpt_batches, gpt_loss,
                          micro_gpt)

WORLD = 2
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
SPEC = zo.AdamW(lr=3e-3, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _reference_on_the_cpu(monkeypatch):
    """The ranks compute on the CPU (gloo), so the torch reference does too, also when
    ZO_TEST_DEVICE=cuda moves the single-process references to the GPU (bf16 matmuls on the two
    devices round differently: 1.4e-2 apart after 3 steps on an H100)."""
    import _engine_util
    monkeypatch.setattr(_engine_util, "DEVICE", "cpu")


def _config(nvme_dir, **kw):
    base = dict(params="cpu", optimizer="cpu", dtype="fp32", chunk_mb=SMALL_CHUNK_MB,
                gpu_budget=1 << 22, cpu_budget=1 << 26, threads=1, prefetch_depth=1, nvme_dir=nvme_dir)
    base.update(kw)
    return zo.OffloadConfig(**base)


def _engine_rank(rank, world, kw, steps, accum, nvme_dir, ckpt):
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(nvme_dir, grad_accum=accum, **kw),
                           device="cpu")
    assert engine.shard.world == world and engine.shard.rank == rank
    shard_elems = sum(c.numel for c in engine.group.chunks)
    norms = []
    for i, (x, y) in enumerate(gpt_batches(steps * accum, batch=2 * world)):
        sl = slice(2 * rank, 2 * rank + 2)  # this rank's half of the global batch
        loss = engine(x[sl], y[sl])
        engine.backward(loss / accum)
        if engine.step() and engine.last_grad_norm is not None:
            norms.append(engine.last_grad_norm)
    if ckpt is not None:
        engine.save_checkpoint(ckpt)
    sd = engine.state_dict()
    engine.close()
    return sd, shard_elems, norms


def _reference(steps, accum, **kw):
    ref = Reference(micro_gpt(), SPEC, accum=accum, dtype=kw.get("dtype", torch.float32), grad_clip=kw.get("clip"))
    for b in gpt_batches(steps * accum, batch=2 * WORLD):
        ref.step(b, gpt_loss)
    return ref


@pytest.mark.parametrize("placement", [dict(params="nvme", optimizer="nvme"),
                                       dict(params="gpu", optimizer="nvme")],
                         ids=["nvme", "gpu-nvme"])
def test_ranks_train_like_one_torch_process_on_the_global_batch(placement, tmp_path):
    nvme = str(tmp_path / "swap") if "nvme" in placement.values() else None
    out = values(run_ranks(_engine_rank, WORLD, tmp_path, placement, 4, 1, nvme, None, timeout_s=120))
    ref = _reference(4, 1)
    total = sum(p.numel() for p in micro_gpt().parameters())
    for sd, shard_elems, _ in out:
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
        assert shard_elems < 0.6 * total  # each rank holds about half of every chunk
    if nvme:  # each rank its own swap directory
        assert sorted(os.listdir(nvme)) == ["rank0", "rank1"]


def test_bf16_ranks_match_the_bf16_recipe(tmp_path):
    """Each rank's bf16 grads of its half, averaged: the reference is the bf16 recipe with the
    two halves as two micro-batches (grads summed in fp32; the ranks sum in bf16: one rounding
    more, ~2e-3 here; the single-process bf16 tests allow 3e-2)."""
    out = values(run_ranks(_engine_rank, WORLD, tmp_path, dict(dtype="bf16"), 3, 1, None, None,
                           timeout_s=120))
    ref = Reference(micro_gpt(), SPEC, accum=WORLD, dtype=torch.bfloat16)
    for x, y in gpt_batches(3, batch=2 * WORLD):
        for r in range(WORLD):
            ref.step((x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]), gpt_loss)
    for sd, _, _ in out:
        assert_params_close(sd, ref.master_state(), rtol=1e-2)


def _resume_rank(rank, world, ckpt):
    engine = zo.initialize(micro_gpt(seed=5), optimizer=SPEC, config=_config(None), device="cpu")
    engine.load_checkpoint(ckpt)
    for x, y in gpt_batches(6, batch=2 * world)[4:]:  # the two steps after the checkpoint
        n = x.shape[0] // world
        loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
    sd = engine.state_dict()
    only = engine.state_dict(rank0_only=True)  # one copy on the node: rank 0's
    assert (only.keys() == sd.keys() and all(torch.equal(only[k], sd[k]) for k in sd)) if rank == 0 \
        else only == {}
    # the export is collective too: rank 0 writes the gathered chunks, shard by shard; a path
    # rank 0 refuses stops every rank (no rank left waiting in a gather)
    try:
        engine.save_weights(os.path.join(os.path.dirname(ckpt), "taken"))
        refused = None
    except (ValueError, RuntimeError) as e:
        refused = f"{type(e).__name__}: {e}"
    files = engine.save_weights(os.path.join(os.path.dirname(ckpt), "export"), shard_size=8_000)
    engine.close()
    return sd, (files, refused)


def test_checkpoint_written_by_two_ranks_resumes_on_two_and_on_one(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    values(run_ranks(_engine_rank, WORLD, tmp_path / "a", dict(), 4, 1, None, ckpt, timeout_s=120))
    from zero_offload.runtime.checkpoint import verify
    assert verify(ckpt)
    ref = _reference(6, 1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("the user's")
    two = values(run_ranks(_resume_rank, WORLD, tmp_path / "b", ckpt, timeout_s=120))
    for sd, _ in two:
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
    (sd, (files, refused0)), (_, (none, refused1)) = two
    assert refused0.startswith("ValueError: save_weights:") and "is not an empty directory" in refused0
    assert refused1 == f"RuntimeError: save_weights: rank 0 refused {tmp_path / 'taken'} (its error says " \
                       f"why); nothing was written"
    assert os.listdir(tmp_path / "taken") == ["notes.txt"]
    assert none == [] and len(files) > 2
    from safetensors.torch import load_file
    exported = {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(f).items()}
    assert set(exported) == set(sd) - {"lm_head.weight"}
    assert all(torch.equal(v, sd[k]) for k, v in exported.items())
    # one process (no group) takes the whole global batch: resharded from 2 ranks to 1
    engine = zo.initialize(micro_gpt(seed=5), optimizer=SPEC, config=_config(None), device="cpu",
                           process_group=None)
    engine.load_checkpoint(ckpt)
    for b in gpt_batches(6, batch=2 * WORLD)[4:]:
        engine.backward(gpt_loss(engine, b))
        engine.step()
    assert_params_close(engine.state_dict(), ref.master_state(), rtol=1e-5)
    engine.close()


def _dies_rank(rank, world):
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(None), device="cpu")
    for i, (x, y) in enumerate(gpt_batches(3, batch=2)):
        if rank == 1 and i == 1:
            os._exit(3)
        engine.backward(engine(x, y))
        engine.step()
    return "finished"


def test_a_dead_rank_makes_the_other_raise_one_clear_error(tmp_path):
    err = error_after_a_rank_dies(_dies_rank, WORLD, tmp_path)
    assert "engine: rank 0 of 2:" in err and "rank 1, the other rank, has probably died" in err, err


def _counting_rank(rank, world, kw, steps, accum):
    """Trains like ``_engine_rank`` and counts the engine's collectives per micro-batch:
    reduce-scatters, all-gathers issued on the spot and all-gathers issued ahead (async)."""
    import zero_offload.runtime.shards as eng  # every collective of the runtime is issued there
    counts = []
    rs, ag = eng.reduce_scatter_mean, eng.all_gather

    def count_rs(*a, **k):
        counts[-1]["rs"] += 1
        return rs(*a, **k)

    def count_ag(out, inp, group, *, async_op=False):
        counts[-1]["ahead" if async_op else "ag"] += 1
        return ag(out, inp, group, async_op=async_op)

    eng.reduce_scatter_mean, eng.all_gather = count_rs, count_ag
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(None, grad_accum=accum, **kw),
                           device="cpu")
    norms = []
    for x, y in gpt_batches(steps * accum, batch=2 * world):
        counts.append({"rs": 0, "ag": 0, "ahead": 0})
        sl = slice(2 * rank, 2 * rank + 2)
        engine.backward(engine(x[sl], y[sl]) / accum)
        if engine.step() and engine.last_grad_norm is not None:
            norms.append(engine.last_grad_norm)
    counts.append({"rs": 0, "ag": 0, "ahead": 0})  # state_dict's gathers, apart
    sd = engine.state_dict()
    n_chunks = len(engine.group.chunks)
    engine.close()
    return sd, counts[:-1], norms, n_chunks


@pytest.mark.parametrize("sync", ["every", "final"])
def test_accumulation_talks_every_micro_batch_or_only_at_the_window_end(sync, tmp_path):
    """grad_sync="final" (DDP's no_sync): no reduce-scatter on the non-final micro-batches, one
    per chunk at the last; the same global-norm clipping and results as torch either way."""
    out = values(run_ranks(_counting_rank, WORLD, tmp_path, dict(grad_clip=0.05, grad_sync=sync), 3, 3,
                           timeout_s=120))
    ref = _reference(3, 3, clip=0.05)
    for sd, counts, norms, n_chunks in out:
        assert norms == pytest.approx(ref.norms, rel=1e-5)
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
        per_micro = [c["rs"] for c in counts]
        if sync == "final":
            assert per_micro == [0, 0, n_chunks] * 3
        else:
            assert per_micro == [n_chunks] * 9


@pytest.mark.parametrize("params", ["gpu", "cpu"])
def test_gpu_params_keep_a_replica_gathered_once_per_step(params, tmp_path):
    """params="gpu": each chunk's params are gathered once per step (the update changed them),
    then reused by the backward and every later use; params elsewhere: gathered at every use,
    the next chunk's gather issued ahead of its use. Results equal to torch either way."""
    out = values(run_ranks(_counting_rank, WORLD, tmp_path, dict(params=params), 4, 1, timeout_s=120))
    ref = _reference(4, 1)
    for sd, counts, _, n_chunks in out:
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
        gathers = [c["ag"] + c["ahead"] for c in counts]
        if params == "gpu":
            assert gathers == [n_chunks] * 4
        else:
            assert all(g > n_chunks for g in gathers)  # forward and backward
            assert all(c["ahead"] > 0 for c in counts[1:])  # after the recording pass


def _phase_counting_rank(rank, world, kw, steps, accum, later=False):
    """"auto" everything on the device with replicas: trains like ``_engine_rank`` and counts the
    all-gathers issued in each call (forward, backward, step) of each micro-batch; at the end each
    replica must equal the all-gather of the params shards. ``later``: the first plan's reserve
    leaves the replicas no room; the step measured after the first window adds them."""
    import zero_offload.runtime.shards as eng
    from zero_offload.runtime.placement import Measured
    calls, ag = [], eng.all_gather

    def count_ag(out, inp, group, *, async_op=False):
        calls[-1][1] += 1
        return ag(out, inp, group, async_op=async_op)

    config = dict(params="auto", optimizer="auto", gpu_budget=1 << 26, grad_accum=accum, **kw)
    if later:  # the whole state fits, the replicas do not: reserve all but that
        probe = zo.initialize(micro_gpt(), optimizer=SPEC, device="cpu", config=_config(None, **config))
        report = probe.plan.report()
        probe.close()
        config["activation_reserve"] = (1 << 26) - (probe.plan.need[Tier.GPU] + report["replicas_bytes"]) + 1
    eng.all_gather = count_ag
    engine = zo.initialize(micro_gpt(), optimizer=SPEC, device="cpu", config=_config(None, **config))
    group = engine.group
    assert engine.plan.request.replicas is (not later) and group.replicas is (not later)
    assert all(group._on_device(c) for c in group.chunks if c.layout.trainable)
    norms = []
    for i, (x, y) in enumerate(gpt_batches(steps * accum, batch=2 * world)):
        if later and i == accum:  # what the first step's measurement does on CUDA
            calls.append(["grow", 0])
            plan = engine.grow_share(Measured(device_limit=1 << 26, device_peak=0, margin=0))
            assert plan.replicas_added and group.replicas and plan.report()["replicas"]
        sl = slice(2 * rank, 2 * rank + 2)
        calls.append(["forward", 0])
        loss = engine(x[sl], y[sl])
        calls.append(["backward", 0])
        engine.backward(loss / accum)
        calls.append(["step", 0])
        if engine.step() and engine.last_grad_norm is not None:
            norms.append(engine.last_grad_norm)
    calls.append(["after", 0])
    name = group.payloads.lowp or group.payloads.master
    stale = []
    for c in group.chunks:
        whole = group.shards.finish(group.shards.gather(group.store.get(c.cid, name, Tier.GPU), what="check"))
        if not c.replica_fresh or not torch.equal(group.shards.finish(group.params(c, None)), whole):
            stale.append(c.cid)
    sd = engine.state_dict()
    n_chunks = len(group.chunks)
    engine.close()
    return sd, calls[:-1], norms, n_chunks, stale


@pytest.mark.parametrize("kw,accum", [(dict(), 1), (dict(grad_clip=0.05), 1), (dict(), 2),
                                      (dict(dtype="bf16"), 1)],
                         ids=["overlap", "clip", "accum", "bf16"])
def test_auto_replicas_gather_each_chunk_once_per_step_right_after_its_update(kw, accum, tmp_path):
    """[Note: gathers after the update]: with the whole state on the device and replicas, each
    chunk's updated params are all-gathered once per step, during backward behind its update (or in
    step() where the updates wait for the clip), so no forward after the first issues a collective;
    results equal torch's, the replicas equal the shards."""
    out = values(run_ranks(_phase_counting_rank, WORLD, tmp_path, kw, 3, accum, timeout_s=120))
    for sd, calls, norms, n_chunks, stale in out:
        assert stale == []
        gathers = [n for _, n in calls]
        update_in = "step" if "grad_clip" in kw else "backward"
        want = []
        for i in range(3 * accum):
            last = i % accum == accum - 1
            want += [n_chunks if i == 0 else 0,  # the first forward gathers (nothing is replicated yet)
                     n_chunks if last and update_in == "backward" else 0,
                     n_chunks if last and update_in == "step" else 0]
        assert gathers == want, calls
        if "dtype" not in kw:
            ref = _reference(3, accum, clip=kw.get("grad_clip"))
            assert_params_close(sd, ref.master_state(), rtol=1e-5)
            if "grad_clip" in kw:
                assert norms == pytest.approx(ref.norms, rel=1e-5)


def test_replicas_the_first_plan_had_no_room_for_come_with_the_measured_step(tmp_path):
    """[Note: replicas when all fits]: a reserve that leaves the whole state on the device but no
    room for the replicas; the measured step (here ``grow_share`` with a measurement) adds them:
    before it every forward and backward gathers each chunk, after it the first forward gathers
    each chunk once more (the replicas) and the updates then gather them in backward; results
    equal torch's."""
    out = values(run_ranks(_phase_counting_rank, WORLD, tmp_path, {}, 3, 1, True, timeout_s=120))
    ref = _reference(3, 1)
    for sd, calls, _, n_chunks, stale in out:
        assert stale == []
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
        phases = [p for p, _ in calls]
        assert phases == ["forward", "backward", "step", "grow"] + ["forward", "backward", "step"] * 2
        gathers = [n for _, n in calls]
        assert gathers[0] >= n_chunks and gathers[1] > 0, calls  # no replicas: gathered again in backward
        assert gathers[3:] == [0, n_chunks, n_chunks, 0, 0, n_chunks, 0], calls


def test_final_grad_sync_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match=r"OffloadConfig.grad_sync='never' is invalid: expected 'every' or 'final'"):
        zo.OffloadConfig(grad_sync="never")


def _replica_fit_rank(rank, world):
    with pytest.raises(zo.FitError if hasattr(zo, "FitError") else ValueError,
                       match=r"params='gpu' with 2 ranks keeps a full replica"):
        zo.initialize(micro_gpt(), optimizer=SPEC, config=_config(None, params="gpu", gpu_budget=70_000),
                      device="cpu")
    return "refused"


def test_gpu_params_that_cannot_hold_a_replica_are_refused_before_anything_is_allocated(tmp_path):
    assert values(run_ranks(_replica_fit_rank, WORLD, tmp_path, timeout_s=60)) == ["refused"] * 2


def test_local_ranks_get_disjoint_blocks_of_cores(monkeypatch):
    from zero_offload import distributed
    monkeypatch.setattr(distributed, "_NODE_CORES", None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert distributed.rank_cores() is None
    have = sorted(os.sched_getaffinity(0))
    if len(have) < 2:
        pytest.skip("needs 2 cores to split")  # CI machines have 2
    blocks = []
    for r in range(2):
        monkeypatch.setattr(distributed, "_NODE_CORES", None)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", str(r))
        blocks.append(distributed.rank_cores())
        assert distributed.threads_per_rank(cuda=False) == len(blocks[-1])
    assert len(blocks[0]) == len(blocks[1]) == len(have) // 2
    assert not set(blocks[0]) & set(blocks[1]) and set(blocks[0]) | set(blocks[1]) <= set(have)


def _meta_rank(rank, world):
    """Every rank builds the model on the meta device and fills its shards with the same init
    (same seed): nobody holds the whole model in fp32."""
    import dataclasses
    from zero_offload.models import GPT
    from _engine_util import MICRO_GPT
    with torch.device("meta"):
        model = GPT(dataclasses.replace(MICRO_GPT))
    torch.manual_seed(7)
    engine = zo.initialize(model, optimizer=SPEC, config=_config(None), device="cpu", init=model.init_param)
    for x, y in gpt_batches(3, batch=2 * world):
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()
    sd = engine.state_dict()
    engine.close()
    return sd


def test_ranks_fill_their_shards_of_a_meta_model_and_train_like_torch(tmp_path):
    from zero_offload.models import GPT
    from _engine_util import MICRO_GPT
    out = values(run_ranks(_meta_rank, WORLD, tmp_path, timeout_s=120))
    start = GPT(MICRO_GPT, device="meta")
    start.to_empty(device="cpu")
    torch.manual_seed(7)
    start.init_weights()
    ref = Reference(start, SPEC)
    for b in gpt_batches(3, batch=2 * WORLD):
        ref.step(b, gpt_loss)
    for sd in out:
        assert_params_close(sd, ref.master_state(), rtol=1e-5)
