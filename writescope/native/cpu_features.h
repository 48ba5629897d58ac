// What this CPU and OS allow, for the native kernels (writescope/native/__init__.py): the paths,
// the CPU-flag checks and the AMX tile permission.
#pragma once
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

namespace wsnative {

// AMX_EMULATED: the AMX path with its tiles emulated in C++ (tests only: checks the AMX code's
// layouts on machines without AMX; it needs AVX512-BF16 for the rest of the path)
enum Isa : int64_t { PORTABLE = 0, AVX512BF16 = 1, AMX = 2, AMX_EMULATED = 3 };
static const char* isa_name(int64_t i) {
  return i == AMX_EMULATED ? "amx-emulated" : i == AMX ? "amx" : i == AVX512BF16 ? "avx512bf16" : "portable";
}

static uint64_t xcr0() {
  uint32_t a, d;
  __asm__ volatile("xgetbv" : "=a"(a), "=d"(d) : "c"(0));
  return (uint64_t(d) << 32) | a;
}

// AVX-512 F, DQ, BW, VL and BF16, with the OS saving the AVX-512 state (read once: CPUID can trap
// in a virtual machine)
static bool cpu_avx512bf16_uncached() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
  if (!(f && dq && bw && vl)) return false;
  unsigned a1, b1, c1, d1;
  if (!__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) || !((a1 >> 5) & 1)) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
  return (xcr0() & 0xE6) == 0xE6;
}
static bool cpu_avx512bf16() {
  static const bool ok = cpu_avx512bf16_uncached();
  return ok;
}

// AMX-BF16 and AMX-TILE flags, and the kernel's permission to use tile data (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, asked once per process; refused on Linux before 5.16: then
// no AMX path)
static bool cpu_amx() {
  static const bool ok = [] {
    if (!cpu_avx512bf16()) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return false;
    return (xcr0() & 0x60000) == 0x60000;
  }();
  return ok;
}

static int64_t best_isa() { return cpu_amx() ? AMX : cpu_avx512bf16() ? AVX512BF16 : PORTABLE; }

// The path asked for (-1: the best this CPU has), refused if the CPU lacks it (names `env`);
// lowered to AVX512-BF16 where the AMX path cannot take the inputs (`amx_ok`) and to the portable
// path where the data is not bf16
static int64_t choose_isa(int64_t req, bool bf16, bool amx_ok, const char* env) {
  int64_t isa = req < 0 ? best_isa() : req;
  TORCH_CHECK(isa >= 0 && isa <= AMX_EMULATED, "unknown CPU kernel path ", isa);
  const int64_t need = isa == AMX_EMULATED ? AVX512BF16 : isa;
  TORCH_CHECK(need <= best_isa(), "CPU kernel path '", isa_name(isa), "' was asked for (", env, ") but this CPU or OS offers at most '",
              isa_name(best_isa()), "'");
  if ((isa == AMX || isa == AMX_EMULATED) && !(bf16 && amx_ok)) isa = AVX512BF16;
  if (isa == AVX512BF16 && !bf16) isa = PORTABLE;
  return isa;
}

}  // namespace wsnative
