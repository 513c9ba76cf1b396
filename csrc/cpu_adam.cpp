// CPU-Adam: the portable scalar path, runtime ISA dispatch, threading and the pybind11 entry
// points (submodule zero_offload._C.cpu_adam). The ISA paths live in cpu_adam_avx2.cpp and
// cpu_adam_avx512.cpp; the loops all three share are in cpu_adam_kernel.h.
//
// Stateless: every call gets its buffers (addresses + element count + dtype codes, checked on
// the Python side in zero_offload/cpu_adam.py) and all its scalars. The only process-wide
// settings are which ISA path runs and the thread pool.
// [Note: no FP contraction] (cpu_adam_kernel.h); precedes every include.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "cpu_adam.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "kernel_queue.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace zero_offload::cpu_adam {
namespace {

// ---------------------------------------------------------------------------------------------
// Scalar path: the 1-lane trait for cpu_adam_kernel.h. This file is compiled with the portable
// baseline flags (no FMA instruction), so the compiler cannot contract a*b+c behind our back;
// the lerp's single-rounding FMA is std::fma (glibc picks the hardware instruction at run time).

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
  static bool any_nan(F a) { return std::isnan(a); }
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
};

}  // namespace
}  // namespace zero_offload::cpu_adam

#include "cpu_adam_kernel.h"

namespace zero_offload::cpu_adam {

const Kernels& scalar_kernels() {
  static const Kernels kernels = make_kernels<ScalarTrait>("scalar");
  return kernels;
}

namespace {

// ---------------------------------------------------------------------------------------------
// ISA selection.

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

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

const Kernels& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return avx512_kernels();
    case Isa::kAvx2: return avx2_kernels();
    default: return scalar_kernels();
  }
}

Isa best_isa() {
  if (supported(Isa::kAvx512)) return Isa::kAvx512;
  if (supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

std::atomic<int>& active_isa() {
  static std::atomic<int> isa{static_cast<int>(best_isa())};
  return isa;
}

const Kernels& active_kernels() { return kernels_for(static_cast<Isa>(active_isa().load())); }

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (int i = 0; i < 3; ++i) {
    if (supported(static_cast<Isa>(i))) names.emplace_back(kIsaNames[i]);
  }
  return names;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
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
    active_isa().store(i);
    return;
  }
  throw std::invalid_argument("unknown ISA path '" + name +
                              "': expected one of scalar, avx2, avx512 (this CPU supports: " +
                              join(supported_isas()) + ")");
}

// ---------------------------------------------------------------------------------------------
// Threading: split [0, numel) into contiguous per-thread ranges.

int default_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

// [Note: chunked work sharing]
// A buffer is cut into chunks whose size depends only on its length (never on the thread count),
// and the threads take chunks in order from an atomic counter until none are left:
//  * each chunk is one contiguous stretch (>= 64 KiB of every fp32 stream, 16 pages), starting
//    on a multiple of 16 elements, i.e. on a 64-byte line when the buffer is 64-byte aligned, so
//    the hardware prefetchers stream and no two threads write the same cache line;
//  * threads that start late (woken from sleep) or run slowly (a busy machine) just take fewer
//    chunks; with ~1000 chunks the last one to finish is at most a small chunk behind, where an
//    even 1/threads split waits for the slowest thread's whole share;
//  * per-chunk partial sums added in chunk order make grad_sumsq independent of the thread count.
constexpr int64_t kMinChunk = 1 << 14;       // elements
constexpr int64_t kTargetChunks = 1024;      // large buffers: about this many chunks
constexpr int64_t kMinPerThread = 1 << 16;   // elements that justify waking one more thread
constexpr int64_t kRangeAlign = 16;          // elements: 64 bytes of fp32

struct Chunks {
  int64_t size;   // elements per chunk (the last may be shorter)
  int64_t count;  // number of chunks
};

Chunks chunks_for(int64_t numel) {
  int64_t size = (numel + kTargetChunks - 1) / kTargetChunks;
  size = (size + kRangeAlign - 1) / kRangeAlign * kRangeAlign;
  size = std::max(size, kMinChunk);
  return Chunks{size, (numel + size - 1) / size};
}

// Calls fn(chunk_index, begin, end) once for every chunk of [0, numel), on up to `threads`
// threads (see [Note: chunked work sharing]).
template <class Fn>
void parallel_chunks(int64_t numel, int threads, const Fn& fn) {
  const Chunks c = chunks_for(numel);
  const int64_t worth = (numel + kMinPerThread - 1) / kMinPerThread;
  const int used = static_cast<int>(std::min<int64_t>({threads, c.count, worth}));
  std::atomic<int64_t> next{0};
  ParallelPool::get().run(used, [&](int) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < c.count;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i, i * c.size, std::min(numel, (i + 1) * c.size));
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Entry points. Python has checked the tensors; these re-check what would otherwise be
// undefined behaviour (cheap integer tests) and raise ValueError.

void check_common(int64_t numel, int threads) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0, got " + std::to_string(numel));
  if (threads < 1) {
    throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
  }
}

Dtype grad_dtype_from(int code) {
  if (code < 0 || code > 2) {
    throw std::invalid_argument("grad dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16), got " +
                                std::to_string(code));
  }
  return static_cast<Dtype>(code);
}

Scalars make_scalars(double step, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool adamw, double grad_scale) {
  // As torch computes them, in double (aten/src/ATen/native/cpu/FusedAdamKernel.cpp):
  //   bias_correction1 = 1 - beta1^step, step_size = lr / bias_correction1
  //   bias_correction2_sqrt = sqrt(1 - beta2^step)
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  const double step_size = lr / bias_correction1;
  Scalars s{};
  const float lerp_weight = static_cast<float>(1 - beta1);
  s.lerp_from_grad = !(std::fabs(lerp_weight) < 0.5f);
  s.lerp_weight = s.lerp_from_grad ? lerp_weight - 1.0f : lerp_weight;
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(eps);
  s.neg_step_size = static_cast<float>(-step_size);
  s.grad_scale = static_cast<float>(grad_scale);
  s.unscale = s.grad_scale != 1.0f;
  if (weight_decay == 0) {
    s.decay = Decay::kNone;
  } else if (adamw) {
    s.decay = Decay::kDecoupled;
    s.decay_factor = static_cast<float>(1 - lr * weight_decay);
  } else {
    s.decay = Decay::kL2;
    s.weight_decay = static_cast<float>(weight_decay);
  }
  return s;
}

// Checks one adam_step call and returns it as a job that runs the kernel and returns its
// seconds (run now by adam_step, or later on the KernelQueue by adam_step_async).
std::function<double()> adam_job(uintptr_t param, uintptr_t grad, int grad_dtype,
                                 uintptr_t exp_avg, uintptr_t exp_avg_sq, int64_t numel,
                                 uintptr_t out, int out_dtype, double step, double lr,
                                 double beta1, double beta2, double eps, double weight_decay,
                                 bool adamw, double grad_scale, int threads, int moment_dtype,
                                 int64_t seed) {
  check_common(numel, threads);
  const Dtype g = grad_dtype_from(grad_dtype);
  if (moment_dtype != 0 && moment_dtype != 1) {
    throw std::invalid_argument("moment dtype code must be 0 (fp32) or 1 (bf16), got " +
                                std::to_string(moment_dtype));
  }
  if (seed < 0 || seed > 0xFFFFFFFFll) {
    throw std::invalid_argument("seed must be in [0, 2**32), got " + std::to_string(seed));
  }
  if (out_dtype != -1 && out_dtype != 1 && out_dtype != 2) {
    throw std::invalid_argument("out dtype code must be -1 (none), 1 (bf16) or 2 (fp16), got " +
                                std::to_string(out_dtype));
  }
  if ((out == 0) != (out_dtype == -1)) {
    throw std::invalid_argument("out and out_dtype must be given together");
  }
  if (!(step >= 1)) throw std::invalid_argument("step must be >= 1");
  if (numel == 0) return [] { return 0.0; };
  if (!param || !grad || !exp_avg || !exp_avg_sq) {
    throw std::invalid_argument("null buffer address with numel > 0");
  }
  const Buffers buffers{reinterpret_cast<float*>(param), reinterpret_cast<const void*>(grad),
                        reinterpret_cast<void*>(exp_avg), reinterpret_cast<void*>(exp_avg_sq),
                        reinterpret_cast<void*>(out), g, static_cast<Dtype>(out_dtype),
                        static_cast<Dtype>(moment_dtype), static_cast<uint32_t>(seed)};
  const Scalars scalars =
      make_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale);
  const Kernels* k = &active_kernels();
  return [buffers, scalars, k, numel, threads] {
    const auto start = std::chrono::steady_clock::now();
    parallel_chunks(numel, threads, [&](int64_t, int64_t begin, int64_t end) {
      k->adam(buffers, scalars, begin, end);
    });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
}

double adam_step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg,
                 uintptr_t exp_avg_sq, int64_t numel, uintptr_t out, int out_dtype, double step,
                 double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool adamw, double grad_scale, int threads, int moment_dtype, int64_t seed) {
  return adam_job(param, grad, grad_dtype, exp_avg, exp_avg_sq, numel, out, out_dtype, step, lr,
                  beta1, beta2, eps, weight_decay, adamw, grad_scale, threads, moment_dtype,
                  seed)();
}

// Checks now (errors raise here, before anything is queued), runs later on the KernelQueue
// (see [Note: why a native queue]); returns the ticket for kernel_wait.
uint64_t adam_step_async(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg,
                         uintptr_t exp_avg_sq, int64_t numel, uintptr_t out, int out_dtype,
                         double step, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool adamw, double grad_scale, int threads,
                         int moment_dtype, int64_t seed) {
  return KernelQueue::get().submit(adam_job(param, grad, grad_dtype, exp_avg, exp_avg_sq, numel,
                                            out, out_dtype, step, lr, beta1, beta2, eps,
                                            weight_decay, adamw, grad_scale, threads,
                                            moment_dtype, seed));
}

double grad_sumsq(uintptr_t grad, int dtype, int64_t numel, double grad_scale, int threads) {
  check_common(numel, threads);
  const Dtype d = grad_dtype_from(dtype);
  if (numel == 0) return 0.0;
  if (!grad) throw std::invalid_argument("null buffer address with numel > 0");
  const Kernels& k = active_kernels();
  std::vector<double> partial(chunks_for(numel).count, 0.0);
  parallel_chunks(numel, threads, [&](int64_t chunk, int64_t begin, int64_t end) {
    partial[chunk] = k.sumsq(reinterpret_cast<const void*>(grad), d, begin, end);
  });
  double total = 0.0;
  for (double p : partial) total += p;  // in chunk order: any thread count, same result
  // sum((g / s)^2) = sum(g^2) / s^2; s is an fp32 value, so s * s is exact in double.
  const double scale = static_cast<float>(grad_scale);
  return total / (scale * scale);
}

bool grad_nonfinite(uintptr_t grad, int dtype, int64_t numel, int threads) {
  check_common(numel, threads);
  const Dtype d = grad_dtype_from(dtype);
  if (numel == 0) return false;
  if (!grad) throw std::invalid_argument("null buffer address with numel > 0");
  const Kernels& k = active_kernels();
  std::atomic<bool> found{false};
  parallel_chunks(numel, threads, [&](int64_t, int64_t begin, int64_t end) {
    if (found.load(std::memory_order_relaxed)) return;  // early exit: skip the remaining chunks
    if (k.nonfinite(reinterpret_cast<const void*>(grad), d, begin, end)) {
      found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

}  // namespace
}  // namespace zero_offload::cpu_adam

namespace zero_offload {

void register_cpu_adam(py::module_& m) {
  using namespace cpu_adam;
  auto sub = m.def_submodule(
      "cpu_adam",
      "Fused CPU Adam/AdamW over flat fp32 params (moments fp32 or bf16, grads fp32/bf16/fp16), "
      "plus grad sum of squares and inf/NaN check. Buffers are integer addresses; "
      "zero_offload/cpu_adam.py checks the tensors. Every call releases the GIL.");
  sub.def("adam_step", &adam_step, py::kw_only(), py::arg("param"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("numel"),
          py::arg("out"), py::arg("out_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
          py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
          py::arg("grad_scale"), py::arg("threads"), py::arg("moment_dtype") = 0,
          py::arg("seed") = 0, py::call_guard<py::gil_scoped_release>(),
          "One fused Adam/AdamW step over `numel` elements, in place; optional low-precision "
          "copy-out of the updated params; moments fp32 (moment_dtype 0) or bf16 (1, stored by "
          "stochastic rounding keyed by `seed`). Returns the seconds the kernel ran (GIL "
          "released).");
  sub.def("adam_step_async", &adam_step_async, py::kw_only(), py::arg("param"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("numel"),
          py::arg("out"), py::arg("out_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
          py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
          py::arg("grad_scale"), py::arg("threads"), py::arg("moment_dtype") = 0,
          py::arg("seed") = 0,
          "adam_step checked now and queued on the native kernel thread; returns a ticket. The "
          "buffers must stay alive until kernel_wait(ticket) returns.");
  sub.def("kernel_wait", [](uint64_t ticket) { return KernelQueue::get().wait(ticket); },
          py::arg("ticket"), py::call_guard<py::gil_scoped_release>(),
          "Block until a queued kernel ran; returns (start, seconds) (start on time.perf_counter's "
          "clock) or raises its error. Once per ticket.");
  sub.def("kernel_ready", [](uint64_t ticket) { return KernelQueue::get().ready(ticket); },
          py::arg("ticket"), "Whether a queued kernel has run (non-blocking).");
  sub.def("grad_sumsq", &grad_sumsq, py::kw_only(), py::arg("grad"), py::arg("dtype"),
          py::arg("numel"), py::arg("grad_scale"), py::arg("threads"),
          py::call_guard<py::gil_scoped_release>(), "sum((grad / grad_scale)^2) in fp64.");
  sub.def("grad_nonfinite", &grad_nonfinite, py::kw_only(), py::arg("grad"), py::arg("dtype"),
          py::arg("numel"), py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
          "Whether any element is inf or NaN.");
  sub.def("isa", [] { return std::string(active_kernels().name); }, "The ISA path in use.");
  sub.def("set_isa", &set_isa, py::arg("name"),
          "Switch the ISA path (scalar | avx2 | avx512); ValueError if this CPU lacks it.");
  sub.def("supported_isas", &supported_isas, "The ISA paths this CPU can run.");
  sub.def("best_isa", [] { return std::string(kIsaNames[static_cast<int>(best_isa())]); },
          "The fastest path this CPU supports (the default).");
  sub.def("default_threads", &default_threads, "CPUs this process may run on.");
}

}  // namespace zero_offload
