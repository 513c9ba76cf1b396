// One native thread that runs CPU-Adam calls in submission order, so that the Python caller can
// queue the next chunk's update and do the last one's bookkeeping while a kernel runs.
//
// [Note: why a native queue]
// A Python worker that calls a GIL-releasing kernel must re-take the GIL when the kernel
// returns, and then run its own bookkeeping (store records, the copy of the updated params to
// the GPU) before it can start the next kernel. While the main thread is busy in Python
// (forward hooks), each re-take can wait up to the interpreter's switch interval, and the
// bookkeeping itself is ~0.5 ms a chunk: together ~10% of a step measured on the H100 host,
// all of it time in which the cores could have run the next update. With this queue the worker
// submits kernel N+1 before it waits for kernel N, so the native thread goes from one kernel to
// the next without the GIL, and the Python side's work overlaps the kernels.
//
// [Note: tickets]
// `submit` returns a ticket (1, 2, ...). `wait(ticket)` blocks until that job ran and returns
// its start time and result (the kernel's seconds) or rethrows its exception; each ticket is waited for once
// (its result is then dropped). Jobs run one at a time, each using the whole fork-join pool.
// The caller keeps the buffers alive until `wait` returns. A forked child gets a fresh queue
// (the parent's thread does not exist there), as ParallelPool does.
//
// [Note: native threads at exit]
// No native thread can end a process with std::terminate: the kernel thread and the pool's
// workers are detached and their objects leaked, so no std::thread is ever destroyed joinable
// and no static destructor waits for them; IoEngine (aio.h) joins its threads in its destructor,
// after they drained the queue. None of them ever takes the GIL, so a join from a thread that
// holds it (a pybind11 dealloc) cannot deadlock, and they may outlive Python finalization: they
// touch only leaked objects and buffers Python keeps alive until the job is waited for
// (KernelTicket waits in __del__ when dropped unwaited). The abort seen at exit came from the
// Python side: a daemon thread returning from a GIL-released call during finalization (see
// [Note: workers stop before the interpreter finalizes] in zero_offload/pipeline.py).
#pragma once

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <utility>

namespace zero_offload {

class KernelQueue {
 public:
  static KernelQueue& get() {
    static std::mutex mu;
    static KernelQueue* queue = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lock(mu);
    if (queue == nullptr || owner != getpid()) {
      queue = new KernelQueue();  // leaked on purpose: no thread joined at interpreter exit
      owner = getpid();
    }
    return *queue;
  }

  uint64_t submit(std::function<double()> job) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) {
      std::thread([this] { loop(); }).detach();
      started_ = true;
    }
    const uint64_t ticket = ++submitted_;
    jobs_.emplace_back(ticket, std::move(job));
    wake_.notify_one();
    return ticket;
  }

  // Blocks until `ticket` has run; returns (start, seconds) or rethrows its error. `start` is
  // the steady clock (CLOCK_MONOTONIC, Python's time.perf_counter) when the job began.
  std::pair<double, double> wait(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mu_);
    if (ticket == 0 || ticket > submitted_) {
      throw std::invalid_argument("unknown kernel ticket " + std::to_string(ticket));
    }
    done_.wait(lock, [&] { return results_.count(ticket) != 0; });
    Result r = std::move(results_[ticket]);
    results_.erase(ticket);
    lock.unlock();
    if (r.error) std::rethrow_exception(r.error);
    return {r.start, r.seconds};
  }

  // Whether `ticket` has run (its result is still waiting to be collected).
  bool ready(uint64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    return results_.count(ticket) != 0;
  }

  KernelQueue(const KernelQueue&) = delete;
  KernelQueue& operator=(const KernelQueue&) = delete;

 private:
  struct Result {
    double start = 0.0;
    double seconds = 0.0;
    std::exception_ptr error;
  };

  KernelQueue() = default;

  void loop() {
    for (;;) {
      std::pair<uint64_t, std::function<double()>> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      Result r;
      r.start = std::chrono::duration<double>(
                    std::chrono::steady_clock::now().time_since_epoch()).count();
      try {
        r.seconds = job.second();
      } catch (...) {
        r.error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        results_.emplace(job.first, std::move(r));
      }
      done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;  // jobs_ got a job
  std::condition_variable done_;  // results_ got a result
  std::deque<std::pair<uint64_t, std::function<double()>>> jobs_;
  std::unordered_map<uint64_t, Result> results_;
  uint64_t submitted_ = 0;
  bool started_ = false;
};

}  // namespace zero_offload
