// SGD and Lion: the portable scalar path, the choice of their table for the active ISA path and
// the pybind11 entry points (submodule zero_offload._C.cpu_rules). The ISA paths live in
// cpu_rules_avx2.cpp and cpu_rules_avx512.cpp; the loops all three share are in
// cpu_rules_kernel.h; ISA selection, threading and the kernel queue are CPU-Adam's
// (cpu_runtime.h, kernel_queue.h), so a rule's queued calls and Adam's run in one order.
//
// Stateless, as CPU-Adam: every call gets its buffers (addresses + element count + dtype codes,
// checked on the Python side in zero_offload/ops/cpu_rules.py) and all its scalars.
// [Note: no FP contraction] (cpu_adam_kernel.h); precedes every include.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "cpu_rules.h"

#include <pybind11/pybind11.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

#include "cpu_runtime.h"
#include "kernel_queue.h"
#include "simd_scalar.h"
#include "cpu_rules_kernel.h"

namespace py = pybind11;

namespace zero_offload::cpu_rules {

// The portable path: cpu_rules_kernel.h's loops over simd_scalar.h's 1-lane trait.
const Kernels& scalar_kernels() {
  static const Kernels kernels = make_kernels<cpu_adam::ScalarTrait>("scalar");
  return kernels;
}

namespace {

using cpu_runtime::Isa;

const Kernels& active_kernels() {
  switch (cpu_runtime::active_isa()) {
    case Isa::kAvx512: return avx512_kernels();
    case Isa::kAvx2: return avx2_kernels();
    default: return scalar_kernels();
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points. Python has checked the tensors and the hyperparameters' ranges; these re-check
// what would otherwise be undefined behaviour (integer codes, null buffers) and raise ValueError.

float unscale_factor(double grad_scale, bool* unscale) {
  if (!(std::isfinite(grad_scale) && grad_scale > 0)) {
    throw std::invalid_argument("grad_scale must be finite and > 0, got " +
                                std::to_string(grad_scale));
  }
  const float scale = static_cast<float>(grad_scale);
  *unscale = scale != 1.0f;
  return scale;
}

// A job that runs `kernel` over [0, numel) on up to `threads` threads and returns its seconds.
template <class S>
std::function<double()> job(void (*kernel)(const Buffers&, const S&, int64_t, int64_t),
                            const Buffers& buffers, const S& scalars, int64_t numel, int threads) {
  if (numel == 0) return [] { return 0.0; };
  return [kernel, buffers, scalars, numel, threads] {
    const auto start = std::chrono::steady_clock::now();
    cpu_runtime::parallel_chunks(numel, threads, [&](int64_t, int64_t begin, int64_t end) {
      kernel(buffers, scalars, begin, end);
    });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
}

Buffers checked_buffers(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t state,
                        bool needs_state, int64_t numel, uintptr_t out, int out_dtype,
                        int threads) {
  cpu_runtime::check_common(numel, threads);
  const Dtype g = cpu_runtime::grad_dtype_from(grad_dtype);
  const Dtype o = cpu_runtime::out_dtype_from(out, out_dtype);
  if (numel > 0 && (!param || !grad || (needs_state && !state))) {
    throw std::invalid_argument("null buffer address with numel > 0");
  }
  return Buffers{reinterpret_cast<float*>(param), reinterpret_cast<const void*>(grad),
                 needs_state ? reinterpret_cast<float*>(state) : nullptr,
                 reinterpret_cast<void*>(out), g, o};
}

// Checks one sgd_step call and returns it as a job (run now by sgd_step, or later on the
// KernelQueue by sgd_step_async).
std::function<double()> sgd_job(uintptr_t param, uintptr_t grad, int grad_dtype,
                                uintptr_t momentum_buffer, int64_t numel, uintptr_t out,
                                int out_dtype, double lr, double momentum, double dampening,
                                double weight_decay, bool nesterov, bool first_step,
                                double grad_scale, int threads) {
  if (nesterov && !(momentum > 0 && dampening == 0)) {
    throw std::invalid_argument("Nesterov momentum requires a momentum and zero dampening");
  }
  SgdScalars s{};
  s.grad_scale = unscale_factor(grad_scale, &s.unscale);
  s.neg_lr = static_cast<float>(-lr);
  s.decay = weight_decay != 0;  // torch: `if weight_decay != 0`, in double
  s.weight_decay = static_cast<float>(weight_decay);
  s.momentum = static_cast<float>(momentum);
  s.one_minus_dampening = static_cast<float>(1 - dampening);
  s.momentum_mode = momentum == 0 ? Momentum::kNone
                    : first_step  ? Momentum::kFirst
                                  : Momentum::kRunning;
  s.nesterov = nesterov;
  const Buffers b = checked_buffers(param, grad, grad_dtype, momentum_buffer,
                                    s.momentum_mode != Momentum::kNone, numel, out, out_dtype,
                                    threads);
  return job(active_kernels().sgd, b, s, numel, threads);
}

std::function<double()> lion_job(uintptr_t param, uintptr_t grad, int grad_dtype,
                                 uintptr_t exp_avg, int64_t numel, uintptr_t out, int out_dtype,
                                 double lr, double beta1, double beta2, double weight_decay,
                                 double grad_scale, int threads) {
  LionScalars s{};
  s.grad_scale = unscale_factor(grad_scale, &s.unscale);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.neg_lr = static_cast<float>(-lr);
  s.decay = weight_decay != 0;
  s.decay_factor = static_cast<float>(1 - lr * weight_decay);
  const Buffers b =
      checked_buffers(param, grad, grad_dtype, exp_avg, true, numel, out, out_dtype, threads);
  return job(active_kernels().lion, b, s, numel, threads);
}

// The bound entry points: run now (returns the kernel's seconds; the binding releases the GIL),
// or checked now, raising here before anything is queued, and run later on the KernelQueue
// ([Note: why a native queue] in kernel_queue.h; returns the ticket for kernel_wait).
double sgd_step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t momentum_buffer,
                int64_t numel, uintptr_t out, int out_dtype, double lr, double momentum,
                double dampening, double weight_decay, bool nesterov, bool first_step,
                double grad_scale, int threads) {
  return sgd_job(param, grad, grad_dtype, momentum_buffer, numel, out, out_dtype, lr, momentum,
                 dampening, weight_decay, nesterov, first_step, grad_scale, threads)();
}

uint64_t sgd_step_async(uintptr_t param, uintptr_t grad, int grad_dtype,
                        uintptr_t momentum_buffer, int64_t numel, uintptr_t out, int out_dtype,
                        double lr, double momentum, double dampening, double weight_decay,
                        bool nesterov, bool first_step, double grad_scale, int threads) {
  return KernelQueue::get().submit(sgd_job(param, grad, grad_dtype, momentum_buffer, numel, out,
                                           out_dtype, lr, momentum, dampening, weight_decay,
                                           nesterov, first_step, grad_scale, threads));
}

double lion_step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg,
                 int64_t numel, uintptr_t out, int out_dtype, double lr, double beta1,
                 double beta2, double weight_decay, double grad_scale, int threads) {
  return lion_job(param, grad, grad_dtype, exp_avg, numel, out, out_dtype, lr, beta1, beta2,
                  weight_decay, grad_scale, threads)();
}

uint64_t lion_step_async(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg,
                         int64_t numel, uintptr_t out, int out_dtype, double lr, double beta1,
                         double beta2, double weight_decay, double grad_scale, int threads) {
  return KernelQueue::get().submit(lion_job(param, grad, grad_dtype, exp_avg, numel, out,
                                            out_dtype, lr, beta1, beta2, weight_decay,
                                            grad_scale, threads));
}

}  // namespace
}  // namespace zero_offload::cpu_rules

namespace zero_offload {

void register_cpu_rules(py::module_& m) {
  using namespace cpu_rules;
  auto sub = m.def_submodule(
      "cpu_rules",
      "Fused CPU SGD (torch.optim.SGD) and Lion over flat fp32 params (grads fp32/bf16/fp16), "
      "with an optional bf16/fp16 copy-out. Buffers are integer addresses; "
      "zero_offload/ops/cpu_rules.py checks the tensors. sgd_step/lion_step release the GIL; "
      "the *_async calls queue on CPU-Adam's kernel thread (wait: cpu_adam.kernel_wait).");
  sub.def("sgd_step", &sgd_step, py::kw_only(), py::arg("param"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("momentum_buffer"), py::arg("numel"), py::arg("out"),
          py::arg("out_dtype"), py::arg("lr"), py::arg("momentum"), py::arg("dampening"),
          py::arg("weight_decay"), py::arg("nesterov"), py::arg("first_step"),
          py::arg("grad_scale"), py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
          "One fused torch.optim.SGD step over `numel` elements, in place (momentum_buffer 0 "
          "when momentum == 0); optional low-precision copy-out. Returns the kernel's seconds.");
  sub.def("sgd_step_async", &sgd_step_async, py::kw_only(), py::arg("param"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("momentum_buffer"), py::arg("numel"), py::arg("out"),
          py::arg("out_dtype"), py::arg("lr"), py::arg("momentum"), py::arg("dampening"),
          py::arg("weight_decay"), py::arg("nesterov"), py::arg("first_step"),
          py::arg("grad_scale"), py::arg("threads"),
          "sgd_step checked now and queued on the native kernel thread; returns a ticket. The "
          "buffers must stay alive until cpu_adam.kernel_wait(ticket) returns.");
  sub.def("lion_step", &lion_step, py::kw_only(), py::arg("param"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("numel"), py::arg("out"),
          py::arg("out_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("weight_decay"), py::arg("grad_scale"), py::arg("threads"),
          py::call_guard<py::gil_scoped_release>(),
          "One fused Lion step (decoupled weight decay) over `numel` elements, in place; "
          "optional low-precision copy-out. Returns the kernel's seconds.");
  sub.def("lion_step_async", &lion_step_async, py::kw_only(), py::arg("param"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("numel"), py::arg("out"),
          py::arg("out_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("weight_decay"), py::arg("grad_scale"), py::arg("threads"),
          "lion_step checked now and queued on the native kernel thread; returns a ticket. The "
          "buffers must stay alive until cpu_adam.kernel_wait(ticket) returns.");
  sub.def("isa", [] { return std::string(active_kernels().name); },
          "The ISA path these kernels use (switched with cpu_adam.set_isa).");
}

}  // namespace zero_offload
