// AVX-512 pieces of the CPU decode-attention kernel (cpu_kernel.cpp): the softmax over a chunk,
// the bf16 packings that the AVX512-BF16 and AMX paths share, and the AVX512-BF16 products.
//
// Layouts (one chunk of m <= chunk keys, a head group of gn <= 16 query heads):
//   s   [m, 16] fp32      scores, one row of 16 heads per key (lanes >= gn unused), then p
//   pa  [steps, 16, 32]   p in bf16: step k holds keys 32k .. 32k + 31; row g = head g (AMX's A
//                         operand: 16 rows of 32 bf16); keys past m are zero
//   vb  [steps, nct, 16, 32]  V in bf16 pairs of keys: tile (k, c), row r, word i =
//                         (V[32k + 2r][16c + i], V[32k + 2r + 1][16c + i]) (AMX's B operand, the
//                         "VNNI" layout); keys past m and columns past dv are zero
//   qb  [16, dkp] bf16    the head group's queries (dkp = dk rounded up to 32, zero padded)
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "avx512_math.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace ws::avx {

using namespace wsnative;  // mask16, mask32, exp512

// One chunk's online-softmax step for the head group (lanes = heads): s <- p = e^(scale s - m'),
// where m' = max(m, the chunk's max); alpha = e^(m - m') rescales what came before; l <- l alpha +
// sum p; m <- m'. A NaN score leaves the max alone (max returns its second operand) and makes its
// p, and so l and the output, NaN. Where m' is -inf (every score so far -inf) p and alpha are 0.
static void softmax(float* s, int64_t m, int64_t gn, float scale, float* mrun, float* lrun, float* alpha) {
  const __mmask16 gm = mask16(gn);
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < m; ++j) {
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(gm, s + 16 * j), vs);
    _mm512_storeu_ps(s + 16 * j, x);
    mx = _mm512_max_ps(x, mx);
  }
  const __m512 mold = _mm512_loadu_ps(mrun);
  const __m512 mnew = _mm512_max_ps(mx, mold);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 sub = _mm512_mask_mov_ps(mnew, _mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
  const __m512 a = exp512(_mm512_sub_ps(mold, sub));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < m; ++j) {
    const __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * j), sub));
    _mm512_storeu_ps(s + 16 * j, p);
    sum = _mm512_add_ps(sum, p);
  }
  _mm512_storeu_ps(lrun, _mm512_fmadd_ps(_mm512_loadu_ps(lrun), a, sum));
  _mm512_storeu_ps(mrun, mnew);
  _mm512_storeu_ps(alpha, a);
}

// p [m, 16] fp32 -> pa [steps, 16, 32] bf16 (rounded to nearest even): two keys' rows converted
// together, their words interleaved per head, and each head's pair scattered to its row
static void pack_p(const float* s, int64_t m, uint16_t* pa) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(order);
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(64));
  const int64_t steps = (m + 31) / 32;
  for (int64_t k = 0; k < steps; ++k)
    for (int r = 0; r < 16; ++r) {
      const int64_t j = 32 * k + 2 * r;
      const __m512 a = j < m ? _mm512_loadu_ps(s + 16 * j) : _mm512_setzero_ps();
      const __m512 b = j + 1 < m ? _mm512_loadu_ps(s + 16 * (j + 1)) : _mm512_setzero_ps();
      const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // words 0-15: a's heads, 16-31: b's
      const __m512i y = _mm512_permutexvar_epi16(idx, x);     // dword g: (a[g], b[g])
      _mm512_i32scatter_epi32(reinterpret_cast<char*>(pa + k * 512) + 4 * r, rows, y, 1);
    }
}

// V [m rows, stride vrs] bf16 -> vb [steps, nct, 16, 32]: rows 2r and 2r + 1 interleaved word by word
static void pack_v(const uint16_t* V, int64_t vrs, int64_t m, int64_t dv, uint16_t* vb) {
  alignas(64) static const uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                              24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
  const int64_t steps = (m + 31) / 32, nct = (dv + 15) / 16;
  for (int64_t k = 0; k < steps; ++k)
    for (int r = 0; r < 16; ++r) {
      const int64_t j = 32 * k + 2 * r;
      const uint16_t* ra = j < m ? V + j * vrs : nullptr;
      const uint16_t* rb = j + 1 < m ? V + (j + 1) * vrs : nullptr;
      for (int64_t c0 = 0; c0 < dv; c0 += 32) {
        const __mmask32 mk = mask32(dv - c0);
        const __m512i za = ra ? _mm512_maskz_loadu_epi16(mk, ra + c0) : _mm512_setzero_si512();
        const __m512i zb = rb ? _mm512_maskz_loadu_epi16(mk, rb + c0) : _mm512_setzero_si512();
        const int64_t ct = c0 / 16;
        _mm512_storeu_si512(vb + ((k * nct + ct) * 16 + r) * 32, _mm512_permutex2var_epi16(za, ilo, zb));
        if (ct + 1 < nct) _mm512_storeu_si512(vb + ((k * nct + ct + 1) * 16 + r) * 32, _mm512_permutex2var_epi16(za, ihi, zb));
      }
    }
}

// t[i] = column i of the 16 x 16 dword matrix whose rows are r[0..15] (in place: 64 shuffles)
static inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], 128-bit lane L: rows 4i .. 4i + 3 at column 4L + k
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88), d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xDD);
    t[k] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[8 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// p [m, 16] fp32 -> pe [steps16, 2, 16, 32] bf16 for the values product that reads V rows as they
// lie (cpu_kernel_amx_tiles.h, values_direct): per 16 keys two A tiles, row h = head h, word 2r =
// p of key r in the even tile and word 2r + 1 in the odd one, the other words zero
static void pack_p_spread(const float* s, int64_t m, uint16_t* pe) {
  const int64_t steps = (m + 15) / 16;
  __m512i r[16];
  for (int64_t k = 0; k < steps; ++k) {
    for (int j = 0; j < 16; ++j) {
      const int64_t key = 16 * k + j;
      r[j] = key < m ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + 16 * key))) : _mm512_setzero_si512();
    }
    transpose16(r);  // r[h]: dword j = p of key j for head h (low half)
    for (int h = 0; h < 16; ++h) {
      _mm512_storeu_si512(pe + k * 1024 + h * 32, r[h]);
      _mm512_storeu_si512(pe + k * 1024 + 512 + h * 32, _mm512_slli_epi32(r[h], 16));
    }
  }
}

// Every byte of columns [c0, c1) of m rows (row stride rs elements) loaded once, in address order,
// XOR-folded into the return value (the caller keeps it so the loads stay): the rows come into
// L1/L2 by a linear read that the hardware prefetcher follows, before the tile loads, which walk
// the rows 16 at a time across their columns, read them
static uint64_t touch(const uint16_t* X, int64_t rs, int64_t m, int64_t c0, int64_t c1) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t j = 0; j < m; ++j)
    for (int64_t c = c0; c < c1; c += 32) acc = _mm512_xor_si512(acc, _mm512_maskz_loadu_epi16(mask32(c1 - c), X + j * rs + c));
  return (uint64_t)_mm512_reduce_or_epi64(acc);
}

// ---------------------------------------------------------------- AVX512-BF16 products
// scores of GB heads (from g0) x JB keys (from j), GB * JB = 16 accumulators (or JB = 1): each
// 32 columns one dot product of bf16 pairs per accumulator, reduced across lanes at the end
template <int GB, int JB>
static inline void qk_block(const uint16_t* qb, int64_t dkp, int64_t dk, const uint16_t* K, int64_t krs, int64_t j, int64_t g0, float* s) {
  __m512 acc[GB * JB];
  for (int i = 0; i < GB * JB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < dk; c += 32) {
    const __mmask32 mk = mask32(dk - c);
    __m512i kv[JB];
    for (int jb = 0; jb < JB; ++jb) kv[jb] = _mm512_maskz_loadu_epi16(mk, K + (j + jb) * krs + c);
    for (int gb = 0; gb < GB; ++gb) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + (g0 + gb) * dkp + c);
      for (int jb = 0; jb < JB; ++jb) acc[gb * JB + jb] = _mm512_dpbf16_ps(acc[gb * JB + jb], qv, (__m512bh)kv[jb]);
    }
  }
  if constexpr (GB * JB == 16) {
    alignas(64) float r[16];
    _mm512_store_ps(r, reduce16(acc));
    for (int gb = 0; gb < GB; ++gb)
      for (int jb = 0; jb < JB; ++jb) s[(j + jb) * 16 + g0 + gb] = r[gb * JB + jb];
  } else {
    for (int gb = 0; gb < GB; ++gb)
      for (int jb = 0; jb < JB; ++jb) s[(j + jb) * 16 + g0 + gb] = _mm512_reduce_add_ps(acc[gb * JB + jb]);
  }
}

template <int GB>
static void qk_heads(const uint16_t* qb, int64_t dkp, int64_t dk, const uint16_t* K, int64_t krs, int64_t m, int64_t g0, float* s) {
  constexpr int JB = 16 / GB;
  int64_t j = 0;
  for (; j + JB <= m; j += JB) qk_block<GB, JB>(qb, dkp, dk, K, krs, j, g0, s);
  for (; j < m; ++j) qk_block<GB, 1>(qb, dkp, dk, K, krs, j, g0, s);
}

// s [m, 16] = the gn heads' scores (lanes >= gn zero), heads in blocks of 8, 4, 2, 1
static void scores(const uint16_t* qb, int64_t dkp, int64_t gn, const uint16_t* K, int64_t krs, int64_t m, int64_t dk, float* s) {
  if (gn < 16) std::memset(s, 0, sizeof(float) * 16 * m);
  int64_t g0 = 0;
  for (; g0 + 8 <= gn; g0 += 8) qk_heads<8>(qb, dkp, dk, K, krs, m, g0, s);
  if (g0 + 4 <= gn) { qk_heads<4>(qb, dkp, dk, K, krs, m, g0, s); g0 += 4; }
  if (g0 + 2 <= gn) { qk_heads<2>(qb, dkp, dk, K, krs, m, g0, s); g0 += 2; }
  if (g0 + 1 <= gn) qk_heads<1>(qb, dkp, dk, K, krs, m, g0, s);
}

// oc[g, 16 (c0 + cb) ...] = sum over the chunk's key pairs of (p pair of head g) . (v pair), for 4
// heads from g0 and CB column tiles from c0: 4 CB accumulators
template <int CB>
static void pv_block(const uint16_t* pa, const uint16_t* vb, int64_t steps, int64_t nct, int64_t g0, int64_t c0, int64_t dv, float* oc) {
  __m512 acc[4][CB];
  for (int g = 0; g < 4; ++g)
    for (int c = 0; c < CB; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < steps; ++k)
    for (int r = 0; r < 16; ++r) {
      __m512i b[CB];
      for (int c = 0; c < CB; ++c) b[c] = _mm512_loadu_si512(vb + ((k * nct + c0 + c) * 16 + r) * 32);
      for (int g = 0; g < 4; ++g) {
        int32_t w;
        std::memcpy(&w, pa + k * 512 + (g0 + g) * 32 + 2 * r, 4);
        const __m512bh wp = (__m512bh)_mm512_set1_epi32(w);
        for (int c = 0; c < CB; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], wp, (__m512bh)b[c]);
      }
    }
  for (int g = 0; g < 4; ++g)
    for (int c = 0; c < CB; ++c) _mm512_mask_storeu_ps(oc + (g0 + g) * dv + (c0 + c) * 16, mask16(dv - (c0 + c) * 16), acc[g][c]);
}

// oc [16, dv] (rows >= gn rounded up to 4 unused) = P V over the chunk
static void values(const uint16_t* pa, const uint16_t* vb, int64_t m, int64_t dv, int64_t gn, float* oc) {
  const int64_t steps = (m + 31) / 32, nct = (dv + 15) / 16;
  for (int64_t g0 = 0; g0 < gn; g0 += 4) {
    int64_t c0 = 0;
    for (; c0 + 4 <= nct; c0 += 4) pv_block<4>(pa, vb, steps, nct, g0, c0, dv, oc);
    switch (nct - c0) {
      case 3: pv_block<3>(pa, vb, steps, nct, g0, c0, dv, oc); break;
      case 2: pv_block<2>(pa, vb, steps, nct, g0, c0, dv, oc); break;
      case 1: pv_block<1>(pa, vb, steps, nct, g0, c0, dv, oc); break;
      default: break;
    }
  }
}

}  // namespace ws::avx

#pragma GCC pop_options
