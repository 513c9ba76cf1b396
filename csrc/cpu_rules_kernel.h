// The SGD and Lion loops, written once over a vector trait V (the contract is in
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
#pragma once

#include <cstdint>

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
    __builtin_memcpy(param, b.param + i, rest * 4);
    if constexpr (Block::kHasState) __builtin_memcpy(state, b.state + i, rest * 4);
    __builtin_memcpy(grad, static_cast<const unsigned char*>(b.grad) + i * g_size, rest * g_size);
    const Buffers staged{param, grad, state, out, b.grad_dtype, b.out_dtype};
    Block::run(staged, s, 0);
    __builtin_memcpy(b.param + i, param, rest * 4);
    if constexpr (Block::kHasState) __builtin_memcpy(b.state + i, state, rest * 4);
    if constexpr (Block::kOut != Dtype::kNone) {
      constexpr int64_t o_size = element_size(Block::kOut);
      __builtin_memcpy(static_cast<unsigned char*>(b.out) + i * o_size, out, rest * o_size);
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

template <class V, Dtype G>
void sgd_by_out(const Buffers& b, const SgdScalars& s, int64_t begin, int64_t end) {
  switch (b.out_dtype) {
    case Dtype::kBFloat16: return sgd_by_decay<V, G, Dtype::kBFloat16>(b, s, begin, end);
    case Dtype::kFloat16: return sgd_by_decay<V, G, Dtype::kFloat16>(b, s, begin, end);
    default: return sgd_by_decay<V, G, Dtype::kNone>(b, s, begin, end);  // checked by caller
  }
}

template <class V, Dtype G>
void lion_by_out(const Buffers& b, const LionScalars& s, int64_t begin, int64_t end) {
  switch (b.out_dtype) {
    case Dtype::kBFloat16: return lion_by_decay<V, G, Dtype::kBFloat16>(b, s, begin, end);
    case Dtype::kFloat16: return lion_by_decay<V, G, Dtype::kFloat16>(b, s, begin, end);
    default: return lion_by_decay<V, G, Dtype::kNone>(b, s, begin, end);  // checked by caller
  }
}

// Kernels::sgd and Kernels::lion for trait V.
template <class V>
void sgd_kernel(const Buffers& b, const SgdScalars& s, int64_t begin, int64_t end) {
  switch (b.grad_dtype) {
    case Dtype::kBFloat16: return sgd_by_out<V, Dtype::kBFloat16>(b, s, begin, end);
    case Dtype::kFloat16: return sgd_by_out<V, Dtype::kFloat16>(b, s, begin, end);
    default: return sgd_by_out<V, Dtype::kFloat32>(b, s, begin, end);  // checked by caller
  }
}

template <class V>
void lion_kernel(const Buffers& b, const LionScalars& s, int64_t begin, int64_t end) {
  switch (b.grad_dtype) {
    case Dtype::kBFloat16: return lion_by_out<V, Dtype::kBFloat16>(b, s, begin, end);
    case Dtype::kFloat16: return lion_by_out<V, Dtype::kFloat16>(b, s, begin, end);
    default: return lion_by_out<V, Dtype::kFloat32>(b, s, begin, end);  // checked by caller
  }
}

template <class V>
Kernels make_kernels(const char* name) {
  return Kernels{name, &sgd_kernel<V>, &lion_kernel<V>};
}

}  // namespace
}  // namespace zero_offload::cpu_rules
