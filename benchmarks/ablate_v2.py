"""Ablation runner for the v2 H100 run: bench_train with parts of commit f30bd3e switched off
(monkeypatched). Usage: python benchmarks/ablate_v2.py {old,pick_only,fetch_only,new} <bench_train args>."""
import runpy, sys
variant = sys.argv[1]
sys.argv = ["benchmarks/bench_train.py"] + sys.argv[2:]
import zero_offload.pipeline as P, zero_offload.engine as E
if variant in ("old", "fetch_only"):
    P.StepPipeline._pick = lambda self: self._runnable()[0]
if variant in ("old", "pick_only"):
    E.Engine._chunk_ready = lambda self, cid: None
runpy.run_path("benchmarks/bench_train.py", run_name="__main__")
