"""The engine's hooks on the model's modules: a module call holds the chunks of the parameters
its forward uses (its own and recorded external ones), and again for its backward, through the
holds the engine gives it (``hold``/``unhold``: [Note: holds] in runtime/prefetch.py). One
``ModuleRecord`` per module that holds parameters directly or reads other modules' ones
([Note: external parameters] in param_guard.py). The engine translates what the hooks report
into its phases and the chunk group's verbs; the hooks know no store, tier or rank. A compiled
region (compiled.py) is one unit: one record holding its whole subtree's parameters, none for the
modules inside it, its hooks run eagerly outside the graph ([Note: compiled regions] there).

[Note: backward hooks] Per module call with grad enabled, the pre-forward hook wraps the module's
input tensors in ``_PostBackward`` (whose backward runs after the module's backward) and the
post-forward hook puts a multi-grad hook on the outputs (runs before it): the second holds the
module's chunks for backward, the first lets them go. Chunks whose post-backward never runs
(inputs that need no grad, e.g. token ids) are let go when backward ends (``end_backward``). A
chunk is released in backward only once every grad it expects this pass has landed
(``GroupChunk.awaiting``): the AccumulateGrad of a parameter may run after its module's
post-backward and needs its real data. The pre-forward tells each chunk which grads to expect.
A call whose chunks are all resident ([Note: resident chunks] in runtime/prefetch.py: they stay
mapped until backward ends) needs neither hook, and gets none: two autograd nodes, a Python hook
and four hold calls less per module call. Then ``watch_output`` puts one hook on the outputs of
the whole forward, so that a ``loss.backward()`` called directly still enters the engine's
backward before the first module's backward runs (a checkpointed block's recompute calls its
modules, which must not look like calls outside the engine).

[Note: failed calls] torch runs a module's post-forward hook (``always_call``) also when the call
raised before its forward ran: in a user's pre-hook registered before ``initialize`` (it runs
before the engine's), or in the engine's own pre-forward (a fetch failed). A model may catch that
and go on (an optional branch). So the pre-forward pushes the call on ``_calls`` before it
holds anything and counts the chunks it holds; the post-forward lets go only those, and does
nothing when the innermost call is not its module's (its pre-forward never ran). Letting go of
chunks never held left a chunk on the device across an update (stale params in the next step).
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .compiled import outside_graph
from .param_guard import Phase
from .runtime.partition import Partition
from .runtime.trace import profile_range

__all__ = ["ModuleHooks", "ModuleRecord"]


@dataclass(eq=False)
class ModuleRecord:
    """A module whose forward uses parameters (its own, or external ones read in its forward;
    see [Note: external parameters]), and the chunks they live in."""

    module: nn.Module
    slots: tuple
    """Slots of the parameters the module holds directly."""
    chunks: tuple
    """Chunks of ``slots`` and ``external``, each once (the chunk group's records)."""
    external: tuple = ()
    """Slots of other modules' parameters this module's forward reads (recorded)."""


@dataclass(eq=False)
class _Call:
    """One running module call: what its pre-forward took ([Note: failed calls])."""

    record: ModuleRecord
    held: int = 0
    """How many of ``record.chunks`` (in order) it holds: all, unless a fetch raised."""
    token: Optional["_BackwardToken"] = None
    """Grad enabled: the call's backward token."""


@dataclass(eq=False)
class _BackwardToken:
    """One module call with grad enabled: whether its chunks are held for its backward."""

    record: ModuleRecord
    held: bool = False
    done: bool = False


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs after the module's backward."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None,) + grads


class ModuleHooks:
    """The forward and backward hooks of every module of ``model`` that uses parameters (see the
    module docstring).

    Args:
        chunks: the chunk group's records by chunk index (``ChunkGroup.chunks``).
        lock: the engine's lock, taken by every hook ([Note: lock order] in engine.py).
        phase: the engine's phase; a module called while it is idle was called outside the engine.
        to_backward: a backward hook ran (the engine enters backward if ``loss.backward()`` was
            called directly).
        hold, unhold: hold a chunk on the device / let it go.
        resident: a held chunk stays mapped until backward ends ([Note: resident chunks]).
        regions: the model's compiled regions (modules; compiled.py, [Note: compiled regions]):
            each is hooked as one unit, the modules inside it not at all.
    """

    def __init__(self, model: nn.Module, partition: Partition, chunks: Sequence, *,
                 lock: threading.RLock, phase: Callable[[], Phase], to_backward: Callable[[], None],
                 hold: Callable, unhold: Callable, resident: Callable = lambda chunk: False,
                 regions: Sequence[nn.Module] = ()):
        self._model, self._partition, self._chunks = model, partition, chunks
        self.regions = tuple(regions)
        """The compiled regions, each one unit ([Note: compiled regions] in compiled.py)."""
        self._lock, self._phase, self._to_backward = lock, phase, to_backward
        self._hold, self._unhold, self._resident = hold, unhold, resident
        self._untokened = False  # a call of this pass went without backward hooks
        self.records: dict = {}
        """module -> its ModuleRecord."""
        self._calls: list[_Call] = []  # the running module calls, innermost last
        self._tokens: list[_BackwardToken] = []  # the calls whose chunks backward has held
        self._handles: list = []

    def install(self) -> None:
        """Hook every module holding parameters directly, and each compiled region for its whole
        subtree (after the chunks are built)."""
        regions = set(self.regions)
        inside = {m for r in regions for m in r.modules() if m is not r}
        for m in self._model.modules():
            if m in inside:  # traced with its region: the region's hooks hold its params
                continue
            slots = self._partition.module_slots(m, recurse=m in regions)
            if slots:
                self._add(ModuleRecord(module=m, slots=slots,
                                       chunks=tuple(dict.fromkeys(self._chunks[s.chunk] for s in slots))))

    def _add(self, rec: ModuleRecord) -> None:
        self.records[rec.module] = rec
        self._handles.append(rec.module.register_forward_pre_hook(
            outside_graph(functools.partial(self._pre_forward, rec)), with_kwargs=True))
        self._handles.append(rec.module.register_forward_hook(
            outside_graph(functools.partial(self._post_forward, rec)), with_kwargs=True, always_call=True))

    def remove(self) -> None:
        """Remove every hook (``close``)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- external parameters ([Note: external parameters] in param_guard.py) ------------------

    def covers(self, module: nn.Module) -> frozenset:
        """The slots ``module``'s own hooks hold and expect (its own and recorded external)."""
        rec = self.records.get(module)
        return frozenset(rec.slots + rec.external) if rec is not None else frozenset()

    def innermost(self) -> nn.Module:
        """The module of the innermost running call (the model outside any)."""
        return self._calls[-1].record.module if self._calls else self._model

    def add_reads(self, reads: dict) -> None:
        """Give each module whose forward read other modules' parameters (``reads``: module ->
        slots, from the guard) those reads."""
        for module, slots in reads.items():
            rec = self.records.get(module)
            new = rec is None
            if new:
                rec = ModuleRecord(module=module, slots=(), chunks=())
            ext = tuple(s for s in slots if s not in rec.slots and s not in rec.external)
            rec.external += ext
            rec.chunks = tuple(dict.fromkeys(rec.chunks + tuple(self._chunks[s.chunk] for s in ext)))
            if new:
                self._add(rec)

    # ---- the hooks ----------------------------------------------------------------------------

    def _pre_forward(self, rec: ModuleRecord, module, args, kwargs):
        if self._phase() is Phase.IDLE:
            raise RuntimeError(
                f"{type(module).__name__} was called outside the engine: its parameters are paged "
                f"by zero_offload, so run the model through the engine (loss = engine(batch)), not "
                f"model(batch); use `with engine.gathered():` to read parameter values")
        with self._lock, profile_range("zero_offload::pre_forward"):
            call = _Call(record=rec)
            self._calls.append(call)  # first: see [Note: failed calls]
            for c in rec.chunks:
                self._hold(c)
                call.held += 1
            if not torch.is_grad_enabled():
                return None
            for s in rec.slots + rec.external:
                if s.trainable:
                    chunk = self._chunks[s.chunk]
                    chunk.expect(chunk.slot(s.index))
            if all(self._resident(c) for c in rec.chunks):
                self._untokened = True  # no backward holds needed ([Note: backward hooks])
                return None
            call.token = token = _BackwardToken(record=rec)
            if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
                flat, spec = list(args), None  # the common case, without pytree's cost
            else:
                flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if not idx:
                return None
            wrapped = _PostBackward.apply(functools.partial(self._post_backward, token),
                                          *(flat[i] for i in idx))
            for i, t in zip(idx, wrapped):
                flat[i] = t
            return (tuple(flat), kwargs) if spec is None else tree_unflatten(flat, spec)

    def _post_forward(self, rec: ModuleRecord, module, args, kwargs, output):
        if self._phase() is Phase.IDLE:
            return None  # the pre-forward hook refused this call (always_call runs us anyway)
        with self._lock, profile_range("zero_offload::post_forward"):
            if not self._calls or self._calls[-1].record is not rec:
                return None  # this call's pre-forward never ran: see [Note: failed calls]
            call = self._calls.pop()
            for c in rec.chunks[:call.held]:
                self._unhold(c)
            token = call.token
            if token is None or output is None:
                return None
            _on_first_grad(output, functools.partial(self._pre_backward, token))
            return None

    def _pre_backward(self, token: _BackwardToken, grad) -> None:
        with self._lock, profile_range("zero_offload::pre_backward"):
            self._to_backward()
            if token.held or token.done:
                return
            token.held = True
            self._tokens.append(token)
            for c in token.record.chunks:
                self._hold(c)

    def _post_backward(self, token: _BackwardToken) -> None:
        with self._lock, profile_range("zero_offload::post_backward"):
            if not token.held:
                return
            token.held = False
            token.done = True
            for c in token.record.chunks:
                self._unhold(c)

    def watch_output(self, output) -> None:
        """After a forward with grad enabled: when a call of it went without backward hooks, the
        first grad reaching ``output`` enters backward ([Note: backward hooks])."""
        if not self._untokened:
            return
        self._untokened = False
        _on_first_grad(output, self._output_grad)

    def _output_grad(self, grad) -> None:
        with self._lock:
            self._to_backward()

    # ---- the end of a pass ------------------------------------------------------------------

    def end_backward(self) -> None:
        """Backward ended: let go of what calls whose post-backward never ran still hold."""
        for token in self._tokens:
            if token.held:
                self._post_backward(token)
        self._tokens.clear()

    def reset(self) -> None:
        """After an exception in forward/backward: forget the running calls and their tokens (the
        engine lets their chunks go)."""
        self._calls.clear()
        self._tokens.clear()
        self._untokened = False


def _on_first_grad(output, fn) -> None:
    """``fn(grad)`` when the first grad reaches a tensor of ``output`` that requires grad (none:
    nothing)."""
    if isinstance(output, torch.Tensor):
        tensors = [output] if output.requires_grad else []
    else:
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
    if len(tensors) == 1:
        tensors[0].register_hook(fn)  # cheaper than the multi-grad hook
    elif tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, fn, mode="any")


def _tensors_in(obj) -> list:
    """Tensors in a module output (tensors, tuples/lists, dicts, dataclass-like outputs)."""
    flat, _ = tree_flatten(obj)
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif hasattr(x, "items") and callable(x.items):  # mappings pytree does not know
            out.extend(_tensors_in(dict(x.items())))
    return out
