// The AVX2 + FMA + F16C vector trait, 8 fp32 lanes (see the trait contract in
// cpu_adam_kernel.h): how one vector is loaded, converted, computed and stored. Included only by
// sources setup.py compiles with these flags (*_avx2.cpp), each after its `fp-contract=off`
// pragma ([Note: no FP contraction] in cpu_adam_kernel.h), and run only after cpuid says the CPU
// has the features (cpu_runtime.cpp). Everything is in an anonymous namespace: each source keeps
// its own copy ([Note: ISA isolation]).
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "simd_avx2.h needs the flags setup.py gives *_avx2.cpp (-mavx2 -mfma -mf16c)"
#endif

#include <immintrin.h>

#include <cstdint>

#include "cpu_adam.h"

namespace zero_offload::cpu_adam {
namespace {

struct Avx2Trait {
  static constexpr int kLanes = 8;
  using F = __m256;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // clamp_min: lo where a < lo, else a (maxps returns its second operand when either is NaN,
  // so a NaN a is kept, as torch's clamp_min keeps it).
  static F max(F a, F lo) { return _mm256_max_ps(lo, a); }
  static bool any_nan(F a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
  // +1 / -1, +0 for +-0, NaN kept (Lion: [Note: sign of NaN] in cpu_rules_kernel.h).
  static F sign(F a) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
    return _mm256_blendv_ps(_mm256_or_ps(pos, neg), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }

  template <Dtype D>
  static F load_as(const void* base, int64_t i) {
    if constexpr (D == Dtype::kFloat32) {
      return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    } else {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (D == Dtype::kBFloat16) {  // bf16 is the top half of an fp32
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        return _mm256_cvtph_ps(h);
      }
    }
  }

  template <Dtype D>
  static void store_as(void* base, int64_t i, F x) {
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i);
    if constexpr (D == Dtype::kBFloat16) {
      // Round to nearest even: bits + 0x7FFF + (bit 16 of bits), keep the top half; NaN ->
      // 0xFFFF as torch's vectorised conversion writes it.
      const __m256i bits = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      __m256i rounded = _mm256_srli_epi32(
          _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
      rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0xFFFF),
                                   _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
      // Pack 8 x u32 (all <= 0xFFFF) to 8 x u16: packus works per 128-bit lane, so gather the
      // two lanes' low halves afterwards.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
      _mm_storeu_si128(dst, _mm256_castsi256_si128(packed));
    } else {
      _mm_storeu_si128(dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }

  // Stochastic rounding to bf16 ([Note: bf16 moments with stochastic rounding]): sr_hash gives
  // lane k the hash of h0 + k * kSrIndexMul (its element's index), computed once per vector and
  // used by both moments; store_bf16_stochastic adds the hash's low (exp_avg) or high
  // (exp_avg_sq) 16 bits to the fp32 bits and keeps the top half; NaN -> kBf16CanonicalNan.
  using SrHash = __m256i;
  static SrHash sr_hash(uint32_t h0) {
    const __m256i lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                             _mm256_set1_epi32(static_cast<int>(kSrIndexMul)));
    __m256i h = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(h0)), lanes);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kSrMix1)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kSrMix2)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    return h;
  }
  template <SrHalf H>
  static void store_bf16_stochastic(void* base, int64_t i, F x, SrHash h) {
    __m256i r;
    if constexpr (H == SrHalf::kLow) {
      r = _mm256_and_si256(h, _mm256_set1_epi32(0xFFFF));
    } else {
      r = _mm256_srli_epi32(h, 16);
    }
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(kBf16CanonicalNan),
                                 _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     _mm256_castsi256_si128(packed));
  }

  // fp64 accumulation: the 8 lanes widen to two vectors of 4 doubles.
  struct Acc {
    __m256d lo, hi;
  };
  static Acc acc_zero() { return Acc{_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static Acc acc_add_squares(Acc acc, F x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    return Acc{_mm256_fmadd_pd(lo, lo, acc.lo), _mm256_fmadd_pd(hi, hi, acc.hi)};
  }
  static double acc_total(Acc acc) {
    const __m256d sum = _mm256_add_pd(acc.lo, acc.hi);
    const __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(sum), _mm256_extractf128_pd(sum, 1));
    return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
  }
  // The 8 lanes' accumulators from / to 8 doubles, in lane order.
  static Acc acc_load(const double* p) { return Acc{_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4)}; }
  static void acc_store(double* p, Acc acc) {
    _mm256_storeu_pd(p, acc.lo);
    _mm256_storeu_pd(p + 4, acc.hi);
  }
};

}  // namespace
}  // namespace zero_offload::cpu_adam
