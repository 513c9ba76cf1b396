// ISA selection (cpuid, once) and the thread count default, shared by every kernel family: see
// cpu_runtime.h.
#include "cpu_runtime.h"

#include <sched.h>

#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace zero_offload::cpu_runtime {
namespace {

constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512"};

struct CpuFeatures {
  bool avx2_fma_f16c = false;
  bool avx512 = false;  // F + BW + VL + DQ (what setup.py compiles *_avx512.cpp for)
};

CpuFeatures detect_cpu() {
  CpuFeatures features;
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return features;
  const bool fma = ecx & (1u << 12), osxsave = ecx & (1u << 27), avx = ecx & (1u << 28),
             f16c = ecx & (1u << 29);
  if (!(osxsave && avx)) return features;
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool os_ymm = (xcr0_lo & 0x6) == 0x6;     // SSE + AVX state saved by the OS
  const bool os_zmm = (xcr0_lo & 0xE6) == 0xE6;   // ... + opmask + both zmm halves
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return features;
  const bool avx2 = ebx & (1u << 5), avx512f = ebx & (1u << 16), avx512dq = ebx & (1u << 17),
             avx512bw = ebx & (1u << 30), avx512vl = ebx & (1u << 31);
  features.avx2_fma_f16c = os_ymm && avx2 && fma && f16c;
  features.avx512 = features.avx2_fma_f16c && os_zmm && avx512f && avx512dq && avx512bw && avx512vl;
#endif
  return features;
}

const CpuFeatures& cpu() {
  static const CpuFeatures features = detect_cpu();
  return features;
}

bool supported(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return cpu().avx2_fma_f16c;
    case Isa::kAvx512: return cpu().avx512;
  }
  return false;
}

std::atomic<int>& active() {
  static std::atomic<int> isa{static_cast<int>(best_isa())};
  return isa;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

Isa active_isa() { return static_cast<Isa>(active().load()); }

const char* isa_name(Isa isa) { return kIsaNames[static_cast<int>(isa)]; }

Isa best_isa() {
  if (supported(Isa::kAvx512)) return Isa::kAvx512;
  if (supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (int i = 0; i < 3; ++i) {
    if (supported(static_cast<Isa>(i))) names.emplace_back(kIsaNames[i]);
  }
  return names;
}

void set_isa(const std::string& name) {
  for (int i = 0; i < 3; ++i) {
    if (name != kIsaNames[i]) continue;
    if (!supported(static_cast<Isa>(i))) {
      throw std::invalid_argument(
          "ISA path '" + name + "' needs CPU features this machine lacks (" +
          (i == 2 ? "AVX-512 F/BW/VL/DQ" : "AVX2 + FMA + F16C") +
          "); this CPU supports: " + join(supported_isas()) +
          ". Unset ZERO_OFFLOAD_ISA or pick one of those.");
    }
    active().store(i);
    return;
  }
  throw std::invalid_argument("unknown ISA path '" + name +
                              "': expected one of scalar, avx2, avx512 (this CPU supports: " +
                              join(supported_isas()) + ")");
}

int default_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace zero_offload::cpu_runtime
