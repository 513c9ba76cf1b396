// SGD and Lion, AVX-512 (F + BW + VL + DQ) path (setup.py compiles *_avx512.cpp with those flags):
// the loops of cpu_rules_kernel.h over the Avx512Trait of simd_avx512.h. Run only after cpuid says
// the CPU has these features (cpu_runtime.cpp checks; see [Note: ISA isolation] in
// cpu_adam_kernel.h).
// [Note: no FP contraction] (cpu_adam_kernel.h): GCC's default -ffp-contract=fast would fuse
// a multiply and a following add into one FMA wherever it sees one, which changes the rounding
// that [Note: formula order] reproduces. It must precede every include, intrinsics too, so all
// inlined code is compiled alike.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
// GCC 12's own AVX-512 headers trip -Wmaybe-uninitialized on their `__Y = __Y` idiom for
// "undefined" vectors (a false positive, fixed in later GCC); keep the build log readable.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include "simd_avx512.h"
#include "cpu_rules_kernel.h"

namespace zero_offload::cpu_rules {

const Kernels& avx512_kernels() {
  static const Kernels kernels = make_kernels<cpu_adam::Avx512Trait>("avx512");
  return kernels;
}

}  // namespace zero_offload::cpu_rules
