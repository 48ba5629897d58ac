// The tile code of the AMX path, included twice by cpu_kernel_amx.h: in namespace ws::amx with the
// tile instructions, and in ws::amx_emu with tiles emulated in scalar C++ (a test-only path, so
// that the layouts below are checked on machines without AMX). WS_TZ / WS_TL / WS_TS / WS_TDP:
// zero, load (16 rows of 64 bytes at a byte stride), store, and C += A B in bf16 pairs.
// (No include guard: included once per namespace.)

// q [gn, dk] fp32 -> bq (bf16, rounded to nearest even; heads >= gn zero)
static void pack_q(const float* q, int64_t gn, int64_t dk, uint16_t* bq) {
  std::memset(bq, 0, sizeof(uint16_t) * dk * 16);
  for (int64_t g = 0; g < gn; ++g)
    for (int64_t c = 0; c < dk; c += 16) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(q + g * dk + c));  // 16 bf16 of columns c ..
      alignas(32) uint16_t w[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(w), h);
      for (int i = 0; i < 16; ++i) {
        const int64_t col = c + i, k = col / 32, r = (col % 32) / 2;
        bq[((k * 16 + r) * 16 + g) * 2 + (col & 1)] = w[i];
      }
    }
}

// S^T of NB blocks of 16 keys from K (rows of stride krs elements) into s. With `prefetch` (the
// QK_PREFETCH tuning), the lines of the next 64 keys are prefetched into L2 meanwhile (72 KB for
// the MLA latent: more than L1; a hint, so past the chunk's end it does nothing wrong), and, for
// values in rows of their own (V != nullptr), this block's value rows.
template <int NB>
static inline void qk_tiles(const uint16_t* K, int64_t krs, int64_t nks, const uint16_t* bq, float* s, const uint16_t* V, int64_t vrs, int64_t dv,
                            bool prefetch, Pacer& pf) {
  WS_TZ(0);
  if constexpr (NB > 1) WS_TZ(1);
  if constexpr (NB > 2) WS_TZ(2);
  if constexpr (NB > 3) WS_TZ(3);
  const int64_t stride = krs * 2;
  for (int64_t k = 0; k < nks; ++k) {
    WS_TL(6, bq + k * 512, 64);
    WS_TL(4, K + 32 * k, stride);
    WS_TDP(0, 4, 6);
    if constexpr (NB > 1) { WS_TL(5, K + 16 * krs + 32 * k, stride); WS_TDP(1, 5, 6); }
    if constexpr (NB > 2) { WS_TL(7, K + 32 * krs + 32 * k, stride); WS_TDP(2, 7, 6); }
    if constexpr (NB > 3) { WS_TL(4, K + 48 * krs + 32 * k, stride); WS_TDP(3, 4, 6); }
    pf.tick(NB);
    if (NB == 4 && prefetch) {
      for (int i = 0; i < 64; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(K) + ((64 + i) * krs + 32 * k) * 2), _MM_HINT_T1);
      if (V != nullptr)
        for (int64_t i = k; i < 64; i += nks)
          for (int64_t c = 0; c < dv; c += 32) _mm_prefetch(reinterpret_cast<const char*>(V + i * vrs + c), _MM_HINT_T1);
    }
  }
  WS_TS(0, s, 64);
  if constexpr (NB > 1) WS_TS(1, s + 256, 64);
  if constexpr (NB > 2) WS_TS(2, s + 512, 64);
  if constexpr (NB > 3) WS_TS(3, s + 768, 64);
}

// s [m, 16] = scores of the chunk's m keys; the last m % 16 rows go through kt ([16, dk], zero padded)
static void scores(const uint16_t* bq, const uint16_t* K, int64_t krs, int64_t m, int64_t dk, float* s, uint16_t* kt,
                   const uint16_t* V, int64_t vrs, int64_t dv, bool prefetch, Pacer& pf) {
  const int64_t nks = dk / 32;
  int64_t j = 0;
  for (; j + 64 <= m; j += 64) qk_tiles<4>(K + j * krs, krs, nks, bq, s + 16 * j, V == nullptr ? nullptr : V + j * vrs, vrs, dv, prefetch, pf);
  for (; j + 16 <= m; j += 16) qk_tiles<1>(K + j * krs, krs, nks, bq, s + 16 * j, nullptr, vrs, dv, false, pf);
  if (j < m) {
    std::memset(kt, 0, sizeof(uint16_t) * 16 * dk);
    for (int64_t i = 0; j + i < m; ++i) std::memcpy(kt + i * dk, K + (j + i) * krs, sizeof(uint16_t) * dk);
    qk_tiles<1>(kt, dk, nks, bq, s + 16 * j, nullptr, vrs, dv, false, pf);
  }
}

// oc[:, 16 c0 ... 16 (c0 + N)] = P V for N column tiles
template <int N>
static inline void pv_tiles(const uint16_t* pa, const uint16_t* vb, int64_t steps, int64_t nct, int64_t c0, float* oc, int64_t dv, Pacer& pf) {
  WS_TZ(0);
  if constexpr (N > 1) WS_TZ(1);
  if constexpr (N > 2) WS_TZ(2);
  if constexpr (N > 3) WS_TZ(3);
  for (int64_t k = 0; k < steps; ++k) {
    const uint16_t* b = vb + (k * nct + c0) * 512;
    WS_TL(4, pa + k * 512, 64);
    WS_TL(5, b, 64);
    WS_TDP(0, 4, 5);
    if constexpr (N > 1) { WS_TL(6, b + 512, 64); WS_TDP(1, 4, 6); }
    if constexpr (N > 2) { WS_TL(7, b + 1024, 64); WS_TDP(2, 4, 7); }
    if constexpr (N > 3) { WS_TL(5, b + 1536, 64); WS_TDP(3, 4, 5); }
    pf.tick(N);
  }
  const int64_t stride = dv * 4;
  WS_TS(0, oc + 16 * c0, stride);
  if constexpr (N > 1) WS_TS(1, oc + 16 * (c0 + 1), stride);
  if constexpr (N > 2) WS_TS(2, oc + 16 * (c0 + 2), stride);
  if constexpr (N > 3) WS_TS(3, oc + 16 * (c0 + 3), stride);
}

// oc [16, dv] = P V over the chunk's m keys
static void values(const uint16_t* pa, const uint16_t* vb, int64_t m, int64_t dv, float* oc, Pacer& pf) {
  const int64_t steps = (m + 31) / 32, nct = dv / 16;
  int64_t c0 = 0;
  for (; c0 + 4 <= nct; c0 += 4) pv_tiles<4>(pa, vb, steps, nct, c0, oc, dv, pf);
  switch (nct - c0) {
    case 3: pv_tiles<3>(pa, vb, steps, nct, c0, oc, dv, pf); break;
    case 2: pv_tiles<2>(pa, vb, steps, nct, c0, oc, dv, pf); break;
    case 1: pv_tiles<1>(pa, vb, steps, nct, c0, oc, dv, pf); break;
    default: break;
  }
}

// oc [16, dv] = P V over the chunk's m keys, reading V's rows where they lie (no re-packing): per 16
// keys, B = 16 rows x 32 columns of V, multiplied by the even and the odd spread p (pe, see
// pack_p_spread), which gives the group's even and odd output columns. oc's columns come out
// permuted within each group of 32: [the 16 even | the 16 odd] (the merge puts them back). The last
// m % 16 rows go through vt ([16, dv], zero padded). Needs dv % 32 == 0.
template <int NG>
static inline void pv_direct_tiles(const uint16_t* pe, const uint16_t* V, int64_t vrs, int64_t m, const uint16_t* vt, int64_t dv, int64_t c0,
                                   float* oc, Pacer& pf) {
  WS_TZ(0);
  WS_TZ(1);
  if constexpr (NG > 1) { WS_TZ(2); WS_TZ(3); }
  const int64_t steps = (m + 15) / 16;
  for (int64_t k = 0; k < steps; ++k) {
    const bool tail = 16 * (k + 1) > m;
    const uint16_t* B = tail ? vt : V + 16 * k * vrs;
    const int64_t stride = (tail ? dv : vrs) * 2;
    WS_TL(4, pe + k * 1024, 64);
    WS_TL(5, pe + k * 1024 + 512, 64);
    WS_TL(6, B + c0, stride);
    WS_TDP(0, 4, 6);
    WS_TDP(1, 5, 6);
    if constexpr (NG > 1) {
      WS_TL(7, B + c0 + 32, stride);
      WS_TDP(2, 4, 7);
      WS_TDP(3, 5, 7);
    }
    pf.tick(2 * NG);
  }
  const int64_t st = dv * 4;
  WS_TS(0, oc + c0, st);
  WS_TS(1, oc + c0 + 16, st);
  if constexpr (NG > 1) { WS_TS(2, oc + c0 + 32, st); WS_TS(3, oc + c0 + 48, st); }
}

static void values_direct(const uint16_t* pe, const uint16_t* V, int64_t vrs, int64_t m, int64_t dv, uint16_t* vt, float* oc, Pacer& pf) {
  if (m % 16) {
    const int64_t j = m / 16 * 16;
    std::memset(vt, 0, sizeof(uint16_t) * 16 * dv);
    for (int64_t i = 0; j + i < m; ++i) std::memcpy(vt + i * dv, V + (j + i) * vrs, sizeof(uint16_t) * dv);
  }
  int64_t c0 = 0;
  for (; c0 + 64 <= dv; c0 += 64) pv_direct_tiles<2>(pe, V, vrs, m, vt, dv, c0, oc, pf);
  if (c0 < dv) pv_direct_tiles<1>(pe, V, vrs, m, vt, dv, c0, oc, pf);
}

