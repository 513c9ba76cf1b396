"""bench adam: the torch composite of case (b) allocates nothing per step, DeepSpeedCPUAdam gets
its rows (timed when it runs, "not available: <reason>" when it does not), every implementation
runs on the --threads count, and % of RMW bandwidth is given only beyond the L3 cache. Tiny sizes;
the command runs in-process (_cli_util)."""
import json
import os
import sys
import types

import torch
from torch.profiler import ProfilerActivity, profile

from zero_offload.bench import cpu_adam
from zero_offload.bench.cpu_adam import HYPER, Composite, Result, finish

from _cli_util import in_process

TINY = ["--sizes", "2K", "--repeats", "1", "--rmw-gib", "0.001", "--gap-ms", "0", "--no-foreach"]


def allocated_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.cpu_memory_usage, 0) for e in prof.events())


def test_torch_composite_allocates_nothing_per_step():
    n = 100_000
    gen = torch.Generator().manual_seed(0)
    init, grad16 = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    comp = Composite(init.clone().requires_grad_(), grad16, lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER))
    comp()  # the optimizer's lazy state
    ptrs = (comp.param.grad.data_ptr(), comp.out.data_ptr(), comp.g32.data_ptr())
    assert comp.param.grad is comp.g32
    # the old composite (p.grad = grad16.float(); ...; p.to(bfloat16)) allocated 6 B/param a step
    assert allocated_bytes(comp) < n
    comp()
    assert (comp.param.grad.data_ptr(), comp.out.data_ptr(), comp.g32.data_ptr()) == ptrs
    # and it is the update it stands for: fused AdamW on the widened grad, the bf16 copy out
    ref = init.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], fused=True, **HYPER)
    for _ in range(3):
        ref.grad = grad16.float()
        opt.step()
    assert torch.equal(comp.param.detach(), ref.detach())
    assert torch.equal(comp.out, ref.detach().to(torch.bfloat16))


def fake_deepspeed(monkeypatch, cls):
    """`from deepspeed.ops.adam import DeepSpeedCPUAdam` gives ``cls``."""
    adam = types.ModuleType("deepspeed.ops.adam")
    adam.DeepSpeedCPUAdam = cls
    for name, mod in (("deepspeed", types.ModuleType("deepspeed")), ("deepspeed.ops", types.ModuleType("deepspeed.ops")),
                      ("deepspeed.ops.adam", adam)):
        monkeypatch.setitem(sys.modules, name, mod)


def bench_adam(capfd, tmp_path, *flags):
    r = in_process(capfd, "bench", "adam", "--threads", "1", *TINY, *flags,
                   "--json-out", str(tmp_path / "a.json"), "--md-out", str(tmp_path / "a.md"))
    assert r.returncode == 0, r.stderr
    return r, json.loads((tmp_path / "a.json").read_text()), (tmp_path / "a.md").read_text()


def test_deepspeed_rows_say_not_available_without_deepspeed(capfd, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed...` raises ImportError
    r, record, md = bench_adam(capfd, tmp_path)
    assert "DeepSpeedCPUAdam: not available: ModuleNotFoundError: " in r.stdout
    assert "| a | 0.002M | DeepSpeedCPUAdam | not available: ModuleNotFoundError: " in md
    assert "| b | 0.002M | DeepSpeedCPUAdam composite | not available: ModuleNotFoundError: " in md
    rows = [x for x in record["results"] if x["impl"].startswith("DeepSpeedCPUAdam")]
    assert len(rows) == 2 and all(x["note"].startswith("not available: ") and not x["seconds"] for x in rows)
    assert record["meta"]["deepspeed"].startswith("not available: ModuleNotFoundError")


def test_deepspeed_op_that_cannot_build_is_not_available_in_one_line(capfd, monkeypatch, tmp_path):
    class NoOp(torch.optim.Optimizer):
        def __init__(self, params, **kwargs):
            raise RuntimeError("DeepSpeedCPUAdam requires the cpu_adam op, which failed to build/load.")

    fake_deepspeed(monkeypatch, NoOp)
    r, record, md = bench_adam(capfd, tmp_path, "--cases", "a")
    line = ("| a | 0.002M | DeepSpeedCPUAdam | not available: RuntimeError: DeepSpeedCPUAdam requires the "
            "cpu_adam op, which failed to build/load. |")
    assert line in md
    assert "| b |" not in md  # case b was not asked for


def test_deepspeed_is_timed_in_both_cases_on_the_threads_asked(capfd, monkeypatch, tmp_path):
    seen = []

    class FakeDS(torch.optim.AdamW):  # DeepSpeedCPUAdam's signature, torch's AdamW's update
        def __init__(self, params, *, adamw_mode, **kwargs):
            assert adamw_mode
            seen.append(os.environ.get("OMP_NUM_THREADS"))
            super().__init__(params, **kwargs)

    fake_deepspeed(monkeypatch, FakeDS)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _, record, md = bench_adam(capfd, tmp_path)
    assert "OMP_NUM_THREADS" not in os.environ  # put back after the run
    assert seen and set(seen) == {"1"}
    rows = {(x["case"], x["impl"]): x for x in record["results"]}
    for key in (("a", "DeepSpeedCPUAdam"), ("b", "DeepSpeedCPUAdam composite")):
        assert rows[key]["note"] is None and len(rows[key]["seconds"]) == 1 and rows[key]["median_s"] > 0
    meta = record["meta"]
    assert (meta["threads"], meta["torch_threads"], meta["omp_num_threads"], meta["sizes"]) == (1, 1, "1", [2000])
    assert meta["deepspeed"] == "available"
    assert "| b | 0.002M | DeepSpeedCPUAdam composite | " in md


def test_pct_of_rmw_only_beyond_the_l3_cache():
    rows = [Result(case="a", impl="torch Adam fused", numel=1000, median_s=1e-3, mparams_per_s=1.0, gb_per_s=1.0),
            Result(case="a", impl="torch Adam fused", numel=10**6, median_s=1e-3, mparams_per_s=1.0, gb_per_s=1.0),
            Result(case="rmw", impl=cpu_adam.RMW, numel=1000, median_s=1e-3, gb_per_s=2.0),
            Result(case="rmw", impl=cpu_adam.RMW, numel=10**6, median_s=1e-3, gb_per_s=2.0)]
    l3 = 1 << 20  # 28 B/param: 1000 params fit twice the L3, 10**6 do not
    pct = {(r.case, r.numel): r.pct_of_rmw for r in finish(rows, l3=l3, rmw_bytes=4 * l3)}
    assert pct == {("a", 1000): None, ("a", 10**6): 50.0, ("rmw", 1000): 100.0, ("rmw", 10**6): 100.0}
    # an RMW buffer that fits the cache is no DRAM reference: no percentage at all
    assert all(r.pct_of_rmw is None for r in finish(rows, l3=l3, rmw_bytes=l3))
