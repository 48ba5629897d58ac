// AMX tiles for the native kernels, all of them 16 rows x 64 bytes (one configuration for a whole
// call): the hardware's configuration (wsnative::amx_hw) and, for tests, the same eight tiles
// emulated in C++ (wsnative::amx_emu), over which the kernels' AMX code is compiled a second time
// so that machines without AMX (CI) check its layouts.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace wsnative::amx_hw {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// once per thread before its first tile instruction of a call; release() after its last
static void configure() {
  TileConfig c;
  std::memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; }
  _tile_loadconfig(&c);
}
static void release() { _tile_release(); }

}  // namespace wsnative::amx_hw

#pragma GCC pop_options

namespace wsnative::amx_emu {

struct Tiles {
  alignas(64) uint8_t t[8][1024];
};
static Tiles& tiles() {
  static thread_local Tiles x;
  return x;
}
static inline float bf(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static void tz(int t) { std::memset(tiles().t[t], 0, 1024); }
static void tl(int t, const void* p, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(tiles().t[t] + 64 * r, static_cast<const char*>(p) + r * stride, 64);
}
static void ts(int t, void* p, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(static_cast<char*>(p) + r * stride, tiles().t[t] + 64 * r, 64);
}
// C [16, 16] fp32 += A [16, 32] bf16 . B [16, 16 pairs] bf16, as TDPBF16PS (with fp32 FMAs)
static void tdp(int c, int a, int b) {
  float* C = reinterpret_cast<float*>(tiles().t[c]);
  const uint16_t* A = reinterpret_cast<const uint16_t*>(tiles().t[a]);
  const uint16_t* B = reinterpret_cast<const uint16_t*>(tiles().t[b]);
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float acc = C[m * 16 + n];
      for (int k = 0; k < 16; ++k) acc = std::fma(bf(A[m * 32 + 2 * k]), bf(B[k * 32 + 2 * n]), std::fma(bf(A[m * 32 + 2 * k + 1]), bf(B[k * 32 + 2 * n + 1]), acc));
      C[m * 16 + n] = acc;
    }
}
static void configure() {}
static void release() {}

}  // namespace wsnative::amx_emu
