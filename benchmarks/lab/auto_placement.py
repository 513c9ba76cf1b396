"""What optimizer="auto" places for a preset GPT on 1/2/4 GPUs of a node, from the planner alone
(runtime/placement.py; no GPU needed): the first plan (half the GPU budget left to the first step's
activations, less where the host cannot hold the rest: [Note: auto reserve]; each row's
reserve_gib) and the plan grown after a measured step whose peak is the store's homes plus an
assumed activation peak. Budgets as the engine resolves "auto" ones: the card's free memory less
10% of its size per GPU; the host's available memory less 10%, divided by the ranks.

    python benchmarks/lab/auto_placement.py --preset 1.3b --card-gib 79.65 --act-gib 17
    # session 22's largest on 2x H200: 27.65B exact (it ran with a 30 GiB first-step reserve set
    # by hand; "auto" now lowers its own); 30.53B exact does not fit (the row says why), with
    # bf16 moments it does
    python benchmarks/lab/auto_placement.py --preset 28b --ranks 2 --card-gib 139.8 --host-gib 245 \
        --act-gib 35
    # session 23's largest on 4x H200: 51.82B exact (35 GiB set by hand then)
    python benchmarks/lab/auto_placement.py --preset 52b --ranks 4 --card-gib 139.8 --host-gib 495 \
        --act-gib 36
    python benchmarks/lab/auto_placement.py --preset 30b --ranks 2 --card-gib 139.8 --host-gib 245 \
        --act-gib 35 --reserve-gib 30 --moments bf16
"""
import argparse
import json

import torch

from zero_offload.models import GPT
from zero_offload.presets import preset
from zero_offload.runtime.partition import partition_parameters
from zero_offload.runtime.placement import (Budgets, ChunkNeed, FitError, Measured, PlacementRequest,
                                            grow_share, plan_placement)
from zero_offload.runtime.store import Tier
from zero_offload.runtime.update_rule import AdamRule
from zero_offload.runtime.vocab import Placement

GiB = 1 << 30


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="1.3b")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--card-gib", type=float, default=79.65, help="the card's size (H100 SXM: 79.65)")
    ap.add_argument("--context-gib", type=float, default=0.5, help="CUDA context and NCCL at init")
    ap.add_argument("--host-gib", type=float, default=503.0, help="the node's available host memory")
    ap.add_argument("--act-gib", type=float, default=17.0,
                    help="the step's device peak beyond the store (activations, logits, allocator)")
    ap.add_argument("--gpu-budget-gib", type=float, default=None, help="an explicit gpu_budget")
    ap.add_argument("--chunk-mb", type=float, default=64.0)
    ap.add_argument("--reserve-gib", type=float, default=None,
                    help="OffloadConfig.activation_reserve of the first plan (default \"auto\": half the budget)")
    ap.add_argument("--moments", choices=("fp32", "bf16"), default="fp32", help="OffloadConfig.moments_dtype")
    args = ap.parse_args()

    with torch.device("meta"):
        model = GPT(preset(args.preset))
    dtype = torch.bfloat16
    part = partition_parameters(model, chunk_numel=int(args.chunk_mb * 2**20) // dtype.itemsize)
    params = sum(c.numel for c in part.chunks)
    card, free = int(args.card_gib * GiB), int((args.card_gib - args.context_gib) * GiB)
    rows = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        gpu = int(args.gpu_budget_gib * GiB) if args.gpu_budget_gib else max(0, free - card // 10)
        cpu = int(args.host_gib * 0.9 * GiB) // ranks
        request = PlacementRequest(
            chunks=tuple(ChunkNeed(numel=-(-c.numel // ranks), dtype=dtype, trainable=c.trainable)
                         for c in part.chunks),
            budgets=Budgets(gpu=gpu, cpu=cpu), params=Placement.AUTO, optimizer=Placement.AUTO,
            rule=AdamRule(moments_dtype=args.moments), prefetch_depth=2, gpu_optimizer=True, ranks=ranks,
            reserve="auto" if args.reserve_gib is None else int(args.reserve_gib * GiB))
        try:
            first = plan_placement(request)
        except FitError as e:  # the engine would refuse at initialize, before allocating: say so
            rows.append({"preset": args.preset, "params": params, "ranks": ranks, "plan": "first step",
                         "fits": False, "why": str(e).split(". ")[0]})
            continue
        peak = first.need[Tier.GPU] + int(args.act_gib * GiB)
        grown = grow_share(first, Measured(device_limit=free, device_peak=peak,
                                          store_peak=first.need[Tier.GPU]))
        for name, plan in (("first step", first), ("after it", grown)):
            r = plan.report()
            rows.append({"preset": args.preset, "params": params, "ranks": ranks, "plan": name,
                         "gpu_budget_gib": round(gpu / GiB, 2), "reserve_gib": round(r["reserve"] / GiB, 2),
                         "gpu_homes_gib": round(r["tiers"]["gpu"]["homes"] / GiB, 2),
                         "gpu_state_gib": round(r["tiers"]["gpu"]["optimizer"] / GiB, 2),
                         "cpu_state_gib": round(r["tiers"]["cpu"]["optimizer"] / GiB, 2),
                         "cpu_homes_gib": round(r["tiers"]["cpu"]["homes"] / GiB, 2),
                         "share": f'{r["share"]["chunks"]}/{r["share"]["chunks"] + r["share"]["host_chunks"] + r["share"]["nvme_chunks"]}',
                         "gpu_expected_peak_gib": round((plan.need[Tier.GPU] + int(args.act_gib * GiB)) / GiB, 2),
                         "why": r["why"]})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
