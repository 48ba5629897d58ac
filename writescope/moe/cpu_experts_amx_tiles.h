// The tile code of the host-expert kernel's AMX path, included twice by cpu_experts_amx.h: in
// namespace wsmoe::amx with the tile instructions, and in wsmoe::amx_emu with tiles emulated in
// scalar C++ (a test-only path, so that the layouts below are checked on machines without AMX).
// WSX_TZ / WSX_TL / WSX_TS / WSX_TDP: zero, load (16 rows of 64 bytes at a byte stride), store,
// and C += A B in bf16 pairs. (No include guard: included once per namespace.)
//
// Y^T = W X^T with the weights as the A operand, read in place: an A tile is 16 rows of W x 32
// input columns (the matrix's own row stride), a B tile 32 inputs x 16 tokens in pairs (xb or hb,
// cpu_experts_avx512.h), a C tile 16 features x 16 tokens. Tiles: C 0-3, A 4-5, B 6-7; two token
// blocks at a time, so each weight tile is read from memory once for up to 32 tokens (for more,
// again from L2). Needs D % 32 == 0 and I % 32 == 0 (else the AVX512-BF16 path runs).

// lines of the A rows PF steps (of 64 bytes) ahead, a hint for the rows' 16 separate streams
static inline void prefetch_rows(const uint16_t* W, int64_t ldw, int64_t k, int64_t ks) {
  if (k + PF_STEPS < ks)
    for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(W + r * ldw + 32 * (k + PF_STEPS)), _MM_HINT_T0);
}

// c [4, 16, 16] = (16 rows of Wa, 16 rows of Wb) x (token block 0, 1), over ks steps of 32 of the
// rows' width: phase 1 with Wa, Wb = the gate and up rows of 16 features, phase 2 with two blocks of
// 16 output rows of w2
template <bool TWO>
static inline void pair_tiles(const uint16_t* Wa, const uint16_t* Wb, int64_t ldw, const uint16_t* xb, int64_t ks, float* c) {
  WSX_TZ(0);
  WSX_TZ(1);
  if constexpr (TWO) { WSX_TZ(2); WSX_TZ(3); }
  const int64_t stride = ldw * 2;
  for (int64_t k = 0; k < ks; ++k) {
    prefetch_rows(Wa, ldw, k, ks);
    prefetch_rows(Wb, ldw, k, ks);
    WSX_TL(4, Wa + 32 * k, stride);
    WSX_TL(5, Wb + 32 * k, stride);
    WSX_TL(6, xb + k * 512, 64);
    WSX_TDP(0, 4, 6);
    WSX_TDP(1, 5, 6);
    if constexpr (TWO) {
      WSX_TL(7, xb + (ks + k) * 512, 64);
      WSX_TDP(2, 4, 7);
      WSX_TDP(3, 5, 7);
    }
  }
  WSX_TS(0, c, 64);
  WSX_TS(1, c + 256, 64);
  if constexpr (TWO) { WSX_TS(2, c + 512, 64); WSX_TS(3, c + 768, 64); }
}

// phase 1 unit: features f0 .. f0 + 15 of one expert (w13 rows of stride ldw) for its nb token
// blocks (xb) -> their pairs in hb (ki = I / 32 steps per block). c: 1024 floats of scratch.
static void gate_up_unit(const uint16_t* W13, int64_t ldw, int64_t D, int64_t I, int64_t f0, const uint16_t* xb, int64_t nb, uint16_t* hb, float* c) {
  const int64_t ks = D / 32, ki = I / 32;
  const uint16_t* Wg = W13 + f0 * ldw;
  const uint16_t* Wu = W13 + (I + f0) * ldw;
  const int64_t at = (f0 / 32) * 512 + ((f0 % 32) / 2) * 32;  // hb row of feature f0 within a block
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    if (two) pair_tiles<true>(Wg, Wu, ldw, xb + b * ks * 512, ks, c);
    else pair_tiles<false>(Wg, Wu, ldw, xb + b * ks * 512, ks, c);
    avx::swiglu_pairs(c, c + 256, hb + b * ki * 512 + at);
    if (two) avx::swiglu_pairs(c + 512, c + 768, hb + (b + 1) * ki * 512 + at);
  }
}

// phase 2 unit: output features d0 .. d0 + 31 of one expert (w2 rows of stride ldw) for its m
// tokens (hb) -> y rows (stride ldy) in bf16, times the routing weights rw. c: 1024 floats.
static void down_unit(const uint16_t* W2, int64_t ldw, int64_t I, int64_t d0, const uint16_t* hb, int64_t m, const float* rw,
                      uint16_t* y, int64_t ldy, float* c) {
  const int64_t ki = I / 32, nb = (m + 15) / 16;
  const uint16_t* W = W2 + d0 * ldw;
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    if (two) pair_tiles<true>(W, W + 16 * ldw, ldw, hb + b * ki * 512, ki, c);
    else pair_tiles<false>(W, W + 16 * ldw, ldw, hb + b * ki * 512, ki, c);
    avx::store_y(c, c + 256, std::min<int64_t>(16, m - 16 * b), rw + 16 * b, y + 16 * b * ldy + d0, ldy);
    if (two) avx::store_y(c + 512, c + 768, std::min<int64_t>(16, m - 16 * (b + 1)), rw + 16 * (b + 1), y + 16 * (b + 1) * ldy + d0, ldy);
  }
}
