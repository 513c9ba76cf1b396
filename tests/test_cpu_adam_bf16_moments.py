"""bf16 Adam moments with stochastic rounding (opt-in, ``adam_step(..., exp_avg/exp_avg_sq bf16,
seed=...)``): see [Note: bf16 moments with stochastic rounding] in csrc/cpu_adam_kernel.h.

The reference: the fp32-moment kernel run on the bf16 moments widened to fp32 must give the same
param / copy-out bits, and a pure-torch implementation of the rounding rule applied to its fp32
moments must give the bf16 kernel's moment bits, on every ISA path and thread count."""
import pytest
import torch

import _cpu_adam_util
from zero_offload.cpu_adam import adam_step, adam_step_async

each_isa = _cpu_adam_util.each_isa  # the fixture: once per ISA path this CPU runs (+ scalar)

MASK32 = 0xFFFFFFFF
BF16_NAN = 0x7FC0
MODES = {  # (adamw, weight_decay)
    "adam": (False, 0.0),
    "adam_l2": (False, 0.1),
    "adamw": (True, 0.1),
}


# ---------------------------------------------------------------------------------------------
# The torch reference of the rounding rule (int64 arithmetic masked to 32 bits).


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def sr_hash(numel: int, seed: int, *, first_index: int = 0) -> torch.Tensor:
    """The one hash (int64 in [0, 2**32)) of each of the elements ``first_index ..``."""
    idx = torch.arange(first_index, first_index + numel, dtype=torch.int64) & MASK32
    return _lowbias32((idx * 0x9E3779B9 + seed * 0x85EBCA6B) & MASK32)


def sr_bf16_bits(values: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """The bf16 bits (int64 in [0, 0xFFFF]) stochastic rounding stores for fp32 ``values`` with
    the rounding bits ``rbits`` (int64 in [0, 2**16), one per element)."""
    values = values.reshape(-1)
    u = values.view(torch.int32).to(torch.int64) & MASK32
    bits = ((u + rbits) & MASK32) >> 16
    return torch.where(torch.isnan(values), torch.full_like(bits, BF16_NAN), bits)


def sr_moment_bits(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, seed: int, *, first_index: int = 0):
    """The reference rule: one hash per element, its low half rounds exp_avg, its high half
    exp_avg_sq. Returns the two moments' bf16 bits."""
    x = sr_hash(exp_avg.numel(), seed, first_index=first_index)
    return sr_bf16_bits(exp_avg, x & 0xFFFF), sr_bf16_bits(exp_avg_sq, x >> 16)


def bits16(t: torch.Tensor) -> torch.Tensor:
    """The 16-bit patterns of a bf16/fp16 tensor as int64 in [0, 0xFFFF]."""
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def from_bits16(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.bfloat16)


def test_reference_is_truncation_or_one_ulp_up():
    """Sanity of the reference itself: the stored value is the fp32 value truncated (toward zero)
    to bf16 or one bf16 ulp further from zero, and exact bf16 values stay exact."""
    v = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    trunc = (v.view(torch.int32).to(torch.int64) & MASK32) >> 16
    for bits in sr_moment_bits(v, v, 7):
        assert bool(((bits == trunc) | (bits == trunc + 1)).all())
    exact = v.bfloat16().float()
    for bits in sr_moment_bits(exact, exact, 7):
        assert torch.equal(bits, bits16(exact.bfloat16()))


# ---------------------------------------------------------------------------------------------
# 1. Bit-exact against the reference.


def _operands(numel: int, grad_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).mul_(3.0).to(grad_dtype)
    exp_avg = torch.randn(numel, generator=gen).mul_(0.1).bfloat16()
    exp_avg_sq = torch.rand(numel, generator=gen).mul_(0.01).bfloat16()
    return param, grad, exp_avg, exp_avg_sq


def _check_against_reference(param, grad, exp_avg, exp_avg_sq, *, out_dtype, seed, threads, hyper, what):
    """One step with bf16 moments, checked bit for bit; updates the given tensors in place."""
    n = param.numel()
    ref_param, ref_m, ref_v = param.clone(), exp_avg.float(), exp_avg_sq.float()
    ref_out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    adam_step(ref_param, grad, ref_m, ref_v, out_lowp=ref_out, threads=threads, **hyper)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    adam_step(param, grad, exp_avg, exp_avg_sq, out_lowp=out, threads=threads, seed=seed, **hyper)
    assert torch.equal(param.view(torch.int32), ref_param.view(torch.int32)), f"{what}: param"
    if out is not None:
        assert torch.equal(bits16(out), bits16(ref_out)), f"{what}: out_lowp"
    expected_bits = sr_moment_bits(ref_m, ref_v, seed)
    for (name, got, wide), expected in zip((("exp_avg", exp_avg, ref_m), ("exp_avg_sq", exp_avg_sq, ref_v)),
                                           expected_bits):
        got_bits = bits16(got)
        if not torch.equal(got_bits, expected):
            bad = (got_bits != expected).nonzero().flatten()
            raise AssertionError(f"{what}: {name}: {bad.numel()} of {n} elements differ from the SR reference, "
                                 f"first at {bad[0].item()}: {got_bits[bad[0]].item():#06x} vs "
                                 f"{expected[bad[0]].item():#06x} (fp32 {wide[bad[0]].item()!r})")


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16], ids=["no_out", "bf16_out"])
@pytest.mark.parametrize("grad_scale", [1.0, 384.0])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("numel", [1, 7, 33, 1000, 4099])
def test_bf16_moments_match_reference(each_isa, numel, grad_dtype, mode, grad_scale, out_dtype):
    """Three steps (seed = step): after each, param and out_lowp equal the fp32-moment kernel's
    on the widened moments, the moments equal the torch SR reference; threads=2 gives the same
    bits as threads=1."""
    adamw, weight_decay = MODES[mode]
    operands = _operands(numel, grad_dtype, seed=numel)
    twin = [t.clone() for t in operands]  # the same run on 2 threads
    for step in (1, 2, 3):
        hyper = dict(step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay,
                     adamw=adamw, grad_scale=grad_scale)
        what = f"{each_isa} numel={numel} step={step}"
        _check_against_reference(*operands, out_dtype=out_dtype, seed=step, threads=1, hyper=hyper, what=what)
        _check_against_reference(*twin, out_dtype=out_dtype, seed=step, threads=2, hyper=hyper, what=what)
        for a, b in zip(operands, twin):
            assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                               b.view(torch.int16 if b.element_size() == 2 else torch.int32)), what


@pytest.mark.parametrize("mode", list(MODES))
def test_bf16_moments_many_chunks_any_thread_count(each_isa, mode):
    """A buffer of many per-thread chunks (each range ends in a partial vector only at the very
    end): the index that keys the rounding is the element's index in the call, so 1, 2 and 3
    threads store the same bits, and those are the reference's."""
    adamw, weight_decay = MODES[mode]
    numel = 200_003
    hyper = dict(step=5, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, adamw=adamw)
    base = _operands(numel, torch.bfloat16, seed=11)
    results = []
    for threads in (1, 2, 3):
        operands = [t.clone() for t in base]
        _check_against_reference(*operands, out_dtype=torch.bfloat16, seed=0xDEADBEEF, threads=threads,
                                 hyper=hyper, what=f"{each_isa} threads={threads}")
        results.append(operands)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_seed_changes_only_the_rounding(each_isa):
    """Different seeds: identical params, moments that differ somewhere but only by the rounding
    direction (at most one bf16 ulp apart); the same seed twice gives the same bits."""
    base = _operands(4099, torch.float32, seed=3)
    hyper = dict(step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=False)
    runs = {}
    for seed in (0, 1, 2**32 - 1, 1):
        operands = [t.clone() for t in base]
        adam_step(*operands, seed=seed, **hyper)
        if seed in runs:
            assert all(torch.equal(a, b) for a, b in zip(runs[seed], operands))
        runs[seed] = operands
    for seed in (1, 2**32 - 1):
        assert torch.equal(runs[seed][0], runs[0][0])
        for k in (2, 3):
            diff = (bits16(runs[seed][k]) - bits16(runs[0][k])).abs()
            assert int(diff.max()) == 1 and int((diff == 1).sum()) > 100


def test_async_equals_sync(each_isa):
    base = _operands(1000, torch.bfloat16, seed=5)
    hyper = dict(step=2, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw=True, seed=77)
    sync = [t.clone() for t in base]
    adam_step(*sync, **hyper)
    queued = [t.clone() for t in base]
    adam_step_async(*queued, **hyper).wait()
    assert all(torch.equal(a, b) for a, b in zip(sync, queued))


def test_fp32_moments_ignore_the_seed(each_isa):
    gen = torch.Generator().manual_seed(9)
    base = [torch.randn(1003, generator=gen), torch.randn(1003, generator=gen), torch.randn(1003, generator=gen),
            torch.rand(1003, generator=gen)]
    hyper = dict(step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=False)
    a, b = [t.clone() for t in base], [t.clone() for t in base]
    adam_step(*a, **hyper)
    adam_step(*b, seed=123456, **hyper)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# 2. and 3.: the rounding itself, driven through the kernel. With beta1 = 0 the new exp_avg is
# exactly grad (lerp weight 1: grad + 0 * (grad - exp_avg)); with beta2 = 0 the new exp_avg_sq
# is fl(grad * grad). So a grad of x stores SR(x) into exp_avg.


def _store_through_kernel(values: torch.Tensor, *, seed: int, betas=(0.0, 0.0)):
    n = values.numel()
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    adam_step(torch.zeros(n), values, m, v, step=1, lr=1e-3, betas=betas, eps=1e-8, weight_decay=0.0,
              adamw=False, seed=seed)
    return m, v


def _neighbours(x32: torch.Tensor):
    """x32's bf16 neighbours (truncated toward zero, one ulp further), P(rounding away from zero)
    and the ulp."""
    lo = x32.view(torch.int32).item() >> 16 << 16  # truncated toward zero (the sign bit stays)
    lo_val = torch.tensor(lo, dtype=torch.int32).view(torch.float32).item()
    hi_val = torch.tensor(lo + 0x10000, dtype=torch.int32).view(torch.float32).item()
    assert lo_val != x32.item() != hi_val
    return lo_val, hi_val, (x32.item() - lo_val) / (hi_val - lo_val), abs(hi_val - lo_val)


def _assert_unbiased(stored: torch.Tensor, x32: torch.Tensor, what: str):
    """Every stored value is one of x32's two bf16 neighbours; their mean is x32 within 4
    standard errors."""
    lo_val, hi_val, p_up, ulp = _neighbours(x32)
    assert bool(((stored == lo_val) | (stored == hi_val)).all()), what
    se = ulp * (p_up * (1 - p_up) / stored.numel()) ** 0.5
    assert abs(stored.mean().item() - x32.item()) < 4 * se, (what, stored.mean().item(), x32.item(), se)


@pytest.mark.parametrize("x", [1.0 + 0.3 * 2**-7, -(1.0 + 0.3 * 2**-7), 3.0e-3 * (1 + 0.71 * 2**-7),
                               1.0 + 0.01 * 2**-7, 1234.5678])
def test_stochastic_rounding_is_unbiased(each_isa, x):
    """Many elements holding the same fp32 value: every stored value is one of its two bf16
    neighbours, and their mean is the value within 4 standard errors. Likewise one element over
    many seeds. Both moments: exp_avg holds x (rounded with the low half of each element's
    hash), exp_avg_sq holds fl(x * x) (rounded with the high half)."""
    x32 = torch.tensor(x, dtype=torch.float32)
    sq32 = x32 * x32  # beta2 = 0: the new exp_avg_sq is fma(grad, grad, 0) = fl(x * x)
    n = 200_000
    m, v = _store_through_kernel(torch.full((n,), x), seed=12345)
    _assert_unbiased(m.double(), x32, "exp_avg over elements")
    _assert_unbiased(v.double(), sq32, "exp_avg_sq over elements")

    seeds = 3000
    over_seeds = torch.empty(2, seeds, dtype=torch.float64)
    one = torch.full((1,), x)
    for seed in range(seeds):
        m, v = _store_through_kernel(one, seed=seed * 2654435761 % 2**32)
        over_seeds[0, seed], over_seeds[1, seed] = m.double(), v.double()
    _assert_unbiased(over_seeds[0], x32, "exp_avg over seeds")
    _assert_unbiased(over_seeds[1], sq32, "exp_avg_sq over seeds")


def _rounding_bits_through_kernel(rounds_up, n: int) -> torch.Tensor:
    """Each element's 16 rounding bits r, recovered from the kernel alone: an fp32 value whose
    low 16 bits are L rounds up iff L + r >= 2**16, so a binary search (one kernel call per probe,
    all elements at once) finds the smallest such L = 2**16 - r. rounds_up(L) -> bool per element."""
    lo = torch.zeros(n, dtype=torch.int64)
    hi = torch.full((n,), 1 << 16, dtype=torch.int64)  # 2**16: never rounds up (r = 0)
    while bool((lo < hi).any()):
        active = lo < hi
        mid = (lo + hi) // 2
        up = rounds_up(mid.clamp(max=0xFFFF))
        hi = torch.where(active & up, mid, hi)
        lo = torch.where(active & ~up, mid + 1, lo)
    return (1 << 16) - lo


def test_moments_share_one_hash_low_and_high_halves(each_isa):
    """The two moments of an element are rounded with the two halves of ONE hash: exp_avg's
    rounding bits (recovered through the kernel) are the low 16 bits of lowbias32(idx *
    0x9E3779B9 + seed * 0x85EBCA6B), exp_avg_sq's are its high 16 bits.
    exp_avg: beta1 = 0, so the new exp_avg is the grad, 1.0 plus L fp32 ulps (bf16 0x3F80 or,
    rounded up, 0x3F81). exp_avg_sq: beta2 = 0.5 from exp_avg_sq = 1, so the new exp_avg_sq is
    fl(0.5 + 0.5 * g * g) = 0.5 plus L fp32 ulps for g = fl(sqrt(L * 2**-23)) (bf16 0x3F00 or
    0x3F01); the fp32-moment kernel confirms that for every L."""
    n, seed = 263, 0x9E3779B9 ^ 12345  # several vectors and a partial one on every path
    hyper = dict(step=1, lr=1e-3, eps=1e-8, weight_decay=0.0, adamw=False, threads=1)

    def sq_grads(low: torch.Tensor) -> torch.Tensor:
        return (low.double() * 2**-23).sqrt().float()

    every = torch.arange(1 << 16, dtype=torch.int64)
    v32 = torch.ones(every.numel())
    adam_step(torch.zeros(every.numel()), sq_grads(every), torch.zeros(every.numel()), v32,
              betas=(0.0, 0.5), **hyper)
    assert torch.equal(v32.view(torch.int32).to(torch.int64), 0x3F000000 + every)

    def m_rounds_up(low):
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        grad = (0x3F800000 + low).to(torch.int32).view(torch.float32)
        adam_step(torch.zeros(n), grad, m, v, betas=(0.0, 0.999), seed=seed, **hyper)
        assert bool(((bits16(m) == 0x3F80) | (bits16(m) == 0x3F81)).all())
        return bits16(m) == 0x3F81

    def v_rounds_up(low):
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
        adam_step(torch.zeros(n), sq_grads(low), m, v, betas=(0.9, 0.5), seed=seed, **hyper)
        assert bool(((bits16(v) == 0x3F00) | (bits16(v) == 0x3F01)).all())
        return bits16(v) == 0x3F01

    r_m = _rounding_bits_through_kernel(m_rounds_up, n)
    r_v = _rounding_bits_through_kernel(v_rounds_up, n)
    x = sr_hash(n, seed)
    assert torch.equal(r_m, x & 0xFFFF), "exp_avg is rounded with the low half of the element's hash"
    assert torch.equal(r_v, x >> 16), "exp_avg_sq is rounded with the high half of the element's hash"
    assert torch.equal((r_v << 16) | r_m, x)
    assert int((r_m != r_v).sum()) > n - 5  # the two moments' bits are not one and the same


def test_nan_inf_and_exact_values(each_isa):
    n = 67  # several vectors and a partial one on every path
    # NaN of either sign and any payload (0xFFFFFFFF would wrap into a small number if the
    # rounding added to it) stores the canonical 0x7FC0 in both moments.
    nan_bits = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00000, 0xFFFFFFFF, 0x7FFFFFFF] * 14,
                            dtype=torch.int64)[:n]
    nans = nan_bits.to(torch.int32).view(torch.float32).clone()
    m, v = _store_through_kernel(nans, seed=99)
    assert bool((bits16(m) == BF16_NAN).all()) and bool((bits16(v) == BF16_NAN).all())

    # +-inf stay +-inf: an infinite exp_avg / exp_avg_sq survives a step with finite grads
    # (beta1 = 0.5: the lerp runs from the grad side, grad - 0.5 * (grad - inf) = inf).
    m = torch.tensor([float("inf"), float("-inf")] * 40, dtype=torch.bfloat16)[:n].clone()
    v = torch.full((n,), float("inf"), dtype=torch.bfloat16)
    adam_step(torch.zeros(n), torch.randn(n), m, v, step=1, lr=1e-3, betas=(0.5, 0.9), eps=1e-8,
              weight_decay=0.0, adamw=False, seed=5)
    assert torch.equal(bits16(m), bits16(torch.tensor([float("inf"), float("-inf")] * 40,
                                                      dtype=torch.bfloat16)[:n]))
    assert bool(torch.isposinf(v.float()).all())

    # Values exactly representable in bf16 are stored exactly, whatever the seed.
    exact = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    small_ints = torch.randint(-16, 17, (n,), generator=torch.Generator().manual_seed(2)).float()
    for seed in (0, 1, 2**31, 2**32 - 1):
        m, _ = _store_through_kernel(exact, seed=seed)
        assert torch.equal(m.float(), exact)
        _, v = _store_through_kernel(small_ints, seed=seed)  # k * k <= 256: exact in bf16
        assert torch.equal(v.float(), small_ints * small_ints)


# ---------------------------------------------------------------------------------------------
# 4. Bad input: one clear error, raised before any buffer is written.


def _bad_inputs():
    n = 37
    return [
        ("fp32_m_bf16_v", dict(exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n, dtype=torch.bfloat16)), {},
         TypeError, "exp_avg has dtype torch.float32 but exp_avg_sq has dtype torch.bfloat16"),
        ("bf16_m_fp32_v", dict(exp_avg=torch.zeros(n, dtype=torch.bfloat16), exp_avg_sq=torch.zeros(n)), {},
         TypeError, "exp_avg has dtype torch.bfloat16 but exp_avg_sq has dtype torch.float32"),
        ("fp16_moments", dict(exp_avg=torch.zeros(n, dtype=torch.float16),
                              exp_avg_sq=torch.zeros(n, dtype=torch.float16)), {},
         TypeError, "exp_avg has dtype torch.float16; expected torch.float32, torch.bfloat16"),
        ("seed_negative", {}, {"seed": -1}, ValueError, "seed must be in [0, 2**32)"),
        ("seed_too_big", {}, {"seed": 2**32}, ValueError, "got 4294967296"),
        ("seed_float", {}, {"seed": 1.5}, TypeError, "seed must be an int in [0, 2**32)"),
        ("seed_bool", {}, {"seed": True}, TypeError, "seed must be an int in [0, 2**32)"),
        ("seed_none", {}, {"seed": None}, TypeError, "seed must be an int in [0, 2**32)"),
    ]


@pytest.mark.parametrize("fn", [adam_step, adam_step_async], ids=["sync", "async"])
@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda case: case[0])
def test_bad_input_raises_before_writing(fn, case):
    _, overrides, kwargs, error, fragment = case
    n = 37
    gen = torch.Generator().manual_seed(0)
    buffers = dict(param=torch.randn(n, generator=gen), grad=torch.randn(n, generator=gen),
                   exp_avg=torch.randn(n, generator=gen).bfloat16(),
                   exp_avg_sq=torch.rand(n, generator=gen).bfloat16())
    buffers.update(overrides)
    out = torch.zeros(n, dtype=torch.bfloat16)
    before = {k: t.clone() for k, t in buffers.items()}
    with pytest.raises(error) as info:
        fn(buffers["param"], buffers["grad"], buffers["exp_avg"], buffers["exp_avg_sq"], step=1, lr=1e-2,
           betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=False, out_lowp=out, **kwargs)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message
    for k, t in buffers.items():
        assert torch.equal(t, before[k]), f"{k} was written"
    assert not out.any()


def test_seed_accepts_the_whole_range_and_integral_types():
    n = 33
    for seed in (0, 2**32 - 1, torch.tensor(5).item()):
        m, _ = _store_through_kernel(torch.randn(n), seed=seed)
        assert torch.isfinite(m.float()).all()


# ---------------------------------------------------------------------------------------------
# 5. A short training run: bf16-SR moments stay close to fp32 moments.


def _least_squares_run(moments: str, steps: int = 200) -> float:
    """Adam (lr 1e-2) on min ||A w - b||^2 / rows from w = 0; returns the final loss.
    moments: "fp32" | "bf16_sr" (the kernel, seed = step) | "bf16_rne" (fp32 kernel, moments
    cast to bf16 round-to-nearest-even and back after every step: what plain bf16 storage does)."""
    gen = torch.Generator().manual_seed(0)
    rows, cols = 512, 256
    a = torch.randn(rows, cols, generator=gen) / cols**0.5
    b = a @ torch.randn(cols, generator=gen) + 0.01 * torch.randn(rows, generator=gen)
    w = torch.zeros(cols)
    dtype = torch.bfloat16 if moments == "bf16_sr" else torch.float32
    m, v = torch.zeros(cols, dtype=dtype), torch.zeros(cols, dtype=dtype)
    for step in range(1, steps + 1):
        grad = (2.0 / rows) * (a.T @ (a @ w - b))
        adam_step(w, grad, m, v, step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                  adamw=False, threads=1, seed=step)
        if moments == "bf16_rne":
            m.copy_(m.bfloat16())
            v.copy_(v.bfloat16())
    return float(((a @ w - b) ** 2).mean())


def test_training_with_bf16_sr_moments_tracks_fp32():
    """Not bit-exact (the moments are rounded every step), but 200 steps end within 3% of the
    fp32-moment loss. Round-to-nearest bf16 moments are reported, not asserted on."""
    initial = _least_squares_run("fp32", steps=0)
    fp32 = _least_squares_run("fp32")
    sr = _least_squares_run("bf16_sr")
    rne = _least_squares_run("bf16_rne")
    print(f"\nleast squares, 200 Adam steps: initial {initial:.6g}, fp32 moments {fp32:.6g}, "
          f"bf16 SR moments {sr:.6g} ({100 * (sr / fp32 - 1):+.2f}%), "
          f"bf16 round-to-nearest moments {rne:.6g} ({100 * (rne / fp32 - 1):+.2f}%)")
    assert fp32 < 0.05 * initial  # the problem is actually being solved
    assert abs(sr - fp32) <= 0.03 * fp32
