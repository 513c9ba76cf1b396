// SGD and Lion, the elementwise update rules beside CPU-Adam: declarations shared by the scalar
// path + entry points (cpu_rules.cpp) and the ISA paths (cpu_rules_avx2.cpp,
// cpu_rules_avx512.cpp). Plain C++ types only, as in cpu_adam.h: an ISA file exports one
// `Kernels` table and nothing else ([Note: ISA isolation] in cpu_adam_kernel.h).
#pragma once

#include <cstdint>

#include "cpu_adam.h"

namespace zero_offload::cpu_rules {

using cpu_adam::Dtype;

// One call's buffers, flat and contiguous, `numel` elements each (the entry point splits
// [0, numel) into chunks).
struct Buffers {
  float* param;     // fp32, updated in place
  const void* grad; // fp32 | bf16 | fp16, read only
  float* state;     // fp32: SGD's momentum_buffer (nullptr without momentum), Lion's exp_avg
  void* out;        // bf16 | fp16 copy of the updated param; nullptr when out_dtype == kNone
  Dtype grad_dtype;
  Dtype out_dtype;
};

// SGD's momentum buffer this call (torch.optim.SGD: `momentum_buffer` None on the first step).
enum class Momentum : int {
  kNone,     // momentum == 0: no buffer
  kFirst,    // first step: buf = grad (torch clones the grad; no dampening)
  kRunning,  // buf = momentum * buf + (1 - dampening) * grad
};

// SGD's per-call scalars, derived in double and rounded to fp32 where torch.optim.SGD's tensor
// ops round them (a Python float operand of an fp32 op is used as float(value)).
struct SgdScalars {
  float neg_lr;               // param.add_(grad, alpha=-lr): float(-lr)
  float weight_decay;         // grad.add(param, alpha=wd): float(wd), when `decay`
  float momentum;             // float(momentum)
  float one_minus_dampening;  // buf.add_(grad, alpha=1 - dampening): float(1 - dampening)
  float grad_scale;           // grads are divided by this (loss-scale unscale) ...
  bool unscale;               // ... unless it is exactly 1
  bool decay;                 // weight_decay != 0 (L2: added to the grad)
  Momentum momentum_mode;
  bool nesterov;              // grad + momentum * buf instead of buf
};

// Lion's per-call scalars (the same roundings as the torch-ops reference of the tests).
struct LionScalars {
  float beta1;            // c = beta1 * m + (1 - beta1) * grad
  float one_minus_beta1;
  float beta2;            // m = beta2 * m + (1 - beta2) * grad
  float one_minus_beta2;
  float neg_lr;           // param += -lr * sign(c)
  float decay_factor;     // param *= float(1 - lr * wd), when `decay` (decoupled)
  float grad_scale;
  bool unscale;
  bool decay;
};

// One ISA's kernels; each works on the element range [begin, end) of its buffers.
struct Kernels {
  const char* name;
  void (*sgd)(const Buffers& buffers, const SgdScalars& scalars, int64_t begin, int64_t end);
  void (*lion)(const Buffers& buffers, const LionScalars& scalars, int64_t begin, int64_t end);
};

const Kernels& scalar_kernels();  // cpu_rules.cpp
const Kernels& avx2_kernels();    // cpu_rules_avx2.cpp
const Kernels& avx512_kernels();  // cpu_rules_avx512.cpp

}  // namespace zero_offload::cpu_rules
