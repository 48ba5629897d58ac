// A plain read of given bytes, the achievable rate a kernel's reading is compared with
// (benchmarks/cpu_attention.py, benchmarks/cpu_experts.py): every byte read once by `threads`
// threads in equal ranges (64-byte loads, four independent accumulators where AVX-512 exists),
// XOR-folded into a checksum that is returned so the loads cannot be dropped.
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_features.h"

#pragma GCC push_options
#pragma GCC target("avx512f")

namespace wsnative {

static uint64_t fold_avx512(const char* p, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  alignas(64) uint64_t w[8];
  _mm512_store_si512(w, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  uint64_t x = w[0] ^ w[1] ^ w[2] ^ w[3] ^ w[4] ^ w[5] ^ w[6] ^ w[7];
  for (; i < n; ++i) x ^= uint64_t(uint8_t(p[i])) << (8 * (i % 8));
  return x;
}

}  // namespace wsnative

#pragma GCC pop_options

namespace wsnative {

static uint64_t fold_plain(const char* p, int64_t n) {
  uint64_t x = 0;
  for (int64_t i = 0; i < n; ++i) x ^= uint64_t(uint8_t(p[i])) << (8 * (i % 8));
  return x;
}

// base[i] .. base[i] + bytes[i]: the regions, read as one range cut into `threads` parts
static int64_t read_probe(const std::vector<const char*>& base, const std::vector<int64_t>& bytes, int64_t threads) {
  std::vector<int64_t> cum{0};
  for (int64_t b : bytes) cum.push_back(cum.back() + b);
  const int64_t total = cum.back(), T = std::max<int64_t>(1, threads);
  const bool wide = cpu_avx512bf16();
  uint64_t x = 0;
#pragma omp parallel num_threads(T) reduction(^ : x)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t a = total * t / n, e = total * (t + 1) / n;
    for (size_t i = 0; i < base.size(); ++i) {
      const int64_t lo = std::max(a, cum[i]), hi = std::min(e, cum[i + 1]);
      if (lo < hi) x ^= wide ? fold_avx512(base[i] + lo - cum[i], hi - lo) : fold_plain(base[i] + lo - cum[i], hi - lo);
    }
  }
  return int64_t(x);
}

}  // namespace wsnative
