// The rules beside CPU-Adam (SGD, Lion, Adafactor, Muon's host passes): the portable scalar
// path, the choice of their table for the active ISA path, Adafactor's orchestration of its
// passes, and the pybind11 entry points (submodule zero_offload._C.cpu_rules). The ISA paths live in
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

#include <algorithm>
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

// ---------------------------------------------------------------------------------------------
// Muon's host passes ([Note: Muon and Adafactor formula order] in cpu_rules_kernel.h).

// torch's lerp with a scalar weight: fma(coeff, end - start, base), coeff = w (base start) for
// |w| < 0.5, else w - 1 (base end), in fp32 (aten/src/ATen/native/cpu/LerpKernel.cpp).
void lerp_weight(double weight, float* coeff, bool* from_end) {
  const float w = static_cast<float>(weight);
  *from_end = !(std::fabs(w) < 0.5f);
  *coeff = *from_end ? w - 1.0f : w;
}

std::function<double()> muon_momentum_job(uintptr_t grad, int grad_dtype,
                                          uintptr_t momentum_buffer, int64_t numel,
                                          uintptr_t out, double momentum, bool nesterov,
                                          double grad_scale, int threads) {
  MuonScalars s{};
  s.grad_scale = unscale_factor(grad_scale, &s.unscale);
  lerp_weight(1 - momentum, &s.lerp_weight, &s.lerp_from_grad);   // buf.lerp_(g, 1 - momentum)
  lerp_weight(momentum, &s.nesterov_weight, &s.nesterov_from_buf); // g.lerp(buf, momentum)
  s.nesterov = nesterov;
  cpu_runtime::check_common(numel, threads);
  const Dtype g = cpu_runtime::grad_dtype_from(grad_dtype);
  if (numel > 0 && (!grad || !momentum_buffer || !out)) {
    throw std::invalid_argument("null buffer address with numel > 0");
  }
  const Buffers b{nullptr, reinterpret_cast<const void*>(grad),
                  reinterpret_cast<float*>(momentum_buffer), reinterpret_cast<void*>(out), g,
                  Dtype::kBFloat16};
  return job(active_kernels().muon_momentum, b, s, numel, threads);
}

std::function<double()> muon_apply_job(uintptr_t param, uintptr_t ortho, int64_t numel,
                                       uintptr_t out, int out_dtype, double lr,
                                       double weight_decay, double adjusted_lr, int threads) {
  MuonScalars s{};
  s.decay_factor = static_cast<float>(1 - lr * weight_decay);  // param.mul_(1 - lr * wd)
  s.decay = s.decay_factor != 1.0f;  // (x * 1 is x: torch's multiply by one changes nothing)
  s.neg_lr = static_cast<float>(-adjusted_lr);
  cpu_runtime::check_common(numel, threads);
  const Dtype o = cpu_runtime::out_dtype_from(out, out_dtype);
  if (numel > 0 && (!param || !ortho)) {
    throw std::invalid_argument("null buffer address with numel > 0");
  }
  const Buffers b{reinterpret_cast<float*>(param), reinterpret_cast<const void*>(ortho), nullptr,
                  reinterpret_cast<void*>(out), Dtype::kBFloat16, o};
  return job(active_kernels().muon_apply, b, s, numel, threads);
}

// ---------------------------------------------------------------------------------------------
// Adafactor: one whole param per call, three passes over it with small steps in between
// ([Note: Muon and Adafactor formula order] in cpu_rules_kernel.h).
//
// [Note: Adafactor's row blocks]
// A factored param's work is cut into tasks of whole rows, each within one matrix of the batch:
// every matrix into `blocks` blocks of `block_rows` rows, about kFactorBlock elements each, at
// most kMaxBlocks (and at most one per row). The cut depends on the shape only, never on the
// thread count, and the threads take tasks in order from a counter, so every sum is added in the
// same order whatever the threads: a row's sum within its task, a column's sum per block into
// the block's own accumulators (added up in block order afterwards), the param's and the
// update's sums per task, added in task order. Column accumulators: `cols` doubles per block
// (kMaxBlocks * cols * 8 bytes at most: 4 MiB for 8192 columns), in L2 while a block runs.
constexpr int64_t kFactorBlock = 1 << 15;  // elements per block, about
constexpr int64_t kMaxBlocks = 64;         // blocks per matrix, at most
constexpr int64_t kColumnPiece = 4096;     // columns per task when the blocks' sums are added

struct FactorPlan {
  int64_t blocks;      // per matrix
  int64_t block_rows;  // rows per block (the last may have fewer)
};

FactorPlan factor_plan(int64_t rows, int64_t cols) {
  const int64_t per_matrix = rows * cols;
  int64_t blocks = (per_matrix + kFactorBlock - 1) / kFactorBlock;
  blocks = std::max<int64_t>(1, std::min({blocks, kMaxBlocks, rows}));
  const int64_t block_rows = (rows + blocks - 1) / blocks;
  return FactorPlan{(rows + block_rows - 1) / block_rows, block_rows};
}

// fn(t) for every task t of [0, tasks), on up to `threads` threads (fewer for little work:
// about cpu_runtime::kMinPerThread of the call's `numel` elements per thread).
template <class Fn>
void run_tasks(int64_t tasks, int64_t numel, int threads, const Fn& fn) {
  const int64_t worth = (numel + cpu_runtime::kMinPerThread - 1) / cpu_runtime::kMinPerThread;
  const int used = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({threads, tasks, worth})));
  std::atomic<int64_t> next{0};
  ParallelPool::get().run(used, [&](int) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tasks;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(t);
    }
  });
}

// torch: norm(g, dim=...) (fp32), .square_(), .div_(n)
float mean_of_squares(double sum_sq, int64_t n) {
  const float norm = static_cast<float>(std::sqrt(sum_sq));
  const float square = norm * norm;
  return square / static_cast<float>(n);
}

float lerp(float start, float end, const FactorScalars& s) {
  return std::fma(s.lerp_weight, end - start, s.lerp_from_end ? end : start);
}

// The per-call constants of one Adafactor step, in double as torch.optim.Adafactor computes
// them in Python.
struct AdafactorConstants {
  double rho;         // min(lr, 1 / sqrt(step))
  double eps1;        // clamp of the row_var mean
  double eps2;        // floor of the param's RMS
  double d;           // clipping threshold of the update's RMS
  double sqrt_numel;  // numel ** 0.5
};

// param.add_(update, alpha=-alpha / denom)'s float(alpha), from the sums of squares:
//   alpha = max(eps2, ||param|| / sqrt(numel)) * rho
//   denom = max(1, ||update|| / (sqrt(numel) * d))
// with each norm rounded to fp32 first (torch's .item() of an fp32 norm), and Python's max
// (the first argument unless the second is greater: a NaN norm gives the first).
float adafactor_step_size(double param_sq, double update_sq, const AdafactorConstants& c) {
  const double param_rms = static_cast<float>(std::sqrt(param_sq)) / c.sqrt_numel;
  const double alpha = (param_rms > c.eps2 ? param_rms : c.eps2) * c.rho;
  const double update_rms = static_cast<float>(std::sqrt(update_sq)) / (c.sqrt_numel * c.d);
  const double denom = update_rms > 1.0 ? update_rms : 1.0;
  return static_cast<float>(-alpha / denom);
}

// The sums of one Adafactor call: grown to the largest param seen and reused, one per thread
// (the kernel thread runs one job at a time; a direct call uses its caller's), so a call neither
// allocates nor faults in fresh pages.
double* scratch(int64_t n) {
  thread_local std::vector<double> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

void adafactor_factored(const Kernels& k, FactorBuffers b, FactorScalars s,
                        const AdafactorConstants& c, int64_t batch, int threads) {
  const int64_t rows = b.rows, cols = b.cols, numel = batch * rows * cols;
  const FactorPlan plan = factor_plan(rows, cols);
  const int64_t tasks = batch * plan.blocks;
  auto task_rows = [&](int64_t t, int64_t* row0, int64_t* row1) {
    const int64_t matrix = t / plan.blocks, first = matrix * rows;
    *row0 = first + (t % plan.blocks) * plan.block_rows;
    *row1 = std::min(first + rows, *row0 + plan.block_rows);
  };
  // Pass 1: sums of squares of the param, of g's rows and columns ([Note: Adafactor's row blocks]).
  const int64_t partials = plan.blocks > 1 ? tasks * cols : 0;
  double* const row_sq = scratch(batch * rows + batch * cols + tasks + partials);
  double* const col_sq = row_sq + batch * rows;
  double* const task_sq = col_sq + batch * cols;
  double* const partial = task_sq + tasks;
  run_tasks(tasks, numel, threads, [&](int64_t t) {
    int64_t row0, row1;
    task_rows(t, &row0, &row1);
    double* acc = plan.blocks > 1 ? partial + t * cols : col_sq + (t / plan.blocks) * cols;
    std::fill(acc, acc + cols, 0.0);
    task_sq[t] = k.factor_sums(b, s, row0, row1, row_sq, acc);
  });
  if (plan.blocks > 1) {
    const int64_t pieces = (cols + kColumnPiece - 1) / kColumnPiece;
    run_tasks(batch * pieces, partials, threads, [&](int64_t t) {
      const int64_t matrix = t / pieces, j0 = (t % pieces) * kColumnPiece;
      const int64_t j1 = std::min(cols, j0 + kColumnPiece);
      double* sum = col_sq + matrix * cols;
      std::fill(sum + j0, sum + j1, 0.0);
      for (int64_t block = 0; block < plan.blocks; ++block) {
        const double* part = partial + (matrix * plan.blocks + block) * cols;
        for (int64_t j = j0; j < j1; ++j) sum[j] += part[j];
      }
    });
  }
  double param_sq = 0.0;
  for (int64_t t = 0; t < tasks; ++t) param_sq += task_sq[t];
  // The factors: row_var.lerp_(norm(g, dim=-1)^2 / cols, w), col_var likewise over rows; the
  // update's denominator, row_var.mean(dim=-2).clamp_(min=eps1), per matrix.
  for (int64_t q = 0; q < batch * rows; ++q) {
    b.row_var[q] = lerp(b.row_var[q], mean_of_squares(row_sq[q], cols), s);
  }
  for (int64_t q = 0; q < batch * cols; ++q) {
    b.col_var[q] = lerp(b.col_var[q], mean_of_squares(col_sq[q], rows), s);
  }
  const float eps1 = static_cast<float>(c.eps1);
  thread_local std::vector<float> row_scale;
  row_scale.resize(batch);
  for (int64_t m = 0; m < batch; ++m) {
    double sum = 0.0;
    for (int64_t r = 0; r < rows; ++r) sum += b.row_var[m * rows + r];
    const float mean = static_cast<float>(sum) / static_cast<float>(rows);
    row_scale[m] = mean < eps1 ? eps1 : mean;  // clamp_ keeps a NaN
  }
  b.row_scale = row_scale.data();
  // Pass 2: the update's sum of squares.
  run_tasks(tasks, numel, threads, [&](int64_t t) {
    int64_t row0, row1;
    task_rows(t, &row0, &row1);
    task_sq[t] = k.factor_norm(b, s, row0, row1);
  });
  double update_sq = 0.0;
  for (int64_t t = 0; t < tasks; ++t) update_sq += task_sq[t];
  s.neg_step = adafactor_step_size(param_sq, update_sq, c);
  // Pass 3: decay, the update, the copy-out.
  run_tasks(tasks, numel, threads, [&](int64_t t) {
    int64_t row0, row1;
    task_rows(t, &row0, &row1);
    k.factor_apply(b, s, row0, row1);
  });
}

void adafactor_vector(const Kernels& k, FactorBuffers b, FactorScalars s,
                      const AdafactorConstants& c, int64_t numel, int threads) {
  // Pass 1: variance.lerp_(g * g, w); the sums of squares of the param and the update, per
  // chunk, added in chunk order.
  const int64_t chunks = cpu_runtime::chunks_for(numel).count;
  double* const sums = scratch(2 * chunks);
  cpu_runtime::parallel_chunks(numel, threads, [&](int64_t chunk, int64_t begin, int64_t end) {
    k.vector_sums(b, s, begin, end, sums + 2 * chunk);
  });
  double param_sq = 0.0, update_sq = 0.0;
  for (int64_t i = 0; i < 2 * chunks; i += 2) {
    param_sq += sums[i];
    update_sq += sums[i + 1];
  }
  s.neg_step = adafactor_step_size(param_sq, update_sq, c);
  // Pass 2: decay, the update, the copy-out.
  cpu_runtime::parallel_chunks(numel, threads, [&](int64_t, int64_t begin, int64_t end) {
    k.vector_apply(b, s, begin, end);
  });
}

std::function<double()> adafactor_job(uintptr_t param, uintptr_t grad, int grad_dtype,
                                      uintptr_t row_var, uintptr_t col_var, uintptr_t variance,
                                      int64_t batch, int64_t rows, int64_t cols, uintptr_t out,
                                      int out_dtype, double step, double lr, double beta2_decay,
                                      double eps1, double eps2, double d, double weight_decay,
                                      double grad_scale, int threads) {
  FactorScalars s{};
  s.grad_scale = unscale_factor(grad_scale, &s.unscale);
  if (batch < 0 || rows < 0 || cols < 0 ||
      (rows > 0 && cols > 0 && batch > INT64_MAX / rows / cols)) {
    throw std::invalid_argument("batch, rows and cols must be >= 0 with a product that fits");
  }
  const int64_t numel = batch * rows * cols;
  cpu_runtime::check_common(numel, threads);
  const Dtype g = cpu_runtime::grad_dtype_from(grad_dtype);
  const Dtype o = cpu_runtime::out_dtype_from(out, out_dtype);
  const bool factored = row_var != 0 || col_var != 0;
  if (factored ? (!row_var || !col_var || variance) : (numel > 0 && !variance)) {
    throw std::invalid_argument("a factored param takes row_var and col_var (and no variance), "
                                "a vector param a variance (and no factors)");
  }
  if (numel > 0 && (!param || !grad)) throw std::invalid_argument("null buffer address with numel > 0");
  if (!(std::isfinite(step) && step >= 1)) {
    throw std::invalid_argument("step must be finite and >= 1, got " + std::to_string(step));
  }
  // As torch.optim.Adafactor computes them in Python (double), rounded where torch's ops round.
  lerp_weight(std::pow(step, beta2_decay), &s.lerp_weight, &s.lerp_from_end);  // one_minus_beta2_t
  s.eps1_sq = static_cast<float>(eps1 * eps1);
  s.decay = weight_decay != 0;
  s.decay_factor = static_cast<float>(1 - lr * weight_decay);
  const double inv_sqrt_step = 1 / std::pow(step, 0.5);
  const AdafactorConstants c{inv_sqrt_step < lr ? inv_sqrt_step : lr, eps1, eps2, d,
                             std::pow(static_cast<double>(numel), 0.5)};
  const FactorBuffers b{reinterpret_cast<float*>(param), reinterpret_cast<const void*>(grad),
                        reinterpret_cast<void*>(out), reinterpret_cast<float*>(row_var),
                        reinterpret_cast<float*>(col_var), reinterpret_cast<float*>(variance),
                        nullptr, factored ? rows : numel, factored ? cols : 1, g, o};
  if (numel == 0) return [] { return 0.0; };
  const Kernels& k = active_kernels();
  return [&k, b, s, c, batch, numel, factored, threads] {
    const auto start = std::chrono::steady_clock::now();
    if (factored) {
      adafactor_factored(k, b, s, c, batch, threads);
    } else {
      adafactor_vector(k, b, s, c, numel, threads);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
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

double muon_momentum(uintptr_t grad, int grad_dtype, uintptr_t momentum_buffer, int64_t numel,
                     uintptr_t out, double momentum, bool nesterov, double grad_scale,
                     int threads) {
  return muon_momentum_job(grad, grad_dtype, momentum_buffer, numel, out, momentum, nesterov,
                           grad_scale, threads)();
}

uint64_t muon_momentum_async(uintptr_t grad, int grad_dtype, uintptr_t momentum_buffer,
                             int64_t numel, uintptr_t out, double momentum, bool nesterov,
                             double grad_scale, int threads) {
  return KernelQueue::get().submit(muon_momentum_job(grad, grad_dtype, momentum_buffer, numel,
                                                     out, momentum, nesterov, grad_scale,
                                                     threads));
}

double muon_apply(uintptr_t param, uintptr_t ortho, int64_t numel, uintptr_t out, int out_dtype,
                  double lr, double weight_decay, double adjusted_lr, int threads) {
  return muon_apply_job(param, ortho, numel, out, out_dtype, lr, weight_decay, adjusted_lr,
                        threads)();
}

uint64_t muon_apply_async(uintptr_t param, uintptr_t ortho, int64_t numel, uintptr_t out,
                          int out_dtype, double lr, double weight_decay, double adjusted_lr,
                          int threads) {
  return KernelQueue::get().submit(muon_apply_job(param, ortho, numel, out, out_dtype, lr,
                                                  weight_decay, adjusted_lr, threads));
}

double adafactor_step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t row_var,
                      uintptr_t col_var, uintptr_t variance, int64_t batch, int64_t rows,
                      int64_t cols, uintptr_t out, int out_dtype, double step, double lr,
                      double beta2_decay, double eps1, double eps2, double d,
                      double weight_decay, double grad_scale, int threads) {
  return adafactor_job(param, grad, grad_dtype, row_var, col_var, variance, batch, rows, cols,
                       out, out_dtype, step, lr, beta2_decay, eps1, eps2, d, weight_decay,
                       grad_scale, threads)();
}

uint64_t adafactor_step_async(uintptr_t param, uintptr_t grad, int grad_dtype,
                              uintptr_t row_var, uintptr_t col_var, uintptr_t variance,
                              int64_t batch, int64_t rows, int64_t cols, uintptr_t out,
                              int out_dtype, double step, double lr, double beta2_decay,
                              double eps1, double eps2, double d, double weight_decay,
                              double grad_scale, int threads) {
  return KernelQueue::get().submit(adafactor_job(param, grad, grad_dtype, row_var, col_var,
                                                 variance, batch, rows, cols, out, out_dtype,
                                                 step, lr, beta2_decay, eps1, eps2, d,
                                                 weight_decay, grad_scale, threads));
}

}  // namespace
}  // namespace zero_offload::cpu_rules

namespace zero_offload {

void register_cpu_rules(py::module_& m) {
  using namespace cpu_rules;
  auto sub = m.def_submodule(
      "cpu_rules",
      "Fused CPU SGD (torch.optim.SGD), Lion, Adafactor (torch.optim.Adafactor) and Muon's host "
      "passes (torch.optim.Muon around Newton-Schulz) over flat fp32 params (grads "
      "fp32/bf16/fp16), with an optional bf16/fp16 copy-out. Buffers are integer addresses; "
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
  sub.def("muon_momentum", &muon_momentum, py::kw_only(), py::arg("grad"), py::arg("grad_dtype"),
          py::arg("momentum_buffer"), py::arg("numel"), py::arg("out"), py::arg("momentum"),
          py::arg("nesterov"), py::arg("grad_scale"), py::arg("threads"),
          py::call_guard<py::gil_scoped_release>(),
          "Muon's momentum pass over `numel` elements: momentum_buffer.lerp_(g, 1 - momentum) in "
          "place, the update (Nesterov: g.lerp(buf, momentum)) written to `out` as bf16. "
          "Returns the kernel's seconds.");
  sub.def("muon_momentum_async", &muon_momentum_async, py::kw_only(), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("momentum_buffer"), py::arg("numel"), py::arg("out"),
          py::arg("momentum"), py::arg("nesterov"), py::arg("grad_scale"), py::arg("threads"),
          "muon_momentum checked now and queued on the native kernel thread; returns a ticket.");
  sub.def("muon_apply", &muon_apply, py::kw_only(), py::arg("param"), py::arg("ortho"),
          py::arg("numel"), py::arg("out"), py::arg("out_dtype"), py::arg("lr"),
          py::arg("weight_decay"), py::arg("adjusted_lr"), py::arg("threads"),
          py::call_guard<py::gil_scoped_release>(),
          "Muon's apply pass: param *= 1 - lr * weight_decay; param -= adjusted_lr * ortho (bf16); "
          "optional low-precision copy-out. Returns the kernel's seconds.");
  sub.def("muon_apply_async", &muon_apply_async, py::kw_only(), py::arg("param"),
          py::arg("ortho"), py::arg("numel"), py::arg("out"), py::arg("out_dtype"), py::arg("lr"),
          py::arg("weight_decay"), py::arg("adjusted_lr"), py::arg("threads"),
          "muon_apply checked now and queued on the native kernel thread; returns a ticket.");
  sub.def("adafactor_step", &adafactor_step, py::kw_only(), py::arg("param"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("row_var"), py::arg("col_var"), py::arg("variance"),
          py::arg("batch"), py::arg("rows"), py::arg("cols"), py::arg("out"),
          py::arg("out_dtype"), py::arg("step"), py::arg("lr"), py::arg("beta2_decay"),
          py::arg("eps1"), py::arg("eps2"), py::arg("d"), py::arg("weight_decay"),
          py::arg("grad_scale"), py::arg("threads"), py::call_guard<py::gil_scoped_release>(),
          "One torch.optim.Adafactor step of one whole param (batch x rows x cols; factored "
          "with row_var/col_var, else with variance), in place; optional low-precision "
          "copy-out. Returns the kernel's seconds.");
  sub.def("adafactor_step_async", &adafactor_step_async, py::kw_only(), py::arg("param"),
          py::arg("grad"), py::arg("grad_dtype"), py::arg("row_var"), py::arg("col_var"),
          py::arg("variance"), py::arg("batch"), py::arg("rows"), py::arg("cols"),
          py::arg("out"), py::arg("out_dtype"), py::arg("step"), py::arg("lr"),
          py::arg("beta2_decay"), py::arg("eps1"), py::arg("eps2"), py::arg("d"),
          py::arg("weight_decay"), py::arg("grad_scale"), py::arg("threads"),
          "adafactor_step checked now and queued on the native kernel thread; returns a ticket.");
  sub.def("isa", [] { return std::string(active_kernels().name); },
          "The ISA path these kernels use (switched with cpu_adam.set_isa).");
}

}  // namespace zero_offload
