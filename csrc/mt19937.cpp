// torch's CPU random stream moved forward without drawing from it (submodule zero_offload._C.rng).
//
// torch's CPU generator is a 32-bit Mersenne Twister (MT19937, Matsumoto & Nishimura 1998) with
// the state of the original reference code: 624 words, `next` (the next word handed out) and
// `left` (draws until the block is regenerated, plus one). Each draw of normal_ / uniform_ on an
// fp32 tensor takes one word, so the state after n draws gives the values any slice of a fill
// would draw: zero_offload/ops/rng.py fills the slices of one tensor on several threads, each
// from its own generator placed where the serial fill would be at that slice.
//
// Moving n draws forward costs n/624 block regenerations ("twists") and no tempering, one pass
// over 2.5 KB that stays in L1: about a tenth of what drawing costs. Python checks the result
// against torch's own draws before it uses it (ops/rng.py, [Note: stream check]).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace py = pybind11;

namespace zero_offload::rng {
namespace {

constexpr int kN = 624;
constexpr int kM = 397;
constexpr uint32_t kMatrixA = 0x9908b0dfu;
constexpr uint32_t kUpper = 0x80000000u;
constexpr uint32_t kLower = 0x7fffffffu;

// One step of the recurrence: the upper bit of u and the lower 31 of v, shifted, and the
// twist matrix where v is odd (branch-free so the loops vectorise).
inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & kUpper) | (v & kLower)) >> 1) ^ ((0u - (v & 1u)) & kMatrixA);
}

// The next block of 624 words, in place (the reference code's next_state): the first N-M words
// read the old block ahead of them, the rest the new words N-M behind (a distance of 227, so
// both loops run 8 or 16 lanes wide).
void regenerate(uint32_t* __restrict s) {
  for (int i = 0; i < kN - kM; ++i) s[i] = s[i + kM] ^ twist(s[i], s[i + 1]);
  for (int i = kN - kM; i < kN - 1; ++i) s[i] = s[i + kM - kN] ^ twist(s[i], s[i + 1]);
  s[kN - 1] = s[kM - 1] ^ twist(s[kN - 1], s[0]);
}

// The state after `n` more draws. A draw with `left` == 1 regenerates the block first, then
// hands out word 0; otherwise it hands out word `next`. So `left` + `next` == 625 after the
// first draw (a freshly seeded state has left 1, next 0).
std::pair<int64_t, int64_t> advance(uintptr_t words, int64_t left, int64_t next, int64_t n) {
  if (words == 0) throw std::invalid_argument("rng.advance: the state words' address is null");
  if (n < 0) throw std::invalid_argument("rng.advance: n must be >= 0, got " + std::to_string(n));
  if (left < 1 || left > kN || next < 0 || next > kN) {
    throw std::invalid_argument("rng.advance: not an MT19937 position (left " + std::to_string(left) +
                                ", next " + std::to_string(next) + ")");
  }
  auto* s = reinterpret_cast<uint32_t*>(words);
  while (n >= left) {  // the draw that takes `left` to 0 regenerates and hands out word 0
    n -= left;
    regenerate(s);
    left = kN;
    next = 1;
  }
  return {left - n, next + n};
}

}  // namespace
}  // namespace zero_offload::rng

namespace zero_offload {

void register_rng(py::module_& m) {
  auto sub = m.def_submodule(
      "rng",
      "torch's CPU generator (MT19937) moved forward without drawing; zero_offload/ops/rng.py "
      "reads and writes the generator's state around it and checks it against torch.");
  sub.def("advance", &rng::advance, py::arg("words"), py::arg("left"), py::arg("next"), py::arg("n"),
          py::call_guard<py::gil_scoped_release>(),
          "Move the 624 uint32 state words at address `words` forward by `n` draws, in place; "
          "returns the new (left, next).");
}

}  // namespace zero_offload
