"""OffloadAdamW on several GPUs of one node, under torchrun: tokens/s and host RSS per case.

    torchrun --nproc-per-node N benchmarks/bench_dp.py --model 1.3b --batch 8 \\
        --cases ddp-offload,fsdp2-offload,fsdp2-cpuoffload,ddp-torch --json-out dp_nN.json

Cases (fp32 params, bf16 autocast, batch ``--batch`` sequences per rank, AdamW lr 1e-4 wd 0.1):
- ``ddp-offload``: DDP + ``zero_offload.OffloadAdamW(overlap_forward=True)`` (each rank keeps
  and updates 1/N of the state on its CPU cores; the updated shards are all-gathered module by
  module in the next forward: ZeRO-2 + offload; on one GPU the update overlaps backward and the
  next forward);
- ``fsdp2-offload``: FSDP2 (``fully_shard`` per block and the root) + ``OffloadAdamW`` on the
  local shards;
- ``fsdp2-cpuoffload``: FSDP2 with ``CPUOffloadPolicy`` + ``torch.optim.AdamW`` on the CPU
  shards (PyTorch's own CPU offload);
- ``ddp-torch``: DDP + fused AdamW on the GPU (no offload: the ceiling);
- ``engine``: ``zero_offload.initialize`` (params and optimizer state on the CPU, bf16, each
  rank holding 1/N of every chunk, a chunk's params all-gathered while it is used; the model is
  built on the meta device and filled by ``initialize`` with ``GPT.init_param``);
- ``engine-gpu``: the same with ``params="gpu"``: a params replica per GPU, gathered once per
  step after the update (ZeRO-2 + offload, the original ZeRO-Offload schedule);
- ``engine-bind``: ``engine`` with ``bind_cores=True`` (each rank's threads on its own block of
  cores instead of floating over every core);
- ``engine-largest``: ``engine`` with ``optimizer="auto"`` (host memory first, then NVMe files
  under ``--nvme-dir``, each rank its share of both) for the largest model of the node (use
  ``--checkpointing``);
- ``engine-auto``: ``engine`` with params and optimizer "auto" (the device first: each rank's
  shard of the state on its GPU where it fits, the share grown after the first step);
- ``ds-zero3``: DeepSpeed ZeRO-3 with params and optimizer offloaded to the CPU (the config of
  ../shared/BASELINES.md; its wheel: ../shared/wheels/README.md).
Rank 0 prints one line per case and writes the JSON: median step time over ``--steps`` timed
steps (after ``--warmup``), global tokens/s, peak host RSS of every rank (sampled every 20 ms)
and their sum, GPU peak of rank 0.
"""
import argparse
import datetime
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench_train import RssSampler  # (this directory: the same sampler as bench_train's)
from zero_offload import OffloadAdamW
from zero_offload.models import GPT, preset


class EngineStep:
    """zero_offload's engine behind the loop's model/optimizer face."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, x, y):
        return self.engine(x, y)

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def zero_grad(self, set_to_none=True):
        pass

    def close(self):
        self.engine.close()


def build(case, cfg, device, world, args):
    torch.manual_seed(0)
    if case in ("engine", "engine-gpu", "engine-bind", "engine-largest", "engine-auto"):
        import zero_offload as zo
        model = GPT(cfg, device="meta")  # no memory: initialize fills the tiers chunk by chunk
        model.set_activation_checkpointing(args.checkpointing)
        largest = case == "engine-largest"
        engine = zo.initialize(model, optimizer=zo.AdamW(lr=1e-4, weight_decay=0.1), device=device,
                               init=model.init_param,
                               config=zo.OffloadConfig(params={"engine-gpu": "gpu", "engine-auto": "auto"}.get(case, "cpu"),
                                                       optimizer="auto" if largest or case == "engine-auto" else "cpu",
                                                       dtype="bf16",
                                                       nvme_dir=args.nvme_dir if largest else None,
                                                       bind_cores=case == "engine-bind"))
        wrapped = EngineStep(engine)
        return wrapped, wrapped
    if case == "ds-zero3":
        import deepspeed
        h = cfg.d_model
        ds_cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                  "bf16": {"enabled": True},
                  "zero_optimization": {
                      "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                      "reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                      "stage3_param_persistence_threshold": 10 * h, "sub_group_size": int(1e9),
                      "offload_param": {"device": "cpu", "pin_memory": True},
                      "offload_optimizer": {"device": "cpu", "pin_memory": True}},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
        with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
            model = GPT(cfg)
        deepspeed.zero.register_external_parameter(model, model.wte.weight)
        ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)

        class DSStep:
            def __call__(self, x, y):
                return ds(x, y)

            def backward(self, loss):
                ds.backward(loss)

            def step(self):
                ds.step()

            def zero_grad(self, set_to_none=True):
                pass
        w = DSStep()
        return w, w
    model = GPT(cfg, device=device)
    if case.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(model, device_ids=[device.index]) if world > 1 else model
        opt = (OffloadAdamW(model.parameters(), lr=1e-4, weight_decay=0.1, overlap_forward=True)
               if case == "ddp-offload"
               else torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True))
        return wrapped, opt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    mesh = init_device_mesh("cuda", (world,))
    kw = {"offload_policy": CPUOffloadPolicy()} if case == "fsdp2-cpuoffload" else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    if case == "fsdp2-offload":
        return model, OffloadAdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    return model, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cases", default="ddp-offload,fsdp2-offload,fsdp2-cpuoffload,ddp-torch")
    ap.add_argument("--json-out")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    ap.add_argument("--nvme-dir", default="/tmp/zo_dp", help="engine-largest: swap directory")
    args = ap.parse_args()
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    cfg = preset(args.model)
    rss = RssSampler()
    g = torch.Generator().manual_seed(1 + rank)
    results = []
    for case in args.cases.split(","):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        rss.reset()
        t_init = time.perf_counter()
        model, opt = build(case, cfg, device, world, args)
        init_s = time.perf_counter() - t_init
        times, losses = [], []
        for i in range(args.warmup + args.steps):
            x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g).to(device)
            y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g).to(device)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if i == args.warmup and isinstance(model, EngineStep):
                model.engine.reset_stats()
            if case.startswith("engine") or case == "ds-zero3":  # bf16 by their own configs
                loss = model(x, y)
                model.backward(loss)
            else:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x, y)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        peaks = [None] * world
        dist.all_gather_object(peaks, rss.peak)
        med = statistics.median(times)
        tokens = world * args.batch * cfg.seq_len
        r = {"case": case, "world": world, "median_s": med, "step_times": times, "init_s": init_s,
             "tokens_per_s": tokens / med, "rss_peak_per_rank_gib": [p / 2**30 for p in peaks],
             "model_tflops_per_gpu": cfg.flops_per_token(cfg.seq_len) * tokens / med / world / 1e12,
             "rss_peak_node_gib": sum(peaks) / 2**30,
             "gpu_peak_gib_rank0": torch.cuda.max_memory_allocated(device) / 2**30,
             "params": sum(p.numel() for p in GPT(cfg, device="meta").parameters()),
             "losses": losses, "gpu": torch.cuda.get_device_name(device)}
        if isinstance(model, EngineStep):
            r["engine_stats"] = model.engine.stats().as_dict()
        results.append(r)
        if rank == 0:
            print(f"[{case} x{world}] {med:.3f} s/step, {r['tokens_per_s']:,.0f} tok/s, host RSS node "
                  f"{r['rss_peak_node_gib']:.1f} GiB (per rank {', '.join(f'{p:.1f}' for p in r['rss_peak_per_rank_gib'])}), "
                  f"GPU {r['gpu_peak_gib_rank0']:.1f} GiB, {r['model_tflops_per_gpu']:.0f} TFLOPS/GPU, "
                  f"init {init_s:.0f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
                  + (", rank 0 holds GiB " + ", ".join(f"{t} {b / 2**30:.1f}" for t, b in
                                                       model.engine.stats().bytes_held.items())
                     if isinstance(model, EngineStep) else ""), flush=True)
        if rank == 0 and args.json_out:  # after every case: a later case that fails loses nothing
            with open(args.json_out, "w") as f:
                json.dump({"results": results, "args": vars(args)}, f, indent=1)
        if hasattr(opt, "close"):
            opt.close()
        del model, opt
        dist.barrier()
    rss.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
