// A small persistent pool of std::threads for fork-join loops over flat buffers (Linux).
//
// Why not OpenMP: torch ships its own libgomp, and a second OpenMP runtime in the same process
// oversubscribes cores or crashes at exit. Why not a task queue: the kernels here are one
// memory-bound pass over a buffer; a fork-join "run fn(t) for t in [0, n) and wait" is all they
// need, and the calling thread takes part as t = 0, so a one-thread call never touches the pool.
//
// [Note: pool handshake]
// Start and finish are two futex words, no mutex on the hot path (a condition variable makes
// every woken worker re-take one mutex in turn, a convoy that costs tens of microseconds at 16
// threads). A call publishes fn_/participants_, then bumps `generation_` (release) and wakes all
// workers. Every worker acknowledges every generation, also those it sits out (index >=
// participants), by decrementing `pending_`; the caller returns only when `pending_` is 0. So no
// worker can still be reading a call's fn_ when the next call overwrites it, and no worker can
// miss or repeat a generation. The last worker to finish sets `done_` and wakes the caller.
// Workers and the caller spin briefly before sleeping on a futex: see [Note: short spin].
//
// [Note: short spin]
// A worker that finished a call watches for the next one for a few tens of microseconds before
// it sleeps. Back-to-back calls (an optimizer stepping param after param) then start on threads
// that are still running; waking a sleeping thread costs tens of microseconds on an idle machine
// and can cost milliseconds on a busy one. The spin is bounded, so an idle pool costs no CPU.
//
// [Note: pool and fork]
// A forked child has no copies of the parent's worker threads. `ParallelPool::get()` remembers
// the pid that created the pool and builds a fresh one in a child (the parent's pool object is
// leaked there on purpose: its state may have been mid-call at fork time, so it is never
// touched). The pool is also leaked at exit, so no static destructor joins threads while the
// interpreter tears down.
//
// [Note: concurrent callers]
// `run` serialises callers: two Python threads calling in with the GIL released take turns.
// Each call uses the pool whole, which is what a memory-bound pass wants anyway.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

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
    fn_ = &fn;
    participants_ = n;
    error_ = nullptr;
    pending_.store(workers_, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);  // [Note: pool handshake]
    futex_wake(&generation_, INT_MAX);
    std::exception_ptr own_error;
    try {
      fn(0);
    } catch (...) {
      own_error = std::current_exception();
    }
    for (int i = 0; i < kSpinIterations && done_.load(std::memory_order_acquire) == 0; ++i) pause();
    while (done_.load(std::memory_order_acquire) == 0) futex_wait(&done_, 0);
    fn_ = nullptr;
    std::exception_ptr error = own_error ? own_error : error_;
    if (error) std::rethrow_exception(error);
  }

  ParallelPool(const ParallelPool&) = delete;
  ParallelPool& operator=(const ParallelPool&) = delete;

 private:
  ParallelPool() = default;

  static void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
            nullptr, 0);
  }
  static void futex_wake(std::atomic<uint32_t>* word, int count) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, count, nullptr,
            nullptr, 0);
  }
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // Makes sure at least `workers` worker threads exist. Called with call_mu_ held, between calls
  // (every existing worker has acknowledged the last generation, so `seen` is current for all).
  void grow(int workers) {
    while (workers_ < workers) {
      const int index = workers_ + 1;  // the caller is index 0
      const uint32_t seen = generation_.load(std::memory_order_relaxed);
      std::thread([this, index, seen] { loop(index, seen); }).detach();  // [Note: pool and fork]
      workers_ = index;  // only once the thread exists: run() waits for workers_ acknowledgements
    }
  }

  void loop(int index, uint32_t seen) {
    for (;;) {
      uint32_t now = generation_.load(std::memory_order_acquire);
      for (int i = 0; i < kSpinIterations && now == seen; ++i) {  // [Note: short spin]
        pause();
        now = generation_.load(std::memory_order_acquire);
      }
      while (now == seen) {
        futex_wait(&generation_, seen);
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;  // exactly one generation ahead: the caller waits for every acknowledgement
      if (index < participants_) {
        try {
          (*fn_)(index);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mu_);
          if (!error_) error_ = std::current_exception();
        }
      }
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {  // the last one out
        done_.store(1, std::memory_order_release);
        futex_wake(&done_, 1);
      }
    }
  }

  static constexpr int kSpinIterations = 2000;  // ~20-150 us, depending on the CPU's pause

  std::mutex call_mu_;                     // held for the whole of one run()
  std::atomic<uint32_t> generation_{0};    // futex word: bumped once per call
  std::atomic<uint32_t> done_{0};          // futex word: 1 once every worker acknowledged
  std::atomic<int> pending_{0};            // workers yet to acknowledge this generation
  int workers_ = 0;                        // threads started (only grown under call_mu_)
  int participants_ = 0;                   // published before the generation bump
  const std::function<void(int)>* fn_ = nullptr;  // likewise
  std::mutex error_mu_;
  std::exception_ptr error_;               // first worker exception of this call
};

}  // namespace zero_offload
