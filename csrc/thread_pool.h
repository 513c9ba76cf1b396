// A small persistent pool of std::threads for fork-join loops over flat buffers.
//
// Why not OpenMP: torch ships its own libgomp, and a second OpenMP runtime in the same process
// oversubscribes cores or crashes at exit. Why not a task queue: the kernels here are one
// memory-bound pass over a buffer, split into `n` contiguous ranges; a fork-join "run fn(t) for
// t in [0, n) and wait" is all they need, and the calling thread takes part as t = 0, so a
// one-range call never touches the pool at all.
//
// [Note: pool and fork]
// A forked child has no copies of the parent's worker threads. `ParallelPool::get()` remembers
// the pid that created the pool and builds a fresh one in a child (the parent's pool object is
// leaked there on purpose: its mutexes may have been held at fork time, so it is never touched).
// The pool is also leaked at exit, so no static destructor joins threads while the interpreter
// tears down.
//
// [Note: concurrent callers]
// `run` serialises callers: two Python threads calling in with the GIL released take turns.
// Each call uses the pool whole, which is what a memory-bound pass wants anyway.
#pragma once

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zero_offload {

class ParallelPool {
 public:
  // The process-wide pool (see [Note: pool and fork]).
  static ParallelPool& get() {
    static std::mutex mu;
    static ParallelPool* pool = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lock(mu);
    if (pool == nullptr || owner != getpid()) {
      pool = new ParallelPool();  // leaked on purpose (see [Note: pool and fork])
      owner = getpid();
    }
    return *pool;
  }

  // Runs fn(t) for every t in [0, n): t = 0 on the calling thread, the rest on pool workers
  // (grown on demand). Returns when all are done; rethrows the first exception any of them threw.
  void run(int n, const std::function<void(int)>& fn) {
    if (n <= 1) {
      fn(0);
      return;
    }
    std::lock_guard<std::mutex> call_lock(call_mu_);  // [Note: concurrent callers]
    grow(n - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      participants_ = n;
      remaining_ = n - 1;
      error_ = nullptr;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_cv_.notify_all();
    std::exception_ptr own_error;
    try {
      fn(0);
    } catch (...) {
      own_error = std::current_exception();
    }
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return remaining_ == 0; });
    fn_ = nullptr;
    std::exception_ptr error = own_error ? own_error : error_;
    lock.unlock();
    if (error) std::rethrow_exception(error);
  }

  ParallelPool(const ParallelPool&) = delete;
  ParallelPool& operator=(const ParallelPool&) = delete;

 private:
  ParallelPool() = default;

  // Makes sure at least `workers` worker threads exist. Called with call_mu_ held.
  void grow(int workers) {
    while (static_cast<int>(threads_.size()) < workers) {
      const int index = static_cast<int>(threads_.size()) + 1;  // the caller is index 0
      uint64_t seen;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load(std::memory_order_relaxed);
      }
      threads_.emplace_back([this, index, seen] { loop(index, seen); });
      threads_.back().detach();  // lives as long as the process (see [Note: pool and fork])
    }
  }

  void loop(int index, uint64_t seen) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (generation_.load(std::memory_order_relaxed) == seen) {
        lock.unlock();
        spin_for_work(seen);
        lock.lock();
      }
      wake_cv_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
      seen = generation_.load(std::memory_order_relaxed);
      if (index >= participants_) continue;  // this call needs fewer threads than the pool has
      const std::function<void(int)>* fn = fn_;
      lock.unlock();
      std::exception_ptr error;
      try {
        (*fn)(index);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error && !error_) error_ = error;
      if (--remaining_ == 0) done_cv_.notify_one();
    }
  }

  // [Note: short spin before sleeping]
  // A worker that finished a call watches for the next one for a few tens of microseconds
  // before it blocks on the condition variable. Back-to-back calls (an optimizer stepping param
  // after param) then start on threads that are still running; waking a sleeping thread costs
  // tens of microseconds on an idle machine and can cost milliseconds on a busy one. The spin
  // is bounded, so an idle pool costs no CPU.
  void spin_for_work(uint64_t seen) const {
    for (int i = 0; i < kSpinIterations; ++i) {
      if (generation_.load(std::memory_order_acquire) != seen) return;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }
  static constexpr int kSpinIterations = 2000;  // ~20-80 us, depending on the CPU's pause

  std::mutex call_mu_;  // held for the whole of one run()
  std::mutex mu_;       // guards everything below
  std::condition_variable wake_cv_;  // workers wait here for a new generation
  std::condition_variable done_cv_;  // the caller waits here for remaining_ == 0
  std::atomic<uint64_t> generation_{0};  // written under mu_; read without it while spinning
  int participants_ = 0;
  int remaining_ = 0;
  const std::function<void(int)>* fn_ = nullptr;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
};

}  // namespace zero_offload
