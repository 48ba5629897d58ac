// Scratch buffers of the native kernels: 64-byte aligned, grown when a call needs more, kept for
// the next call (thread_local instances: no allocation, and no page faults, in a decode step).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdlib>

namespace wsnative {

template <typename E>
struct Buf {
  E* p = nullptr;
  size_t n = 0;
  E* get(size_t want) {
    if (want > n) {
      std::free(p);
      n = 0;  // a failed allocation below leaves an empty buffer, not a stale size over nullptr
      p = static_cast<E*>(std::aligned_alloc(64, (std::max<size_t>(want, 1) * sizeof(E) + 63) / 64 * 64));
      TORCH_CHECK(p != nullptr, "native CPU kernel: out of memory for ", want * sizeof(E), " bytes of scratch");
      n = want;
    }
    return p;
  }
  ~Buf() { std::free(p); }
};

}  // namespace wsnative
