"""Partition of a module's parameters into chunks: which parameter lives where.

A *slot* is one distinct ``nn.Parameter`` (tied parameters, one object reachable under several
names, get one slot). Slots are packed, in module order (``named_parameters`` order), into
*chunks* of about ``chunk_numel`` elements; a parameter is never split (one larger than a chunk
gets a chunk of its own). Trainable and frozen parameters never share a chunk, so frozen chunks
carry no gradient or optimizer payloads. Every slot starts at a multiple of ``ALIGN_ELEMS``
elements, so kernels see aligned sub-buffers and the padding between slots is zeros.

This module is pure bookkeeping (no store, no hooks): the engine builds it once at initialize
and it never changes. Its packer, ``pack`` (items in order, by key, into chunks), is shared with
``OffloadAdam``, which packs each param group's trainable params by dtype, unaligned.

[Note: whole parameters] A chunk holds whole parameters (the packing above never splits one), so
an update rule that is not elementwise (Muon's matrices, Adafactor's factors: runtime/rules.py)
always finds a whole parameter inside one chunk. Two more things must align for it, and both are
asked for with ``align_to_params``: the element range each slot's update covers
(``update_spans``: the param's own elements, not the padding after it, so no update run spans
two params) and the cut between data-parallel ranks (``shard_spans``: at parameter boundaries
instead of equal shares). Elementwise rules (Adam, SGD, Lion) take the other choice of both: runs
merge over the padding into one kernel call per chunk, and shards are equal.

The runtime's collectives (runtime/shards.py, [Note: chunk shards]) cut every chunk in equal
shards of k elements. So an aligned cut is made a layout (``align_shards``): the chunk is laid
out for N ranks as N pieces of k elements (k the largest span ``shard_spans`` gives, rounded up to
the alignment), rank r's params at ``r*k`` onwards in its piece, padding after them. The equal
shards of that layout are the aligned spans: nothing below the front end's packing knows. The
cost: each rank allocates k elements of every payload of such a chunk, the largest rank's share,
so a chunk of few large params is held less evenly than an equal cut would (a chunk of one param
is held whole by one rank while the others hold padding): pack several params per chunk (a
larger ``chunk_mb``) when that matters.

[Note: slot identity] The partition is the only place that maps a Parameter object to its slot;
it is an index *derived* from the slot records (``Partition.slot_of``), built once, never
written to afterwards, and nothing is stored on the parameters themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence, TypeVar

import torch
from torch import nn

from .vocab import round_up

__all__ = ["ALIGN_ELEMS", "ChunkLayout", "Packed", "ParamSlot", "Partition", "align_shards", "pack",
           "partition_parameters", "shard_spans", "update_spans"]

T = TypeVar("T")

ALIGN_ELEMS = 64
"""Slot offsets and chunk sizes are multiples of this many elements (128 B in bf16, 256 B in
fp32: whole cache lines and SIMD vectors)."""


@dataclass(frozen=True, eq=False)
class ParamSlot:
    """One distinct parameter and where its elements live inside its chunk's flat payloads."""

    index: int
    """Position among all slots (module order)."""
    name: str
    """First qualified name (``named_parameters`` order); tied aliases are in ``Partition.names``."""
    param: nn.Parameter
    shape: torch.Size
    numel: int
    trainable: bool
    chunk: int
    """Index of the chunk (``Partition.chunks``) holding this slot."""
    offset: int
    """First element inside the chunk's flat payloads."""

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    """Consecutive slots packed into one flat buffer of ``numel`` elements (padded)."""

    index: int
    slots: tuple[ParamSlot, ...]
    numel: int
    trainable: bool
    key: Hashable = None
    """The front end's key of its params (``partition_parameters``' ``key``; the engine: the
    update rule)."""


@dataclass(frozen=True, eq=False)
class Partition:
    """All chunks and slots of one module. See [Note: slot identity]."""

    chunks: tuple[ChunkLayout, ...]
    slots: tuple[ParamSlot, ...]
    names: dict = field(default_factory=dict)
    """Every qualified parameter name, tied aliases included -> its ParamSlot."""
    empty: tuple = ()
    """(name, Parameter) of zero-element parameters: no slot, nothing to page or update."""
    _by_param: dict = field(default_factory=dict, repr=False)

    def slot_of(self, param: torch.Tensor) -> ParamSlot | None:
        """The slot of a parameter object (None for a tensor the partition does not hold)."""
        return self._by_param.get(id(param))

    def module_slots(self, module: nn.Module, *, recurse: bool = False) -> tuple[ParamSlot, ...]:
        """Slots of the parameters ``module`` holds directly (not its children's; with
        ``recurse``, its descendants' too), in order, tied parameters included once."""
        seen, out = set(), []
        for p in (module.parameters() if recurse else module._parameters.values()):
            slot = self.slot_of(p) if p is not None else None
            if slot is not None and slot.index not in seen:
                seen.add(slot.index)
                out.append(slot)
        return tuple(out)


@dataclass(frozen=True, eq=False)
class Packed:
    """One chunk ``pack`` made: items of one key, each at its first element."""

    key: Hashable
    members: tuple
    """``(item, offset)`` in the order given; offsets are multiples of ``pack``'s ``align``."""
    numel: int
    """Elements of the chunk: the last member's end, rounded up to ``align``."""


def pack(items: Iterable[T], *, chunk_numel: int, size: Callable[[T], int],
         key: Callable[[T], Hashable] = lambda item: None, align: int = ALIGN_ELEMS) -> list[Packed]:
    """Pack ``items``, in the order given, into chunks of about ``chunk_numel`` elements; the one
    packer of both front ends (the engine's partition, OffloadAdam's chunks).

    Items of one ``key`` share chunks, items of different keys never do (the engine keys by
    trainable, OffloadAdam by dtype), with one open chunk per key, so an item of another key in
    between does not close it. An item is never split: one larger than ``chunk_numel`` gets a
    chunk of its own. Each item starts at a multiple of ``align`` elements; a chunk closes once
    it is full. Chunks come in the order of their first item. ``size``: an item's elements (more
    than 0).
    """
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be a positive int, got {chunk_numel!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0:
        raise ValueError(f"align must be a positive int, got {align!r}")
    open_: dict = {}  # key -> [members, fill, position of its first item]
    closed: list = []  # (position of the first item, key, members, fill)

    def close(k) -> None:
        members, fill, first = open_.pop(k)
        closed.append((first, k, members, fill))

    for position, item in enumerate(items):
        k, n = key(item), size(item)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"pack: an item's size must be a positive int, got {n!r}")
        need = round_up(n, align)
        if k in open_ and open_[k][1] + need > chunk_numel:
            close(k)
        entry = open_.setdefault(k, [[], 0, position])
        entry[0].append((item, entry[1]))
        entry[1] += need
        if entry[1] >= chunk_numel:
            close(k)
    for k in list(open_):
        close(k)
    closed.sort(key=lambda c: c[0])
    return [Packed(key=k, members=tuple(members), numel=fill) for _, k, members, fill in closed]


def partition_parameters(module: nn.Module, *, chunk_numel: int,
                         key: Callable[[str, nn.Parameter], Hashable] | None = None, world: int = 1,
                         whole: Callable[[Hashable], bool] = lambda key: False) -> Partition:
    """Pack ``module``'s distinct parameters into chunks of about ``chunk_numel`` elements.

    Module order, trainable and frozen kept apart, no parameter split, offsets aligned to
    ``ALIGN_ELEMS`` (``pack``). ``key(name, param)``: trainable params of different keys never
    share a chunk (the engine keys them by update rule; ``ChunkLayout.key``). ``world``,
    ``whole(key)``: the trainable chunks of a key for which ``whole`` is true are laid out for
    ``world`` ranks cut at parameter boundaries (``align_shards``, [Note: whole parameters]).
    """
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be a positive int, got {chunk_numel!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"partition_parameters needs an nn.Module, got {type(module).__name__}")

    empty, distinct, rank = [], [], {}  # rank: id(param) -> slot index (module order)
    for name, p in module.named_parameters():
        if p.numel() == 0:
            empty.append((name, p))
            continue
        rank[id(p)] = len(rank)
        distinct.append((name, p))
    def chunk_key(item) -> tuple:
        name, p = item
        return (bool(p.requires_grad), key(name, p) if key is not None and p.requires_grad else None)

    packed = pack(distinct, chunk_numel=chunk_numel, size=lambda item: item[1].numel(), key=chunk_key)

    chunks, by_param = [], {}
    for ci, c in enumerate(packed):
        trainable, ckey = c.key
        offsets, numel = [o for _, o in c.members], c.numel
        if trainable and world > 1 and whole(ckey):
            offsets, numel = align_shards(offsets, numel, world)
        chunk_slots = []
        for ((name, p), _), offset in zip(c.members, offsets):
            slot = ParamSlot(index=rank[id(p)], name=name, param=p, shape=p.shape, numel=p.numel(),
                             trainable=trainable, chunk=ci, offset=offset)
            chunk_slots.append(slot)
            by_param[id(p)] = slot
        chunks.append(ChunkLayout(index=ci, slots=tuple(chunk_slots), numel=numel, trainable=trainable,
                                  key=ckey))
    slots = sorted(by_param.values(), key=lambda s: s.index)
    names = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        s = by_param.get(id(p))
        if s is not None:
            names[name] = s
    return Partition(chunks=tuple(chunks), slots=tuple(slots), names=names, empty=tuple(empty),
                     _by_param=by_param)


def update_spans(layout: ChunkLayout, *, align_to_params: bool) -> tuple[tuple[int, int], ...]:
    """Per slot of ``layout``, the elements ``[start, stop)`` of the chunk its update covers:
    the param's own elements with ``align_to_params``, else the param and the padding after it,
    up to the next slot or the chunk's end (touching spans then merge into one kernel call per
    chunk). See [Note: whole parameters]."""
    if align_to_params:
        return tuple((s.offset, s.end) for s in layout.slots)
    stops = [s.offset for s in layout.slots[1:]] + [layout.numel]
    return tuple((s.offset, stop) for s, stop in zip(layout.slots, stops))


def shard_spans(bounds: Sequence[int], world: int, *,
                align_to_params: bool) -> tuple[tuple[tuple[int, int], ...], int]:
    """``(spans, k)``: each rank's elements ``[lo, hi)`` of a chunk (rank order, contiguous,
    covering the chunk; a span may be empty) and the shard size ``k`` every rank allocates.

    ``bounds``: ``0 = b0 < b1 < ... < bm = numel``, where the chunk's slots start, then its end
    (``[s.offset for s in layout.slots] + [layout.numel]``). Without ``align_to_params`` the
    chunk is cut in equal shares, ``k = ceil(numel / world)`` (distributed.py, [Note: chunk
    shards]), wherever that falls. With it, cuts fall only on ``bounds`` ([Note: whole
    parameters]) and ``k`` is the smallest largest shard such a cut allows; a rank's span is
    then shorter than ``k`` or empty, so an all-gather of the ranks' ``k``-element pieces holds
    rank r's elements at ``[r*k, r*k + hi - lo)``, not at ``lo``."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"shard_spans: world must be a positive int, got {world!r}")
    bounds = [int(b) for b in bounds]
    if len(bounds) < 2 or bounds[0] != 0 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"shard_spans: bounds must rise strictly from 0 to the chunk's size, got "
                         f"{bounds[:8]}{'...' if len(bounds) > 8 else ''}")
    n = bounds[-1]
    if not align_to_params:
        k = -(-n // world)
        spans = tuple((min(r * k, n), min((r + 1) * k, n)) for r in range(world))
        return spans, k
    pieces = [b - a for a, b in zip(bounds, bounds[1:])]

    def cuts(cap: int) -> list:
        """Greedy: each rank takes params while they fit ``cap``; the bounds it stops at."""
        out, fill = [], 0
        for i, p in enumerate(pieces):
            if fill + p > cap:
                out.append(bounds[i])
                fill = 0
            fill += p
        return out

    lo, hi = max(pieces), n  # the least cap that needs at most ``world`` shards
    while lo < hi:
        mid = (lo + hi) // 2
        if len(cuts(mid)) < world:
            hi = mid
        else:
            lo = mid + 1
    edges = [0, *cuts(lo)]
    edges += [n] * (world + 1 - len(edges))
    spans = tuple((a, b) for a, b in zip(edges, edges[1:]))
    return spans, max(b - a for a, b in spans)


def align_shards(offsets: Sequence[int], numel: int, world: int, *,
                 align: int = ALIGN_ELEMS) -> tuple[tuple[int, ...], int]:
    """A chunk of items at ``offsets`` (rising from 0; the chunk has ``numel`` elements) laid out
    for ``world`` ranks cut at item boundaries ([Note: whole parameters]): ``(offsets, numel)`` of
    the new layout, ``world * k`` elements where rank r's items start at ``r * k``, in order, each
    at its old distance from the first item of its rank. ``k`` (``shard_spans``' largest share)
    is rounded up to ``align``, so aligned offsets stay aligned."""
    spans, k = shard_spans(list(offsets) + [numel], world, align_to_params=True)
    k = round_up(k, align)
    out, r = [], 0
    for off in offsets:
        while not spans[r][0] <= off < spans[r][1]:
            r += 1
        out.append(r * k + off - spans[r][0])
    return tuple(out), world * k
