"""ops/rng.py: torch's CPU random fills drawn in slices on several threads give exactly the values
of one serial torch call, and leave the generator exactly where that call leaves it ([Note:
parallel draws]); what does not qualify runs as the plain torch call; without the native
advance (or with a generator layout it does not know) every fill is serial and says so once."""
import math

import pytest
import torch

from zero_offload.ops import _native, rng
from zero_offload.ops.rng import ParallelDraws, advanced, stream_check

MIN = 1 << 12  # a small slice so the tests cut many slices quickly


def _state_after(seed, fn):
    g = torch.Generator().manual_seed(seed)
    out = fn(g)
    return out, g.get_state()


@pytest.mark.parametrize("pre,n", [(0, 0), (0, 1), (0, 624), (1, 623), (5, 619), (5, 620), (624, 624),
                                   (700, 1300), (3, 100_000), (0, 1 << 20)])
def test_advanced_state_draws_what_torch_draws_after_n(pre, n):
    g = torch.Generator().manual_seed(1234 + pre)
    torch.rand(pre, generator=g)
    moved = advanced(g.get_state(), n)
    torch.rand(n, generator=g)
    assert torch.equal(moved, g.get_state())  # every byte: words, position, seed, normal cache


SIZES = [2 * MIN, 2 * MIN + 1, 2 * MIN + 15, 2 * MIN + 16, 2 * MIN + 17, 3 * MIN + 7, 7 * MIN + 3,
         (1 << 16) + 5]


@pytest.mark.parametrize("op", ["normal_", "uniform_"])
@pytest.mark.parametrize("numel", SIZES)
def test_sliced_fills_equal_one_serial_call_and_leave_the_generator_where_it_leaves_it(op, numel):
    args = (0.25, 0.02) if op == "normal_" else (-0.1, 0.3)
    expect, after = _state_after(numel, lambda g: getattr(torch.empty(numel), op)(*args, generator=g))
    with ParallelDraws(threads=3, min_slice=MIN) as draws:
        g = torch.Generator().manual_seed(numel)
        out = torch.empty(numel)
        with draws.mode():
            getattr(out, op)(*args, generator=g)
        assert draws.drawn == numel  # it was cut into slices (not the plain call)
    assert torch.equal(out, expect)
    assert torch.equal(g.get_state(), after)


def test_the_default_generator_keyword_arguments_views_and_torch_init_functions():
    n = 5 * MIN + 9
    base = torch.empty(3 * n)

    def fills(t):  # each reads the default generator, as a model's init does
        t[n:2 * n].normal_(mean=0.5, std=2.0)  # a view at an offset, keywords
        t[:n].uniform_(to=3.0)
        w = t[2 * n:].view(-1)
        torch.nn.init.trunc_normal_(w, std=0.02)
        torch.nn.init.normal_(w[:4 * MIN], 0.0, 0.1)
        m = torch.empty(64, MIN)
        torch.nn.init.kaiming_uniform_(m, a=math.sqrt(5))
        torch.nn.init.xavier_normal_(m)
        return torch.cat([t, m.view(-1)])

    torch.manual_seed(3)
    expect = fills(base.clone())
    after = torch.get_rng_state()
    torch.manual_seed(3)
    with ParallelDraws(threads=2, min_slice=MIN) as draws:
        with draws.mode():
            got = fills(base.clone())
        assert draws.drawn > 0
    assert torch.equal(got, expect)
    assert torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize("make", [
    lambda: torch.empty(MIN),                                    # too small to cut
    lambda: torch.empty(8 * MIN, 2)[:, 0],                       # not contiguous
    lambda: torch.empty(8 * MIN, dtype=torch.bfloat16),          # not fp32 (other draws per element)
    lambda: torch.empty(8 * MIN, dtype=torch.float64),
])
def test_what_does_not_qualify_runs_as_the_plain_call(make):
    expect, after = _state_after(5, lambda g: make().normal_(0.0, 1.0, generator=g))
    with ParallelDraws(threads=2, min_slice=MIN) as draws:
        g = torch.Generator().manual_seed(5)
        t = make()
        with draws.mode():
            t.normal_(0.0, 1.0, generator=g)
        assert draws.drawn == 0
    assert torch.equal(t, expect) and torch.equal(g.get_state(), after)


def test_one_thread_and_other_ops_pass_through():
    with ParallelDraws(threads=1, min_slice=MIN) as draws:
        torch.manual_seed(0)
        t = torch.empty(8 * MIN)
        with draws.mode():
            t.normal_()
            t.mul_(2).add_(1)
        assert draws.drawn == 0
    torch.manual_seed(0)
    assert torch.equal(t, torch.empty(8 * MIN).normal_().mul_(2).add_(1))


def test_without_the_native_advance_fills_are_serial_exact_and_say_so(monkeypatch):
    assert stream_check() is None  # this build and this torch: the parallel path is checked
    monkeypatch.setattr(_native, "rng", None)
    stream_check.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"drawn on one thread \(the native extension has no rng "
                                                r"module \(rebuild it: pip install -e \.\)\); they are exact"):
            draws = ParallelDraws(threads=2, min_slice=MIN)
        with draws:
            torch.manual_seed(1)
            t = torch.empty(8 * MIN)
            with draws.mode():
                t.normal_()
            assert draws.drawn == 0
        torch.manual_seed(1)
        assert torch.equal(t, torch.empty(8 * MIN).normal_())
    finally:
        monkeypatch.undo()
        stream_check.cache_clear()
    assert rng.stream_check() is None


def test_a_bad_thread_count_is_refused():
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        ParallelDraws(threads=0)


# ---- kept draws ([Note: kept draws]) --------------------------------------------------------------

@pytest.mark.parametrize("op", ["normal_", "uniform_"])
@pytest.mark.parametrize("lo,hi", [(0, 3 * MIN), (3 * MIN + 5, 9 * MIN), (9 * MIN + 17, 20 * MIN + 9), (5, 6)])
def test_a_kept_range_gets_the_whole_fills_values_and_the_rest_is_not_drawn(op, lo, hi):
    n = 20 * MIN + 9  # region: a first param of 6 * MIN, a second of the rest (with a tail)
    args = (0.1, 0.02) if op == "normal_" else (-0.1, 0.3)

    def fills(region):
        getattr(region[:6 * MIN], op)(*args)
        getattr(region[6 * MIN:], op)(*args)
        region[6 * MIN:].mul_(2.0)  # elementwise in place: keeps the kept elements right

    torch.manual_seed(7)
    expect = torch.zeros(n)
    fills(expect)
    after = torch.get_rng_state()
    torch.manual_seed(7)
    got = torch.zeros(n)
    with ParallelDraws(threads=3, min_slice=MIN) as draws:
        with draws.mode(), draws.keeping(got, lo, hi):
            fills(got)
        assert not draws.tainted and draws.skipped > 0
    assert torch.equal(got[lo:hi], expect[lo:hi])
    assert torch.equal(torch.get_rng_state(), after)  # the stream moved past every slice
    assert (got == 0).sum() >= draws.skipped - 32  # what was skipped was left as it was


@pytest.mark.parametrize("read", [
    lambda w: w.div_(w.norm()),               # a reduction over the whole parameter
    lambda w: w.copy_(w.flip(0)),             # elements moved: an out-of-place read
    lambda w: w[:MIN].copy_(w[-MIN:]),        # in place, from elsewhere in the parameter
])
def test_an_init_that_reads_skipped_elements_taints_the_slot_and_undo_replays_it(read):
    n = 12 * MIN
    other = torch.Generator().manual_seed(5)  # an init's own generator comes back too

    def init(w):
        w.normal_(0.0, 0.02)
        torch.rand(3, generator=other)
        read(w)

    torch.manual_seed(9)
    expect = torch.zeros(n)
    init(expect)
    after, other_after = torch.get_rng_state(), other.get_state()
    torch.manual_seed(9)
    other.manual_seed(5)
    got = torch.zeros(n)
    with ParallelDraws(threads=2, min_slice=MIN) as draws:
        with draws.mode():
            with draws.keeping(got, 0, 3 * MIN):
                init(got)
            assert draws.tainted
            draws.undo()
            got.zero_()
            init(got)
    assert torch.equal(got, expect)
    assert torch.equal(torch.get_rng_state(), after)
    assert torch.equal(other.get_state(), other_after)


def test_one_thread_draws_only_the_kept_slices():
    n = 16 * MIN
    torch.manual_seed(4)
    expect = torch.empty(n).normal_()
    after = torch.get_rng_state()
    torch.manual_seed(4)
    got = torch.zeros(n)
    with ParallelDraws(threads=1, min_slice=MIN) as draws:
        with draws.mode(), draws.keeping(got, 0, n // 2):
            got.normal_()
        assert draws.skipped >= n // 4
    assert torch.equal(got[:n // 2], expect[:n // 2]) and torch.equal(torch.get_rng_state(), after)
