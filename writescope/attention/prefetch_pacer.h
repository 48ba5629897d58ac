// Paced software prefetch for the AMX path of the CPU decode-attention kernel (cpu_kernel.cpp,
// the PACED tuning).
//
// Why: a chunk's keys are read from memory during its scores; the softmax and the values product
// then run from L2, and the memory sits idle meanwhile (benchmarks/results/cpu_attention_h200.md:
// leaving the values product out took MLA 16 x 32K from 55 to 76 GB/s). The pacer keeps reads in
// flight through the whole chunk instead: a cursor runs over the portion's rows one chunk (or two)
// ahead, and every AMX product step calls tick(n), which issues the lines that n products earn at
// this chunk's rate (the lines still to prefetch / the products the chunk has).
//
// Streams: one (K; MLA's values are K's rows), or two (K and V in rows of their own, taken in
// turn). A stream is the byte range of its rows end to end: where the row stride exceeds the row,
// the gaps are fetched too (a hint, so never wrong, only wasted bandwidth).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace ws {

struct Pacer {
  const char* cur[2] = {nullptr, nullptr};
  const char* end[2] = {nullptr, nullptr};
  int streams = 0, turn = 0;
  bool l1 = false;          // prefetch into L1 (T0) rather than L2 (T1)
  int64_t credit = 0, rate = 0;  // in 1/256 of a line per product

  bool on() const { return streams > 0; }
  // Stream s covers [begin, end) (bytes); the cursor starts at begin.
  void add(const char* begin, const char* stop) {
    cur[streams] = begin;
    end[streams] = stop;
    ++streams;
  }
  // This chunk: every stream's cursor is to reach its own target (clamped to its end) over
  // `products` product steps. A cursor already past its target issues nothing for it.
  void plan(const char* const target[2], int64_t products) {
    int64_t lines = 0;
    for (int s = 0; s < streams; ++s) {
      const char* t = std::min(target[s], end[s]);
      if (t > cur[s]) lines += (t - cur[s] + 63) / 64;
      end_chunk[s] = t;
    }
    rate = products > 0 ? (lines * 256 + products - 1) / products : lines * 256;
    credit = products > 0 ? 0 : rate;  // no products: everything at once (issued by the next tick)
  }
  inline void tick(int64_t products) {
    if (streams == 0) return;
    credit += rate * products;
    while (credit >= 256) {
      int s = turn;
      if (streams == 2) {
        turn ^= 1;
        if (cur[s] >= end_chunk[s]) s ^= 1;
      }
      if (cur[s] >= end_chunk[s]) { credit = 0; return; }
      if (l1) _mm_prefetch(cur[s], _MM_HINT_T0);
      else _mm_prefetch(cur[s], _MM_HINT_T1);
      cur[s] += 64;
      credit -= 256;
    }
  }

 private:
  const char* end_chunk[2] = {nullptr, nullptr};
};

}  // namespace ws
