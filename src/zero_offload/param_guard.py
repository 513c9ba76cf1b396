"""The param guard: every read of a parameter an engine manages is correct or loud.

An ``Engine`` pages its parameters' values in and out of the compute device chunk by chunk; a
``ParamGuard`` owns what the parameters themselves hold meanwhile and what happens when torch
reads them. The engine calls it at a few points (``show``/``hide`` when a chunk is mapped or
let go, ``forward()`` around the model's forward, ``end_forward``/``end_backward``/``reset`` for
the holds it took, ``explain`` for an error); the guard calls back the engine's ``hold`` (make
chunk c readable now) and ``unhold``. It knows no store, tier or rank.

[Note: parameter data] While a chunk is in use on the compute device, each of its parameters'
``.data`` is a view of the chunk's device buffer (working dtype; ``show``). Otherwise ``.data`` is
the parameter's placeholder: a tensor of its shape, the working dtype and the compute device
whose storage has zero bytes (as FSDP2 frees unsharded parameters), so ``shape``, ``numel``,
``dtype`` and ``device`` stay meaningful. Torch does not check every read of such a tensor
(``w * x``, ``w.sum()``, ``print(w)`` read a null pointer: a segfault on the CPU, an illegal
address on CUDA), so a parameter holding its placeholder has the class ``_PagedParameter`` (a
per-engine subclass of its own class: identity, ``isinstance``, hooks and grads unchanged), whose
``__torch_function__`` sees every torch call taking it. Metadata calls (``_METADATA_CALLS``)
pass; any other reaches ``ParamGuard.read``: in forward or backward (any thread) the chunk is
fetched on the spot (a forward read is recorded as in [Note: external parameters] and held until
the forward ends; a backward read, e.g. a custom Function's ``ctx.weight``, until backward ends);
idle, it raises naming the parameter and the fix (``engine.gathered()``, ``state_dict()``,
``close()``), as do ``p.data``, ``state_dict()``'s ``detach`` and pickling. The call itself runs
with subclass dispatch off, so outputs are plain tensors. A mapped chunk's parameters get their
own class back (``show``; ``hide`` guards them again), so reads of real values pay nothing per op
(the subclass path costs tens of µs per ``F.linear`` on the CPU), except in a recording forward,
where every parameter stays guarded. ``close`` restores each class once the values are back; if
they cannot be read, the parameters stay guarded and raise.

[Note: external parameters] Module hooks fetch the chunks of the parameters a module holds
directly, but models read parameters elsewhere too: a parent's ``F.linear(x, self.tok.weight)``
(tied head), a parameter handed to a custom ``autograd.Function``, a weight shared by two
modules. The first forward with grad enabled records them: every parameter is guarded and
temporary hooks on every module keep a call stack (``_ReadFrame``; the root is always on it); a
read of a parameter whose chunk no module on that stack holds holds the chunk until the innermost
module's forward ends and is recorded as that module's *external* read. When the forward ends,
the engine gives each such module's record the parameter and its chunk (``take_reads``): later
forwards hold it in that module's pre-forward, backward holds it with the module's backward
token, and its grad is ``expect``ed like the module's own (modules without parameters get a
record and hooks then). In the recording pass, backward reaches such chunks through saved views
(held until backward ends). A read first seen later (a branch taken on step 3) meets a guarded
placeholder and is fetched and recorded the same way, on the innermost running module that has a
record (else the root); ``record_reads()`` makes the next forward record with the exact call
stack again.

[Note: saved parameter views] Autograd may save views of parameters for backward (``linear``
saves ``weight.t()``), which would keep a released chunk's device buffer alive. While the engine
runs forward, a ``saved_tensors_hooks`` pair replaces a saved tensor living in a chunk's device
buffer by a small ``_SavedParamView`` (chunk, offset, size, stride), rebuilt in backward from
the buffer current then (the pre-backward hook fetched the chunk again; else ``unpack`` holds it
until backward ends). Not when every chunk is resident (runtime/prefetch.py, [Note: resident
chunks]): each stays mapped, its buffer the same, until backward ends, and the hooks' two Python
calls per saved tensor (about 600 per step of a 1.31B GPT) are saved too.
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import linecache
import os
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch
from torch import nn

from .compiled import dynamo_loaded, eager, outside_graph
from .runtime.partition import ChunkLayout, ParamSlot, Partition

__all__ = ["CompiledReadError", "ParamGuard", "Phase", "PHASES", "GuardedChunk"]


class Phase(enum.Enum):
    """What the engine is doing (which decides how the guard answers a read); ``PHASES`` lists
    the legal moves."""

    IDLE = "idle"
    FORWARD = "forward"    # inside engine(...)
    BACKWARD = "backward"  # between the first backward hook and the end of backward


PHASES = {
    Phase.IDLE: frozenset({Phase.FORWARD, Phase.BACKWARD}),
    Phase.FORWARD: frozenset({Phase.IDLE}),
    Phase.BACKWARD: frozenset({Phase.IDLE}),
}


class GuardedChunk(Protocol):
    """What the guard reads of the engine's record of one chunk (the chunk group's
    ``GroupChunk``)."""

    layout: ChunkLayout
    buffer: Optional[torch.Tensor]
    """The device buffer its parameters point into while it is mapped; None otherwise."""

    def expects(self, index: int) -> bool:
        """The grad of the parameter of slot ``index`` (``ParamSlot.index``) is expected in this
        pass."""


class CompiledReadError(RuntimeError):
    """A compiled region read a parameter whose chunk its hooks do not hold."""


def _metadata_calls() -> frozenset:
    """Torch calls on a tensor that neither read nor hand out its values: property getters and
    setters of metadata (``data``'s setter, not its getter), shape queries, hook registration."""
    getters = ("shape", "dtype", "device", "layout", "requires_grad", "is_leaf", "grad", "_grad",
               "grad_fn", "_grad_fn", "ndim", "is_cuda", "is_cpu", "is_meta", "is_sparse",
               "is_sparse_csr", "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps",
               "_version", "output_nr", "retains_grad", "name", "itemsize", "nbytes",
               "_backward_hooks", "_post_accumulate_grad_hooks")
    setters = ("data", "grad", "_grad", "requires_grad", "name", "_backward_hooks",
               "_post_accumulate_grad_hooks")
    methods = ("size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
               "element_size", "is_floating_point", "is_complex", "is_signed", "get_device",
               "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
               "__hash__", "__len__", "data_ptr", "untyped_storage", "is_pinned", "is_shared",
               "_is_view")
    t = torch.Tensor
    out = {getattr(t, n).__get__ for n in getters if hasattr(t, n)}
    out |= {getattr(t, n).__set__ for n in setters if hasattr(t, n)}
    out |= {getattr(t, n) for n in methods if hasattr(t, n)}
    return frozenset(out)


_METADATA_CALLS = _metadata_calls()
"""Calls ``_PagedParameter`` lets through without a check; see [Note: parameter data]."""

_UNREADABLE_MARKERS = ("for storage of size 0", "data is not allocated yet",
                       "tensor with unallocated storage")
"""torch's messages for a read of a zero-byte placeholder; see [Note: parameter data]."""


def _call_name(func) -> str:
    """``torch.Tensor.sum``, ``.data`` (a property) or ``F.linear`` as the user wrote it."""
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):
        return f".{getattr(getattr(func, '__self__', None), '__name__', '?')}"
    return name


def _tensor_args(args, kwargs) -> Iterator:
    """The arguments torch's dispatch looks at: positional and keyword ones, and the items of a
    list/tuple among them (tensor lists: ``torch.cat``, ``_foreach_*``)."""
    for a in itertools.chain(args, kwargs.values()):
        if type(a) in (list, tuple):
            yield from a
        else:
            yield a


class _PagedParameter(nn.Parameter):
    """The class of a managed parameter while a guard guards it (the per-engine subclass made by
    ``ParamGuard.install`` carries ``_guard``); see [Note: parameter data]."""

    _guard: Callable = staticmethod(lambda: None)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func not in _METADATA_CALLS:
            for a in _tensor_args(args, kwargs):
                if isinstance(a, _PagedParameter):
                    guard = type(a)._guard()
                    if guard is None:
                        raise RuntimeError(
                            "this parameter's values were held by a zero_offload engine that was "
                            "dropped without close(), so they are lost; call engine.close() (or "
                            "use `with zo.initialize(...) as engine:`) to write them back")
                    guard.read(a, func)
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.__repr__:  # print as the plain parameter it stands for
                t = args[0]
                return repr(t.detach().requires_grad_(t.requires_grad))
            return func(*args, **kwargs)


def _unreadable(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor with a parameter's metadata and a storage of zero bytes (allocated once at full
    size and freed: the caching allocator reuses the block)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


@dataclass(eq=False)
class _ReadFrame:
    """One module call while reads are recorded; see [Note: external parameters]."""

    module: nn.Module
    covers: frozenset
    """Slots the module's hooks hold and expect during this call (own and recorded external)."""
    grad: bool
    """Grad mode at the call (a read's grad is expected only then)."""
    read: set = field(default_factory=set)
    """Slots recorded as external reads of this call."""
    held: list = field(default_factory=list)
    """Chunks held for those reads (let go when the call ends)."""


@dataclass(frozen=True)
class _SavedParamView:
    """A saved tensor that lives in a chunk's device buffer; see [Note: saved parameter views]."""

    chunk: GuardedChunk
    offset: int
    size: torch.Size
    stride: tuple


class ParamGuard:
    """What an engine's parameters hold and how their reads are answered; see the module
    docstring. Built before the chunks load (``placeholders``), guarding from ``install`` on.

    Args:
        module: the model.
        partition: which parameter lives where.
        chunks: the engine's chunk records by index (the list it fills as chunks load).
        device, dtype: the compute device and the working dtype (of the placeholders).
        lock: the engine's lock; a read that must fetch, and every hold the guard takes or lets
            go, runs under it.
        phase: what the engine is doing now.
        hold: make a chunk readable now (its params point into its device buffer on return);
            ``unhold`` lets that hold go.
        innermost: the innermost running module that has a record, else the model (where a read
            no recording saw is attributed).
        covers: the slots a module's own hooks hold and expect (its own and recorded external).
        regions: the model's compiled regions (compiled.py, [Note: compiled regions]): their
            parameters hold their own class whenever mapped, the modules inside them get no
            recording hooks, and the recording forward runs them eagerly.
    """

    def __init__(self, module: nn.Module, partition: Partition, chunks: Sequence[GuardedChunk], *,
                 device: torch.device, dtype: torch.dtype, lock: threading.RLock,
                 phase: Callable[[], Phase], hold: Callable[[GuardedChunk], None],
                 unhold: Callable[[GuardedChunk], None], innermost: Callable[[], nn.Module],
                 covers: Callable[[nn.Module], frozenset], regions: Sequence[nn.Module] = ()):
        self._module = module
        self._regions = tuple(regions)
        self._inside = frozenset(m for r in regions for m in r.modules() if m is not r)
        """Modules inside a compiled region (traced with it: no hooks of ours)."""
        self._in_regions = frozenset(s.index for r in regions for s in partition.module_slots(r, recurse=True))
        """Slots of the regions' parameters: never guarded while mapped."""
        self._partition = partition
        self._chunks = chunks
        self._device = device
        self._lock = lock
        self._phase = phase
        self._hold = hold
        self._unhold = unhold
        self._innermost = innermost
        self._covers = covers
        self.placeholders = tuple(_unreadable(s.shape, dtype, device) for s in partition.slots)
        """Each slot's zero-byte placeholder, by slot index; see [Note: parameter data]."""
        self._classes: tuple = ()  # each slot's own class (install)
        self._guards: tuple = ()   # each slot's guarded class (install)
        self.recorded = False
        """A forward with grad enabled has recorded the reads ([Note: external parameters])."""
        self.closed = False
        self._read_frames: list[_ReadFrame] = []
        self._reads: dict = {}  # module -> {slot: None} read outside its owners in this forward
        self._forward_holds: list = []  # chunks held for such reads until forward ends
        self._backward_holds: list = []  # chunks held for reads in backward until it ends
        self._live: dict = {}  # device-buffer storage address -> chunk (mapped ones)
        self._saved_hooks = (self._pack, self._unpack)  # run eagerly once dynamo is loaded
        self._gathering = False  # inside lend(): the params hold CPU copies

    # ---- the parameters' classes ------------------------------------------------------------

    def install(self) -> None:
        """Guard every parameter from now on (after the chunks loaded: the classes they have
        then are the ones ``close`` gives back)."""
        self._classes = tuple(type(s.param) for s in self._partition.slots)
        ref = weakref.ref(self)
        made: dict = {}
        for cls in self._classes:
            if cls not in made:
                name = "_PagedParameter" if cls is nn.Parameter else f"_Paged{cls.__name__}"
                made[cls] = type(name, (_PagedParameter, cls), {"_guard": ref})
        self._guards = tuple(made[cls] for cls in self._classes)
        self._guard_all()

    def _guard_all(self) -> None:
        """Every parameter checks its reads, mapped or not (the recording forward: it sees reads
        of chunks that happen to be on the device too), but a compiled region's mapped ones
        (a graph must not see a guarded class: [Note: compiled regions] in compiled.py)."""
        for s in self._partition.slots:
            if s.index in self._in_regions and self._chunks[s.chunk].buffer is not None:
                continue
            s.param.__class__ = self._guards[s.index]

    def record_reads(self) -> None:
        """The next forward records again which module reads which parameter."""
        self.recorded = False
        self._guard_all()

    def show(self, chunk: GuardedChunk, buf: torch.Tensor) -> None:
        """The chunk's params point into ``buf``, its device buffer (the engine sets
        ``chunk.buffer`` right after); their own classes once reads are recorded."""
        recorded, classes, in_regions = self.recorded, self._classes, self._in_regions
        for s in chunk.layout.slots:
            if recorded or s.index in in_regions:  # real values: a plain parameter, no per-op
                s.param.__class__ = classes[s.index]  # check ([Note: parameter data]); first, so
            s.param.data = buf[s.offset:s.end].view(s.shape)  # that .data = is not dispatched
        self._live[buf.untyped_storage().data_ptr()] = chunk

    def hide(self, chunk: GuardedChunk) -> None:
        """The chunk's params hold their placeholders again, guarded (the engine then clears
        ``chunk.buffer``)."""
        guards, placeholders = self._guards, self.placeholders
        for s in chunk.layout.slots:
            s.param.data = placeholders[s.index]
            s.param.__class__ = guards[s.index]
        self._live.pop(chunk.buffer.untyped_storage().data_ptr(), None)

    @contextlib.contextmanager
    def lend(self, values: Sequence[tuple]) -> Iterator[None]:
        """``values``: (slot, CPU tensor) pairs the params hold inside the block, readable while
        the engine is idle (``engine.gathered()``); placeholders again after."""
        try:
            self._gathering = True
            for s, v in values:
                s.param.data = v
            yield
        finally:
            self._gathering = False
            for s, _ in values:
                s.param.data = self.placeholders[s.index]

    def close(self, *, values_back: bool, conceal: bool) -> None:
        """The engine closes. ``values_back``: the params hold their trained values: each gets
        its own class again. Else, with ``conceal``, each holds its placeholder, guarded (it
        raises on use, naming itself; none points into freed chunks). Any later read that would
        fetch raises."""
        if values_back:
            for s, cls in zip(self._partition.slots, self._classes):
                s.param.__class__ = cls
        elif conceal:
            for s in self._partition.slots:
                s.param.data = self.placeholders[s.index]
                s.param.__class__ = self._guards[s.index]
        self.closed = True

    # ---- reads ------------------------------------------------------------------------------

    def read(self, param: torch.Tensor, func) -> None:
        """A torch call reads ``param`` (called by ``_PagedParameter`` on any thread). Returns at
        once when its values are on the device and nothing is to be recorded; otherwise fetches
        them (forward, backward) or raises (idle). See [Note: parameter data]."""
        slot = self._partition.slot_of(param)
        if slot is None:
            return
        chunk = self._chunks[slot.chunk]
        if torch.compiler.is_compiling():  # dynamo traces a graph over it: it cannot fetch
            if chunk.buffer is None:
                raise self._compiled_read(slot)
            return
        if chunk.buffer is not None:
            if self._phase() is not Phase.FORWARD:
                return
            if self.recorded and (chunk.expects(slot.index) or not slot.trainable
                                  or not torch.is_grad_enabled()):
                return
        with self._lock:
            self._read_slow(slot, chunk, func)

    def _read_slow(self, slot: ParamSlot, chunk: GuardedChunk, func) -> None:
        if self.closed:
            raise RuntimeError(
                f"parameter {slot.name!r} was read ({_call_name(func)}) after its engine was "
                f"closed without writing its values back; restore them from a checkpoint "
                f"(engine.save_checkpoint / engine.save_weights / engine.state_dict)")
        phase = self._phase()
        if phase is Phase.IDLE:
            if chunk.buffer is not None or self._gathering:
                return
            raise RuntimeError(
                f"parameter {slot.name!r} was read ({_call_name(func)}) outside the engine: its "
                f"values live in zero_offload's chunks (device/CPU/NVMe), not in the parameter, "
                f"between engine calls. Read them with `with engine.gathered():` (fp32 CPU "
                f"copies) or engine.state_dict(), or call engine.close() to write them back into "
                f"the model")
        if phase is Phase.BACKWARD:
            if chunk.buffer is None:  # e.g. a custom Function's backward reading ctx.weight
                self._hold(chunk)
                self._backward_holds.append(chunk)
            return
        if self._read_frames:  # the recording forward
            self._note_read(slot, chunk)
            return
        # A read no recording saw: fetch it now, and hold it with the innermost running module
        # from the next forward on.
        self._hold(chunk)
        self._forward_holds.append(chunk)
        if torch.is_grad_enabled() and slot.trainable:
            chunk.expect(slot)
        self._reads.setdefault(self._innermost(), {})[slot] = None

    def _note_read(self, slot: ParamSlot, chunk: GuardedChunk) -> None:
        """A torch call of the recording forward reads ``slot``'s parameter."""
        frames = self._read_frames
        if any(slot in f.covers or slot in f.read for f in frames):
            return  # held and expected by a module on the call stack for all of this call
        frame = frames[-1]
        self._hold(chunk)
        frame.held.append(chunk)
        if frame.grad and slot.trainable:
            chunk.expect(slot)
        frame.read.add(slot)
        self._reads.setdefault(frame.module, {})[slot] = None

    # ---- the engine's forward and backward ----------------------------------------------------

    @contextlib.contextmanager
    def forward(self, *, views: bool = True) -> Iterator[None]:
        """Around the model's forward: saved tensors living in a chunk's device buffer become
        views ([Note: saved parameter views]; not with ``views=False``: every chunk stays mapped
        until backward ends), and the reads are recorded when they are due ([Note: external
        parameters]). After an error, the reads noted so far are forgotten."""
        if self._saved_hooks[0] is self._pack and dynamo_loaded():
            # Autograd calls them inside a compiled region's call too: never traced by dynamo.
            reason = "zero_offload's saved-tensor hooks run eagerly"
            self._saved_hooks = (outside_graph(self._pack, reason), outside_graph(self._unpack, reason))
        try:
            with torch.autograd.graph.saved_tensors_hooks(*self._saved_hooks) if views else contextlib.nullcontext():
                if self.recorded:
                    yield
                else:
                    with self._recording():
                        yield
        except BaseException:
            self._reads.clear()
            raise

    def take_reads(self) -> dict:
        """{module: {slot: None}}: parameters each module's forward read outside the modules
        holding them, in the forward that just ended (for the engine's records)."""
        reads, self._reads = self._reads, {}
        return reads

    def end_forward(self) -> None:
        """The forward ended: let go of the chunks held for reads no recording saw."""
        for c in self._forward_holds:
            self._unhold(c)
        self._forward_holds.clear()

    def end_backward(self) -> None:
        """Backward ended: let go of the chunks held for reads in it."""
        for c in self._backward_holds:
            self._unhold(c)
        self._backward_holds.clear()

    def reset(self) -> None:
        """After an error in forward/backward the engine drops every hold: forget the guard's."""
        self._forward_holds.clear()
        self._backward_holds.clear()

    @contextlib.contextmanager
    def _recording(self):
        grad = torch.is_grad_enabled()
        handles = []

        def push(module, args):
            self._read_frames.append(_ReadFrame(module=module, covers=self._covers(module),
                                                grad=torch.is_grad_enabled()))

        def pop(module, args, output):
            if not self._read_frames or self._read_frames[-1].module is not module:
                return  # (always_call) this call's push never ran: a pre-hook before it raised
            frame = self._read_frames.pop()
            with self._lock:
                for c in frame.held:
                    self._unhold(c)

        try:
            for m in self._module.modules():
                if m in self._inside:
                    continue
                handles.append(m.register_forward_pre_hook(push))
                handles.append(m.register_forward_hook(pop, always_call=True))
            # Reads before the root's hooks run (e.g. in user pre-hooks) belong to the root.
            self._read_frames.append(_ReadFrame(module=self._module, covers=self._covers(self._module),
                                                grad=grad))
            with eager() if self._regions else contextlib.nullcontext():
                yield
        finally:
            for h in handles:
                h.remove()
            with self._lock:
                for frame in self._read_frames:
                    for c in frame.held:
                        self._unhold(c)
            self._read_frames.clear()
        if grad:
            self.recorded = True

    # ---- saved tensors ([Note: saved parameter views]) ----------------------------------------

    def _pack(self, t: torch.Tensor):
        if t.layout is not torch.strided or t.device != self._device or not self._live:
            return t
        chunk = self._live.get(t.untyped_storage().data_ptr())
        if chunk is None or t.dtype is not chunk.buffer.dtype:
            return t
        return _SavedParamView(chunk=chunk, offset=t.storage_offset() - chunk.buffer.storage_offset(),
                               size=t.size(), stride=t.stride())

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParamView):
            return saved
        chunk = saved.chunk
        with self._lock:
            if chunk.buffer is None:
                # Used in backward outside a module's hooks: keep it until backward ends.
                self._hold(chunk)
                self._backward_holds.append(chunk)
        buf = chunk.buffer
        return buf.as_strided(saved.size, saved.stride, buf.storage_offset() + saved.offset)

    # ---- errors -----------------------------------------------------------------------------

    def _compiled_read(self, slot: ParamSlot) -> "CompiledReadError":
        """Dynamo met the placeholder of ``slot``'s parameter: a compiled region reads a
        parameter outside it that the recording forward did not see it read ([Note: compiled
        regions] in compiled.py)."""
        region = self._innermost()
        name = next((n for n, m in self._module.named_modules() if m is region), None)
        where = f"the compiled region {name!r}" if name else "a compiled region"
        return CompiledReadError(
            f"parameter {slot.name!r} is read inside {where} (torch.compile) but belongs to a "
            f"module outside it, and the first forward, which records such reads, did not read "
            f"it (a branch taken only now?). Fix: call "
            f"engine.record_reads() before the forward that first takes this path (that forward "
            f"records every read, running the compiled regions eagerly), or make the parameter "
            f"part of the region")

    def explain(self, e: BaseException) -> BaseException:
        """A RuntimeError from a read of a placeholder becomes one naming the read and the fix;
        anything else is returned as is. See [Note: parameter data]."""
        cause = e
        while cause is not None:  # dynamo wraps what a read raised while it traced a graph
            if isinstance(cause, CompiledReadError):
                return cause
            cause = cause.__cause__ or cause.__context__
        if not isinstance(e, RuntimeError) or not any(m in str(e) for m in _UNREADABLE_MARKERS):
            return e
        names = {m: n for n, m in self._module.named_modules()}
        site, module, frame = "", None, None
        tb = e.__traceback__
        while tb is not None:  # the innermost frame running code of a module of the model
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and owner in names:
                module, frame, lineno = owner, tb.tb_frame, tb.tb_lineno
            tb = tb.tb_next
        params = []
        if frame is not None:
            code = frame.f_code
            line = linecache.getline(code.co_filename, lineno).strip()
            site = (f" in {type(module).__name__} {names[module] or '(the model)'!r}, "
                    f"{code.co_name} at {os.path.basename(code.co_filename)}:{lineno}: `{line}`")
            prefix = names[module] + "." if names[module] else ""
            for path in re.findall(r"\bself\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*)", line):
                parts = re.sub(r"\[(\d+)\]", r".\1", path).split(".")
                for k in range(len(parts), 0, -1):
                    try:
                        t = module.get_parameter(".".join(parts[:k]))
                    except AttributeError:
                        continue
                    if self._partition.slot_of(t) is not None:
                        params.append(prefix + ".".join(parts[:k]))
                    break
            for name, v in frame.f_locals.items():
                if isinstance(v, torch.Tensor):
                    slot = self._partition.slot_of(v)
                    if slot is not None and slot.name not in params:
                        params.append(slot.name)
        what = (f"parameter {', '.join(repr(p) for p in dict.fromkeys(params))}" if params
                else "a parameter")
        return RuntimeError(
            f"{what} was read{site} while zero_offload had paged it off the device, by a path "
            f"torch's dispatch does not show the parameter to (e.g. a parameter nested inside "
            f"another object). Fix: pass the parameter itself to the torch call, or read it "
            f"inside the forward of the module holding it (outside the engine, use `with "
            f"engine.gathered():`)")
