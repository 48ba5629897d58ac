// AMX-BF16 products of the CPU decode-attention kernel (cpu_kernel.cpp), for bf16 keys and values
// with dk % 32 == 0 and dv % 16 == 0. Every tile is 16 rows x 64 bytes (one configuration for the
// whole call): a C tile holds 16 x 16 fp32, an A tile 16 x 32 bf16, a B tile 16 rows of 16 bf16
// pairs. Layouts of s, pa and vb as in cpu_kernel_avx512.h.
//
// Scores as S^T = K Q^T: A = 16 keys x 32 columns read straight from the compute region (row
// stride krs), B = the head group's queries packed once per portion (bq [dk / 32, 16, 16, 2]: row r
// of step k holds, per head, columns 32k + 2r and 32k + 2r + 1), C = 16 keys x 16 heads, which
// is s's layout. Values as O = P V: A = pa (16 heads x 32 keys), B = vb (32 keys x 16 columns in
// pairs), C = 16 heads x 16 columns of oc.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "prefetch_pacer.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace ws::amx {

using namespace wsnative::amx_hw;  // configure, release

#define WS_TZ(t) _tile_zero(t)
#define WS_TL(t, p, s) _tile_loadd(t, p, s)
#define WS_TS(t, p, s) _tile_stored(t, p, s)
#define WS_TDP(c, a, b) _tile_dpbf16ps(c, a, b)
#include "cpu_kernel_amx_tiles.h"
#undef WS_TZ
#undef WS_TL
#undef WS_TS
#undef WS_TDP

}  // namespace ws::amx

#pragma GCC pop_options

// ---------------------------------------------------------------- emulated tiles (tests only)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace ws::amx_emu {

using namespace wsnative::amx_emu;  // the emulated tiles: tz, tl, ts, tdp, configure, release

#define WS_TZ(t) tz(t)
#define WS_TL(t, p, s) tl(t, p, s)
#define WS_TS(t, p, s) ts(t, p, s)
#define WS_TDP(c, a, b) tdp(c, a, b)
#include "cpu_kernel_amx_tiles.h"
#undef WS_TZ
#undef WS_TL
#undef WS_TS
#undef WS_TDP

}  // namespace ws::amx_emu

#pragma GCC pop_options
