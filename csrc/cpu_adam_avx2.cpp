// CPU-Adam, AVX2 + FMA + F16C path (setup.py compiles *_avx2.cpp with those flags): the loops of
// cpu_adam_kernel.h over the Avx2Trait of simd_avx2.h. Run only after cpuid says the CPU has these
// features (cpu_runtime.cpp checks; see [Note: ISA isolation] in cpu_adam_kernel.h).
// [Note: no FP contraction] (cpu_adam_kernel.h): GCC's default -ffp-contract=fast would fuse
// a multiply and a following add into one FMA wherever it sees one, which changes the rounding
// that [Note: formula order] reproduces. It must precede every include, intrinsics too, so all
// inlined code is compiled alike.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "simd_avx2.h"
#include "cpu_adam_kernel.h"

namespace zero_offload::cpu_adam {

const Kernels& avx2_kernels() {
  static const Kernels kernels = make_kernels<cpu_adam::Avx2Trait>("avx2");
  return kernels;
}

}  // namespace zero_offload::cpu_adam
