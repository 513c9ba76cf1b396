// What every CPU kernel family (CPU-Adam: cpu_adam.cpp; SGD and Lion: cpu_rules.cpp) shares
// at run time: which ISA path runs (one process-wide setting: the fastest the CPU supports,
// switched by set_isa), how a call's elements are split over the thread pool, and the checks of
// the integer arguments every entry point takes. Uses the standard library, so include it only
// from sources built with the baseline flags, never from an *_avx2.cpp / *_avx512.cpp ([Note: ISA
// isolation] in cpu_adam_kernel.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_adam.h"
#include "thread_pool.h"

namespace zero_offload::cpu_runtime {

using cpu_adam::Dtype;

// ---------------------------------------------------------------------------------------------
// ISA selection (cpu_runtime.cpp). Each kernel family maps the active path to its own table.

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Isa active_isa();                           // the path every kernel call takes now
const char* isa_name(Isa isa);              // "scalar" | "avx2" | "avx512"
Isa best_isa();                             // the fastest path this CPU supports (the default)
std::vector<std::string> supported_isas();  // the names of the paths this CPU can run
void set_isa(const std::string& name);      // std::invalid_argument if unknown or unsupported
int default_threads();                      // CPUs this process may run on

// ---------------------------------------------------------------------------------------------
// Threading: split [0, numel) into contiguous ranges taken by the pool's threads.

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

inline Chunks chunks_for(int64_t numel) {
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
// Checks shared by the entry points. Python has checked the tensors; these re-check what would
// otherwise be undefined behaviour (cheap integer tests) and raise ValueError.

inline void check_common(int64_t numel, int threads) {
  if (numel < 0) throw std::invalid_argument("numel must be >= 0, got " + std::to_string(numel));
  if (threads < 1) {
    throw std::invalid_argument("threads must be >= 1, got " + std::to_string(threads));
  }
}

inline Dtype grad_dtype_from(int code) {
  if (code < 0 || code > 2) {
    throw std::invalid_argument("grad dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16), got " +
                                std::to_string(code));
  }
  return static_cast<Dtype>(code);
}

// The optional low-precision copy-out: no buffer (out == 0, code -1), or bf16 (1) / fp16 (2).
inline Dtype out_dtype_from(uintptr_t out, int code) {
  if (code != -1 && code != 1 && code != 2) {
    throw std::invalid_argument("out dtype code must be -1 (none), 1 (bf16) or 2 (fp16), got " +
                                std::to_string(code));
  }
  if ((out == 0) != (code == -1)) {
    throw std::invalid_argument("out and out_dtype must be given together");
  }
  return static_cast<Dtype>(code);
}

}  // namespace zero_offload::cpu_runtime
