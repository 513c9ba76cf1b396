"""Data-parallel primitives on ``torch.distributed`` (NCCL on GPUs, gloo on the CPU): which
process group and rank, FSDP2's DTensor params (their local shards), the default group under a
launcher, CPU-Adam threads and cores per rank, and collectives whose failure says what it means.
The runtime's collectives themselves are ``Shards``' (shards.py): nothing above ``runtime/``
calls a collective.
"""
from __future__ import annotations

import atexit
import contextlib
import glob
import os
import re
import sys
from typing import Optional

import torch

__all__ = ["PeerError", "PeerFailure", "announce_default_group", "available_cores", "bind_to_cores",
           "check_ranks_agree", "collective", "cpu_threads", "gather_objects", "is_dtensor", "local", "rank_cores",
           "rank_device", "resolve_device", "resolve_group", "start_default_group", "threads_per_rank"]


def is_dtensor(t) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (FSDP2's params and grads)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory holds this rank's elements: a DTensor's local shard (FSDP2 keeps
    the same storage between steps and reads it at its next all-gather), or ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def resolve_group(process_group, owner: str):
    """The process group to shard over, or None. ``"auto"``: the default group when
    ``torch.distributed`` is initialized with more than one rank; None: no sharding."""
    if process_group is None:
        return None
    import torch.distributed as dist
    if isinstance(process_group, str):
        if process_group != "auto":
            raise ValueError(f"{owner}: process_group={process_group!r} is invalid: pass 'auto', None "
                             f"or a torch.distributed ProcessGroup")
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return dist.group.WORLD
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{owner}: process_group must be 'auto', None or a torch.distributed "
                        f"ProcessGroup, got {type(process_group).__name__}")
    return process_group


_LAUNCH_VARS = ("RANK", "MASTER_ADDR", "MASTER_PORT")
"""What ``init_process_group``'s ``env://`` rendezvous reads beside ``WORLD_SIZE`` (torchrun sets
them all)."""


def start_default_group(owner: str, device: torch.device, *, fix: str) -> "str | None":
    """Under a launcher (``WORLD_SIZE`` > 1 in the environment) with no default process group yet,
    start it from the environment, as ``deepspeed.initialize`` does: NCCL when ``device`` is a
    GPU (made the current device first), gloo on the CPU; it is destroyed at exit. Returns the
    backend started, or None when there was nothing to start (one process, or a group exists).
    An incomplete environment is refused before anything changes: without it each process would
    train alone, silently. ``fix``: the caller's other ways out (the messages' last words)."""
    world = os.environ.get("WORLD_SIZE", "1") or "1"
    if not world.strip().isdigit():
        raise ValueError(f"{owner}: WORLD_SIZE={world!r} is not a number of processes; launch with "
                         f"`torchrun --nproc-per-node N` (it sets WORLD_SIZE), or unset it")
    world = int(world)
    if world <= 1:
        return None
    import torch.distributed as dist
    if not dist.is_available():
        raise RuntimeError(f"{owner}: WORLD_SIZE={world} but this torch build has no "
                           f"torch.distributed; install a build with it, or unset WORLD_SIZE to train "
                           f"in one process")
    if dist.is_initialized():
        return None
    missing = [v for v in _LAUNCH_VARS if not os.environ.get(v)]
    if missing:
        raise ValueError(f"{owner}: WORLD_SIZE={world} but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set, so this process cannot join "
                         f"the other ranks; launch with `torchrun --nproc-per-node N` (it sets RANK, "
                         f"LOCAL_RANK, MASTER_ADDR and MASTER_PORT), or {fix}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend)
    except (RuntimeError, ValueError) as e:  # (DistNetworkError and DistStoreError included)
        raise RuntimeError(
            f"{owner}: WORLD_SIZE={world} but the default process group ({backend}) did not start "
            f"from the environment ({type(e).__name__}: {' '.join(str(e).split())[:300]}); check "
            f"MASTER_ADDR={os.environ['MASTER_ADDR']} and MASTER_PORT={os.environ['MASTER_PORT']} "
            f"and that every rank starts, or {fix}") from None
    atexit.register(_destroy_if_current, dist.group.WORLD)
    return backend


def announce_default_group(backend: "str | None", *, owner: str, before: str) -> None:
    """One line on rank 0 when ``owner`` started the default process group (``backend``, as
    ``start_default_group`` returned it; None: nothing was started, nothing said)."""
    if backend is None:
        return
    import torch.distributed as dist
    if dist.get_rank() == 0:
        print(f"{owner}: WORLD_SIZE={dist.get_world_size()} and no process group: "
              f"started the default one from the environment ({backend}); call "
              f"torch.distributed.init_process_group() before {before} to set it up yourself",
              file=sys.stderr, flush=True)


def resolve_device(device) -> torch.device:
    """The compute device ``device`` names (a CUDA device or the CPU; a CUDA device without an
    index: the current one); None: CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported; use a CUDA device or 'cpu'")
    return dev


def rank_device(device, *, ranked: bool) -> torch.device:
    """The compute device: ``device``; by default CUDA when available (with several ranks GPU
    ``LOCAL_RANK``, as torchrun numbers them), else the CPU."""
    if device is None and ranked and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return resolve_device(device)


def _destroy_if_current(group) -> None:
    """At exit: destroy the default group ``start_default_group`` started, unless it is gone or
    replaced (the caller's own to destroy then)."""
    import torch.distributed as dist
    with contextlib.suppress(Exception):  # exiting: nothing to report to
        if dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()


def check_ranks_agree(owner: str, settings: dict, group, *, device: "torch.device | None" = None) -> None:
    """Every rank of ``group`` passes its ``settings`` (name -> a plain picklable value, the same
    names on every rank); where any value differs between the ranks, raise on every rank one
    ``ValueError`` naming the first such setting, each value and the ranks holding it (instead of
    a collective that mismatches or times out later). A collective: every rank calls it.
    ``device``: the CUDA device the group's NCCL collectives use (the object all-gather runs on
    the current device)."""
    with collective(owner, "the comparison of the ranks' settings", group):
        gathered = gather_objects(settings, group, device=device)
    for name in settings:
        values = [g.get(name, "(not given)") for g in gathered]
        if len({repr(v) for v in values}) > 1:  # (by repr: a nan equals itself)
            raise ValueError(f"{owner}: ranks disagree on {name}: {_who_has(values)}; pass the same "
                             f"settings on every rank")


def gather_objects(obj, group, *, device: "torch.device | None" = None) -> list:
    """Every rank's ``obj`` (a small picklable value), in rank order: ``all_gather_object`` on
    ``group``. ``device``: the CUDA device the group's NCCL collectives use (the object all-gather
    runs on the current device). A collective: every rank calls it (wrap it in ``collective``)."""
    import torch.distributed as dist
    gathered = [None] * dist.get_world_size(group)
    on_device = (torch.cuda.device(device) if device is not None and device.type == "cuda"
                 else contextlib.nullcontext())
    with on_device:
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _who_has(values: list, limit: int = 200) -> str:
    """``"rank 0 has 64.0, rank 1 has 32.0"`` (ranks holding one value together); for long
    sequences (a model's parameters), the first entry where they differ."""
    shown = [repr(v) for v in values]
    if max(map(len, shown)) > limit and all(isinstance(v, (list, tuple)) for v in values):
        i = next(i for i in range(max(map(len, values)))
                 if len({repr(v[i]) if i < len(v) else None for v in values}) > 1)
        head = f"entry {i}: "
        shown = [repr(v[i]) if i < len(v) else f"no such entry ({len(v)} in all)" for v in values]
    else:
        head = ""
    ranks: dict = {}
    for r, text in enumerate(shown):
        ranks.setdefault(text if len(text) <= limit else text[:limit - 3] + "...", []).append(r)
    return head + ", ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} "
                            f"{'have' if len(rs) > 1 else 'has'} {text}" for text, rs in ranks.items())


_NODE_CORES: "list[int] | None" = None  # the cores of the process before any binding


def _numa_node_of() -> dict:
    """cpu -> NUMA node, from sysfs ({} where it is not readable)."""
    out = {}
    for file in glob.glob("/sys/devices/system/node/node*/cpulist"):
        node = os.path.basename(os.path.dirname(file))[4:]
        if not node.isdigit():
            continue
        try:
            with open(file) as f:
                spec = f.read().strip()
        except OSError:
            continue
        for part in filter(None, spec.split(",")):
            lo, _, hi = part.partition("-")
            out.update(dict.fromkeys(range(int(lo), int(hi or lo) + 1), int(node)))
    return out


def rank_cores() -> "list[int] | None":
    """This local rank's cores: the cores the process could use before any binding, ordered by
    NUMA node, cut into ``LOCAL_WORLD_SIZE`` (torchrun sets it) contiguous blocks; rank
    ``LOCAL_RANK`` takes its block, so ranks share no core and (with one or two ranks per socket)
    each reads memory on its own socket. None with one local rank (or fewer cores than ranks)."""
    global _NODE_CORES
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    if ranks == 1:
        return None
    if _NODE_CORES is None:
        try:
            cores = sorted(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            return None
        node = _numa_node_of()
        _NODE_CORES = sorted(cores, key=lambda c: (node.get(c, 0), c))
    per = len(_NODE_CORES) // ranks
    if per < 1:
        return None
    r = int(os.environ.get("LOCAL_RANK", "0") or 0) % ranks
    return _NODE_CORES[r * per:(r + 1) * per]


def bind_to_cores(cores: "list[int]") -> None:
    """Every thread of this process runs on ``cores`` from now on (threads started later inherit
    it from the thread that starts them), as ``numactl --physcpubind`` for the running process."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cores)


def threads_per_rank(cuda: bool) -> int:
    """CPU-Adam threads for one of ``LOCAL_WORLD_SIZE`` ranks on this node (torchrun sets it):
    its block of cores (``rank_cores``), less one per rank driving a GPU (its Python thread must
    not be preempted by the kernel's workers)."""
    cores = rank_cores()
    per = available_cores() if cores is None else len(cores)
    return max(1, per - (1 if cuda else 0))


def cpu_threads(threads: Optional[int], device: torch.device, *, ranked: bool) -> Optional[int]:
    """CPU-Adam threads: ``threads`` (``OffloadConfig.threads``) when set; with several ranks this
    rank's share of the node's cores (``threads_per_rank``); else by default every core this
    process may use minus two when a GPU is driven (the Python thread issuing kernels and the
    autograd/copy threads must not be preempted by the kernel's workers, or the GPU starves);
    None (the kernel's default) on the CPU."""
    if threads is not None:
        return threads
    if ranked:
        return threads_per_rank(device.type == "cuda")
    if device.type != "cuda":
        return None
    return max(1, available_cores() - 2)


def available_cores() -> int:
    """Cores this process may run on (its affinity; all of them where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class PeerFailure(RuntimeError):
    """A collective failed: another rank died, raised, timed out or ran a different collective
    (``collective``). The ranks' states no longer match: every rank must stop."""


class PeerError(RuntimeError):
    """Another rank raised in a part every rank passes together (``Shards.exchange``): this rank
    raises too, naming that rank and its error, instead of waiting in a later collective."""


@contextlib.contextmanager
def collective(owner: str, what: str, group):
    """Run collectives; a failure (a rank died, raised or timed out) is raised as one
    ``PeerFailure`` that names this rank, the peer (with two ranks, the other one), what to look
    at and what to do; the cause's first line (shortened) ends it."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        if isinstance(e, PeerFailure):
            raise
        import torch.distributed as dist
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        peer = f"rank {1 - rank}, the other rank," if world == 2 else "another rank"
        text = str(e).splitlines()[0] if str(e) else ""
        text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[.../pair.cc:553] " source location
        if len(text) > 160:
            text = text[:157] + "..."
        raise PeerFailure(
            f"{owner}: rank {rank} of {world}: {what} failed: {peer} has probably died, raised an "
            f"error, timed out or runs with different settings; its output shows the first error. "
            f"The ranks' training states no longer match: stop every rank and restart from the "
            f"last checkpoint (here: {type(e).__name__}: {text})") from e


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, *, async_op: bool = False):
    """``out`` = the ranks' ``inp`` concatenated along dim 0 (``all_gather_single`` where torch has
    it, else ``all_gather_into_tensor``)."""
    import torch.distributed as dist
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_mean(out: torch.Tensor, inp: torch.Tensor, group, *, async_op: bool = False):
    """``out`` = this rank's piece of the mean over the ranks of ``inp`` (``inp`` holds world x
    ``out.numel()`` elements). NCCL averages in the collective (``async_op``: returns its work);
    other backends sum, then divide (synchronously: gloo has no AVG)."""
    import torch.distributed as dist
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if dist.get_backend(group) == "nccl":
        return fn(out, inp, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)
    out.div_(dist.get_world_size(group))
    return None


def all_reduce(t: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    import torch.distributed as dist
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                           "min": dist.ReduceOp.MIN}[op], group=group)
    return t
