"""What the front ends know of ``torch.compile``: the compiled regions of a model, what each
needs from the engine, and the modes that cannot work with parameters that move.

[Note: compiled regions] A *compiled region* is a module of the model whose call is compiled:
``block.compile(...)`` (torch stores the compiled ``_call_impl`` on the module, names unchanged),
or ``torch.compile(block)`` registered in the parent in the block's place (an ``OptimizedModule``
wrapping it, as torchtitan does; names gain ``._orig_mod``). Dynamo does not trace the region's
own ``Module._call_impl`` frame (torch/nn code): the region's forward hooks are called from it,
each a frame of its own (which dynamo would compile as a graph of its own, unless it is disabled:
ours are, ``outside_graph``, so they run eagerly), and the graph starts at the region's
``forward``; every module called inside is traced (inlined), hooks included. So the front ends
treat a region as one unit, as FSDP2 treats a ``fully_shard`` module:

- the engine hooks the region itself (not the modules inside it): its pre-forward holds the
  chunks of every parameter of its subtree, its backward token holds them for the region's
  backward (the compiled backward and any recomputation of activation checkpointing inside it);
  the modules inside get no hooks and no records, and the region's parameters hold their own
  class while mapped (no per-op guard a graph would trace: [Note: parameter data] in
  param_guard.py);
- the first forward, which records the reads of parameters outside their modules ([Note:
  external parameters]), runs every region eagerly (``eager()``): a read inside a region of a
  parameter outside it is recorded on the region, held by its pre-forward from then on, and no
  graph is ever traced over a guarded placeholder; the second forward compiles;
- the engine's hooks are ``outside_graph``: if a module the engine hooks is called from inside a
  region anyway (a module shared between a region and the rest), dynamo breaks the graph around
  them and runs them eagerly (FSDP2's hooks do the same), and ``fullgraph=True`` raises dynamo's
  error with our reason;
- ``OffloadAdam``'s forward pre-hook ([Note: forward overlap] in offload_optim.py) waits for a
  region's whole subtree at the region's call and does nothing inside a graph.

Modes that cannot work are refused before anything changes (``check_regions``): CUDA graphs
(``mode="reduce-overhead"``, ``"max-autotune"``, ``triton.cudagraphs``, the ``cudagraphs``
backend) replay the addresses they recorded, and the engine points each parameter into a
different chunk buffer every time a chunk comes back. A region compiled after ``initialize``
(its modules already have the engine's hooks, which a graph would trace) is refused at the next
forward (``CompileWatch``), naming the order that works: compile, then initialize.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import torch
from torch import nn

__all__ = ["CompileWatch", "CompiledRegion", "check_backward", "check_regions", "check_regions_fit",
           "compiled_regions", "dynamo_loaded", "eager", "global_pre_hook", "is_region", "outside_graph"]

F = TypeVar("F", bound=Callable)


def dynamo_loaded() -> bool:
    """``torch.compile`` has been used in this process (it imports dynamo, which takes ~2 s: we
    never import it ourselves). Without it no module is compiled and no graph is traced."""
    return "torch._dynamo" in sys.modules


def _optimized_module_class():
    if not dynamo_loaded():
        return None
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo
        return None
    return OptimizedModule


def is_region(module: nn.Module) -> bool:
    """``module``'s call is compiled (``module.compile()``, or ``torch.compile(module)``'s
    wrapper); see [Note: compiled regions]."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    cls = _optimized_module_class()
    return cls is not None and isinstance(module, cls)


@dataclass(frozen=True, eq=False)
class CompiledRegion:
    """One compiled region of a model ([Note: compiled regions])."""

    module: nn.Module
    """The module in the tree whose call is compiled (the ``OptimizedModule`` wrapper for
    ``torch.compile(block)``)."""
    name: str
    """Its qualified name in the model ("" for the model itself)."""
    backend: str
    """The compiler backend's name ("inductor", "aot_eager", ...; "?" when torch hides it)."""
    cudagraphs: bool
    """The backend records CUDA graphs."""


def _dynamo_context(module: nn.Module):
    """The dynamo context ``torch.compile`` built for ``module``'s call (private torch state,
    read defensively: None when this torch keeps it elsewhere)."""
    ctx = getattr(module, "dynamo_ctx", None)
    if ctx is not None and getattr(module, "_orig_mod", None) is not None:
        return ctx
    fn = getattr(module, "_compiled_call_impl", None)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return None
    try:
        return dict(zip(code.co_freevars, (c.cell_contents for c in cells))).get("self")
    except ValueError:  # an empty cell
        return None


def _describe(module: nn.Module, name: str) -> CompiledRegion:
    ctx = _dynamo_context(module)
    backend, cudagraphs = "?", False
    if ctx is not None:
        try:
            from torch._dynamo.eval_frame import innermost_backend
            compiler = innermost_backend(ctx.callback)
        except (ImportError, AttributeError):
            compiler = None
        if compiler is not None:
            backend = str(getattr(compiler, "compiler_name", None)
                          or getattr(compiler, "__name__", None) or type(compiler).__name__)
            options = getattr(compiler, "config", None) or {}
            cudagraphs = backend == "cudagraphs" or bool(options.get("triton.cudagraphs", False))
            if backend == "inductor" and "triton.cudagraphs" not in options:
                try:
                    import torch._inductor.config as inductor_config
                    cudagraphs = bool(inductor_config.triton.cudagraphs)
                except (ImportError, AttributeError):
                    pass
    return CompiledRegion(module=module, name=name, backend=backend, cudagraphs=cudagraphs)


def compiled_regions(model: nn.Module) -> tuple[CompiledRegion, ...]:
    """The outermost compiled modules of ``model`` (the model itself included), in module
    order; a compiled module inside one is part of it."""
    out: list[CompiledRegion] = []
    inside: set = set()
    if not dynamo_loaded():
        return ()
    for name, m in model.named_modules():
        if m in inside or not is_region(m):
            continue
        out.append(_describe(m, name))
        inside.update(m.modules())
    return tuple(out)


class CompileWatch:
    """Refuses, at the next forward, a module compiled after ``initialize`` outside the regions
    found then: the engine's hooks on the modules inside it would be traced. A few tenths of a
    µs per module per forward once dynamo is loaded (a 1,200-module model: 0.1-0.3 ms), nothing
    before."""

    def __init__(self, model: nn.Module, regions: tuple):
        known = {r.module for r in regions}
        inside = {m for r in known for m in r.modules()}
        names = {m: n for n, m in model.named_modules()}
        self._outside = tuple((m, names[m]) for m in model.modules() if m not in inside)
        """Modules outside every region, with their names."""
        self._edges = tuple((parent._modules, name, child, names[child]) for parent in model.modules()
                            for name, child in parent._modules.items() if child is not None)
        """(a module's ``_modules``, a child's name there, the child, its qualified name):
        ``torch.compile(child)`` put in its place changes it."""

    def check(self) -> None:
        if not dynamo_loaded():
            return
        new = [name for m, name in self._outside if m.__dict__.get("_compiled_call_impl") is not None]
        for children, name, child, qualified in self._edges:
            if children.get(name) is not child and is_region(children.get(name)):
                new.append(qualified)
        if new:
            raise RuntimeError(
                f"{', '.join(repr(n or 'the model') for n in new[:3])} was compiled (torch.compile) "
                f"after zo.initialize; the engine hooks a compiled module as one unit, decided at "
                f"initialize: compile first, then initialize (e.g. `for block in model.blocks: "
                f"block.compile()` before zo.initialize(model, ...))")


def check_regions(regions: tuple, *, owner: str) -> None:
    """Refuse what cannot work, before anything changes ([Note: compiled regions])."""
    if not regions:
        return
    if not hasattr(torch.compiler, "set_stance"):
        raise RuntimeError(
            f"{owner}: {_names(regions)} is compiled (torch.compile), which needs torch >= 2.6 "
            f"with zero_offload (torch.compiler.set_stance); upgrade torch, or initialize the "
            f"model without compiling it")
    graphed = [r for r in regions if r.cudagraphs]
    if graphed:
        raise ValueError(
            f"{owner}: {_names(graphed)} is compiled with CUDA graphs ({graphed[0].backend}; "
            f"mode='reduce-overhead' or 'max-autotune', or triton.cudagraphs), which replay the "
            f"parameter addresses they recorded, while zero_offload points each parameter into a "
            f"new chunk buffer whenever its chunk comes back to the device; compile with "
            f"mode='default' or 'max-autotune-no-cudagraphs'")


def check_regions_fit(regions: tuple, partition, plan) -> None:
    """Refuse a region whose chunks (params and grads, whole) cannot be on the device at once
    beside the homes and the look-ahead: its hooks hold them all for its call and its backward
    (e.g. the whole model compiled while its params are paged). ``partition``: the engine's
    ``Partition``; ``plan``: its ``PlacementPlan``."""
    if not regions or plan.request.params is None:
        return
    from .runtime.placement import FitError, chunk_bytes
    from .runtime.store import Tier

    request = plan.request
    whole = [dataclasses.replace(c, numel=c.numel * request.ranks) for c in request.chunks]
    big = max(chunk_bytes(c, request, ("params",)) for c in whole)
    room = request.budgets.gpu - (plan.need[Tier.GPU] - plan.working[Tier.GPU])  # beside the homes
    room -= request.prefetch_depth * big
    for r in regions:
        cids = sorted({s.chunk for s in partition.module_slots(r.module, recurse=True)})
        paged = [c for c in cids if plan.homes[c].params is not Tier.GPU]
        need = sum(chunk_bytes(whole[c], request, ("params", "grads")) for c in paged)
        if need > room:
            raise FitError(
                f"zero_offload.initialize: the compiled region {r.name or 'the model'!r} holds "
                f"{len(paged)} chunks of paged params with their grads on the device at once "
                f"({need} bytes), but gpu_budget leaves {max(room, 0)} bytes beside the homes "
                f"and the look-ahead; compile smaller modules (each block: block.compile(), not "
                f"the whole model), or raise gpu_budget, or place params='gpu'")


def global_pre_hook(call: Callable[[nn.Module], None]) -> Callable:
    """A global forward pre-hook (``register_module_forward_pre_hook``) running ``call(module)``
    eagerly before each module called outside a graph and before each compiled region (for
    which ``call`` must cover the region's subtree: ``is_region``), and doing nothing for the
    modules a region's graph inlines ([Note: compiled regions]). Dynamo traces a region's
    hooks as frames of their own (the region's ``_call_impl`` is skipped) and inlines the hooks
    of the modules inside: so the region's call reaches ``call`` through a graph break, and a
    module inside costs nothing."""
    eager_call = outside_graph(call, "zero_offload waits for a compiled region's params, eagerly, "
                                     "before its graph runs")
    wrapper = _optimized_module_class()

    def hook(module, args):
        if torch.compiler.is_compiling():
            if getattr(module, "_compiled_call_impl", None) is not None or (
                    wrapper is not None and isinstance(module, wrapper)):
                eager_call(module)
            return None
        call(module)
        return None
    return hook


def check_backward() -> None:
    """Refuse compiled autograd (``torch._dynamo.config.compiled_autograd``, or its context
    manager): it traces the backward hooks, which hold and let go chunks eagerly. A compiled
    region's backward is compiled anyway (AOTAutograd)."""
    if not dynamo_loaded():
        return
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if getattr(torch._dynamo.config, "compiled_autograd", False) or getattr(ca, "compiled_autograd_enabled", False):
        raise RuntimeError(
            "engine.backward under compiled autograd (torch._dynamo.config.compiled_autograd or "
            "compiled_autograd._enable): it would trace zero_offload's backward hooks, which page "
            "chunks in and out eagerly; turn it off around engine.backward (each compiled "
            "region's backward is compiled anyway, by AOTAutograd)")


def _names(regions) -> str:
    names = [repr(r.name) if r.name else "the model" for r in regions]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Every compiled region runs eagerly inside the block (``torch.compiler.set_stance``)."""
    with torch.compiler.set_stance("force_eager"):
        yield


_ENGINE_HOOKS = ("zero_offload's module hooks page parameters in and out and run eagerly, so this "
                 "module cannot be inside a graph; compile the modules the engine treats as units "
                 "(e.g. each transformer block: block.compile()) before zo.initialize")


def outside_graph(fn: F, reason: str = _ENGINE_HOOKS) -> F:
    """``fn`` (a hook) always runs eagerly: dynamo breaks a graph around it rather than tracing
    it ([Note: compiled regions]); with ``fullgraph=True`` dynamo raises, with this reason.
    ``fn`` itself when dynamo is not loaded (nothing can trace it then; a model compiled later
    is refused by ``CompileWatch``)."""
    if not dynamo_loaded():
        return fn
    disable = getattr(torch._dynamo, "disable", None)
    if disable is None:
        return fn
    try:
        return disable(fn, recursive=True, reason=reason)
    except TypeError:  # torch < 2.7: no reason
        return disable(fn, recursive=True)
