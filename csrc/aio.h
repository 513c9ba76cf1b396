// Asynchronous file I/O engine: a pool of threads doing pread/pwrite (O_DIRECT when the caller
// opened the file so) on 4096-aligned buffers, offsets and sizes. No Python, no libtorch here:
// buffers are addresses, files are descriptors the caller owns and keeps open until every
// request on them has completed. The pybind11 front is register_aio() in aio.cpp.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pybind11 { class module_; }

namespace zero_offload {

constexpr int64_t kIoAlignment = 4096;  // O_DIRECT: address, offset and size are multiples

enum class IoOp { kRead, kWrite };

struct IoEngineConfig {
    int threads;         // I/O threads; each has one piece in flight at a time
    int64_t block_size;  // a request is split into pieces of this many bytes (multiple of 4096)
    int queue_depth;     // most pieces taken by threads at once, engine-wide
};

// What failed, for an OSError that names the file, offset and size.
struct IoError {
    int err = 0;           // errno; 0 = no error
    int64_t offset = 0;    // file offset of the failed piece (first failure wins)
    int64_t nbytes = 0;    // its size
    std::string message;   // human-readable, names the operation, file, offset and size
};

class IoEngine;

// One submitted transfer. Shared by the Python handle and the engine's queue.
// [Note: request lifetime] The engine holds a shared_ptr per queued piece; the caller's handle
// holds another. Memory at `addr` must stay valid until done() (Python keeps the tensor).
class IoRequest {
  public:
    IoRequest(IoOp op, int fd, std::string path, uintptr_t addr, int64_t nbytes, int64_t offset,
              int notify_fd);
    ~IoRequest();
    IoRequest(const IoRequest&) = delete;
    IoRequest& operator=(const IoRequest&) = delete;

    bool done() const;
    void wait() const;            // blocks until every piece has finished (call without the GIL)
    IoError error() const;        // valid once done()
    IoOp op() const { return op_; }
    int64_t nbytes() const { return nbytes_; }
    int64_t offset() const { return offset_; }
    const std::string& path() const { return path_; }

  private:
    friend class IoEngine;
    void record_error(int err, int64_t offset, int64_t nbytes, const std::string& what);

    const IoOp op_;
    const int fd_;
    const std::string path_;
    const uintptr_t addr_;
    const int64_t nbytes_;
    const int64_t offset_;
    IoEngine* engine_ = nullptr;  // set by IoEngine::submit; successors are queued there
    int notify_fd_;  // owned dup of the caller's eventfd, written once on completion; -1 if none

    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    int64_t pieces_left_ = 0;  // guarded by mu_
    bool done_ = false;        // guarded by mu_
    IoError error_;            // guarded by mu_
    // Requests submitted with `after = this`, queued when this one completes.
    std::vector<std::shared_ptr<IoRequest>> successors_;  // guarded by mu_
};

class IoEngine {
  public:
    explicit IoEngine(IoEngineConfig config);
    ~IoEngine();  // finishes every queued piece, then joins the threads
    IoEngine(const IoEngine&) = delete;
    IoEngine& operator=(const IoEngine&) = delete;

    // Queues `request` (split into block_size pieces). If `after` is given and not yet done, the
    // request starts only when `after` completes, and fails if `after` failed.
    void submit(const std::shared_ptr<IoRequest>& request, const std::shared_ptr<IoRequest>& after);
    const IoEngineConfig& config() const { return config_; }

  private:
    struct Piece {
        std::shared_ptr<IoRequest> request;
        int64_t begin;  // byte offset within the request
        int64_t size;
    };
    void enqueue(const std::shared_ptr<IoRequest>& request);
    void worker();
    void run_piece(const Piece& piece);
    void finish_piece(const std::shared_ptr<IoRequest>& request);

    const IoEngineConfig config_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Piece> queue_;  // guarded by mu_
    int in_flight_ = 0;        // pieces taken by threads, guarded by mu_ (<= queue_depth)
    bool stopping_ = false;    // guarded by mu_
    std::vector<std::thread> threads_;
};

void register_aio(pybind11::module_& m);

}  // namespace zero_offload
