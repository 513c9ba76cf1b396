"""Data parallelism of the runtime, written once: a ``Shards`` holds the process group, this
rank's place in it and every collective both front ends run (FSDP2's ``FSDPParamGroup`` owns its
collectives the same way). One rank is the identity inside (FSDP2's ``unshard``: ``if world_size
== 1``), so no caller ever tests for a process group.

[Note: chunk shards] With N ranks a chunk of n elements is split into N contiguous shards of
``k = ceil(n / N)`` elements (the last ones shorter or empty; every rank's buffers have k
elements so that an all-gather of equal pieces rebuilds the chunk). Rank r owns elements
``[r*k, min((r+1)*k, n))``: its fp32 master, moments and grads live only there, so the node's
host memory holds each optimizer byte once, whatever N is. A param's span may be cut by a shard
boundary (``cut``): each rank updates its part.

[Note: collective failures] A collective that fails (a peer died, raised or timed out, or ran
another collective) raises one ``PeerFailure`` naming this rank, the peer and the way out
(distributed.py, ``collective``), and calls the owner's ``on_failure`` first (the engine's
[Note: failed engine]); an owner that takes no further collectives says so through ``refuse``,
called before each one starts. Pins a caller takes for a collective are released by that caller,
where it took them, when the collective raises.

[Note: ranks raise together] A part that each rank runs alone and that may fail on some ranks
only (placement before the store exists, moves into the GPU share) ends in ``exchange``: every
rank passes its result, or the error it caught, in one object all-gather. Where any rank failed,
every rank raises: the failing rank its own error, the others one ``PeerError`` naming the failing
rank(s) and the first one's error (which says the fix); no rank goes on to a collective the failed
one never calls (a hang, or a timeout much later that names nothing).

[Note: comm streams] With NCCL on CUDA a grads reduce-scatter is issued async (NCCL runs it on
its own stream after the compute stream's work so far); ``CommStreams.reduce`` waits for it and
everything ordered after the reduction (the shard's copy to the host) is issued on that stream,
so the compute stream never waits for a collective. The buffers the collective reads and writes
are recorded on that stream (``record_stream``), so the caching allocator does not reuse their
memory before the stream has passed them. Param all-gathers issued ahead (``gather(ahead=True)``)
are waited for device-side by their user (``finish``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from .distributed import (PeerError, all_gather, all_reduce, check_ranks_agree, collective, gather_objects,
                          reduce_scatter_mean)

__all__ = ["CommStreams", "Gather", "Shards"]


class CommStreams(NamedTuple):
    """The CUDA streams of the collectives (one object lists them; see [Note: comm streams])."""

    reduce: "torch.cuda.Stream"  # waits for a grads reduce-scatter, then sends the shard on


class Gather(NamedTuple):
    """An all-gather: the whole tensor, and the work to wait for before using it (None: done)."""

    full: torch.Tensor
    work: object = None
    what: str = ""


class Shards:
    """This rank's place in a data-parallel group and the runtime's collectives over it.

    Args:
        group: the ``torch.distributed`` process group (``distributed.resolve_group``), or None:
            one rank, every method the identity.
        owner: the front end's name, for errors.
        device: the compute device; with NCCL the collectives take tensors there.
        on_failure: called with the error when a collective fails ([Note: collective failures]).
        refuse: called before a collective starts; raises when the owner takes no more.
    """

    def __init__(self, group=None, *, owner: str = "zero_offload", device: "torch.device | None" = None,
                 on_failure: Optional[Callable[[BaseException], None]] = None,
                 refuse: Optional[Callable[[], None]] = None):
        self.group = group
        self.owner = owner
        self.device = device
        self.on_failure = on_failure
        self.refuse = refuse
        self.rank, self.world = 0, 1
        self.comm_device = torch.device("cpu")
        """Where the group's collectives take tensors: the compute device with NCCL, else the CPU."""
        self.streams: Optional[CommStreams] = None
        self._scratch: Optional[list] = None
        """Within ``reusing_scratch``: [the whole-chunk buffer ``fill`` reuses, or None yet]."""
        if group is not None:
            import torch.distributed as dist
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            if dist.get_backend(group) == "nccl" and device is not None:
                self.comm_device = device
                if device.type == "cuda":
                    self.streams = CommStreams(reduce=torch.cuda.Stream(device))

    # ---- where this rank's elements are ([Note: chunk shards]) --------------------------------

    def span(self, n: int) -> tuple[int, int, int]:
        """``(lo, hi, k)``: this rank's elements ``[lo, hi)`` of a chunk of ``n`` and the shard
        size ``k`` every rank allocates."""
        k = -(-n // self.world)
        lo = min(self.rank * k, n)
        return lo, min(lo + k, n), k

    def cut(self, lo: int, hi: int, n: int) -> "tuple[int, int, int] | None":
        """The part of a chunk's elements ``[lo, hi)`` (of ``n``) this rank holds, as ``(offset,
        stop, start)``: its range in the rank's shard and the first of the span's elements it
        holds; None when it holds none."""
        mine_lo, mine_hi, _ = self.span(n)
        a, b = max(lo, mine_lo), min(hi, mine_hi)
        return (a - mine_lo, b - mine_lo, a - lo) if a < b else None

    def fill(self, buf: torch.Tensor, numel: int, fill: Callable[[torch.Tensor], None]) -> None:
        """``fill`` writes a chunk of ``numel`` elements at whole-chunk offsets; ``buf`` (this
        rank's shard, or less: a payload sized by shapes) gets this rank's part of it, from its
        start (one rank: ``fill`` writes ``buf`` itself)."""
        if self.world == 1:
            fill(buf)
            return
        lo, hi, _ = self.span(numel)
        whole = self._whole(numel, buf.dtype)
        fill(whole)
        n = min(buf.numel(), hi - lo)
        buf[:n].copy_(whole[lo:lo + n])

    def _whole(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed CPU buffer of a whole chunk for ``fill``: within ``reusing_scratch`` one
        buffer serves every fill (its pages are touched once, not once per chunk)."""
        if self._scratch is None:
            return torch.zeros(numel, dtype=dtype)
        nbytes = numel * dtype.itemsize
        if self._scratch[0] is None or self._scratch[0].numel() < nbytes:
            self._scratch[0] = None
            self._scratch[0] = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[0][:nbytes].view(dtype).zero_()

    @contextlib.contextmanager
    def reusing_scratch(self):
        """Within: ``fill`` writes every chunk into one reused whole-chunk buffer (the engine's
        ``initialize`` fills chunk after chunk), freed at the end."""
        self._scratch = [None]
        try:
            yield
        finally:
            self._scratch = None

    # ---- collectives ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def collective(self, what: str):
        """Run collectives of the group; see [Note: collective failures]."""
        if self.refuse is not None:
            self.refuse()
        try:
            with collective(self.owner, what, self.group):
                yield
        except BaseException as e:
            if self.on_failure is not None:
                self.on_failure(e)
            raise

    def check_settings(self, settings: dict, *, owner: Optional[str] = None) -> None:
        """Every rank passes its settings; a difference raises on every rank, naming it (as
        ``owner``; ``distributed.check_ranks_agree``). Nothing to compare with one rank."""
        if self.world > 1:
            check_ranks_agree(owner or self.owner, settings, self.group, device=self.comm_device)

    def exchange(self, value, *, error: Optional[BaseException] = None, doing: str, what: str,
                 owner: Optional[str] = None) -> list:
        """Every rank's ``value`` (small, picklable), in rank order, unless some rank passes an
        ``error`` (its part failed): then every rank raises, this one ``error`` itself, the
        others a ``PeerError`` saying which rank could not ``doing`` ("place its shard") and why
        ([Note: ranks raise together]). ``what``: the collective, for a failure of it; ``owner``:
        who asks, for the message (default: the shards' owner). One rank:
        ``[value]``, or ``error`` raised. A collective: every rank calls it."""
        if self.world == 1:
            if error is not None:
                raise error
            return [value]
        text = None
        if error is not None:
            line = str(error).splitlines()[0] if str(error) else ""
            text = f"{type(error).__name__}: {line[:1000]}"
        with self.collective(what):
            got = gather_objects((text, None if error is not None else value), self.group,
                                 device=self.comm_device)
        if error is not None:
            raise error
        failed = [(r, t) for r, (t, _) in enumerate(got) if t is not None]
        if failed:
            (first, why), rest = failed[0], [r for r, _ in failed[1:]]
            raise PeerError(
                f"{owner or self.owner}: rank {first} of {self.world} could not {doing} ({why})"
                + (f"; rank{'s' if len(rest) > 1 else ''} {', '.join(map(str, rest))} could not "
                   f"either" if rest else "")
                + f"; so rank {self.rank} stops too: fix that on rank {first} (its error says how) and "
                  f"start every rank again")
        return [v for _, v in got]

    def gather(self, shard: torch.Tensor, *, what: str, out: Optional[torch.Tensor] = None,
               ahead: bool = False) -> Gather:
        """Every rank's ``shard`` concatenated, on ``shard``'s device (into ``out`` when given).
        ``ahead``: issued async, ``finish`` waits for it where it is used. One rank: ``shard``."""
        if self.world == 1:
            return Gather(shard)
        full = out if out is not None else torch.empty(shard.numel() * self.world, dtype=shard.dtype,
                                                       device=shard.device)
        with self.collective(what):
            work = all_gather(full, shard, self.group, async_op=ahead)
        return Gather(full, work if ahead else None, what)

    def finish(self, gather: Gather) -> torch.Tensor:
        """The whole tensor of ``gather``, the current stream ordered after the collective."""
        if gather.work is not None:
            with self.collective(gather.what):
                gather.work.wait()
        return gather.full

    def gather_whole(self, pieces: Sequence[torch.Tensor], numel: int, *, what: str,
                     copy: bool = True) -> list:
        """CPU copies of whole chunks of ``numel`` elements from every rank's ``pieces`` (shards of
        one dtype and size): one all-gather for all of them. One rank: copies of the pieces
        (``copy=False``: the pieces themselves where they are CPU tensors the caller owns)."""
        if self.world == 1:
            return [p[:numel].to("cpu", copy=copy) for p in pieces]
        mine = torch.stack(list(pieces)).to(self.comm_device)
        n, k = mine.shape
        full = torch.empty(self.world * n, k, dtype=mine.dtype, device=self.comm_device)
        with self.collective(what):
            all_gather(full, mine, self.group)
        whole = full.view(self.world, n, k).transpose(0, 1).reshape(n, self.world * k)[:, :numel].cpu()
        return list(whole.unbind(0))

    def reduce_scatter(self, full: torch.Tensor, shard: torch.Tensor, *, what: str) -> None:
        """``shard`` = this rank's piece of the ranks' mean of ``full`` (``full`` holds world x
        ``shard.numel()`` elements; one rank: ``full`` itself). Work ordered after it goes in
        ``after_reduce()`` ([Note: comm streams])."""
        if self.world == 1:
            if shard is not full:
                shard.copy_(full)
            return
        stream = self.streams.reduce if self.streams is not None else None
        out = shard if full.dtype is shard.dtype else torch.empty(shard.numel(), dtype=full.dtype,
                                                                  device=full.device)
        with self.collective(what):
            work = reduce_scatter_mean(out, full, self.group, async_op=stream is not None)
        with self.after_reduce():
            if work is not None:
                with self.collective(what):
                    work.wait()
            if out is not shard:
                shard.copy_(out)
            if stream is not None:
                full.record_stream(stream)
                out.record_stream(stream)

    def after_reduce(self):
        """The stream work ordered after a ``reduce_scatter`` runs on ([Note: comm streams]):
        the comm stream with NCCL on CUDA, else the current one."""
        if self.streams is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.streams.reduce)

    def agree(self, ok: bool, *, what: str = "the all-reduce of a vote") -> bool:
        """Whether every rank says ``ok`` (one rank: ``ok``)."""
        if self.world == 1:
            return ok
        with self.collective(what):
            return bool(all_reduce(torch.tensor([int(ok)], device=self.comm_device), self.group, "min").item())

    def max_steps(self, steps: Sequence[int], *, what: str = "the all-reduce of the step counts") -> list:
        """The largest of every rank's ``steps`` (the same length on every rank), elementwise: a
        param cut by a shard boundary is stepped by each of its ranks, one without a part of it
        says 0. One rank: ``steps``."""
        steps = [int(s) for s in steps]
        if self.world == 1 or not steps:
            return steps
        with self.collective(what):
            return all_reduce(torch.tensor(steps, dtype=torch.int64, device=self.comm_device),
                              self.group, "max").tolist()

    def sum(self, value: float, *, what: str) -> float:
        """The sum over the ranks of ``value`` (float64; one rank: ``value``)."""
        if self.world == 1:
            return value
        with self.collective(what):
            return all_reduce(torch.tensor([value], dtype=torch.float64, device=self.comm_device),
                              self.group).item()
