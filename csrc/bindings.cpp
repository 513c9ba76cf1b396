// The one extension module, zero_offload._C. Each native concept registers its own functions;
// nothing here but the list. No libtorch: buffers cross as (address, numel, dtype code).
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace zero_offload {
void register_cpu_adam(py::module_& m);  // csrc/cpu_adam.cpp
void register_cpu_rules(py::module_& m); // csrc/cpu_rules.cpp
void register_aio(py::module_& m);       // csrc/aio.cpp
void register_rng(py::module_& m);       // csrc/mt19937.cpp
}  // namespace zero_offload

PYBIND11_MODULE(_C, m) {
    m.doc() = "zero_offload native core: vectorised CPU-Adam, SGD and Lion, O_DIRECT async I/O, and "
              "torch's CPU random stream moved forward";
    zero_offload::register_cpu_adam(m);
    zero_offload::register_cpu_rules(m);
    zero_offload::register_aio(m);
    zero_offload::register_rng(m);
}
