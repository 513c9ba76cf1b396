"""benchmarks/fair (issue 22's training harness) on the CPU: one process group per case, the same
threads, weights and data for every case, rows with the fields the summary needs, and the
driver's failure rows (a case that fails, a case past its timeout, a case past the deadline).

The init file is written with a large init_std so the step-0 loss depends on the weights: the
check that every case starts from the same weights could fail (a second init differs by far more
than the tolerance, asserted below)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FAIR = Path(__file__).resolve().parents[1] / "benchmarks" / "fair"
sys.path.insert(0, str(FAIR))

from case import batch_for  # noqa: E402
from make_init import main as make_init  # noqa: E402

from zero_offload.models import GPT, preset  # noqa: E402

MODEL, SEQ, BATCH, STD = "tiny", 32, 2, 0.5
REQUIRED = ("run_id", "order", "label", "case", "world", "recipe", "threads", "omp_num_threads",
            "torch_threads_per_rank", "threads_reported", "pids", "init_fingerprint", "step0_loss",
            "step0_loss_rank_mean", "median_s", "p25_s", "p75_s", "min_s", "max_s", "total_wall_s",
            "wall_mean_s", "step_times", "tokens_per_s", "model_tflops_per_gpu", "pss_peak_per_rank_gib",
            "memavail_start_gib", "memavail_min_gib", "memavail_drop_gib", "host_bytes_per_param",
            "driver_memavail_drop_gib", "gpu_peak_alloc_per_rank_gib", "gpu_peak_reserved_per_rank_gib",
            "params", "versions", "config", "error")


def _driver(tmp_path, *args, name="out"):
    out = tmp_path / name
    cmd = [sys.executable, str(FAIR / "run.py"), "--out", str(out), "--model", MODEL, "--seq", str(SEQ),
           "--batch", str(BATCH), "--warmup", "1", "--steps", "2", "--device", "cpu", "--settle", "0",
           "--init", str(tmp_path / "init.pt"), "--init-std", str(STD), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    rows = []
    if (out / "rows.jsonl").exists():
        rows = [json.loads(ln) for ln in (out / "rows.jsonl").read_text().splitlines() if ln.strip()]
    return r, rows, out


def _reference_losses(seed: int, seeded: bool = False) -> dict:
    """Step 0's loss on rank 0 from GPT(seed) as make_init.py builds it (``seeded``: as
    ``--init seeded:SEED`` draws it: the seed, then ``init_weights`` on the built model), in each
    recipe: fp32 params under bf16 autocast (ddp, offload-adamw) and bf16 params (the engine's
    working copy)."""
    torch.manual_seed(seed)
    model = GPT(preset(MODEL, seq_len=SEQ, init_std=STD))
    if seeded:  # the modules' own reset_parameters drew first in GPT(); the seed restarts here
        torch.manual_seed(seed)
        model.init_weights()
    x, y = batch_for(0, 0, batch=BATCH, seq=SEQ, vocab=model.config.vocab_size, seed=1234)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = float(model(x, y))
        bf16 = float(model.to(torch.bfloat16)(x, y))
    return {"ddp": autocast, "offload-adamw": autocast, "engine": bf16}


def test_cases_share_threads_weights_data_in_own_processes(tmp_path):
    make_init(["--model", MODEL, "--seq", str(SEQ), "--init-std", str(STD), "--out", str(tmp_path / "init.pt")])
    r, rows, out = _driver(tmp_path, "--plan", "ddp@1 engine@1 offload-adamw@1", "--seed", "3")
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    assert sorted((row["label"], row["world"]) for row in rows) == [
        ("ddp", 1), ("engine", 1), ("offload-adamw", 1)]
    assert [row["order"] for row in rows] == [0, 1, 2]
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, f"{row['label']}@{row['world']} lacks {missing}"
        assert row["error"] is None
    # one process group per case: no pid twice
    pids = [p for row in rows for p in row["pids"]]
    assert len(pids) == len(set(pids)) == 3
    # the same threads for every case (this machine's cores // N), every knob agreeing
    for row in rows:
        t = len(os.sched_getaffinity(0)) // row["world"]
        assert row["threads"] == t and row["omp_num_threads"] == str(t)
        assert row["torch_threads_per_rank"] == [t] * row["world"]
        engine_threads = {k: v for k, v in row["threads_reported"].items() if isinstance(v, int)}
        assert set(engine_threads.values()) == {t}, row["threads_reported"]
    assert len({row["init_fingerprint"] for row in rows}) == 1
    # same weights and data: every step-0 loss is its recipe's reference, computed here from the
    # same seed; a model from another seed is far outside that tolerance
    ref, other = _reference_losses(0), _reference_losses(1)
    for row in rows:
        want = ref[row["case"]]
        assert abs(other[row["case"]] - want) > 10 * 1e-3 * want
        assert abs(row["step0_loss"] - want) < 1e-3 * want, (row["label"], row["step0_loss"], want)
    summary = (out / "summary.md").read_text()
    assert "## N = 1" in summary and "| engine |" in summary and "| offload-adamw |" in summary


def test_failure_timeout_and_deadline_each_leave_one_clear_row(tmp_path):
    # a case that fails (an init file of another shape): an error row naming the fix, exit 1
    make_init(["--model", MODEL, "--seq", "64", "--out", str(tmp_path / "init.pt")])
    r, rows, _ = _driver(tmp_path, "--plan", "ddp@1", name="bad")
    assert r.returncode == 1
    [row] = rows
    assert "seq_len" in row["error"] and "make_init.py" in row["error"] and "\n" not in row["error"]
    assert "ddp@1" in r.stdout
    # past --case-timeout: the case's process group is killed, the row says so (the driver
    # writes the missing init file first)
    os.unlink(tmp_path / "init.pt")
    r, rows, _ = _driver(tmp_path, "--plan", "engine@1", "--case-timeout", "1", name="slow")
    assert r.returncode == 1
    assert (tmp_path / "init.pt").is_file()
    [row] = rows
    assert row["error"].startswith("timeout: killed after")
    # past --deadline: not started, a "not run" row, and exit 0 (nothing failed)
    r, rows, _ = _driver(tmp_path, "--plan", "ddp@1 engine@1", "--deadline", "2", name="late")
    assert r.returncode == 0, r.stderr
    assert [row["not_run"][:8] for row in rows] == ["deadline", "deadline"]
    # a plan naming an unknown case: one line, exit 2, nothing run
    r, rows, _ = _driver(tmp_path, "--plan", "ddp@1 nosuch@2", name="typo")
    assert r.returncode == 2 and rows == []
    assert r.stderr.strip().count("\n") == 0 and "unknown case 'nosuch'" in r.stderr


def test_plan_order_is_priority_under_a_deadline(tmp_path):
    # about 12 s expected per CPU case: a 35 s deadline (27 s after the driver's reserve) takes
    # the plan's first two items and leaves the third, whatever the shuffle
    r = subprocess.run([sys.executable, str(FAIR / "run.py"), "--plan", "offload-adamw@1 ddp@1 engine@1",
                        "--out", str(tmp_path), "--device", "cpu", "--model", MODEL, "--dry-run",
                        "--deadline", "35", "--seed", "5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    order, _, dropped = r.stdout.splitlines()[0].partition("not run")
    assert "offload-adamw@1" in order and "ddp@1" in order and "engine@1" in dropped


def test_anchors_keep_their_time_whatever_the_shuffle():
    # 2026-11-27 (s10): the shuffle put engine@2 and engine@4 last, baselines ran past their
    # estimates, and the call came back without an engine row; a baseline now may not use the
    # time the engine and ddp rows after it are expected to need
    from fairplan import parse_plan
    from run import anchor_keep_s
    order = parse_plan("fsdp2@2 engine@2 ds-zero2@2 ddp@2 engine@4")
    cost = {"fsdp2": 100.0, "engine": 50.0, "ds-zero2": 70.0, "ddp": 20.0}
    keep = [anchor_keep_s(order, n, cost=lambda i: cost[i.case], scale=2.0, settle=1.0)
            for n in range(len(order))]
    assert keep == [pytest.approx((50 + 20 + 50) * 2.2 + 3), 0.0, pytest.approx((20 + 50) * 2.2 + 2), 0.0, 0.0]


def test_thread_sweep_knob_is_capped_by_the_rule(tmp_path):
    from fairplan import parse_plan
    from run import item_threads
    [a, b] = parse_plan("fsdp2:reshard=1,threads=8@2 engine@2")
    assert item_threads(a, 32) == 8 and item_threads(b, 32) == 32
    assert a.case_args() == ["--fsdp-reshard", "1"]  # the driver applies threads, not case.py's knob
    r = subprocess.run([sys.executable, str(FAIR / "run.py"), "--plan", "ddp:threads=64@1", "--cores", "4",
                        "--out", str(tmp_path), "--device", "cpu", "--dry-run"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "from 1 to 4" in r.stderr


def test_tree_knob_runs_another_source_tree_and_names_it(tmp_path, monkeypatch):
    """``tree=NAME`` (a before/after comparison in one call): the case imports zero_offload from
    that tree, its row records the tree's path and commit; a tree that is not there stops the
    plan before anything runs, in one line."""
    import zero_offload
    src = tmp_path / "trees" / "other" / "src"
    src.mkdir(parents=True)  # the package as imported here (its extension built: a CI install has it
    (src / "zero_offload").symlink_to(Path(zero_offload.__file__).parent)  # in site-packages only)
    (tmp_path / "trees" / "other" / "COMMIT").write_text("feedc0de\n")
    make_init(["--model", MODEL, "--seq", str(SEQ), "--init-std", str(STD), "--out", str(tmp_path / "init.pt")])
    monkeypatch.setenv("FAIR_TREES", str(tmp_path / "trees"))  # the driver's children inherit it
    r, rows, _ = _driver(tmp_path, "--plan", "engine:tree=other@1")
    bad = subprocess.run([sys.executable, str(FAIR / "run.py"), "--plan", "engine:tree=gone@1", "--out",
                          str(tmp_path / "bad"), "--device", "cpu", "--dry-run"], capture_output=True,
                         text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    [row] = rows
    assert row["error"] is None and row["label"] == "engine[tree=other]"
    assert row["zero_offload_commit"] == "feedc0de" == row["versions"]["zero_offload_commit"]
    assert str(tmp_path / "trees" / "other" / "src") in row["versions"]["zero_offload"]
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "tree=gone" in bad.stderr


@pytest.mark.parametrize("text, labels", [
    ("n4", None),
    ("ds-zero3:prefetch=5e7,reduce=5e8@4; fsdp2:reshard=1@2",
     [("ds-zero3[prefetch=5e7,reduce=5e8]", 4), ("fsdp2[reshard=1]", 2)]),
])
def test_plans_parse(text, labels):
    from fairplan import parse_plan
    items = parse_plan(text)
    if labels is not None:
        assert [(i.label, i.world) for i in items] == labels
        assert items[0].case_args() == ["--ds-prefetch-bucket", "5e7", "--ds-reduce-bucket", "5e8"]
    else:
        assert {i.world for i in items} == {4} and len(items) == len({i.label for i in items})


def test_the_ckpt_knob_takes_a_fraction_of_the_blocks():
    from case import parse_args, set_checkpointing
    from fairplan import parse_plan, step_flops
    item, = parse_plan("engine-auto:ckpt=0.5@4")
    assert item.case_args() == ["--checkpointing", "0.5"]
    for bad in ("1.5", "half", "-0.1"):
        with pytest.raises(ValueError, match="fraction of blocks"):
            parse_plan(f"engine-auto:ckpt={bad}@4")
    base = ["--case", "engine", "--threads", "1", "--init", "x", "--json-out", "y"]
    assert parse_args(base).checkpointing == 0.0
    assert parse_args(base + ["--checkpointing"]).checkpointing == 1.0
    assert parse_args(base + ["--checkpointing", "0.25"]).checkpointing == 0.25
    model = GPT(preset(MODEL, seq_len=SEQ))
    n = len(model.blocks)
    for fraction, on in ((1.0, n), (0.0, 0), (0.5, round(n / 2)), (1 / n, 1)):
        set_checkpointing(model, fraction)
        assert [b.checkpoint for b in model.blocks] == [True] * on + [False] * (n - on), fraction
    assert step_flops(6, batch=1, seq=1, checkpointing=0.5) == pytest.approx(6 * (1 + 0.5 / 3))
    assert step_flops(6, batch=1, seq=1, checkpointing=True) == pytest.approx(8)


def test_compile_knob_compiles_each_block_of_engine_and_ddp_only():
    import argparse
    from case import _compile_blocks, parse_args
    from fairplan import parse_plan
    items = parse_plan("compile")
    assert [(i.label, i.world) for i in items] == [
        ("engine", 1), ("engine[compile=1]", 1), ("ddp", 1), ("ddp[compile=1]", 1)]
    assert items[1].case_args() == ["--compile", "1"]
    with pytest.raises(ValueError, match="takes no knob 'compile'"):
        parse_plan("offload-adamw:compile=1@1")
    with pytest.raises(ValueError, match="holds another knob; separate knobs with ','"):
        parse_plan("engine-auto:gpu-cap=25.6:ckpt=1@1")  # (the case got '--gpu-cap 25.6:ckpt=1')
    assert parse_plan("engine-auto:gpu-cap=25.6,ckpt=0.5,params=gpu@1")[0].knobs == (
        ("gpu-cap", "25.6"), ("checkpointing", "0.5"), ("engine-params", "gpu"))
    assert parse_args(["--case", "engine", "--threads", "1", "--init", "x", "--json-out", "y",
                       "--compile", "1"]).compile == "1"
    model = GPT(preset(MODEL, seq_len=SEQ))
    assert _compile_blocks(argparse.Namespace(compile="0"), model) == {}
    assert _compile_blocks(argparse.Namespace(compile="1"), model)["compile"].startswith("each block")
    assert all(b._compiled_call_impl is not None for b in model.blocks)


def test_memory_sampler_walks_no_page_table_during_the_timed_steps(monkeypatch):
    """[Note: no page-table walk while timing]: a smaps_rollup read cost 40-85 ms of CPU under the
    case's mm lock on the GPU hosts, so inside the timed window only statm's RSS is read."""
    import case

    reads = []
    monkeypatch.setattr(case, "_read_pss_kib", lambda: reads.append("pss") or 1)
    sampler = case.MemSampler(period=3600)  # sampled by hand below, never by its thread
    reads.clear()
    sampler.sample()
    assert reads == ["pss"]
    sampler.enter_timed()  # one PSS read just before the timed steps
    reads.clear()
    for _ in range(3):
        sampler.sample()
    assert reads == [] and sampler.timed_samples == 3 and sampler.rss_peak_timed > 0
    sampler.leave_timed()  # and one right after them
    assert reads == ["pss"]


def test_the_opt_knob_picks_the_rule_of_the_cases_that_take_it():
    """Issue 25's table: each rule offloaded (engine, offload-adamw) vs the same torch optimizer
    without offload (torch-opt) vs AdamW offloaded, in one plan."""
    from fairplan import parse_plan
    items = parse_plan("engine:opt=muon@1 torch-opt:opt=muon@1 engine@1 offload-adamw:opt=adafactor@2")
    assert [(i.label, i.world) for i in items] == [("engine[opt=muon]", 1), ("torch-opt[opt=muon]", 1),
                                                   ("engine", 1), ("offload-adamw[opt=adafactor]", 2)]
    assert items[0].case_args() == ["--opt", "muon"] and items[2].case_args() == []
    with pytest.raises(ValueError, match="opt=rmsprop is not a rule; choose from adamw, sgd, lion, adafactor, muon"):
        parse_plan("engine:opt=rmsprop@1")
    with pytest.raises(ValueError, match="case ddp takes no knob 'opt'"):
        parse_plan("ddp:opt=sgd@1")


def test_seeded_init_needs_no_file_and_gives_every_case_init_weights_values(tmp_path):
    """``--init seeded:SEED`` (issue 24: no 120 GB init file at 30B): the engine draws through its
    own meta path (``init=model.init_param``), the torch cases per parameter; both give the values
    ``GPT.init_weights`` gives right after ``torch.manual_seed(SEED)``, on one rank and on two (rank 0's batch is the same at every N), so the step-0 losses are the
    recipes' references and the two engine rows agree."""
    r, rows, out = _driver(tmp_path, "--plan", "ddp@1 engine@1 engine-auto@2", "--seed", "2",
                           "--init", "seeded:0")
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    assert not (tmp_path / "init.pt").exists()  # no file written or read
    assert sorted((row["label"], row["world"]) for row in rows) == [("ddp", 1), ("engine", 1), ("engine-auto", 2)]
    for row in rows:
        missing = [k for k in REQUIRED + ("init", "init_s", "host_bytes_per_param", "case_timeout_s")
                   if k not in row]
        assert not missing, f"{row['label']}@{row['world']} lacks {missing}"
        assert row["error"] is None and row["init_file"] is None
        assert row["init"].startswith("seeded: init_weights values (torch.manual_seed(0)")
        assert row["init_fingerprint"] == f"seeded:0:init_std={STD}"
        assert row["params"] == preset(MODEL, seq_len=SEQ).num_params()
        assert row["host_bytes_per_param"] == row["driver_host_bytes_per_param"]
    by = {row["label"]: row for row in rows}
    assert "gpu" in by["engine"]["engine_peak_gib"] and "cpu" in by["engine"]["engine_held_gib"]
    ref, other = _reference_losses(0, seeded=True), _reference_losses(1, seeded=True)
    for row in rows:
        case = "engine" if row["case"].startswith("engine") else row["case"]
        assert abs(other[case] - ref[case]) > 10 * 1e-3 * ref[case]
        assert abs(row["step0_loss"] - ref[case]) < 1e-3 * ref[case], (row["label"], row["step0_loss"], ref[case])
    assert by["engine"]["step0_loss"] == by["engine-auto"]["step0_loss"]  # the same weights, bit for bit
    summary = (out / "summary.md").read_text()
    assert "seeded: init_weights values" in summary and "bf16: " in summary


def test_seeded_values_are_init_weights_values_and_rows_of_other_weights_are_not_compared():
    import case
    from summarize import step0_groups
    cfg = preset(MODEL, seq_len=SEQ, init_std=STD)
    want = GPT(cfg)
    torch.manual_seed(7)
    want.init_weights()
    want = want.state_dict()
    model = GPT(cfg, device="meta")
    model.to_empty(device="cpu")
    weights = case.Weights("seeded:7", cfg, threads=2)
    assert weights.load(model) == len(list(model.parameters()))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    with pytest.raises(case.CaseError, match="seeded:SEED with an integer SEED"):
        case.Weights("seeded:x", cfg, threads=1)
    rows = [{"case": "engine", "init_fingerprint": "seeded:0", "step0_loss": 1.0},
            {"case": "engine-auto", "init_fingerprint": "seeded:0", "step0_loss": 1.0},
            {"case": "ddp-bf16", "init_fingerprint": "9:abc", "step0_loss": 2.0},
            {"case": "ddp", "init_fingerprint": "seeded:0", "step0_loss": 3.0}]
    assert step0_groups(rows) == {("bf16", "seeded:0"): [1.0, 1.0], ("bf16", "9:abc"): [2.0],
                                  ("autocast", "seeded:0"): [3.0]}


def test_estimates_scale_with_params_and_flops_per_step():
    """[Note: estimates scale with the model]: start-up per billion params beyond 1.31B, a step by
    the FLOPs per rank (batch, seq, checkpointing) or the params, whichever is larger; 5 timed
    steps once a step passes 10 s; the case timeout follows (at least 300 s)."""
    from fairplan import (REF_PARAMS, REF_STEP_FLOPS, case_timeout, expected_seconds, parse_plan,
                          step_flops)
    from run import _preset
    ref = preset("1.3b")
    assert REF_PARAMS == ref.num_params() == _preset("1.3b", 1024).num_params()
    assert REF_STEP_FLOPS == step_flops(ref.flops_per_token(1024), batch=8, seq=1024, checkpointing=False)
    [eng] = parse_plan("engine-auto@4")
    [ds] = parse_plan("ds-zero3@4")

    def est(item, name, batch=8, ckpt=False, steps=20):
        cfg = preset(name)
        return expected_seconds(item, params=cfg.num_params(), warmup=3, steps=steps, cuda=True,
                                flops=step_flops(cfg.flops_per_token(1024), batch=batch, seq=1024,
                                                 checkpointing=ckpt))
    from fairplan import CASES, NVME_STARTUP_S, NVME_STEP_S_PER_B, WORK_EXPONENT
    e, d = CASES["engine-auto"], CASES["ds-zero3"]
    base = est(eng, "1.3b")
    assert base == pytest.approx(e.startup_s + 23 * e.step_s[4])  # the 1.31B numbers, as measured there
    big = preset("30b")
    work = big.flops_per_token(1024) * 8 * 1024 * 4 / 3 / REF_STEP_FLOPS
    assert work > big.num_params() / REF_PARAMS  # at 8x1024 the FLOPs ratio rules
    beyond = (big.num_params() - REF_PARAMS) / 1e9
    startup = e.startup_s + e.startup_per_b * beyond + e.startup_per_rank_b * beyond / 4  # each rank's shard
    assert e.startup_per_rank_b > 0 and d.startup_per_rank_b == 0  # DeepSpeed's start-up is the whole model's
    assert e.work_exponent is None  # the common exponent
    assert est(eng, "30b", ckpt=True) == pytest.approx(startup + (3 + 20) * e.step_s[4] * work ** WORK_EXPONENT)
    ds_startup = d.startup_s + d.startup_per_b * (big.num_params() - REF_PARAMS) / 1e9
    ds_step = d.step_s[4] * work ** d.work_exponent  # DeepSpeed's own exponent (s14/s16 at 6.58B/14B)
    timed = 5 if ds_step > 10 else 20  # a step over 10 s: 5 timed steps
    assert est(ds, "30b", ckpt=True) == pytest.approx(ds_startup + (3 + timed) * ds_step)
    assert est(ds, "30b", ckpt=True, batch=16) == pytest.approx(ds_startup + (3 + 5) * ds_step * 2 ** d.work_exponent)
    # a smaller batch does not make the CPU side's per-param work smaller
    assert est(eng, "30b", batch=1) == pytest.approx(
        startup + 23 * e.step_s[4] * (big.num_params() / REF_PARAMS) ** WORK_EXPONENT)
    assert est(ds, "30b", ckpt=True) - est(eng, "30b", ckpt=True) > 2 * 29  # zero.Init's start-up
    assert case_timeout(base) == 300.0 and case_timeout(est(eng, "30b", ckpt=True)) > 2 * startup
    # session 16 at 14.01B on the 4-GPU node: the estimates cover what ran (ds-zero3 251 s had
    # been priced at 364 and dropped; engine-auto 123 s, fsdp2 229 s), within 35%
    for item, ran in ((eng, 123), (ds, 251), (parse_plan("fsdp2:reshard=1@4")[0], 229)):
        assert ran * 0.85 <= est(item, "14b", ckpt=True) <= ran * 1.35, (item.label, est(item, "14b", ckpt=True))
    # session 22 on 2x H200: engine-auto 148 s at 27.65B and 69 s at 12.75B on 2 ranks, 120 s at
    # 14.01B on one (the whole model's start-up had priced them at 248, 140 and 149 s and dropped
    # the 12.75B row beside FSDP2's); fsdp2 164-231 s, ds-zero3 138-153 s at 6.58B: covered, and
    # not above 1.8x what ran
    for plan, name, ran in (("engine-auto@2", "28b", 148), ("engine-auto@2", "13b", 69),
                            ("engine-auto@1", "14b", 120), ("fsdp2:reshard=1@2", "13b", 164),
                            ("ds-zero3@2", "7b", 138)):
        e2 = est(parse_plan(plan)[0], name, ckpt=True)
        assert ran <= e2 <= ran * 1.8, (plan, name, e2)
    # the optimizer state on NVMe moves at the disk's pace (s16: 15.7 s a step at 1.31B, 162 s a case)
    [nv] = parse_plan("engine:optimizer=nvme@1")
    nvme = est(nv, "1.3b", steps=5)
    assert nvme == pytest.approx(CASES["engine"].startup_s + NVME_STARTUP_S + 8 * NVME_STEP_S_PER_B * REF_PARAMS / 1e9)
    assert 150 <= nvme <= 220
    for name in ("big4", "big4-base", "big1", "7b4"):
        assert parse_plan(name)[0].label == "engine-auto"


def test_driver_dry_run_of_a_30b_plan_imports_no_torch(tmp_path):
    # the driver's estimates read presets.py alone: a 30B plan is priced without torch or a file
    code = ("import sys, runpy; sys.argv = ['run.py', '--plan', 'big4', '--model', '30b', '--init', 'seeded:0', "
            f"'--out', {str(tmp_path)!r}, '--device', 'cpu', '--dry-run', '--checkpointing'];\n"
            "try:\n    runpy.run_path(" + repr(str(FAIR / "run.py")) + ", run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "engine-auto@4" in r.stdout and not (tmp_path / "rows.jsonl").exists()


def test_muon_plan_and_the_ds_stage_knob_of_ds_muon():
    """Issue 25's Muon table in one plan (AdamW offloaded as the reference row: engine's default
    rule, so the summary's "vs engine" column stands), and ds-muon's stage knob: the stages
    DeepSpeed runs Muon at without offload, refused elsewhere and beyond them."""
    from case import parse_args
    from fairplan import CASES, parse_plan
    items = parse_plan("muon")
    assert [(i.label, i.world) for i in items] == [
        ("engine[opt=muon]", 1), ("engine", 1), ("engine-auto[opt=muon]", 1), ("offload-adamw[opt=muon]", 1),
        ("torch-opt[opt=muon]", 1), ("ds-muon", 1), ("torch-opt", 1), ("ds-muon[ds-stage=1]", 1)]
    assert items[-1].case_args() == ["--ds-stage", "1"] and items[5].case_args() == []
    assert CASES["ds-muon"].gpu_only and "no offload" in CASES["ds-muon"].recipe
    with pytest.raises(ValueError, match="ds-stage=3: DeepSpeed runs Muon at ZeRO stage 1 or 2 here"):
        parse_plan("ds-muon:ds-stage=3@1")
    with pytest.raises(ValueError, match="case ds-zero2 takes no knob 'ds-stage'"):
        parse_plan("ds-zero2:ds-stage=1@1")
    base = ["--case", "ds-muon", "--threads", "1", "--init", "x", "--json-out", "y"]
    assert parse_args(base).ds_stage == "2" and parse_args(base + ["--ds-stage", "1"]).ds_stage == "1"
    with pytest.raises(SystemExit):
        parse_args(base + ["--ds-stage", "0"])


def test_ds_muon_config_is_torch_muons_recipe_without_offload():
    import argparse
    from case import BETAS, EPS, LR, WD, ds_muon_config
    two, one = (ds_muon_config(argparse.Namespace(ds_stage=s, batch=3)) for s in ("2", "1"))
    for conf in (two, one):
        assert "offload" not in json.dumps(conf) and conf["bf16"] == {"enabled": True}
        assert conf["train_micro_batch_size_per_gpu"] == 3 and conf["gradient_clipping"] == 0.0
        assert conf["optimizer"] == {"type": "Muon", "params": {
            "lr": LR, "weight_decay": WD, "momentum": torch.optim.Muon([torch.zeros(2, 2)]).defaults["momentum"],
            "ns_method": "standard", "betas": list(BETAS), "eps": EPS, "torch_adam": True}}
    assert two["zero_optimization"]["stage"] == 2 and two["zero_optimization"]["overlap_comm"] and "data_types" not in two
    assert one["zero_optimization"] == {"stage": 1} and one["data_types"] == {"grad_accum_dtype": "fp32"}


def _ds_name_rule(config_class, model):
    """deepspeed 0.19.8's set_optimizer_flags for a model without zero.Init: Muon for 2-D params
    whose names hold neither "embed" nor "lm_head"."""
    for name, p in model.named_parameters():
        p.use_muon = p.dim() >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def _fake_deepspeed(monkeypatch, *, fail=False, own_rule=False):
    """A stand-in for ``deepspeed`` whose initialize tags params the way 0.19.8's does (through the
    module's set_optimizer_flags, or, with own_rule, through a reference it holds itself) and
    returns an engine whose optimizer is a MuonWithAuxAdam with one group per half."""
    import types
    ds = types.ModuleType("deepspeed")
    ds.__version__ = "0.19.8-fake"
    ds.set_optimizer_flags = _ds_name_rule
    ds.models = []

    def initialize(model, model_parameters, config):
        ds.models.append(model)
        (_ds_name_rule if own_rule else ds.set_optimizer_flags)(None, model)
        if fail:
            raise RuntimeError("initialize failed")
        params = list(model_parameters)
        muon = type("MuonWithAuxAdam", (), {})()
        muon.param_groups = [{"params": [p for p in params if p.use_muon is h], "use_muon": h} for h in (True, False)]
        muon.aux_optimizer = torch.optim.AdamW([torch.zeros(1)])
        engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(optimizer=muon), module=model)
        return engine, muon, None, None
    ds.initialize = initialize
    monkeypatch.setitem(sys.modules, "deepspeed", ds)
    return ds


def test_ds_muon_gives_muon_torch_opts_params_and_says_what_it_retagged(monkeypatch):
    """[Note: ds-muon's split] DeepSpeed's name rule would give Muon the tied embedding/head (wte)
    and wpe; ds-muon tags torch-opt[opt=muon]'s split for the one initialize call, records the
    names it changed, puts DeepSpeed's function back (also when initialize fails), and refuses a
    DeepSpeed that tags without it."""
    import argparse
    from case import CaseError, _torch_rule, build_ds_muon
    cfg = preset(MODEL, seq_len=SEQ)
    sd = GPT(cfg).state_dict()
    args = argparse.Namespace(ds_stage="2", batch=BATCH, checkpointing=False)
    ds = _fake_deepspeed(monkeypatch)
    runner = build_ds_muon(args, cfg, torch.device("cpu"), 1, sd)
    assert ds.set_optimizer_flags is _ds_name_rule
    model, = ds.models
    facts = runner.extra()
    assert facts["ds_muon_retagged"] == ["wte.weight", "wpe.weight"] and facts["ds_aux_adam"] == "AdamW"
    torch_muon = {id(p) for p in _torch_rule("muon", model).opts[0].param_groups[0]["params"]}
    assert {id(p) for p in model.parameters() if p.use_muon} == torch_muon
    assert facts["muon_params"] == sum(p.numel() for p in model.parameters() if id(p) in torch_muon)
    assert [g["numel"] for g in facts["ds_param_groups"]] == [
        facts["muon_params"], sum(p.numel() for p in model.parameters()) - facts["muon_params"]]

    ds = _fake_deepspeed(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="initialize failed"):
        build_ds_muon(args, cfg, torch.device("cpu"), 1, sd)
    assert ds.set_optimizer_flags is _ds_name_rule
    _fake_deepspeed(monkeypatch, own_rule=True)
    with pytest.raises(CaseError, match=r"use_muon off torch's split on \['wte.weight', 'wpe.weight'\]"):
        build_ds_muon(args, cfg, torch.device("cpu"), 1, sd)


def test_nvme_on_the_same_machine_and_placement_both_engines(tmp_path):
    """Issue 22: our engine with its optimizer state on NVMe (params on the host) beside DeepSpeed
    ZeRO-3 with offload_optimizer on NVMe (ZeRO-Infinity; offload_param cpu): the knobs, the
    DeepSpeed config its docs give, a clear error without a swap directory, and on the CPU the
    engine's case training from the same weights in a swap directory the driver made and removed."""
    import argparse
    from case import CaseError, ds_config
    from fairplan import parse_plan
    engine, ds = parse_plan("engine:optimizer=nvme@1 ds-zero3:nvme=1@1")
    assert engine.case_args() == ["--engine-optimizer", "nvme"] and ds.case_args() == ["--ds-nvme", "1"]
    with pytest.raises(ValueError, match="engine-optimizer=gpu: choose from cpu, nvme"):
        parse_plan("engine:optimizer=gpu@1")
    with pytest.raises(ValueError, match="case ds-zero2 takes no knob 'ds-nvme'"):
        parse_plan("ds-zero2:nvme=1@1")
    cfg = preset("tiny")
    args = argparse.Namespace(batch=2, ds_reduce_bucket=None, ds_prefetch_bucket=None, ds_sub_group=None,
                              ds_ratio="0.5", ds_nvme="1", nvme_dir=str(tmp_path / "ds"))
    conf = ds_config(args, cfg, 1, "ds-zero3")
    zero = conf["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": str(tmp_path / "ds"), "pin_memory": True,
                                         "buffer_count": 4, "fast_init": False}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert conf["aio"]["block_size"] == 1 << 20 and conf["aio"]["queue_depth"] == 8
    assert "aio" not in ds_config(argparse.Namespace(**{**vars(args), "ds_nvme": "0"}), cfg, 1, "ds-zero3")
    with pytest.raises(CaseError, match="ds-nvme=1 needs a swap directory: give the run --nvme-dir"):
        ds_config(argparse.Namespace(**{**vars(args), "nvme_dir": None}), cfg, 1, "ds-zero3")

    make_init(["--model", MODEL, "--seq", str(SEQ), "--init-std", str(STD), "--out", str(tmp_path / "init.pt")])
    swap = tmp_path / "swap"
    r, rows, _ = _driver(tmp_path, "--plan", "engine:optimizer=nvme@1", "--nvme-dir", str(swap))
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    [row] = rows
    assert row["error"] is None and row["config"]["offload_config"]["optimizer"] == "nvme"
    assert abs(row["step0_loss"] - _reference_losses(0)["engine"]) < 1e-3 * row["step0_loss"]
    assert swap.is_dir() and list(swap.iterdir()) == []  # the case's own directory made and removed


def test_the_profile_knob_traces_untimed_steps_after_the_timed_ones(tmp_path):
    """``profile=N``: N steps after the timed ones under torch.profiler; rank 0's Chrome trace
    (gzipped) lands beside the row's JSON in the log dir and its log holds the top ops. The timed
    steps are the same two as without it."""
    import gzip
    from fairplan import parse_plan
    [item] = parse_plan("engine-auto:profile=2@1")
    assert item.case_args() == ["--profile", "2"]
    make_init(["--model", MODEL, "--seq", str(SEQ), "--init-std", str(STD), "--out", str(tmp_path / "init.pt")])
    logs = tmp_path / "logs"
    r, rows, out = _driver(tmp_path, "--plan", "engine-auto:profile=2@1", "--log-dir", str(logs))
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    [row] = rows
    assert row["error"] is None and row["profiled_steps"] == 2 and len(row["step_times"]) == 2
    [trace] = list(logs.rglob("*_trace_r0.json.gz"))
    with gzip.open(trace, "rt") as f:
        assert json.load(f)["traceEvents"]
    [log] = [p for p in logs.rglob("*.log") if "engine-auto" in p.name]
    text = log.read_text()
    assert "Self CPU" in text and "profiled 2 steps (not timed)" in text
    summary = (out / "summary.md").read_text()  # the row's notes: the profile, the engine's init parts
    assert "2 untimed steps profiled" in summary and "init homes " in summary
    from fairplan import parse_plan as plan
    assert [i.label for i in plan("gap4")] == ["engine-auto[profile=3]", "ddp[profile=3]"] * 2


def test_the_notes_say_when_the_engine_replicated_the_params():
    """A skeptic reads the mode of each engine row: replicas (at initialize, or added by the
    measured first step) or none."""
    from summarize import _notes
    row = {"engine_stats": {"placement": {"replicas": True, "replicas_added": False}}}
    assert _notes(row) == "params replicated on every GPU"
    row["engine_stats"]["placement"]["replicas_added"] = True
    assert _notes(row) == "params replicated on every GPU (added by the measured first step)"
    assert _notes({"engine_stats": {"placement": {"replicas": False}}}) == "" == _notes({})


def test_the_notes_say_how_much_of_the_state_the_gpu_share_holds():
    """A partial GPU share is named (chunks of the rank's trainable ones); a whole one or none is
    not (the placement says so elsewhere)."""
    from summarize import _notes
    share = {"chunks": 44, "host_chunks": 6, "nvme_chunks": 0}
    assert _notes({"engine_stats": {"placement": {"share": share}}}) == "GPU share 44 of 50 chunks"
    share.update(host_chunks=0)
    assert _notes({"engine_stats": {"placement": {"share": share}}}) == ""
    assert _notes({"engine_stats": {"placement": {"share": {"chunks": 0, "host_chunks": 50}}}}) == ""


def test_the_moments_knob_runs_bf16_moments_and_the_row_names_the_difference(tmp_path):
    """Issue 24's opt-in bf16 moments through the harness: ``moments=bf16`` reaches
    ``OffloadConfig.moments_dtype`` of the engine cases only, and the row's recipe says the moments
    are bf16 and inexact (its step-0 loss is the fp32 row's: the moments act after step 0)."""
    from fairplan import parse_plan
    items = parse_plan("engine:moments=bf16@1 engine-auto:moments=fp32@1")
    assert items[0].label == "engine[moments=bf16]" and items[0].case_args() == ["--engine-moments", "bf16"]
    with pytest.raises(ValueError, match="case ddp takes no knob"):
        parse_plan("ddp:moments=bf16@1")
    with pytest.raises(ValueError, match="fp16"):
        parse_plan("engine:moments=fp16@1")
    from fairplan import recipe
    assert "bf16 moments" in recipe("engine-auto", {"engine-moments": "bf16"})  # a not-run row says it too
    assert recipe("engine", {}) == recipe("engine", {"engine-moments": "fp32"})
    r, rows, _ = _driver(tmp_path, "--plan", "engine@1 engine:moments=bf16@1", "--seed", "3", "--init", "seeded:0")
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    by = {row["label"]: row for row in rows}
    assert by["engine[moments=bf16]"]["error"] is None, by["engine[moments=bf16]"]["error"]
    assert by["engine[moments=bf16]"]["config"]["offload_config"]["moments_dtype"] == "bf16"
    assert by["engine"]["config"]["offload_config"]["moments_dtype"] == "fp32"
    assert "bf16 moments" in by["engine[moments=bf16]"]["recipe"] and "inexact" in by["engine[moments=bf16]"]["recipe"]
    assert "bf16 moments" not in by["engine"]["recipe"]
    assert by["engine[moments=bf16]"]["step0_loss"] == by["engine"]["step0_loss"]
