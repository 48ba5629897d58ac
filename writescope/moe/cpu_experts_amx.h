// AMX-BF16 path of the host-expert kernel (cpu_experts.cpp): the tile body
// (cpu_experts_amx_tiles.h) with real tiles in wsmoe::amx and emulated ones in wsmoe::amx_emu
// (tests only). Every tile is 16 rows x 64 bytes (one configuration per thread and call).
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "cpu_experts_avx512.h"

namespace wsmoe {
constexpr int64_t PF_STEPS = 4;  // prefetch distance of the A rows, in 64-byte steps (a hint; not tuned on AMX)
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace wsmoe::amx {

using namespace wsnative::amx_hw;  // configure, release

#define WSX_TZ(t) _tile_zero(t)
#define WSX_TL(t, p, s) _tile_loadd(t, p, s)
#define WSX_TS(t, p, s) _tile_stored(t, p, s)
#define WSX_TDP(c, a, b) _tile_dpbf16ps(c, a, b)
#include "cpu_experts_amx_tiles.h"
#undef WSX_TZ
#undef WSX_TL
#undef WSX_TS
#undef WSX_TDP

}  // namespace wsmoe::amx

#pragma GCC pop_options

// ---------------------------------------------------------------- emulated tiles (tests only)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace wsmoe::amx_emu {

using namespace wsnative::amx_emu;  // the emulated tiles: tz, tl, ts, tdp, configure, release

#define WSX_TZ(t) tz(t)
#define WSX_TL(t, p, s) tl(t, p, s)
#define WSX_TS(t, p, s) ts(t, p, s)
#define WSX_TDP(c, a, b) tdp(c, a, b)
#include "cpu_experts_amx_tiles.h"
#undef WSX_TZ
#undef WSX_TL
#undef WSX_TS
#undef WSX_TDP

}  // namespace wsmoe::amx_emu

#pragma GCC pop_options
