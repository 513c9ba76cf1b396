// The CPU-Adam loops, written once over a vector "trait" V and included by each ISA's source
// (cpu_adam.cpp: 1-lane scalar; cpu_adam_avx2.cpp: 8 lanes; cpu_adam_avx512.cpp: 16 lanes; the
// traits are simd_scalar.h, simd_avx2.h, simd_avx512.h). One formula for every path, so the paths
// agree bit for bit with each other and with torch.
//
// [Note: ISA isolation]
// This header (like cpu_rules_kernel.h and the simd_*.h traits) is compiled three times with
// three sets of ISA flags. Everything in it lives in an anonymous namespace and uses no
// standard-library inline templates, so each translation unit keeps its own copy: the linker
// never merges an AVX-512-compiled copy into the baseline path (which would crash with SIGILL on
// a CPU without AVX-512). Include it only from a .cpp file, after the trait's header, and export
// nothing but the `Kernels` table.
//
// The trait contract: a trait V provides, for `typename V::F` holding V::kLanes fp32 lanes:
//   set1(float), load(const float*), store(float*, F), add, sub, mul, div, sqrt,
//   fmadd(a, b, c) = a * b + c rounded once, any_nan(F) -> bool,
//   sign(F) -> F: +1 / -1 per lane, +0 for +-0, NaN kept (Lion, cpu_rules_kernel.h),
//   load_as<Dtype>(const void* base, int64_t i) -> F   (fp32 | bf16 | fp16 elements i..i+kLanes)
//   store_as<Dtype>(void* base, int64_t i, F)          (bf16 | fp16: round to nearest even)
//   SrHash, sr_hash(uint32_t h0) -> SrHash   (bf16 moments: lane k holds lowbias32(h0 + k *
//     kSrIndexMul), its element's hash; see [Note: bf16 moments with stochastic rounding])
//   store_bf16_stochastic<SrHalf>(void* base, int64_t i, F, SrHash)   (lane k stochastically
//     rounded to bf16 with the low or high 16 bits of lane k's hash)
//   Acc, acc_zero(), acc_add_squares(Acc, F) (fp64 accumulation), acc_total(Acc) -> double,
//     acc_load(const double*) / acc_store(double*, Acc) (kLanes doubles, lane k's at [k]),
//   max(F a, F lo): torch's clamp_min (lo where a < lo, else a; a NaN a kept).
#pragma once

#include <cstdint>

#include "cpu_adam.h"

namespace zero_offload::cpu_adam {
namespace {

// [Note: formula order]
// Every operation below is the one torch's fused CPU Adam performs on its vectorised body
// (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, fp32 params), in the same order and with the
// same fp32 roundings, as torch's released x86 wheels execute it. Its source writes
// `grad += param * wd` and `exp_avg_sq * beta2 + (1 - beta2) * grad * grad` as separate
// multiplies and adds, but GCC contracts both into FMAs when it builds the AVX2/AVX-512 kernels
// (seen in the disassembly, and confirmed by the bit-exact parity tests); the lerp is an
// explicit fmadd. We write those three FMAs explicitly and forbid every other contraction (see
// [Note: no FP contraction]), so the result does not depend on what our compiler would fuse.
// Do not reassociate, precompute reciprocals or fuse anything else:
// tests/test_cpu_adam_parity.py checks bit equality.
//
// [Note: no FP contraction]
// GCC contracts a*b + c into an FMA by default (-ffp-contract=fast), wherever its optimiser
// happens to see the pattern: with scalars kept in registers it fuses AdamW's
// `param * (1 - lr * wd) + update`, which torch's kernel does not. Each source that includes
// this header therefore starts with `#pragma GCC optimize("fp-contract=off")` (clang:
// `#pragma clang fp contract(off)`) before any include, so the only FMAs are the explicit ones.
// [Note: bf16 moments with stochastic rounding]
// With moment_dtype == kBFloat16 both moments are stored as bf16 (opt-in; 8 bytes a param
// less traffic per update). Each element's moments are widened bf16 -> fp32 (exact), the update
// runs in fp32 with exactly the formula above (so param, the copy-out and the fp32 moment values
// before they are stored are bit-identical to what the fp32-moment kernel computes from the
// same widened moments), and the two new moments are stored by stochastic rounding:
//   u = the fp32 bits of the value; idx = the element's index in the call's buffers (0 ..
//   numel - 1, whatever the thread split);
//   x = lowbias32(idx * kSrIndexMul + seed * kSrSeedMul) (cpu_adam.h), ONE hash per element;
//   r = x & 0xFFFF for exp_avg, x >> 16 for exp_avg_sq (SrHalf);
//   bf16 bits = (u + r) >> 16, uint32 arithmetic; NaN -> kBf16CanonicalNan.
// Rounding up happens with probability (u & 0xFFFF) / 2^16, so each stored value is unbiased
// (each half of the hash is uniform on [0, 2^16)); +-inf stay +-inf (their low bits are zero),
// finite values beyond bf16's largest may round to inf (no saturation). The two moments of an
// element share the hash but use disjoint bits of it; it is computed once per vector and
// reused by both stores (half the hashing of one hash per moment, which matters where the
// kernel is compute-bound, as on the 2-core dev VM). The rounding depends only on (value, idx,
// which moment, seed): every ISA path and every thread count gives the same bits, and
// tests/test_cpu_adam_bf16_moments.py reproduces them in torch. The caller should pass a
// different seed each step (e.g. the step count): with a fixed seed an element that keeps one
// value would round the same way each time.
inline uint32_t sr_hash_base(uint32_t seed, int64_t idx) {
  return static_cast<uint32_t>(idx) * kSrIndexMul + seed * kSrSeedMul;
}

// Stores the two new moments: fp32 as they are, bf16 by stochastic rounding with one hash per
// element (idx: the absolute index of element i of b's buffers, see the tail staging in
// adam_range).
template <class V, Dtype M>
inline void store_moments(const Buffers& b, int64_t i, int64_t idx, typename V::F exp_avg,
                          typename V::F exp_avg_sq) {
  if constexpr (M == Dtype::kFloat32) {
    V::store(static_cast<float*>(b.exp_avg) + i, exp_avg);
    V::store(static_cast<float*>(b.exp_avg_sq) + i, exp_avg_sq);
  } else {
    const typename V::SrHash h = V::sr_hash(sr_hash_base(b.seed, idx));
    V::template store_bf16_stochastic<SrHalf::kLow>(b.exp_avg, i, exp_avg, h);
    V::template store_bf16_stochastic<SrHalf::kHigh>(b.exp_avg_sq, i, exp_avg_sq, h);
  }
}

// One vector of elements [i, i + kLanes) of b's buffers, whose absolute indices (for the
// stochastic rounding of bf16 moments) are [idx, idx + kLanes).
template <class V, Dtype G, Dtype O, Decay W, Dtype M>
inline void adam_block(const Buffers& b, const Scalars& s, int64_t i, int64_t idx) {
  using F = typename V::F;
  F grad = V::template load_as<G>(b.grad, i);
  if (s.unscale) grad = V::div(grad, V::set1(s.grad_scale));  // grad = grad / grad_scale
  F param = V::load(b.param + i);
  if constexpr (W == Decay::kL2) {
    grad = V::fmadd(param, V::set1(s.weight_decay), grad);  // grad += param * wd
  } else if constexpr (W == Decay::kDecoupled) {
    param = V::mul(param, V::set1(s.decay_factor));  // param *= 1 - lr * wd
  }
  // exp_avg.lerp_(grad, 1 - beta1): exp_avg + w * (grad - exp_avg), or, for w >= 0.5,
  // grad + (w - 1) * (grad - exp_avg)
  F exp_avg = V::template load_as<M>(b.exp_avg, i);
  exp_avg = V::fmadd(V::set1(s.lerp_weight), V::sub(grad, exp_avg),
                     s.lerp_from_grad ? grad : exp_avg);
  // exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad, as fma((1 - beta2) * grad,
  // grad, exp_avg_sq * beta2)
  F exp_avg_sq = V::fmadd(V::mul(V::set1(s.one_minus_beta2), grad), grad,
                          V::mul(V::template load_as<M>(b.exp_avg_sq, i), V::set1(s.beta2)));
  store_moments<V, M>(b, i, idx, exp_avg, exp_avg_sq);
  // denom = sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps
  F denom = V::add(V::div(V::sqrt(exp_avg_sq), V::set1(s.bias_correction2_sqrt)), V::set1(s.eps));
  // param = param + (-lr / (1 - beta1^step)) * exp_avg / denom
  param = V::add(param, V::div(V::mul(V::set1(s.neg_step_size), exp_avg), denom));
  V::store(b.param + i, param);
  if constexpr (O != Dtype::kNone) V::template store_as<O>(b.out, i, param);
}

// A range that is not a whole number of vectors ends with a partial vector: it is staged
// through zero-padded local buffers and run through the same adam_block, so tail elements get
// exactly the same arithmetic as the body (no separate scalar loop to drift from it), and the
// same stochastic rounding (the staged block is told its absolute index).
template <class V, Dtype G, Dtype O, Decay W, Dtype M>
void adam_range(const Buffers& buffers, const Scalars& scalars, int64_t begin, int64_t end) {
  // Local copies: the compiler can then see that the float stores into the buffers never
  // overwrite a scalar or a buffer address, and keeps both in registers for the whole loop.
  const Buffers b = buffers;
  const Scalars s = scalars;
  int64_t i = begin;
  for (; i + V::kLanes <= end; i += V::kLanes) adam_block<V, G, O, W, M>(b, s, i, i);
  if constexpr (V::kLanes > 1) {
    const int64_t rest = end - i;
    if (rest <= 0) return;
    alignas(64) float param[V::kLanes] = {};
    alignas(64) unsigned char exp_avg[V::kLanes * 4] = {};
    alignas(64) unsigned char exp_avg_sq[V::kLanes * 4] = {};
    alignas(64) unsigned char grad[V::kLanes * 4] = {};
    alignas(64) unsigned char out[V::kLanes * 4] = {};
    constexpr int64_t m_size = element_size(M);
    __builtin_memcpy(param, b.param + i, rest * 4);
    __builtin_memcpy(exp_avg, static_cast<const unsigned char*>(b.exp_avg) + i * m_size,
                     rest * m_size);
    __builtin_memcpy(exp_avg_sq, static_cast<const unsigned char*>(b.exp_avg_sq) + i * m_size,
                     rest * m_size);
    __builtin_memcpy(grad, static_cast<const unsigned char*>(b.grad) + i * element_size(G),
                     rest * element_size(G));
    const Buffers staged{param, grad, exp_avg, exp_avg_sq, out, G, O, M, b.seed};
    adam_block<V, G, O, W, M>(staged, s, 0, i);  // staged lane k is element i + k
    __builtin_memcpy(b.param + i, param, rest * 4);
    __builtin_memcpy(static_cast<unsigned char*>(b.exp_avg) + i * m_size, exp_avg,
                     rest * m_size);
    __builtin_memcpy(static_cast<unsigned char*>(b.exp_avg_sq) + i * m_size, exp_avg_sq,
                     rest * m_size);
    if constexpr (O != Dtype::kNone) {
      __builtin_memcpy(static_cast<unsigned char*>(b.out) + i * element_size(O), out,
                       rest * element_size(O));
    }
  }
}

template <class V, Dtype G, Dtype O, Dtype M>
void adam_by_decay(const Buffers& b, const Scalars& s, int64_t begin, int64_t end) {
  switch (s.decay) {
    case Decay::kNone: return adam_range<V, G, O, Decay::kNone, M>(b, s, begin, end);
    case Decay::kL2: return adam_range<V, G, O, Decay::kL2, M>(b, s, begin, end);
    case Decay::kDecoupled: return adam_range<V, G, O, Decay::kDecoupled, M>(b, s, begin, end);
  }
}

template <class V, Dtype G, Dtype O>
void adam_by_moment(const Buffers& b, const Scalars& s, int64_t begin, int64_t end) {
  switch (b.moment_dtype) {
    case Dtype::kBFloat16: return adam_by_decay<V, G, O, Dtype::kBFloat16>(b, s, begin, end);
    default: return adam_by_decay<V, G, O, Dtype::kFloat32>(b, s, begin, end);  // checked by caller
  }
}

template <class V, Dtype G>
void adam_by_out(const Buffers& b, const Scalars& s, int64_t begin, int64_t end) {
  switch (b.out_dtype) {
    case Dtype::kBFloat16: return adam_by_moment<V, G, Dtype::kBFloat16>(b, s, begin, end);
    case Dtype::kFloat16: return adam_by_moment<V, G, Dtype::kFloat16>(b, s, begin, end);
    default: return adam_by_moment<V, G, Dtype::kNone>(b, s, begin, end);  // checked by caller
  }
}

// Kernels::adam for trait V: picks the instantiation for this call's dtypes (grad, copy-out,
// moments) and decay mode.
template <class V>
void adam_kernel(const Buffers& b, const Scalars& s, int64_t begin, int64_t end) {
  switch (b.grad_dtype) {
    case Dtype::kBFloat16: return adam_by_out<V, Dtype::kBFloat16>(b, s, begin, end);
    case Dtype::kFloat16: return adam_by_out<V, Dtype::kFloat16>(b, s, begin, end);
    default: return adam_by_out<V, Dtype::kFloat32>(b, s, begin, end);  // checked by caller
  }
}

// Loads grad[i, i + kLanes) as fp32, or, at the end of a range, the `rest` elements there
// padded with zeros (which add nothing to a sum of squares and are finite).
template <class V, Dtype G>
inline typename V::F load_partial(const void* grad, int64_t i, int64_t rest) {
  alignas(64) unsigned char staged[V::kLanes * 4] = {};
  __builtin_memcpy(staged, static_cast<const unsigned char*>(grad) + i * element_size(G),
                   rest * element_size(G));
  return V::template load_as<G>(staged, 0);
}

template <class V, Dtype G>
double sumsq_range(const void* grad, int64_t begin, int64_t end) {
  // Two accumulators: two independent FMA chains keep the adder busy at memory speed.
  typename V::Acc acc0 = V::acc_zero(), acc1 = V::acc_zero();
  int64_t i = begin;
  for (; i + 2 * V::kLanes <= end; i += 2 * V::kLanes) {
    acc0 = V::acc_add_squares(acc0, V::template load_as<G>(grad, i));
    acc1 = V::acc_add_squares(acc1, V::template load_as<G>(grad, i + V::kLanes));
  }
  for (; i + V::kLanes <= end; i += V::kLanes) {
    acc0 = V::acc_add_squares(acc0, V::template load_as<G>(grad, i));
  }
  if (i < end) acc1 = V::acc_add_squares(acc1, load_partial<V, G>(grad, i, end - i));
  return V::acc_total(acc0) + V::acc_total(acc1);
}

// x * 0 is NaN exactly when x is inf or NaN, and NaN survives every later add: one mul and one
// add per vector, one test per range.
template <class V, Dtype G>
bool nonfinite_range(const void* grad, int64_t begin, int64_t end) {
  const typename V::F zero = V::set1(0.0f);
  typename V::F acc = zero;
  int64_t i = begin;
  for (; i + V::kLanes <= end; i += V::kLanes) {
    acc = V::add(acc, V::mul(V::template load_as<G>(grad, i), zero));
  }
  if (i < end) acc = V::add(acc, V::mul(load_partial<V, G>(grad, i, end - i), zero));
  return V::any_nan(acc);
}

template <class V>
double sumsq_kernel(const void* grad, Dtype dtype, int64_t begin, int64_t end) {
  switch (dtype) {
    case Dtype::kBFloat16: return sumsq_range<V, Dtype::kBFloat16>(grad, begin, end);
    case Dtype::kFloat16: return sumsq_range<V, Dtype::kFloat16>(grad, begin, end);
    default: return sumsq_range<V, Dtype::kFloat32>(grad, begin, end);
  }
}

template <class V>
bool nonfinite_kernel(const void* grad, Dtype dtype, int64_t begin, int64_t end) {
  switch (dtype) {
    case Dtype::kBFloat16: return nonfinite_range<V, Dtype::kBFloat16>(grad, begin, end);
    case Dtype::kFloat16: return nonfinite_range<V, Dtype::kFloat16>(grad, begin, end);
    default: return nonfinite_range<V, Dtype::kFloat32>(grad, begin, end);
  }
}

template <class V>
Kernels make_kernels(const char* name) {
  return Kernels{name, &adam_kernel<V>, &sumsq_kernel<V>, &nonfinite_kernel<V>};
}

}  // namespace
}  // namespace zero_offload::cpu_adam
