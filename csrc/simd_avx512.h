// The AVX-512 (F + BW + VL + DQ) + FMA + F16C vector trait, 16 fp32 lanes (see the trait
// contract in cpu_adam_kernel.h): how one vector is loaded, converted, computed and stored.
// Included only by sources setup.py compiles with these flags (*_avx512.cpp), each after its
// `fp-contract=off` pragma ([Note: no FP contraction] in cpu_adam_kernel.h), and run only after
// cpuid says the CPU has the features (cpu_runtime.cpp). Everything is in an anonymous namespace:
// each source keeps its own copy ([Note: ISA isolation]).
#pragma once

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512DQ__)
#error "simd_avx512.h needs the flags setup.py gives *_avx512.cpp (-mavx512f/bw/vl/dq ...)"
#endif

#include <immintrin.h>

#include <cstdint>

#include "cpu_adam.h"

namespace zero_offload::cpu_adam {
namespace {

struct Avx512Trait {
  static constexpr int kLanes = 16;
  using F = __m512;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // clamp_min: lo where a < lo, else a (maxps returns its second operand when either is NaN,
  // so a NaN a is kept, as torch's clamp_min keeps it).
  static F max(F a, F lo) { return _mm512_max_ps(lo, a); }
  static bool any_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
  // +1 / -1, +0 for +-0, NaN kept (Lion: [Note: sign of NaN] in cpu_rules_kernel.h).
  static F sign(F a) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), zero,
                                    _mm512_set1_ps(1.0f));
    s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), s, _mm512_set1_ps(-1.0f));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), s, a);
  }

  template <Dtype D>
  static F load_as(const void* base, int64_t i) {
    if constexpr (D == Dtype::kFloat32) {
      return _mm512_loadu_ps(static_cast<const float*>(base) + i);
    } else {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (D == Dtype::kBFloat16) {  // bf16 is the top half of an fp32
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        return _mm512_cvtph_ps(h);
      }
    }
  }

  template <Dtype D>
  static void store_as(void* base, int64_t i, F x) {
    __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i);
    if constexpr (D == Dtype::kBFloat16) {
      // Round to nearest even: bits + 0x7FFF + (bit 16 of bits), keep the top half; NaN ->
      // 0xFFFF as torch's vectorised conversion writes it.
      const __m512i bits = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      __m512i rounded = _mm512_srli_epi32(
          _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
      rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded,
                                        _mm512_set1_epi32(0xFFFF));
      _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(rounded));
    } else {
      _mm256_storeu_si256(dst, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }

  // Stochastic rounding to bf16 ([Note: bf16 moments with stochastic rounding]): sr_hash gives
  // lane k the hash of h0 + k * kSrIndexMul (its element's index), computed once per vector and
  // used by both moments; store_bf16_stochastic adds the hash's low (exp_avg) or high
  // (exp_avg_sq) 16 bits to the fp32 bits and keeps the top half; NaN -> kBf16CanonicalNan.
  using SrHash = __m512i;
  static SrHash sr_hash(uint32_t h0) {
    const __m512i lanes = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int>(kSrIndexMul)));
    __m512i h = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(h0)), lanes);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kSrMix1)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kSrMix2)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    return h;
  }
  template <SrHalf H>
  static void store_bf16_stochastic(void* base, int64_t i, F x, SrHash h) {
    __m512i r;
    if constexpr (H == SrHalf::kLow) {
      r = _mm512_and_si512(h, _mm512_set1_epi32(0xFFFF));
    } else {
      r = _mm512_srli_epi32(h, 16);
    }
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded,
                                      _mm512_set1_epi32(kBf16CanonicalNan));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        _mm512_cvtepi32_epi16(rounded));
  }

  // fp64 accumulation: the 16 lanes widen to two vectors of 8 doubles.
  struct Acc {
    __m512d lo, hi;
  };
  static Acc acc_zero() { return Acc{_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static Acc acc_add_squares(Acc acc, F x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    return Acc{_mm512_fmadd_pd(lo, lo, acc.lo), _mm512_fmadd_pd(hi, hi, acc.hi)};
  }
  static double acc_total(Acc acc) { return _mm512_reduce_add_pd(_mm512_add_pd(acc.lo, acc.hi)); }
  // The 16 lanes' accumulators from / to 16 doubles, in lane order.
  static Acc acc_load(const double* p) { return Acc{_mm512_loadu_pd(p), _mm512_loadu_pd(p + 8)}; }
  static void acc_store(double* p, Acc acc) {
    _mm512_storeu_pd(p, acc.lo);
    _mm512_storeu_pd(p + 8, acc.hi);
  }
};

}  // namespace
}  // namespace zero_offload::cpu_adam
