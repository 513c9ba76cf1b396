"""Write the initial weights every fair case starts from: ``GPT(preset)`` built on the CPU in
fp32 after ``torch.manual_seed(seed)`` (seed 0: the models' own init), saved as a state dict with
its config, for ``torch.load(path, mmap=True)``.

    python benchmarks/fair/make_init.py --model 1.3b --out /dev/shm/init_1.3b.pt

The file appears only when whole (written beside it, then renamed). ``--init-std`` overrides the
config's init_std: the CPU test uses a large one so the step-0 loss depends on the weights.
"""
import argparse
import dataclasses
import os
import sys
import time

import torch

from zero_offload.models import GPT, preset


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1.3b")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    over = {}
    if args.seq:
        over["seq_len"] = args.seq
    if args.init_std:
        over["init_std"] = args.init_std
    cfg = preset(args.model, **over)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    blob = {"format": "zo-fair-init-1", "model": args.model, "seed": args.seed,
            "config": dataclasses.asdict(cfg), "state_dict": model.state_dict()}
    tmp = f"{args.out}.tmp{os.getpid()}"
    try:
        torch.save(blob, tmp)
        os.replace(tmp, args.out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    print(f"[make_init] {args.model}: {cfg.num_params() / 1e9:.3f}B params, seed {args.seed} -> {args.out} "
          f"({os.path.getsize(args.out) / 2**30:.2f} GiB, {time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
