// Asynchronous file I/O engine (see aio.h) and its pybind11 front, zero_offload._C.IoEngine.
//
// [Note: why threads and pread/pwrite] With O_DIRECT a pread/pwrite goes straight to the block
// device, so N threads give N requests in flight without the page cache. That needs no library
// (libaio/liburing are often missing where users build), survives file systems without kernel
// AIO, and measures at the disk's bandwidth (benchmarks/bench_io.py). Each request is cut into
// block_size pieces so one large transfer is spread over every thread.
#include "aio.h"

#include <pybind11/pybind11.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <stdexcept>
#include <system_error>
#include <unistd.h>

namespace py = pybind11;

namespace zero_offload {

namespace {

const char* op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

std::string describe(IoOp op, int64_t nbytes, int64_t offset, const std::string& path) {
    return std::string(op_name(op)) + " of " + std::to_string(nbytes) + " bytes at offset " +
           std::to_string(offset) + " of " + path;
}

void check_aligned(const char* what, int64_t value) {
    if (value % kIoAlignment != 0) {
        throw std::invalid_argument(std::string(what) + " = " + std::to_string(value) +
                                    " is not a multiple of 4096: O_DIRECT I/O needs 4096-aligned "
                                    "buffer addresses, file offsets and sizes");
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// IoRequest

IoRequest::IoRequest(IoOp op, int fd, std::string path, uintptr_t addr, int64_t nbytes,
                     int64_t offset, int notify_fd)
    : op_(op), fd_(fd), path_(std::move(path)), addr_(addr), nbytes_(nbytes), offset_(offset),
      notify_fd_(-1) {
    if (fd < 0) throw std::invalid_argument("fd must be an open file descriptor, got " + std::to_string(fd));
    if (nbytes <= 0) throw std::invalid_argument("nbytes must be > 0, got " + std::to_string(nbytes));
    if (offset < 0) throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
    if (addr == 0) throw std::invalid_argument("buffer address is null");
    check_aligned("buffer address", static_cast<int64_t>(addr));
    check_aligned("nbytes", nbytes);
    check_aligned("offset", offset);
    if (notify_fd >= 0) {
        notify_fd_ = ::dup(notify_fd);
        if (notify_fd_ < 0) {
            throw std::system_error(errno, std::generic_category(), "dup(notify_fd)");
        }
    }
}

IoRequest::~IoRequest() {
    if (notify_fd_ >= 0) ::close(notify_fd_);
}

bool IoRequest::done() const {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
}

void IoRequest::wait() const {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
}

IoError IoRequest::error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
}

void IoRequest::record_error(int err, int64_t offset, int64_t nbytes, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.err != 0) return;  // the first failure is the one reported
    error_.err = err;
    error_.offset = offset;
    error_.nbytes = nbytes;
    error_.message = what;
}

// ---------------------------------------------------------------------------------------------
// IoEngine

IoEngine::IoEngine(IoEngineConfig config) : config_(config) {
    if (config.threads < 1 || config.threads > 256) {
        throw std::invalid_argument("threads must be in 1..256, got " + std::to_string(config.threads));
    }
    if (config.block_size < kIoAlignment || config.block_size % kIoAlignment != 0) {
        throw std::invalid_argument("block_size must be a positive multiple of 4096, got " +
                                    std::to_string(config.block_size));
    }
    if (config.queue_depth < 1) {
        throw std::invalid_argument("queue_depth must be >= 1, got " + std::to_string(config.queue_depth));
    }
    threads_.reserve(config.threads);
    for (int i = 0; i < config.threads; ++i) threads_.emplace_back([this] { worker(); });
}

IoEngine::~IoEngine() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
}

void IoEngine::submit(const std::shared_ptr<IoRequest>& request, const std::shared_ptr<IoRequest>& after) {
    if (request->engine_ != nullptr && request->engine_ != this) {
        throw std::invalid_argument("this request was already submitted to another engine");
    }
    request->engine_ = this;
    if (after) {
        if (after->engine_ != this) {
            throw std::invalid_argument("`after` must be a request submitted to the same engine");
        }
        std::lock_guard<std::mutex> lock(after->mu_);
        if (!after->done_) {
            // [Note: ordering] queued by finish_piece() of `after`, so this request's pieces can
            // never run beside `after`'s (read-after-write on one slot sees the write).
            after->successors_.push_back(request);
            return;
        }
        if (after->error_.err != 0) {
            request->record_error(after->error_.err, request->offset_, request->nbytes_,
                                  describe(request->op_, request->nbytes_, request->offset_, request->path_) +
                                      " not started: an earlier request it was ordered after failed (" +
                                      after->error_.message + ")");
            {
                std::lock_guard<std::mutex> rlock(request->mu_);
                request->pieces_left_ = 1;
            }
            finish_piece(request);
            return;
        }
    }
    enqueue(request);
}

void IoEngine::enqueue(const std::shared_ptr<IoRequest>& request) {
    const int64_t n = (request->nbytes_ + config_.block_size - 1) / config_.block_size;
    {
        std::lock_guard<std::mutex> rlock(request->mu_);
        request->pieces_left_ = n;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        for (int64_t i = 0; i < n; ++i) {
            const int64_t begin = i * config_.block_size;
            queue_.push_back(Piece{request, begin, std::min(config_.block_size, request->nbytes_ - begin)});
        }
    }
    if (n == 1) cv_.notify_one(); else cv_.notify_all();
}

void IoEngine::worker() {
    for (;;) {
        Piece piece;
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [this] {
                return (!queue_.empty() && in_flight_ < config_.queue_depth) || (stopping_ && queue_.empty());
            });
            if (queue_.empty()) return;  // stopping, and nothing left to do
            piece = std::move(queue_.front());
            queue_.pop_front();
            ++in_flight_;
        }
        run_piece(piece);
        {
            std::lock_guard<std::mutex> lock(mu_);
            --in_flight_;
        }
        cv_.notify_one();
        finish_piece(piece.request);
    }
}

void IoEngine::run_piece(const Piece& piece) {
    IoRequest& r = *piece.request;
    {
        // a piece of a request that already failed is skipped: the caller gets the first error
        std::lock_guard<std::mutex> lock(r.mu_);
        if (r.error_.err != 0) return;
    }
    char* buf = reinterpret_cast<char*>(r.addr_) + piece.begin;
    const int64_t file_offset = r.offset_ + piece.begin;
    int64_t moved = 0;
    while (moved < piece.size) {
        const size_t want = static_cast<size_t>(piece.size - moved);
        const ssize_t got = r.op_ == IoOp::kRead ? ::pread(r.fd_, buf + moved, want, file_offset + moved)
                                                 : ::pwrite(r.fd_, buf + moved, want, file_offset + moved);
        if (got < 0) {
            if (errno == EINTR) continue;
            const int err = errno;
            r.record_error(err, file_offset + moved, piece.size - moved,
                           describe(r.op_, piece.size - moved, file_offset + moved, r.path_) +
                               " failed: " + std::strerror(err));
            return;
        }
        if (got == 0) {
            // pread at end of file, or a pwrite that made no progress: a short transfer
            r.record_error(EIO, file_offset + moved, piece.size - moved,
                           "short " + describe(r.op_, piece.size - moved, file_offset + moved, r.path_) +
                               (r.op_ == IoOp::kRead ? ": the file ends before offset + size"
                                                     : ": the device accepted no more bytes"));
            return;
        }
        moved += got;
    }
}

void IoEngine::finish_piece(const std::shared_ptr<IoRequest>& request) {
    std::vector<std::shared_ptr<IoRequest>> successors;
    IoError failed;
    {
        std::lock_guard<std::mutex> lock(request->mu_);
        if (--request->pieces_left_ > 0) return;
        request->done_ = true;
        successors.swap(request->successors_);
        failed = request->error_;
    }
    request->cv_.notify_all();
    if (request->notify_fd_ >= 0) {
        const uint64_t one = 1;  // eventfd increment (also fine for a pipe: 8 bytes)
        ssize_t ignored = ::write(request->notify_fd_, &one, sizeof(one));
        (void)ignored;  // a full pipe / closed reader only loses a wake-up the reader no longer wants
    }
    for (const auto& next : successors) {
        if (failed.err != 0) {
            // submit() sees `request` done and failed, and fails `next` the same way
            next->engine_->submit(next, request);
        } else {
            next->engine_->enqueue(next);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Python front. Python (zero_offload/swap_io.py) checks tensors and keeps them alive; this
// layer sees addresses only.

namespace {

[[noreturn]] void raise_os_error(const IoError& e, const std::string& path) {
    py::object exc = py::module_::import("builtins").attr("OSError")(e.err, e.message, path);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    throw py::error_already_set();
}

}  // namespace

void register_aio(py::module_& m) {
    py::enum_<IoOp>(m, "IoOp")
        .value("READ", IoOp::kRead)
        .value("WRITE", IoOp::kWrite);

    py::class_<IoRequest, std::shared_ptr<IoRequest>>(m, "IoRequest",
                                                      "One submitted transfer; wait() without the GIL.")
        .def("done", &IoRequest::done, "True once every piece has finished (successfully or not).")
        .def(
            "wait",
            [](const IoRequest& r) {
                {
                    py::gil_scoped_release release;
                    r.wait();
                }
                const IoError e = r.error();
                if (e.err != 0) raise_os_error(e, r.path());
            },
            "Block (GIL released) until done; raise OSError naming file, offset and size on failure.")
        .def_property_readonly("nbytes", &IoRequest::nbytes)
        .def_property_readonly("offset", &IoRequest::offset)
        .def_property_readonly("path", &IoRequest::path)
        .def_property_readonly("op", &IoRequest::op);

    py::class_<IoEngine>(m, "IoEngine", "Pool of I/O threads; see csrc/aio.h.")
        .def(py::init([](int threads, int64_t block_size, int queue_depth) {
                 return new IoEngine(IoEngineConfig{threads, block_size, queue_depth});
             }),
             py::kw_only(), py::arg("threads"), py::arg("block_size"), py::arg("queue_depth"))
        .def(
            "submit",
            [](IoEngine& engine, IoOp op, int fd, const std::string& path, uintptr_t addr, int64_t nbytes,
               int64_t offset, int notify_fd, std::shared_ptr<IoRequest> after) {
                auto request = std::make_shared<IoRequest>(op, fd, path, addr, nbytes, offset, notify_fd);
                engine.submit(request, after);
                return request;
            },
            py::kw_only(), py::arg("op"), py::arg("fd"), py::arg("path"), py::arg("addr"), py::arg("nbytes"),
            py::arg("offset"), py::arg("notify_fd") = -1, py::arg("after") = nullptr,
            "Queue a transfer of nbytes between memory at addr and fd at offset (all 4096-aligned).")
        .def_property_readonly("threads", [](const IoEngine& e) { return e.config().threads; })
        .def_property_readonly("block_size", [](const IoEngine& e) { return e.config().block_size; })
        .def_property_readonly("queue_depth", [](const IoEngine& e) { return e.config().queue_depth; });
}

}  // namespace zero_offload
