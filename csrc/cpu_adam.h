// CPU-Adam: declarations shared by the scalar path + dispatch (cpu_adam.cpp) and the ISA paths
// (cpu_adam_avx2.cpp, cpu_adam_avx512.cpp, each compiled with its own flags by setup.py).
//
// Only plain C++ types cross between the translation units: an ISA file exports one `Kernels`
// table of function pointers and nothing else, so no inline function compiled with AVX-512
// flags can be picked by the linker for the baseline path (see [Note: ISA isolation] in
// cpu_adam_kernel.h).
#pragma once

#include <cstdint>

namespace zero_offload::cpu_adam {

// Element types of the buffers that cross from Python (zero_offload/_native.py mirrors these
// codes). Params are always fp32; the moments are fp32 or (both) bf16, see [Note: bf16 moments
// with stochastic rounding] in cpu_adam_kernel.h; grads and the copy-out buffer may be narrower.
enum class Dtype : int {
  kNone = -1,  // no buffer (copy-out only)
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};

namespace {  // each source its own copy ([Note: ISA isolation] in cpu_adam_kernel.h)
// Bytes per element of a buffer of this type (kNone: never read).
constexpr int64_t element_size(Dtype dtype) { return dtype == Dtype::kFloat32 ? 4 : 2; }
}  // namespace

// How weight decay enters the update (torch: ADAM_MODE::ORIGINAL vs ADAM_MODE::ADAMW).
enum class Decay : int {
  kNone,       // weight_decay == 0: the term is skipped, exactly as torch skips it
  kL2,         // Adam:  grad += weight_decay * param
  kDecoupled,  // AdamW: param *= 1 - lr * weight_decay
};

// The per-call scalars, derived in double and rounded to fp32 exactly where torch's fused CPU
// Adam (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) rounds them, so every path reproduces its
// results bit for bit on the vectorised body. Built once per call by `make_scalars`.
struct Scalars {
  float lerp_weight;     // exp_avg.lerp_(grad, 1 - beta1): float(1 - beta1), or that minus 1
  bool lerp_from_grad;   //   when |1 - beta1| >= 0.5 (torch lerps from the grad side then)
  float beta2;           // float(beta2)
  float one_minus_beta2; // float(1 - beta2)
  float bias_correction2_sqrt;  // float(sqrt(1 - beta2^step))
  float eps;             // float(eps)
  float neg_step_size;   // float(-lr / (1 - beta1^step))
  float weight_decay;    // kL2: float(weight_decay)
  float decay_factor;    // kDecoupled: float(1 - lr * weight_decay)
  float grad_scale;      // grads are divided by this (loss-scale unscale) ...
  bool unscale;          // ... unless it is exactly 1
  Decay decay;
};

// One call's buffers. All flat and contiguous, `numel` elements each (the dispatch splits
// [0, numel) into per-thread ranges).
struct Buffers {
  float* param;
  const void* grad;
  void* exp_avg;     // fp32 or bf16 elements, as moment_dtype says (both moments alike)
  void* exp_avg_sq;
  void* out;  // nullptr when out_dtype == kNone
  Dtype grad_dtype;
  Dtype out_dtype;
  Dtype moment_dtype;  // kFloat32 or kBFloat16
  uint32_t seed;       // kBFloat16 moments: the stochastic-rounding seed of this call
};

// Stochastic rounding of bf16 moments (see [Note: bf16 moments with stochastic rounding] in
// cpu_adam_kernel.h): element idx has ONE hash, lowbias32(idx * kSrIndexMul + seed * kSrSeedMul),
// all mod 2^32, with lowbias32(x): x ^= x >> 16; x *= kSrMix1; x ^= x >> 15; x *= kSrMix2;
// x ^= x >> 16. Its low 16 bits round exp_avg, its high 16 bits exp_avg_sq (SrHalf).
constexpr uint32_t kSrIndexMul = 0x9E3779B9u;
constexpr uint32_t kSrSeedMul = 0x85EBCA6Bu;
constexpr uint32_t kSrMix1 = 0x7FEB352Du;
constexpr uint32_t kSrMix2 = 0x846CA68Bu;
constexpr uint16_t kBf16CanonicalNan = 0x7FC0;  // every NaN moment is stored as this

// Which half of an element's hash rounds a moment: kLow (bits 0-15) for exp_avg, kHigh (bits
// 16-31) for exp_avg_sq.
enum class SrHalf { kLow, kHigh };

// One ISA's kernels; each works on the element range [begin, end) of its buffers.
struct Kernels {
  const char* name;
  void (*adam)(const Buffers& buffers, const Scalars& scalars, int64_t begin, int64_t end);
  // Sum over [begin, end) of double(grad[i])^2, accumulated in fp64.
  double (*sumsq)(const void* grad, Dtype dtype, int64_t begin, int64_t end);
  // Whether any of grad[begin, end) is inf or NaN.
  bool (*nonfinite)(const void* grad, Dtype dtype, int64_t begin, int64_t end);
};

const Kernels& scalar_kernels();  // cpu_adam.cpp
const Kernels& avx2_kernels();    // cpu_adam_avx2.cpp
const Kernels& avx512_kernels();  // cpu_adam_avx512.cpp

}  // namespace zero_offload::cpu_adam
