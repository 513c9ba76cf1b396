"""torch's CPU random fills of large fp32 tensors (``normal_``, ``uniform_``) drawn on several
threads, with the values one serial call gives, the generator left where that call leaves it.

[Note: parallel draws] torch's CPU generator is one MT19937 stream, and a fill draws one 32-bit
word per element, in element order, on one thread (the generator's lock held). ``uniform_``
maps word i to element i; ``normal_`` (float32, >= 16 elements, contiguous: torch's
``normal_fill``) first writes element i's uniform from word i, then turns each block of 16
(elements j and j + 8) into normals, and when the size is not a multiple of 16 draws 16 more
words for the last 16 elements. So a slice of the tensor that starts on a multiple of 16 and is
filled by the same torch call from a generator placed at its first word gets exactly the values
the whole call gives there (the last slice, at least 16 long, takes the tail and its 16 extra
words). ``ParallelDraws`` cuts a large fill into such slices, places one generator per slice
(``_C.rng.advance`` moves a copy of the state forward without drawing, about a tenth of the cost
of drawing), fills the slices on a thread pool (torch releases the GIL), and moves the caller's
generator to where the serial call would leave it. Every other op, and fills too small to be
worth it, run unchanged.

[Note: kept draws] With several ranks each rank keeps only its shard of a chunk, yet an init
must see its whole parameter drawn in order (the stream). Inside ``keeping(region, lo, hi)`` a
sliced fill of a tensor lying in ``region`` (the chunk's buffer) draws only the slices that
overlap elements ``[lo, hi)`` of the region; the generator still moves past every slice, so the
kept elements are exactly the whole fill's, and the rest are left as they were. That is right
only while nothing reads a skipped element into a kept one: the mode watches every later op of
the init, and one that reads the region other than elementwise in place (an op outside
``_IN_PLACE``, or its region arguments laid out unlike its output: ``w.copy_(w.t())``, a norm, a
QR) marks the slot ``tainted``. The caller then puts back every generator the slot used (``undo``:
the states before their first use) and runs that slot's init again without skipping. GPT-style
inits (``normal_``, ``zero_``, ``fill_``, ``mul_``) skip; ``orthogonal_``-style ones draw in full.

[Note: stream check] The layout of the generator's state (torch's legacy ``THGeneratorState``:
seed, ``left``, ``next``, 624 words as uint64) and the slicing rule above are torch's internals.
``stream_check()`` tests both against torch's own draws once per process (states moved forward
across block boundaries; sliced fills of sizes with and without a tail); if any differ,
``ParallelDraws`` draws serially (exact, slower) and says so once.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import warnings
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _native

__all__ = ["ParallelDraws", "advanced", "stream_check"]

_STATE_BYTES = 5056
_LEFT = slice(8, 12)      # int32
_NEXT = slice(16, 24)     # uint64
_WORDS = slice(24, 24 + 624 * 8)  # 624 x uint64, the low 32 bits used
_MIN_SLICE = 1 << 18
"""Elements of the smallest slice worth a thread (a generator's set-up is ~10 us)."""

_aten = torch.ops.aten


def advanced(state: torch.Tensor, n: int) -> torch.Tensor:
    """A copy of a CPU generator's ``get_state()`` moved forward by ``n`` 32-bit draws."""
    out = state.clone()
    words = out[_WORDS].view(torch.int32)[0::2].contiguous()
    left, nxt = _native.rng.advance(words.data_ptr(), int(out[_LEFT].view(torch.int32)[0]),
                                    int(out[_NEXT].view(torch.int64)[0]), int(n))
    out[_WORDS].view(torch.int32)[0::2] = words
    out[_LEFT].view(torch.int32)[0] = left
    out[_NEXT].view(torch.int64)[0] = nxt
    return out


def _generator(state: torch.Tensor) -> torch.Generator:
    g = torch.Generator()
    g.set_state(state)
    return g


@functools.lru_cache(maxsize=None)
def stream_check() -> Optional[str]:
    """None when ``advanced`` and sliced fills reproduce torch's draws here; else why not (see
    [Note: stream check])."""
    if getattr(_native.rng, "advance", None) is None:
        return "the native extension has no rng module (rebuild it: pip install -e .)"
    g = torch.Generator()
    g.manual_seed(20240611)
    if g.get_state().numel() != _STATE_BYTES:
        return f"torch's CPU generator state is {g.get_state().numel()} bytes, not {_STATE_BYTES}"
    for pre, n in ((0, 1), (5, 618), (5, 619), (700, 1300), (3, 5000)):
        g.manual_seed(20240611 + pre)
        torch.rand(pre, generator=g)
        moved = _generator(advanced(g.get_state(), n))
        torch.rand(n, generator=g)
        if not torch.equal(torch.rand(64, generator=g), torch.rand(64, generator=moved)):
            return "a generator state moved forward does not match torch's draws"
    draws = ParallelDraws(threads=2, min_slice=32, check=False)
    try:
        for numel in (4099, 4096, 48 + 7, 1000):
            for op in ("normal_", "uniform_"):
                g.manual_seed(numel)
                serial = getattr(torch.empty(numel), op)(0.5, 1.5, generator=g)
                after = torch.rand(8, generator=g)
                g.manual_seed(numel)
                out = torch.empty(numel)
                with draws.mode():
                    getattr(out, op)(0.5, 1.5, generator=g)
                if not (torch.equal(out, serial) and torch.equal(torch.rand(8, generator=g), after)):
                    return f"{op} drawn in slices differs from one call"
    finally:
        draws.close()
    return None


class ParallelDraws:
    """A thread pool that draws large ``normal_`` / ``uniform_`` fills in slices: see [Note:
    parallel draws]. ``mode()`` is the context in which the torch calls of the caller's thread are
    drawn this way. ``threads``: the pool's size; ``min_slice``: the smallest slice (elements).
    ``check``: run ``stream_check`` first (off only inside it). Close it (or use ``with``)."""

    def __init__(self, *, threads: int, min_slice: int = _MIN_SLICE, check: bool = True):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"ParallelDraws: threads must be an int >= 1, got {threads!r}")
        self.threads = threads
        self.min_slice = max(16, min_slice // 16 * 16)
        self.why_serial = stream_check() if check else None
        """None, or why every fill runs serially (see [Note: stream check])."""
        if self.why_serial is not None:
            warnings.warn(f"zero_offload: initial values are drawn on one thread ({self.why_serial}); "
                          f"they are exact, only slower", RuntimeWarning, stacklevel=2)
        self._pool = (concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                            thread_name_prefix="zero_offload-draws")
                      if threads > 1 and self.why_serial is None else None)
        self.drawn = 0
        """Elements drawn in slices (the rest ran as plain torch calls)."""
        self.skipped = 0
        """Elements of sliced fills not drawn: outside the kept range ([Note: kept draws])."""
        self._keep: Optional[tuple[torch.Tensor, int, int]] = None
        self.tainted = False
        self._skipped_now = False  # a slice was skipped since keeping() began
        self._before: dict = {}  # generator -> its state before its first use since keeping() began

    @contextlib.contextmanager
    def keeping(self, region: torch.Tensor, lo: int, hi: int):
        """Within: sliced fills of tensors in ``region`` (a contiguous fp32 CPU buffer) draw only
        the slices overlapping its elements ``[lo, hi)``; ``tainted`` says whether an op then
        read a skipped element ([Note: kept draws])."""
        self._keep, self.tainted, self._skipped_now = (region, lo, hi), False, False
        self._before = {torch.default_generator: torch.default_generator.get_state()}
        try:
            yield self
        finally:
            self._keep = None

    def undo(self) -> None:
        """Every generator used since ``keeping`` began back where it was then."""
        for gen, state in self._before.items():
            gen.set_state(state)

    def _saw(self, generator) -> None:
        if self._keep is not None and isinstance(generator, torch.Generator) and generator not in self._before:
            self._before[generator] = generator.get_state()

    def _reads(self, func, args, kwargs) -> None:
        """Taint the kept slot if ``func`` reads the region other than elementwise in place."""
        if self._keep is None or not self._skipped_now or self.tainted:
            return
        base = self._keep[0].untyped_storage().data_ptr()
        mine = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                and a.device.type == "cpu" and a.untyped_storage().data_ptr() == base]
        if not mine or func in _VIEWS:
            return
        out = args[0] if args and isinstance(args[0], torch.Tensor) else None
        same = out is not None and all(a.storage_offset() == out.storage_offset() and a.shape == out.shape
                                       and a.stride() == out.stride() for a in mine)
        if func not in _IN_PLACE or not same:
            self.tainted = True

    def _kept_slices(self, t: torch.Tensor, slices):
        """The slices of a fill of ``t`` to draw: all, or those overlapping the kept range."""
        if self._keep is None:
            return slices
        region, lo, hi = self._keep
        start = region.data_ptr()
        if region.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() or t.data_ptr() < start:
            return slices
        off = (t.data_ptr() - start) // t.element_size()
        keep = [(a, b) for a, b in slices if a + off < hi and b + off > lo]
        if len(keep) < len(slices):
            self._skipped_now = True
            self.skipped += sum(b - a for a, b in slices) - sum(b - a for a, b in keep)
        return keep

    def mode(self) -> "_DrawMode":
        return _DrawMode(self)

    def _slices(self, numel: int, normal: bool) -> list[tuple[int, int]]:
        """Slices of a fill: multiples of 16 long, the last one taking the rest (>= 16)."""
        size = max(self.min_slice, math.ceil(numel / (4 * self.threads) / 16) * 16)
        cuts = list(range(0, numel, size)) + [numel]
        if normal and len(cuts) > 2 and cuts[-1] - cuts[-2] < 16:
            del cuts[-2]  # a tail under 16 joins the slice before it
        return list(zip(cuts[:-1], cuts[1:]))

    def draw(self, op: str, t: torch.Tensor, a: float, b: float, generator: torch.Generator) -> bool:
        """Fill ``t`` as ``t.<op>(a, b, generator=generator)`` would, in slices; False (nothing
        done) when it does not qualify (then the caller runs the torch call)."""
        numel = t.numel()
        inline = self._pool is None and self._keep is not None and self.why_serial is None  # one thread
        if ((self._pool is None and not inline) or numel < 2 * self.min_slice or type(t) not in (torch.Tensor, torch.nn.Parameter)
                or t.dtype is not torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                or generator.device.type != "cpu"):
            return False
        flat = t.view(-1)
        normal = op == "normal_"
        state = generator.get_state()
        futures = []

        def one(lo, hi, start):
            with torch.no_grad():  # (grad mode is per thread)
                getattr(flat[lo:hi], op)(a, b, generator=_generator(start))

        slices = self._slices(numel, normal)
        keep = set(self._kept_slices(t, slices))
        try:
            for lo, hi in slices:
                if (lo, hi) in keep:
                    if inline:
                        one(lo, hi, state)
                    else:
                        futures.append(self._pool.submit(one, lo, hi, state))
                state = advanced(state, hi - lo)  # (while the slice draws)
            if normal and numel % 16:
                state = advanced(state, 16)  # the tail's redraw ([Note: parallel draws])
        finally:
            for f in futures:
                f.result()  # every slice finished (the first failure raised)
        generator.set_state(state)
        self.drawn += numel
        return True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_VIEWS = frozenset(getattr(_aten, n).default for n in (
    "view", "_unsafe_view", "as_strided", "alias", "detach", "t", "expand", "permute", "unsqueeze",
    "squeeze", "_reshape_alias") if hasattr(getattr(_aten, n, None), "default")) | frozenset(
    o for o in (_aten.slice.Tensor, _aten.select.int, _aten.transpose.int, _aten.unbind.int,
                _aten.split.Tensor, _aten.squeeze.dim, _aten.view.dtype))
"""Ops that make views of a tensor and read none of its elements ([Note: kept draws])."""
_IN_PLACE = frozenset(o for o in (
    _aten.normal_.default, _aten.uniform_.default, _aten.zero_.default, _aten.fill_.Scalar,
    _aten.mul_.Scalar, _aten.mul_.Tensor, _aten.div_.Scalar, _aten.div_.Tensor, _aten.add_.Scalar,
    _aten.add_.Tensor, _aten.sub_.Scalar, _aten.sub_.Tensor, _aten.clamp_.default, _aten.clamp_min_.default,
    _aten.clamp_max_.default, _aten.erfinv_.default, _aten.copy_.default, _aten.neg_.default,
    _aten.abs_.default, _aten.sqrt_.default, _aten.exp_.default, _aten.log_.default, _aten.tanh_.default))
"""Elementwise in-place ops: each element of the output read from the same element of the
inputs that lie in the region (when they are laid out as the output)."""

_OPS = {_aten.normal_.default: ("normal_", "mean", "std", 0.0, 1.0),
        _aten.uniform_.default: ("uniform_", "from", "to", 0.0, 1.0)}


class _DrawMode(TorchDispatchMode):
    """The caller's ``normal_`` / ``uniform_`` calls go to ``ParallelDraws.draw``."""

    def __init__(self, draws: ParallelDraws):
        super().__init__()
        self.draws = draws

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo's disable unless this says no: a
        # wrapper on every op, which imports torch._dynamo at its first call; nothing here is
        # compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        draws = self.draws
        if draws._keep is not None:  # [Note: kept draws]
            draws._saw(kwargs.get("generator"))
            draws._reads(func, args, kwargs)
        spec = _OPS.get(func)
        if spec is not None:
            op, ka, kb, da, db = spec
            t = args[0]
            a = args[1] if len(args) > 1 else kwargs.get(ka, da)
            b = args[2] if len(args) > 2 else kwargs.get(kb, db)
            gen = kwargs.get("generator")
            gen = torch.default_generator if gen is None else gen
            if self.draws.draw(op, t, float(a), float(b), gen):
                return t
        return func(*args, **kwargs)
