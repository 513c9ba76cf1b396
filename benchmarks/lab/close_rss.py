"""Peak host RSS during Engine.close (Linux): a 0.5B-param fp32 model of Linear layers built on
meta, params and optimizer on the CPU (16 B/param of state), one step, then the peak (VmHWM)
is reset right before close. Before/after a change, run it with PYTHONPATH pointing at each
tree: ``PYTHONPATH=<tree>/src python benchmarks/lab/close_rss.py``."""
import gc
import time

import torch

import zero_offload as zo


def st(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


width, depth = 4096, 30
with torch.device("meta"):
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
n = sum(p.numel() for p in model.parameters())


def init(name, t):
    torch.nn.init.normal_(t, std=0.01)


cfg = zo.OffloadConfig(params="cpu", optimizer="cpu", dtype="fp32", gpu_budget=4 << 30,
                       cpu_budget=12 << 30, threads=2)
engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-4), config=cfg, device="cpu", init=init)
x = torch.randn(2, width)
engine.backward(engine(x).square().mean()); engine.step()
engine.synchronize(); gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = st("VmRSS:")
t0 = time.perf_counter()
engine.close()
dt = time.perf_counter() - t0
G = 2**30
print(f"params {n/1e9:.3f}B: RSS before close {before/G:.2f} GiB, peak during close {st('VmHWM:')/G:.2f} GiB "
      f"(+{(st('VmHWM:')-before)/G:.2f}), after {st('VmRSS:')/G:.2f} GiB; close {dt:.1f} s")
