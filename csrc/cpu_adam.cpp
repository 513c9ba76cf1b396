// CPU-Adam: the portable scalar path, the choice of its table for the active ISA path and the
// pybind11 entry points (submodule zero_offload._C.cpu_adam, which also holds what every kernel
// family shares: the ISA switch and the kernel queue's kernel_wait). The ISA paths live in
// cpu_adam_avx2.cpp and cpu_adam_avx512.cpp; the loops all three share are in cpu_adam_kernel.h;
// ISA selection and threading in cpu_runtime.h.
//
// Stateless: every call gets its buffers (addresses + element count + dtype codes, checked on
// the Python side in zero_offload/ops/cpu_adam.py) and all its scalars. The only process-wide
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

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_runtime.h"
#include "kernel_queue.h"
#include "simd_scalar.h"
#include "cpu_adam_kernel.h"

namespace py = pybind11;

namespace zero_offload::cpu_adam {

// The portable path: cpu_adam_kernel.h's loops over simd_scalar.h's 1-lane trait.
const Kernels& scalar_kernels() {
  static const Kernels kernels = make_kernels<ScalarTrait>("scalar");
  return kernels;
}

namespace {

using cpu_runtime::check_common;
using cpu_runtime::grad_dtype_from;
using cpu_runtime::Isa;
using cpu_runtime::parallel_chunks;

const Kernels& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return avx512_kernels();
    case Isa::kAvx2: return avx2_kernels();
    default: return scalar_kernels();
  }
}

const Kernels& active_kernels() { return kernels_for(cpu_runtime::active_isa()); }

// ---------------------------------------------------------------------------------------------
// Entry points (checks shared with the other kernel families: cpu_runtime.h).

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
  const Dtype o = cpu_runtime::out_dtype_from(out, out_dtype);
  if (!(step >= 1)) throw std::invalid_argument("step must be >= 1");
  if (numel == 0) return [] { return 0.0; };
  if (!param || !grad || !exp_avg || !exp_avg_sq) {
    throw std::invalid_argument("null buffer address with numel > 0");
  }
  const Buffers buffers{reinterpret_cast<float*>(param), reinterpret_cast<const void*>(grad),
                        reinterpret_cast<void*>(exp_avg), reinterpret_cast<void*>(exp_avg_sq),
                        reinterpret_cast<void*>(out), g, o,
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
  std::vector<double> partial(cpu_runtime::chunks_for(numel).count, 0.0);
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
  sub.def("set_isa", &cpu_runtime::set_isa, py::arg("name"),
          "Switch the ISA path (scalar | avx2 | avx512); ValueError if this CPU lacks it.");
  sub.def("supported_isas", &cpu_runtime::supported_isas, "The ISA paths this CPU can run.");
  sub.def("best_isa", [] { return std::string(cpu_runtime::isa_name(cpu_runtime::best_isa())); },
          "The fastest path this CPU supports (the default).");
  sub.def("default_threads", &cpu_runtime::default_threads, "CPUs this process may run on.");
}

}  // namespace zero_offload
