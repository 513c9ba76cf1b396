// The update rules beside CPU-Adam (SGD, Lion, Adafactor's passes, Muon's host passes):
// declarations shared by the scalar path + entry points (cpu_rules.cpp) and the ISA paths
// (cpu_rules_avx2.cpp, cpu_rules_avx512.cpp). Plain C++ types only, as in cpu_adam.h: an ISA file exports one
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

// Muon's two host passes (torch.optim.Muon around its Newton-Schulz iterations), elementwise.
//   momentum: Buffers{param unused, grad, state = momentum_buffer, out = bf16 update}
//     buf = buf.lerp(g, 1 - momentum); u = g.lerp(buf, momentum) (Nesterov) or buf; out = bf16(u)
//   apply: Buffers{param, grad = the orthogonalised update (bf16), state unused, out = copy-out}
//     param = param * (1 - lr * wd); param = param + (-adjusted_lr) * ortho
struct MuonScalars {
  float grad_scale;
  bool unscale;
  float lerp_weight;      // buf.lerp_(g, w): w = float(1 - momentum), or w - 1 when |w| >= 0.5
  bool lerp_from_grad;    //   (torch's lerp: fma(coeff, end - start, |w| < 0.5 ? start : end))
  bool nesterov;
  float nesterov_weight;  // g.lerp(buf, w): w = float(momentum), likewise
  bool nesterov_from_buf;
  float decay_factor;     // apply: float(1 - lr * wd) ...
  bool decay;             // ... skipped when it is exactly 1
  float neg_lr;           // apply: float(-adjusted_lr)
};

// Adafactor over one whole param (torch.optim.Adafactor's single-tensor step). A param of two
// or more dims is `batch` matrices of rows x cols (the leading dims are the batch), its second
// moment factored into row_var (batch x rows) and col_var (batch x cols); a param of fewer dims
// is one vector of `rows * cols * batch` elements with a full `variance`.
struct FactorBuffers {
  float* param;
  const void* grad;
  void* out;
  float* row_var;    // factored (else nullptr)
  float* col_var;    // factored
  float* variance;   // not factored
  const float* row_scale;  // pass 2 and 3: per batch, the clamped mean of its row_var
  int64_t rows;
  int64_t cols;
  Dtype grad_dtype;
  Dtype out_dtype;
};

struct FactorScalars {
  float grad_scale;
  bool unscale;
  float lerp_weight;    // variance.lerp_(g * g, w): float(step ** beta2_decay) (or minus 1)
  bool lerp_from_end;
  float eps1_sq;        // var_estimate.clamp_(min=float(eps1 * eps1))
  float decay_factor;   // param *= float(1 - lr * wd) ...
  bool decay;           // ... when wd != 0
  float neg_step;       // param += float(-alpha / denom) * update
};

// One ISA's kernels. The elementwise ones work on the element range [begin, end) of their
// buffers; the factored Adafactor ones on the rows [row0, row1) (global: row q is elements
// [q * cols, (q + 1) * cols), batch q / rows), all in one batch.
struct Kernels {
  const char* name;
  void (*sgd)(const Buffers& buffers, const SgdScalars& scalars, int64_t begin, int64_t end);
  void (*lion)(const Buffers& buffers, const LionScalars& scalars, int64_t begin, int64_t end);
  void (*muon_momentum)(const Buffers& buffers, const MuonScalars& scalars, int64_t begin,
                        int64_t end);
  void (*muon_apply)(const Buffers& buffers, const MuonScalars& scalars, int64_t begin,
                     int64_t end);
  // Factored pass 1: row_sq[q] = sum over the row of g^2, col_sq[j] += the rows' g^2 in column
  // j (col_sq: this call's own `cols` accumulators); returns the rows' sum of param^2.
  double (*factor_sums)(const FactorBuffers& b, const FactorScalars& s, int64_t row0,
                        int64_t row1, double* row_sq, double* col_sq);
  // Factored pass 2: the rows' sum of update^2 (the update is not stored).
  double (*factor_norm)(const FactorBuffers& b, const FactorScalars& s, int64_t row0,
                        int64_t row1);
  // Factored pass 3: decay, param += neg_step * update, the copy-out.
  void (*factor_apply)(const FactorBuffers& b, const FactorScalars& s, int64_t row0,
                       int64_t row1);
  // Vector pass 1: variance updated in place; sums[0] += param^2, sums[1] += update^2.
  void (*vector_sums)(const FactorBuffers& b, const FactorScalars& s, int64_t begin, int64_t end,
                      double* sums);
  // Vector pass 2: decay, param += neg_step * update, the copy-out.
  void (*vector_apply)(const FactorBuffers& b, const FactorScalars& s, int64_t begin,
                       int64_t end);
};

const Kernels& scalar_kernels();  // cpu_rules.cpp
const Kernels& avx2_kernels();    // cpu_rules_avx2.cpp
const Kernels& avx512_kernels();  // cpu_rules_avx512.cpp

}  // namespace zero_offload::cpu_rules
