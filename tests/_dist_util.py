"""Runs a test function on N CPU processes joined by gloo (torch.distributed), each in its own
process, and returns what each rank returned or raised; a rank that neither returns nor raises
within the timeout is killed and reported as hung. Rank functions live at module level in test
files (the rank process imports them by name).

The processes come from a fork server that imported torch and zero_offload once (``_context``),
not from ``spawn``, which imported torch again for every rank of every test: about 2.5 s per
``run_ranks`` on the 2-core CI machine against 0.1 s, over a hundred calls in the suite. The
server has computed nothing (no OpenMP pool, no CUDA context: a rank starts its own), and each
rank takes the parent's environment as it is at the call, as a spawned one would."""
import datetime
import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "zero_offload.engine", "zero_offload.offload_optim"]
_ctx = None


def _context():
    """The fork server's multiprocessing context, its preloads set before it first starts."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world, port, out_dir, args, timeout_s, backend="gloo", init_group=True, env=None):
    import torch
    import torch.distributed as dist

    if env is not None:  # the caller's environment now, not the fork server's from its start
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    result = {"rank": rank}
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if init_group:
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        result["value"] = fn(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        try:
            result["error"] = f"{type(e).__name__}: {e}"
        except Exception:  # an exception whose str() fails
            result["error"] = type(e).__name__
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn, world, tmp_path, *args, timeout_s=60, collective_timeout_s=30, backend="gloo",
              init_group=True):
    """``fn(rank, world, *args)`` on ``world`` processes; returns a list of result dicts.
    ``backend="nccl"``: rank r drives GPU r. ``init_group=False``: the launcher's environment
    only (as torchrun sets it), no process group."""
    os.makedirs(tmp_path, exist_ok=True)
    ctx = _context()
    port = _free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, str(tmp_path), args,
                                                   collective_timeout_s, backend, init_group, env))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            results.append({"rank": r, "error": "hung", "exitcode": None})
            continue
        path = os.path.join(tmp_path, f"rank{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                results.append({**pickle.load(f), "exitcode": p.exitcode})
        else:
            results.append({"rank": r, "error": f"exited with {p.exitcode} without a result",
                            "exitcode": p.exitcode})
    return results


def values(results):
    """The ranks' return values; raises with every rank's traceback if any rank failed."""
    bad = [r for r in results if "error" in r]
    if bad:
        raise AssertionError("\n".join(f"rank {r['rank']}: {r['error']}\n{r.get('traceback', '')}" for r in bad))
    return [r["value"] for r in results]


def error_after_a_rank_dies(fn, world, tmp_path, *args):
    """Runs ``fn`` (in which rank 1 calls ``os._exit(3)`` part-way) and returns rank 0's error;
    rank 0 must fail (not hang) and rank 1 must have died."""
    results = run_ranks(fn, world, tmp_path, *args, timeout_s=90, collective_timeout_s=30)
    assert results[1]["exitcode"] == 3, results[1]
    assert "error" in results[0] and results[0]["error"] != "hung", results[0]
    return results[0]["error"]
