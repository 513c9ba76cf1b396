// The loops of the rules beside CPU-Adam (SGD, Lion, Muon's host passes, Adafactor's passes),
// written once over a vector trait V (the contract is in
// cpu_adam_kernel.h; the traits are simd_scalar.h, simd_avx2.h, simd_avx512.h) and included by
// each ISA's source (cpu_rules.cpp, cpu_rules_avx2.cpp, cpu_rules_avx512.cpp). One formula for
// every path, so the paths agree bit for bit with each other. Compiled three times with three
// sets of ISA flags: everything here is in an anonymous namespace and uses no standard-library
// inline templates ([Note: ISA isolation] in cpu_adam_kernel.h).
//
// [Note: SGD and Lion formula order]
// Each step is the sequence of fp32 tensor ops its reference runs, in the same order, with the
// same roundings, as torch's CPU kernels execute them on their vectorised body:
// `a.add(b, alpha=s)` is fmadd(b, float(s), a) (aten/src/ATen/native/ufunc/add.h), `a.mul(s)`
// is a * float(s), `a / s` is a / float(s). The references:
//   SGD  = torch.optim.SGD (maximize=False), torch/optim/sgd.py `_single_tensor_sgd`:
//     g = grad / grad_scale                               (the fused loss-scale unscale)
//     if weight_decay != 0:  g = g.add(param, alpha=weight_decay)
//     if momentum != 0:
//         first step:  buf = g.clone()                    (no dampening on the first step)
//         else:        buf = buf.mul(momentum).add(g, alpha=1 - dampening)
//         g = g.add(buf, alpha=momentum) if nesterov else buf
//     param = param.add(g, alpha=-lr)
//   Lion = Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2
//   (decoupled weight decay), as the torch ops of tests/test_cpu_rules.py write it:
//     g = grad / grad_scale
//     c = m.mul(beta1).add(g, alpha=1 - beta1)            (the interpolated momentum)
//     if weight_decay != 0:  param = param.mul(1 - lr * weight_decay)
//     param = param.add(sign(c), alpha=-lr)
//     m = m.mul(beta2).add(g, alpha=1 - beta2)
// So the body's results equal the reference's bit for bit; torch runs the last few elements of
// each op through a scalar loop whose rounding its compiler chose (a fused or unfused
// multiply-add), so there the two may differ by an ulp. Every multiply-add above is an explicit
// fmadd, and no other contraction happens ([Note: no FP contraction] in cpu_adam_kernel.h).
//
// [Note: sign of NaN]
// sign(c) is +1 / -1, and +0 for c = +-0 (torch.sign(-0.0) is 0 too). For a NaN c the trait's
// sign gives NaN (torch.sign gives 0 on its vectorised path): a NaN grad then makes the param NaN,
// as it does with SGD and Adam, instead of leaving a silently frozen param behind a NaN moment.
//
// [Note: Muon and Adafactor formula order]
// Their elementwise arithmetic is also their reference's tensor ops, in order, rounded where
// torch's CPU kernels round them (`x.lerp(y, w)` is fma(w', y - x, |w| < 0.5 ? x : y) with
// w' = w or w - 1, aten/src/ATen/native/cpu/LerpKernel.cpp; `rsqrt` is 1 / sqrt; `clamp_(min=)`
// keeps a NaN), so what is not a reduction is torch's bit for bit:
//   Muon = torch.optim.Muon (torch/optim/_muon.py `_single_tensor_muon`), around the
//   Newton-Schulz iterations (which run in torch, on the GPU or the CPU):
//     g = grad / grad_scale
//     momentum pass: buf.lerp_(g, 1 - momentum); update = g.lerp(buf, momentum) (Nesterov) or
//                    buf; out = update.bfloat16()   (torch casts to bf16 first thing in NS)
//     apply pass:    param.mul_(1 - lr * wd); param.add_(ortho, alpha=-adjusted_lr)   (ortho:
//                    bf16, widened exactly)
//   Adafactor = torch.optim.Adafactor (torch/optim/_adafactor.py `_single_tensor_adafactor`):
//     factored (2 or more dims; cpu_rules.cpp's adafactor_job runs the passes and the small
//     steps between them): pass 1 the sums of squares of the param (for its RMS), of every
//     row and every column of g; then row_var / col_var lerp to those means and the mean of
//     row_var (per matrix of the batch) clamped to eps1; pass 2 the sum of squares of the
//     update, never stored,
//         update = rsqrt(clamp((row_var[i] * col_var[j]) / mean, eps1^2)) * g
//     (torch: (row_var @ col_var).div_(mean).clamp_(min=eps1^2).rsqrt_().mul_(grad)); pass 3
//         param = param * (1 - lr * wd)   (when wd != 0)
//         param = param + float(-alpha / denom) * update, and the copy-out
//     vector (fewer dims): pass 1 variance.lerp_(g * g, w) stored, the sums of squares of the
//     param and of the update = rsqrt(clamp(variance, eps1^2)) * g; pass 2 as pass 3 above.
// The sums are fp64 (each square exact) over rows and blocks in a fixed order, so the results
// do not depend on the thread count; torch sums in fp32, so the norms, row and column means may
// differ from torch's in their last bit (and, through them, what follows).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu_rules.h"

namespace zero_offload::cpu_rules {
namespace {

using cpu_adam::element_size;

// One vector of SGD: elements [i, i + kLanes) of b's buffers.
template <class V, Dtype G, Dtype O, bool W, Momentum M, bool Nesterov>
struct SgdBlock {
  using Scalars = SgdScalars;
  static constexpr Dtype kGrad = G;
  static constexpr Dtype kOut = O;
  static constexpr bool kHasState = M != Momentum::kNone;
  static constexpr bool kHasParam = true;

  static void run(const Buffers& b, const SgdScalars& s, int64_t i) {
    using F = typename V::F;
    F grad = V::template load_as<G>(b.grad, i);
    if (s.unscale) grad = V::div(grad, V::set1(s.grad_scale));  // g = grad / grad_scale
    F param = V::load(b.param + i);
    if constexpr (W) grad = V::fmadd(param, V::set1(s.weight_decay), grad);  // g += wd * param
    if constexpr (M != Momentum::kNone) {
      F buf;
      if constexpr (M == Momentum::kFirst) {
        buf = grad;  // buf = g.clone()
      } else {       // buf = buf * momentum + (1 - dampening) * g
        buf = V::fmadd(grad, V::set1(s.one_minus_dampening),
                       V::mul(V::load(b.state + i), V::set1(s.momentum)));
      }
      V::store(b.state + i, buf);
      // g = g + momentum * buf (Nesterov), else g = buf
      grad = Nesterov ? V::fmadd(buf, V::set1(s.momentum), grad) : buf;
    }
    param = V::fmadd(grad, V::set1(s.neg_lr), param);  // param = param - lr * g
    V::store(b.param + i, param);
    if constexpr (O != Dtype::kNone) V::template store_as<O>(b.out, i, param);
  }
};

// One vector of Lion.
template <class V, Dtype G, Dtype O, bool W>
struct LionBlock {
  using Scalars = LionScalars;
  static constexpr Dtype kGrad = G;
  static constexpr Dtype kOut = O;
  static constexpr bool kHasState = true;
  static constexpr bool kHasParam = true;

  static void run(const Buffers& b, const LionScalars& s, int64_t i) {
    using F = typename V::F;
    F grad = V::template load_as<G>(b.grad, i);
    if (s.unscale) grad = V::div(grad, V::set1(s.grad_scale));  // g = grad / grad_scale
    const F m = V::load(b.state + i);
    // c = beta1 * m + (1 - beta1) * g
    const F c = V::fmadd(grad, V::set1(s.one_minus_beta1), V::mul(m, V::set1(s.beta1)));
    F param = V::load(b.param + i);
    if constexpr (W) param = V::mul(param, V::set1(s.decay_factor));  // param *= 1 - lr * wd
    param = V::fmadd(V::sign(c), V::set1(s.neg_lr), param);  // param -= lr * sign(c)
    // m = beta2 * m + (1 - beta2) * g
    V::store(b.state + i, V::fmadd(grad, V::set1(s.one_minus_beta2), V::mul(m, V::set1(s.beta2))));
    V::store(b.param + i, param);
    if constexpr (O != Dtype::kNone) V::template store_as<O>(b.out, i, param);
  }
};

// One vector of Muon's momentum pass ([Note: Muon and Adafactor formula order]).
template <class V, Dtype G, bool Nesterov>
struct MuonMomentumBlock {
  using Scalars = MuonScalars;
  static constexpr Dtype kGrad = G;
  static constexpr Dtype kOut = Dtype::kBFloat16;
  static constexpr bool kHasState = true;
  static constexpr bool kHasParam = false;

  static void run(const Buffers& b, const MuonScalars& s, int64_t i) {
    using F = typename V::F;
    F grad = V::template load_as<G>(b.grad, i);
    if (s.unscale) grad = V::div(grad, V::set1(s.grad_scale));  // g = grad / grad_scale
    F buf = V::load(b.state + i);
    // buf.lerp_(g, 1 - momentum)
    buf = V::fmadd(V::set1(s.lerp_weight), V::sub(grad, buf), s.lerp_from_grad ? grad : buf);
    V::store(b.state + i, buf);
    F update = buf;
    if constexpr (Nesterov) {  // update = g.lerp(buf, momentum)
      update = V::fmadd(V::set1(s.nesterov_weight), V::sub(buf, grad),
                        s.nesterov_from_buf ? buf : grad);
    }
    V::template store_as<Dtype::kBFloat16>(b.out, i, update);  // update.bfloat16()
  }
};

// One vector of Muon's apply pass: b.grad holds the orthogonalised update (bf16).
template <class V, Dtype O, bool W>
struct MuonApplyBlock {
  using Scalars = MuonScalars;
  static constexpr Dtype kGrad = Dtype::kBFloat16;
  static constexpr Dtype kOut = O;
  static constexpr bool kHasState = false;
  static constexpr bool kHasParam = true;

  static void run(const Buffers& b, const MuonScalars& s, int64_t i) {
    using F = typename V::F;
    F param = V::load(b.param + i);
    if constexpr (W) param = V::mul(param, V::set1(s.decay_factor));  // param *= 1 - lr * wd
    // param += -adjusted_lr * ortho
    param = V::fmadd(V::template load_as<Dtype::kBFloat16>(b.grad, i), V::set1(s.neg_lr), param);
    V::store(b.param + i, param);
    if constexpr (O != Dtype::kNone) V::template store_as<O>(b.out, i, param);
  }
};

// Runs Block over [begin, end). A range that is not a whole number of vectors ends with a
// partial vector, staged through zero-padded local buffers and run through the same Block, so
// tail elements get exactly the body's arithmetic (as adam_range in cpu_adam_kernel.h does).
template <class V, class Block>
void rule_range(const Buffers& buffers, const typename Block::Scalars& scalars, int64_t begin,
                int64_t end) {
  // Local copies: the compiler can then see that the float stores into the buffers never
  // overwrite a scalar or a buffer address, and keeps both in registers for the whole loop.
  const Buffers b = buffers;
  const typename Block::Scalars s = scalars;
  int64_t i = begin;
  for (; i + V::kLanes <= end; i += V::kLanes) Block::run(b, s, i);
  if constexpr (V::kLanes > 1) {
    const int64_t rest = end - i;
    if (rest <= 0) return;
    constexpr int64_t g_size = element_size(Block::kGrad);
    alignas(64) float param[V::kLanes] = {};
    alignas(64) float state[V::kLanes] = {};
    alignas(64) unsigned char grad[V::kLanes * 4] = {};
    alignas(64) unsigned char out[V::kLanes * 4] = {};
    if constexpr (Block::kHasParam) __builtin_memcpy(param, b.param + i, rest * 4);
    if constexpr (Block::kHasState) __builtin_memcpy(state, b.state + i, rest * 4);
    __builtin_memcpy(grad, static_cast<const unsigned char*>(b.grad) + i * g_size, rest * g_size);
    const Buffers staged{param, grad, state, out, b.grad_dtype, b.out_dtype};
    Block::run(staged, s, 0);
    if constexpr (Block::kHasParam) __builtin_memcpy(b.param + i, param, rest * 4);
    if constexpr (Block::kHasState) __builtin_memcpy(b.state + i, state, rest * 4);
    if constexpr (Block::kOut != Dtype::kNone) {
      constexpr int64_t o_size = element_size(Block::kOut);
      __builtin_memcpy(static_cast<unsigned char*>(b.out) + i * o_size, out, rest * o_size);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Adafactor's passes (see [Note: Muon and Adafactor formula order] and cpu_rules.cpp's
// adafactor_job for what runs between them). Rows are processed whole, a row that is not a
// whole number of vectors ending with one partial vector staged through zero-padded locals.

// `rest` (< kLanes) elements of dtype D at element i of base, the other lanes `pad`.
template <class V, Dtype D>
inline typename V::F load_rest(const void* base, int64_t i, int64_t rest, float pad = 0.0f) {
  alignas(64) float staged_f[V::kLanes];
  for (int k = 0; k < V::kLanes; ++k) staged_f[k] = pad;
  if constexpr (D == Dtype::kFloat32) {
    __builtin_memcpy(staged_f, static_cast<const float*>(base) + i, rest * 4);
    return V::load(staged_f);
  } else {
    alignas(64) uint16_t staged[V::kLanes] = {};
    __builtin_memcpy(staged, static_cast<const uint16_t*>(base) + i, rest * 2);
    return V::template load_as<D>(staged, 0);
  }
}

// The lanes of x from `rest` on set to zero (a partial vector's padding adds nothing to a sum).
template <class V>
inline typename V::F keep_lanes(typename V::F x, int64_t rest) {
  alignas(64) float staged[V::kLanes];
  V::store(staged, x);
  for (int64_t k = rest; k < V::kLanes; ++k) staged[k] = 0.0f;
  return V::load(staged);
}

template <class V, Dtype G>
inline typename V::F scaled_grad(const void* grad, const FactorScalars& s, int64_t i) {
  typename V::F g = V::template load_as<G>(grad, i);
  return s.unscale ? V::div(g, V::set1(s.grad_scale)) : g;
}

// The update of a factored param: rsqrt(clamp(row_var * col_var / mean, eps1^2)) * g, as
// torch's ops: (row_var @ col_var).div_(mean).clamp_(min=eps1 * eps1).rsqrt_().mul_(grad).
template <class V>
inline typename V::F factored_update(typename V::F g, typename V::F row, typename V::F col,
                                     typename V::F mean, typename V::F eps1_sq) {
  typename V::F var = V::div(V::mul(row, col), mean);
  var = V::max(var, eps1_sq);
  return V::mul(V::div(V::set1(1.0f), V::sqrt(var)), g);
}

// The update of a vector param from its (updated) variance: rsqrt(clamp(v, eps1^2)) * g.
template <class V>
inline typename V::F vector_update(typename V::F g, typename V::F var, typename V::F eps1_sq) {
  return V::mul(V::div(V::set1(1.0f), V::sqrt(V::max(var, eps1_sq))), g);
}

template <class V, Dtype G>
double factor_sums_range(const FactorBuffers& buffers, const FactorScalars& scalars,
                         int64_t row0, int64_t row1, double* row_sq, double* col_sq) {
  using F = typename V::F;
  const FactorBuffers b = buffers;
  const FactorScalars s = scalars;
  const int64_t cols = b.cols;
  typename V::Acc param_acc = V::acc_zero();
  for (int64_t q = row0; q < row1; ++q) {
    const int64_t base = q * cols;
    typename V::Acc row_acc = V::acc_zero();
    int64_t j = 0;
    for (; j + V::kLanes <= cols; j += V::kLanes) {
      const F g = scaled_grad<V, G>(b.grad, s, base + j);
      row_acc = V::acc_add_squares(row_acc, g);
      V::acc_store(col_sq + j, V::acc_add_squares(V::acc_load(col_sq + j), g));
      param_acc = V::acc_add_squares(param_acc, V::load(b.param + base + j));
    }
    if constexpr (V::kLanes > 1) {
      const int64_t rest = cols - j;
      if (rest > 0) {
        F g = load_rest<V, G>(b.grad, base + j, rest);
        if (s.unscale) g = V::div(g, V::set1(s.grad_scale));
        row_acc = V::acc_add_squares(row_acc, g);
        alignas(64) double staged[V::kLanes] = {};
        __builtin_memcpy(staged, col_sq + j, rest * 8);
        V::acc_store(staged, V::acc_add_squares(V::acc_load(staged), g));
        __builtin_memcpy(col_sq + j, staged, rest * 8);
        param_acc = V::acc_add_squares(param_acc,
                                       load_rest<V, Dtype::kFloat32>(b.param, base + j, rest));
      }
    }
    row_sq[q] = V::acc_total(row_acc);
  }
  return V::acc_total(param_acc);
}

template <class V, Dtype G>
double factor_norm_range(const FactorBuffers& buffers, const FactorScalars& scalars,
                         int64_t row0, int64_t row1) {
  using F = typename V::F;
  const FactorBuffers b = buffers;
  const FactorScalars s = scalars;
  const int64_t rows = b.rows, cols = b.cols;
  const F eps1_sq = V::set1(s.eps1_sq);
  typename V::Acc acc = V::acc_zero();
  for (int64_t q = row0; q < row1; ++q) {
    const int64_t base = q * cols, batch = q / rows;
    const float* col_var = b.col_var + batch * cols;
    const F row = V::set1(b.row_var[q]), mean = V::set1(b.row_scale[batch]);
    int64_t j = 0;
    for (; j + V::kLanes <= cols; j += V::kLanes) {
      const F g = scaled_grad<V, G>(b.grad, s, base + j);
      acc = V::acc_add_squares(acc, factored_update<V>(g, row, V::load(col_var + j), mean, eps1_sq));
    }
    if constexpr (V::kLanes > 1) {
      const int64_t rest = cols - j;
      if (rest > 0) {
        F g = load_rest<V, G>(b.grad, base + j, rest);
        if (s.unscale) g = V::div(g, V::set1(s.grad_scale));
        const F col = load_rest<V, Dtype::kFloat32>(col_var, j, rest, 1.0f);
        acc = V::acc_add_squares(acc, keep_lanes<V>(factored_update<V>(g, row, col, mean, eps1_sq),
                                                    rest));
      }
    }
  }
  return V::acc_total(acc);
}

template <class V, Dtype G, Dtype O, bool W>
void factor_apply_range(const FactorBuffers& buffers, const FactorScalars& scalars, int64_t row0,
                        int64_t row1) {
  using F = typename V::F;
  const FactorBuffers b = buffers;
  const FactorScalars s = scalars;
  const int64_t rows = b.rows, cols = b.cols;
  const F eps1_sq = V::set1(s.eps1_sq), neg_step = V::set1(s.neg_step);
  for (int64_t q = row0; q < row1; ++q) {
    const int64_t base = q * cols, batch = q / rows;
    const float* col_var = b.col_var + batch * cols;
    const F row = V::set1(b.row_var[q]), mean = V::set1(b.row_scale[batch]);
    int64_t j = 0;
    for (; j + V::kLanes <= cols; j += V::kLanes) {
      const F g = scaled_grad<V, G>(b.grad, s, base + j);
      const F update = factored_update<V>(g, row, V::load(col_var + j), mean, eps1_sq);
      F param = V::load(b.param + base + j);
      if constexpr (W) param = V::mul(param, V::set1(s.decay_factor));  // param *= 1 - lr * wd
      param = V::fmadd(update, neg_step, param);  // param += -alpha / denom * update
      V::store(b.param + base + j, param);
      if constexpr (O != Dtype::kNone) V::template store_as<O>(b.out, base + j, param);
    }
    if constexpr (V::kLanes > 1) {
      const int64_t rest = cols - j;
      if (rest > 0) {
        F g = load_rest<V, G>(b.grad, base + j, rest);
        if (s.unscale) g = V::div(g, V::set1(s.grad_scale));
        const F col = load_rest<V, Dtype::kFloat32>(col_var, j, rest, 1.0f);
        const F update = factored_update<V>(g, row, col, mean, eps1_sq);
        F param = load_rest<V, Dtype::kFloat32>(b.param, base + j, rest);
        if constexpr (W) param = V::mul(param, V::set1(s.decay_factor));
        param = V::fmadd(update, neg_step, param);
        alignas(64) float staged[V::kLanes];
        V::store(staged, param);
        __builtin_memcpy(b.param + base + j, staged, rest * 4);
        if constexpr (O != Dtype::kNone) {
          alignas(64) unsigned char out[V::kLanes * 4];
          V::template store_as<O>(out, 0, param);
          __builtin_memcpy(static_cast<unsigned char*>(b.out) + (base + j) * element_size(O), out,
                           rest * element_size(O));
        }
      }
    }
  }
}

// One vector of a vector param's pass 1 (elements i..i + kLanes of the staged or real buffers):
// variance.lerp_(g * g, w) stored; returns the update.
template <class V>
inline typename V::F vector_variance(typename V::F g, float* variance, const FactorScalars& s) {
  using F = typename V::F;
  const F g2 = V::mul(g, g);
  F var = V::load(variance);
  var = V::fmadd(V::set1(s.lerp_weight), V::sub(g2, var), s.lerp_from_end ? g2 : var);
  V::store(variance, var);
  return vector_update<V>(g, var, V::set1(s.eps1_sq));
}

template <class V, Dtype G>
void vector_sums_range(const FactorBuffers& buffers, const FactorScalars& scalars, int64_t begin,
                       int64_t end, double* sums) {
  using F = typename V::F;
  const FactorBuffers b = buffers;
  const FactorScalars s = scalars;
  typename V::Acc param_acc = V::acc_zero(), update_acc = V::acc_zero();
  int64_t i = begin;
  for (; i + V::kLanes <= end; i += V::kLanes) {
    const F g = scaled_grad<V, G>(b.grad, s, i);
    update_acc = V::acc_add_squares(update_acc, vector_variance<V>(g, b.variance + i, s));
    param_acc = V::acc_add_squares(param_acc, V::load(b.param + i));
  }
  if constexpr (V::kLanes > 1) {
    const int64_t rest = end - i;
    if (rest > 0) {
      F g = load_rest<V, G>(b.grad, i, rest);
      if (s.unscale) g = V::div(g, V::set1(s.grad_scale));
      alignas(64) float var[V::kLanes] = {};
      __builtin_memcpy(var, b.variance + i, rest * 4);
      const F update = vector_variance<V>(g, var, s);
      __builtin_memcpy(b.variance + i, var, rest * 4);
      update_acc = V::acc_add_squares(update_acc, keep_lanes<V>(update, rest));
      param_acc = V::acc_add_squares(param_acc, load_rest<V, Dtype::kFloat32>(b.param, i, rest));
    }
  }
  sums[0] = V::acc_total(param_acc);
  sums[1] = V::acc_total(update_acc);
}

template <class V, Dtype G, Dtype O, bool W>
void vector_apply_range(const FactorBuffers& buffers, const FactorScalars& scalars, int64_t begin,
                        int64_t end) {
  using F = typename V::F;
  const FactorBuffers b = buffers;
  const FactorScalars s = scalars;
  const F eps1_sq = V::set1(s.eps1_sq), neg_step = V::set1(s.neg_step);
  int64_t i = begin;
  for (; i + V::kLanes <= end; i += V::kLanes) {
    const F g = scaled_grad<V, G>(b.grad, s, i);
    const F update = vector_update<V>(g, V::load(b.variance + i), eps1_sq);
    F param = V::load(b.param + i);
    if constexpr (W) param = V::mul(param, V::set1(s.decay_factor));
    param = V::fmadd(update, neg_step, param);
    V::store(b.param + i, param);
    if constexpr (O != Dtype::kNone) V::template store_as<O>(b.out, i, param);
  }
  if constexpr (V::kLanes > 1) {
    const int64_t rest = end - i;
    if (rest > 0) {
      F g = load_rest<V, G>(b.grad, i, rest);
      if (s.unscale) g = V::div(g, V::set1(s.grad_scale));
      const F update = vector_update<V>(g, load_rest<V, Dtype::kFloat32>(b.variance, i, rest, 1.0f),
                                        eps1_sq);
      F param = load_rest<V, Dtype::kFloat32>(b.param, i, rest);
      if constexpr (W) param = V::mul(param, V::set1(s.decay_factor));
      param = V::fmadd(update, neg_step, param);
      alignas(64) float staged[V::kLanes];
      V::store(staged, param);
      __builtin_memcpy(b.param + i, staged, rest * 4);
      if constexpr (O != Dtype::kNone) {
        alignas(64) unsigned char out[V::kLanes * 4];
        V::template store_as<O>(out, 0, param);
        __builtin_memcpy(static_cast<unsigned char*>(b.out) + i * element_size(O), out,
                         rest * element_size(O));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch: each call's dtypes and modes pick one instantiation (the modes are template
// parameters, as in torch's fused kernels, so the loop body has no branches on them).

template <class V, Dtype G, Dtype O, bool W, Momentum M>
void sgd_by_nesterov(const Buffers& b, const SgdScalars& s, int64_t begin, int64_t end) {
  if (M != Momentum::kNone && s.nesterov) {
    return rule_range<V, SgdBlock<V, G, O, W, M, true>>(b, s, begin, end);
  }
  return rule_range<V, SgdBlock<V, G, O, W, M, false>>(b, s, begin, end);
}

template <class V, Dtype G, Dtype O, bool W>
void sgd_by_momentum(const Buffers& b, const SgdScalars& s, int64_t begin, int64_t end) {
  switch (s.momentum_mode) {
    case Momentum::kNone:
      return rule_range<V, SgdBlock<V, G, O, W, Momentum::kNone, false>>(b, s, begin, end);
    case Momentum::kFirst: return sgd_by_nesterov<V, G, O, W, Momentum::kFirst>(b, s, begin, end);
    case Momentum::kRunning: return sgd_by_nesterov<V, G, O, W, Momentum::kRunning>(b, s, begin, end);
  }
}

template <class V, Dtype G, Dtype O>
void sgd_by_decay(const Buffers& b, const SgdScalars& s, int64_t begin, int64_t end) {
  if (s.decay) return sgd_by_momentum<V, G, O, true>(b, s, begin, end);
  return sgd_by_momentum<V, G, O, false>(b, s, begin, end);
}

template <class V, Dtype G, Dtype O>
void lion_by_decay(const Buffers& b, const LionScalars& s, int64_t begin, int64_t end) {
  if (s.decay) return rule_range<V, LionBlock<V, G, O, true>>(b, s, begin, end);
  return rule_range<V, LionBlock<V, G, O, false>>(b, s, begin, end);
}

// A call's grad (or copy-out) dtype as a template argument: fn(std::integral_constant<Dtype, D>{})
// for the D it holds, so fn picks the instantiation of that dtype (the loops are untouched). Any
// other grad dtype reads as fp32, any other copy-out dtype as none: the caller checked them.
template <class Fn>
auto by_grad_dtype(Dtype d, Fn&& fn) {
  switch (d) {
    case Dtype::kBFloat16: return fn(std::integral_constant<Dtype, Dtype::kBFloat16>{});
    case Dtype::kFloat16: return fn(std::integral_constant<Dtype, Dtype::kFloat16>{});
    default: return fn(std::integral_constant<Dtype, Dtype::kFloat32>{});
  }
}

template <class Fn>
auto by_out_dtype(Dtype d, Fn&& fn) {
  switch (d) {
    case Dtype::kBFloat16: return fn(std::integral_constant<Dtype, Dtype::kBFloat16>{});
    case Dtype::kFloat16: return fn(std::integral_constant<Dtype, Dtype::kFloat16>{});
    default: return fn(std::integral_constant<Dtype, Dtype::kNone>{});
  }
}

// Kernels::sgd and Kernels::lion for trait V.
template <class V>
void sgd_kernel(const Buffers& b, const SgdScalars& s, int64_t begin, int64_t end) {
  by_grad_dtype(b.grad_dtype, [&](auto g) {
    by_out_dtype(b.out_dtype, [&](auto o) {
      sgd_by_decay<V, decltype(g)::value, decltype(o)::value>(b, s, begin, end);
    });
  });
}

template <class V>
void lion_kernel(const Buffers& b, const LionScalars& s, int64_t begin, int64_t end) {
  by_grad_dtype(b.grad_dtype, [&](auto g) {
    by_out_dtype(b.out_dtype, [&](auto o) {
      lion_by_decay<V, decltype(g)::value, decltype(o)::value>(b, s, begin, end);
    });
  });
}

// Muon's and Adafactor's dispatch, likewise.
template <class V, Dtype G>
void muon_momentum_by_nesterov(const Buffers& b, const MuonScalars& s, int64_t begin, int64_t end) {
  if (s.nesterov) return rule_range<V, MuonMomentumBlock<V, G, true>>(b, s, begin, end);
  return rule_range<V, MuonMomentumBlock<V, G, false>>(b, s, begin, end);
}

template <class V>
void muon_momentum_kernel(const Buffers& b, const MuonScalars& s, int64_t begin, int64_t end) {
  return by_grad_dtype(b.grad_dtype, [&](auto d) {
    return muon_momentum_by_nesterov<V, decltype(d)::value>(b, s, begin, end);
  });
}

template <class V, Dtype O>
void muon_apply_by_decay(const Buffers& b, const MuonScalars& s, int64_t begin, int64_t end) {
  if (s.decay) return rule_range<V, MuonApplyBlock<V, O, true>>(b, s, begin, end);
  return rule_range<V, MuonApplyBlock<V, O, false>>(b, s, begin, end);
}

template <class V>
void muon_apply_kernel(const Buffers& b, const MuonScalars& s, int64_t begin, int64_t end) {
  return by_out_dtype(b.out_dtype, [&](auto d) {
    return muon_apply_by_decay<V, decltype(d)::value>(b, s, begin, end);
  });
}

template <class V>
double factor_sums_kernel(const FactorBuffers& b, const FactorScalars& s, int64_t row0,
                          int64_t row1, double* row_sq, double* col_sq) {
  return by_grad_dtype(b.grad_dtype, [&](auto d) {
    return factor_sums_range<V, decltype(d)::value>(b, s, row0, row1, row_sq, col_sq);
  });
}

template <class V>
double factor_norm_kernel(const FactorBuffers& b, const FactorScalars& s, int64_t row0,
                          int64_t row1) {
  return by_grad_dtype(b.grad_dtype, [&](auto d) {
    return factor_norm_range<V, decltype(d)::value>(b, s, row0, row1);
  });
}

template <class V>
void vector_sums_kernel(const FactorBuffers& b, const FactorScalars& s, int64_t begin,
                        int64_t end, double* sums) {
  return by_grad_dtype(b.grad_dtype, [&](auto d) {
    return vector_sums_range<V, decltype(d)::value>(b, s, begin, end, sums);
  });
}

// An apply pass (factor_apply_range or vector_apply_range) for the call's grad and copy-out
// dtypes and decay.
template <template <class, Dtype, Dtype, bool> class Apply, class V, Dtype G, Dtype O>
struct ApplyByDecay {
  static void run(const FactorBuffers& b, const FactorScalars& s, int64_t begin, int64_t end) {
    if (s.decay) return Apply<V, G, O, true>::run(b, s, begin, end);
    return Apply<V, G, O, false>::run(b, s, begin, end);
  }
};

template <template <class, Dtype, Dtype, bool> class Apply, class V>
void apply_kernel(const FactorBuffers& b, const FactorScalars& s, int64_t begin, int64_t end) {
  by_grad_dtype(b.grad_dtype, [&](auto g) {
    by_out_dtype(b.out_dtype, [&](auto o) {
      ApplyByDecay<Apply, V, decltype(g)::value, decltype(o)::value>::run(b, s, begin, end);
    });
  });
}

template <class V, Dtype G, Dtype O, bool W>
struct FactorApply {
  static void run(const FactorBuffers& b, const FactorScalars& s, int64_t row0, int64_t row1) {
    factor_apply_range<V, G, O, W>(b, s, row0, row1);
  }
};

template <class V, Dtype G, Dtype O, bool W>
struct VectorApply {
  static void run(const FactorBuffers& b, const FactorScalars& s, int64_t begin, int64_t end) {
    vector_apply_range<V, G, O, W>(b, s, begin, end);
  }
};

template <class V>
Kernels make_kernels(const char* name) {
  return Kernels{name,
                 &sgd_kernel<V>,
                 &lion_kernel<V>,
                 &muon_momentum_kernel<V>,
                 &muon_apply_kernel<V>,
                 &factor_sums_kernel<V>,
                 &factor_norm_kernel<V>,
                 &apply_kernel<FactorApply, V>,
                 &vector_sums_kernel<V>,
                 &apply_kernel<VectorApply, V>};
}

}  // namespace
}  // namespace zero_offload::cpu_rules
