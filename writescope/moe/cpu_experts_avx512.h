// AVX-512 pieces of the host-expert kernel (cpu_experts.cpp): SiLU, the bf16 pair packings and
// epilogues that the AMX path shares, and the AVX512-BF16 path's dot products.
//
// Layouts (bf16 as uint16_t; an expert's w13 [2I, D] rows of stride ldw, w2 [D, I] rows of ldw2):
//   xb  a group's tokens for AMX, [nb, D/32, 16, 32]: block b (tokens 16b .. 16b + 15), step k,
//       row r, word 2t + e = x[16b + t][32k + 2r + e] (AMX's B operand, the "VNNI" pair layout);
//       tokens past m are zero
//   hb  the group's h = silu(g) * u the same way over I: [nb, I/32, 16, 32]
//   h   the AVX512-BF16 path's h: [n, I] bf16, row-major (token rows as in x)
// A C tile (and the AVX path's small result blocks) is [16 features, 16 tokens] fp32.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "avx512_math.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace wsmoe::avx {

constexpr int64_t TC = 64;  // tokens per chunk of a unit (their partial results stay in L1)

using namespace wsnative;  // mask16, mask32, exp512

// silu(g) * u in fp32: g / (1 + e^-g) * u (NaN in, NaN out)
static inline __m512 swiglu16(__m512 g, __m512 u) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

// words 0-15 of cvtne2ps_pbh(b, a) are a's, 16-31 b's; this order makes dword t = (a[t], b[t])
alignas(64) static const uint16_t PAIR_ORDER[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// x [m rows of stride ldx] bf16 -> xb [nb, K/32, 16, 32] (K % 32 == 0): a 16 x 16 transpose of
// dwords per (block, step); tokens past m zero
static void pack_tokens(const uint16_t* x, int64_t ldx, int64_t m, int64_t K, uint16_t* xb) {
  const int64_t nb = (m + 15) / 16, ks = K / 32;
  std::memset(xb, 0, sizeof(uint16_t) * nb * ks * 512);
  for (int64_t t = 0; t < m; ++t) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(x + t * ldx);
    uint32_t* dst = reinterpret_cast<uint32_t*>(xb + (t / 16) * ks * 512) + (t % 16);
    for (int64_t k = 0; k < ks; ++k)
      for (int r = 0; r < 16; ++r) dst[(k * 16 + r) * 16] = row[k * 16 + r];
  }
}

// C tiles g, u [16 features, 16 tokens] -> 8 rows of hb (dst, 32 words apart): row j holds the
// pairs (h[2j][t], h[2j + 1][t]), h rounded to bf16 (nearest even)
static void swiglu_pairs(const float* g, const float* u, uint16_t* dst) {
  const __m512i idx = _mm512_load_si512(PAIR_ORDER);
  for (int j = 0; j < 8; ++j) {
    const __m512 h0 = swiglu16(_mm512_loadu_ps(g + 32 * j), _mm512_loadu_ps(u + 32 * j));
    const __m512 h1 = swiglu16(_mm512_loadu_ps(g + 32 * j + 16), _mm512_loadu_ps(u + 32 * j + 16));
    const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(h1, h0);
    _mm512_storeu_si512(dst + 32 * j, _mm512_permutexvar_epi16(idx, w));
  }
}

// C tiles c0, c1 [16 features, 16 tokens] (features d0 .. d0 + 15 and d0 + 16 .. d0 + 31) ->
// y rows of nt tokens (row t at y + t ldy, from d0), times the routing weight rw[t], in bf16
static void store_y(const float* c0, const float* c1, int64_t nt, const float* rw, uint16_t* y, int64_t ldy) {
  const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  for (int64_t t = 0; t < nt; ++t) {
    const __m512 w = _mm512_set1_ps(rw[t]);
    const __m512 a = _mm512_mul_ps(w, _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)t)), c0, 4));
    const __m512 b = _mm512_mul_ps(w, _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)t)), c1, 4));
    _mm512_storeu_si512(y + t * ldy, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

// ---------------------------------------------------------------- the AVX512-BF16 path
// out[j * ldo + i] = w[i] . x[j] over K bf16 (pairs along K, fp32 lanes, reduced at the end),
// for R rows x TB tokens, R * TB == 16 accumulators. The accumulators are named variables: GCC
// keeps an array of them in memory inside the loop (a store per product). Accumulator q is row
// q / TB, token q % TB; its repeated loads of one row or token are the same load (CSE).
#define WSX_Q16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
template <int R, int TB>
static inline void dots(const uint16_t* const* w, const uint16_t* const* x, int64_t K, float* out, int64_t ldo) {
  static_assert(R * TB == 16, "16 accumulators");
#define WSX_ZERO(q) __m512 a##q = _mm512_setzero_ps();
  WSX_Q16(WSX_ZERO)
  for (int64_t c = 0; c < K; c += 32) {
    const __mmask32 mk = mask32(K - c);
#define WSX_STEP(q) a##q = _mm512_dpbf16_ps(a##q, (__m512bh)_mm512_maskz_loadu_epi16(mk, w[(q) / TB] + c), (__m512bh)_mm512_maskz_loadu_epi16(mk, x[(q) % TB] + c));
    WSX_Q16(WSX_STEP)
  }
  const __m512 v[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
  alignas(64) float r[16];
  _mm512_store_ps(r, reduce16(v));
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < TB; ++j) out[j * ldo + i] = r[i * TB + j];
}
#undef WSX_ZERO
#undef WSX_STEP

// out[t * ldo + i] for rows i < 16 from W (rows past nr repeat the last one, their results unused)
// and tokens t < m of X (rows of stride ldx; the last block repeats the last token), in blocks of
// R rows: each row block is read from memory once, then from L1 for every token block
template <int R>
static void row_blocks(const uint16_t* W, int64_t ldw, int64_t nr, int64_t rows, const uint16_t* X, int64_t ldx, int64_t m, int64_t K, float* out, int64_t ldo) {
  constexpr int TB = 16 / R;
  const uint16_t* w[R];
  const uint16_t* x[TB];
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    for (int i = 0; i < R; ++i) w[i] = W + std::min<int64_t>(r0 + i, nr - 1) * ldw;
    for (int64_t t0 = 0; t0 < m; t0 += TB) {
      for (int j = 0; j < TB; ++j) x[j] = X + std::min<int64_t>(t0 + j, m - 1) * ldx;
      dots<R, TB>(w, x, K, out + t0 * ldo + r0, ldo);
    }
  }
}

// one token count's blocking: 16 rows x 1 token (decode), 8 x 2, or 4 x 4
static void products(const uint16_t* W, int64_t ldw, int64_t nr, int64_t rows, const uint16_t* X, int64_t ldx, int64_t m, int64_t K, float* out, int64_t ldo) {
  if (m == 1) row_blocks<16>(W, ldw, nr, rows, X, ldx, m, K, out, ldo);
  else if (m < 4) row_blocks<8>(W, ldw, nr, rows, X, ldx, m, K, out, ldo);
  else row_blocks<4>(W, ldw, nr, rows, X, ldx, m, K, out, ldo);
}

// phase 1 unit: features f0 .. f0 + 15 (< I) of one expert for its m tokens (x rows of stride ldx)
// -> h rows (stride ldh) in bf16. g, u: scratch of (TC + 4) x 16 fp32 each.
static void gate_up_unit(const uint16_t* W13, int64_t ldw, int64_t D, int64_t I, int64_t f0, const uint16_t* x, int64_t ldx, int64_t m,
                         uint16_t* h, int64_t ldh, float* g, float* u) {
  const int64_t nr = std::min<int64_t>(16, I - f0);
  const __mmask16 mk = mask16(nr);
  for (int64_t t0 = 0; t0 < m; t0 += TC) {
    const int64_t tc = std::min(TC, m - t0);
    products(W13 + f0 * ldw, ldw, nr, 16, x + t0 * ldx, ldx, tc, D, g, 16);
    products(W13 + (I + f0) * ldw, ldw, nr, 16, x + t0 * ldx, ldx, tc, D, u, 16);
    for (int64_t t = 0; t < tc; ++t) {
      const __m512 hv = swiglu16(_mm512_loadu_ps(g + 16 * t), _mm512_loadu_ps(u + 16 * t));
      _mm256_mask_storeu_epi16(h + (t0 + t) * ldh + f0, mk, (__m256i)_mm512_cvtneps_pbh(hv));
    }
  }
}

// phase 2 unit: output features d0 .. d0 + 31 (< D) of one expert for its m tokens (h rows of stride
// ldh) -> y rows (stride ldy) in bf16, times the routing weights rw. o: scratch of (TC + 4) x 32 fp32.
static void down_unit(const uint16_t* W2, int64_t ldw, int64_t D, int64_t I, int64_t d0, const uint16_t* h, int64_t ldh, int64_t m,
                      const float* rw, uint16_t* y, int64_t ldy, float* o) {
  const int64_t nr = std::min<int64_t>(32, D - d0);
  for (int64_t t0 = 0; t0 < m; t0 += TC) {
    const int64_t tc = std::min(TC, m - t0);
    products(W2 + d0 * ldw, ldw, nr, 32, h + t0 * ldh, ldh, tc, I, o, 32);
    for (int64_t t = 0; t < tc; ++t) {
      const __m512 w = _mm512_set1_ps(rw[t0 + t]);
      const __m512 a = _mm512_mul_ps(w, _mm512_loadu_ps(o + 32 * t)), b = _mm512_mul_ps(w, _mm512_loadu_ps(o + 32 * t + 16));
      _mm512_mask_storeu_epi16(y + (t0 + t) * ldy + d0, mask32(nr), (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

}  // namespace wsmoe::avx

#pragma GCC pop_options
