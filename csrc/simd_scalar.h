// The portable 1-lane vector trait (see the trait contract in cpu_adam_kernel.h) and the scalar
// fp16/bf16 conversions it is built on. Every kernel family's scalar path (cpu_adam.cpp,
// cpu_rules.cpp) includes it after its `fp-contract=off` pragma ([Note: no FP contraction] in
// cpu_adam_kernel.h). Those sources are compiled with the portable baseline flags (no FMA
// instruction), so the compiler cannot contract a*b+c behind our back; the single-rounding FMA
// is std::fma (glibc picks the hardware instruction at run time). Everything is in an anonymous
// namespace: each source gets its own copy ([Note: ISA isolation]).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_adam.h"

namespace zero_offload::cpu_adam {
namespace {

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float float_from_half(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return bits_float(float_bits(magnitude) | sign);
  }
  if (exponent == 31) return bits_float(sign | 0x7F800000u | (mantissa << 13));  // inf / NaN
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// fp32 -> fp16, round to nearest even, overflow to inf, NaN kept (quiet, top payload bits), as
// the F16C instruction (and so torch's .to(torch.float16)) does.
uint16_t half_from_float(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00 | ((a >> 13) & 0x3FF);  // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds to inf (and inf itself)
  if (a >= 0x38800000u) {  // normal fp16 (>= 2^-14): rebias the exponent, round the mantissa
    const uint32_t rebiased = a - (112u << 23);
    return sign | static_cast<uint16_t>((rebiased + 0xFFF + ((rebiased >> 13) & 1)) >> 13);
  }
  // Subnormal or zero: adding 0.5 (ulp 2^-24, the fp16 subnormal step) rounds |f| to nearest
  // even in hardware; the bits above 0.5's are the fp16 mantissa (0x400 = the smallest normal).
  const float rounded = bits_float(a) + 0.5f;
  return sign | static_cast<uint16_t>(float_bits(rounded) - float_bits(0.5f));
}

// fp32 -> bf16, round to nearest even; every NaN becomes 0xFFFF, as torch's vectorised
// conversion (at::vec cvtfp32_bf16) writes it.
uint16_t bf16_from_float(float f) {
  const uint32_t u = float_bits(f);
  if (std::isnan(f)) return 0xFFFF;
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// lowbias32 of h0, this element's pre-mix hash ([Note: bf16 moments with stochastic rounding]
// in cpu_adam_kernel.h).
uint32_t sr_lowbias32(uint32_t h0) {
  uint32_t x = h0;
  x ^= x >> 16;
  x *= kSrMix1;
  x ^= x >> 15;
  x *= kSrMix2;
  x ^= x >> 16;
  return x;
}

// fp32 -> bf16 by stochastic rounding with the 16 random bits r (< 2^16).
uint16_t bf16_stochastic(float f, uint32_t r) {
  if (std::isnan(f)) return kBf16CanonicalNan;
  return static_cast<uint16_t>((float_bits(f) + r) >> 16);
}

struct ScalarTrait {
  static constexpr int kLanes = 1;
  using F = float;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F fmadd(F a, F b, F c) { return std::fma(a, b, c); }
  // clamp_min: lo where a < lo, else a (a NaN a is kept, as torch's clamp_min keeps it).
  static F max(F a, F lo) { return a < lo ? lo : a; }
  static bool any_nan(F a) { return std::isnan(a); }
  // +1 / -1, +0 for +-0, NaN kept (Lion: [Note: sign of NaN] in cpu_rules_kernel.h).
  static F sign(F a) { return a > 0.0f ? 1.0f : a < 0.0f ? -1.0f : a != a ? a : 0.0f; }
  template <Dtype D>
  static F load_as(const void* base, int64_t i) {
    if constexpr (D == Dtype::kFloat32) {
      return static_cast<const float*>(base)[i];
    } else if constexpr (D == Dtype::kBFloat16) {
      return bits_float(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16);
    } else {
      return float_from_half(static_cast<const uint16_t*>(base)[i]);
    }
  }
  template <Dtype D>
  static void store_as(void* base, int64_t i, F x) {
    if constexpr (D == Dtype::kBFloat16) {
      static_cast<uint16_t*>(base)[i] = bf16_from_float(x);
    } else {
      static_cast<uint16_t*>(base)[i] = half_from_float(x);
    }
  }
  using SrHash = uint32_t;
  static SrHash sr_hash(uint32_t h0) { return sr_lowbias32(h0); }
  template <SrHalf H>
  static void store_bf16_stochastic(void* base, int64_t i, F x, SrHash h) {
    static_cast<uint16_t*>(base)[i] = bf16_stochastic(x, H == SrHalf::kLow ? (h & 0xFFFFu) : (h >> 16));
  }
  using Acc = double;
  static Acc acc_zero() { return 0.0; }
  static Acc acc_add_squares(Acc acc, F x) { return acc + static_cast<double>(x) * x; }
  static double acc_total(Acc acc) { return acc; }
  static Acc acc_load(const double* p) { return *p; }
  static void acc_store(double* p, Acc acc) { *p = acc; }
};

}  // namespace
}  // namespace zero_offload::cpu_adam
