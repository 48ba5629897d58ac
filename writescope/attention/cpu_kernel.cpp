// The CPU decode-attention kernel (writescope/attention/cpu_kernel.py builds and documents it).
//
// One call attends a whole decode batch over the compute region, in place. Work plan:
//   segment   (sequence, KV head, group of <= 16 of its query heads): n keys
//   key space the segments' keys end to end, W keys in all, cut into R ranges: one per thread (T
//             equal ranges), or with DYNAMIC_SPLIT up to 4 per thread, taken from a counter
//   portion   a range's part of one segment: attended in chunks of `chunk` keys with an online
//             softmax (running max m, sum l, unnormalised output acc), written to slot u + sg
//             (distinct for every (range u, segment sg) that meet: both run in key order)
//   merge     per segment, its portions' (acc, m, l) by log-sum-exp into (o, lse)
// Each chunk: scores s = K q (ISA), softmax (AVX-512 or scalar), p V (ISA), acc = alpha acc + p V.
#include <torch/extension.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <optional>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "read_probe.h"
#include "scratch.h"
#include "cpu_kernel_avx512.h"
#include "cpu_kernel_amx.h"

namespace ws {

using namespace wsnative;  // the paths (Isa), the CPU-flag checks
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// The path for these inputs: the requested one (-1: the best this CPU has), lowered where the
// inputs need it (AMX: bf16, dk % 32 == 0, dv % 16 == 0; AVX512-BF16: bf16)
static int64_t choose(int64_t req, bool bf16, int64_t dk, int64_t dv) {
  return choose_isa(req, bf16, dk % 32 == 0 && dv % 16 == 0, "WRITESCOPE_CPU_ISA");
}

// Tuning of the bf16 paths, for benchmarks/cpu_attention.py to compare in one run (set_tuning):
//   LINEAR_FIRST  each chunk is first read in address order (V packed, the rest of K touched), so the
//                 hardware prefetcher streams it, then the products run from L2
//   QK_PREFETCH   software prefetch (into L2) of the next 64 keys during the AMX scores
//   PV_DIRECT     AMX values product on V's rows where they lie (no re-packing into key pairs; two
//                 products per tile, even and odd columns; needs dv % 32 == 0)
//   PACED         (AMX) software prefetch spread over every product step of a chunk, one chunk ahead
//                 (prefetch_pacer.h), in place of QK_PREFETCH's bursts during the scores;
//                 PACED_L1: into L1 rather than L2; PACED_FAR: two chunks ahead
//   DYNAMIC_SPLIT the key space cut into up to SPLIT_PER_THREAD ranges per thread (of >= SPLIT_MIN_KEYS
//                 keys), which the threads take in order from an atomic counter as each finishes its
//                 last: a thread slowed by another on its core (the thread issuing the GPU work, a
//                 driver thread) then takes fewer ranges instead of holding up the whole call
//                 (without it: one equal range per thread)
// and, to time a chunk's stages by leaving one out (the results are then wrong; benchmarks only):
//   SKIP_SCORES, SKIP_SOFTMAX (softmax and the packing of p), SKIP_PACK_V, SKIP_VALUES.
// Default PACED | PV_DIRECT (12), with chunks of 128 keys (cpu_kernel.py, CHUNK): the fastest of the
// variants measured side by side on the H200 host (benchmarks/results/cpu_attention.md, run 5);
// with DYNAMIC_SPLIT (1036): as fast with the cores to itself and 25% faster (MLA 4 x 8K) with one
// process spinning beside it, on the 2-core development machine (cpu_attention.md; not yet timed
// on the H200 host).
// TEST_FAIL (tests only): every call fails inside the kernel, as a failed allocation would.
enum Tuning : int64_t { LINEAR_FIRST = 1, QK_PREFETCH = 2, PV_DIRECT = 4, PACED = 8, PACED_L1 = 16, PACED_FAR = 32, SKIP_SCORES = 64, SKIP_SOFTMAX = 128, SKIP_PACK_V = 256,
                        SKIP_VALUES = 512, DYNAMIC_SPLIT = 1024, TEST_FAIL = 1 << 20 };
constexpr int64_t SPLIT_PER_THREAD = 4, SPLIT_MIN_KEYS = 256;
static std::atomic<int64_t> g_tuning{PACED | PV_DIRECT | DYNAMIC_SPLIT};
static std::atomic<uint64_t> g_sink{0};

// ---------------------------------------------------------------- per-thread scratch
struct Scratch {
  Buf<float> s, oc;
  Buf<uint16_t> q, pa, vb, kt, vt;
};
static Scratch& scratch() {
  static thread_local Scratch w;
  return w;
}

// ---------------------------------------------------------------- the plan of one call
struct Plan {
  int64_t H, G, dk, dv, chunk, isa, tuning;
  float scale;
  bool bf16, permuted;  // permuted: acc's columns in PV_DIRECT's order (merge restores them)
  const float* q;  // [B, H, G, dk] fp32
  std::vector<const char*> k, v;
  std::vector<int64_t> khs, krs, vhs, vrs;  // per listed sequence, in elements
  std::vector<int64_t> seg_i, seg_b, seg_h, seg_g0, seg_gn, cum;  // cum: [S + 1]
  float *acc, *mpart, *lpart;  // slots [R + S, 16, dv], [R + S, 16], [R + S, 16] (R ranges, S segments)
  float *o, *lse;              // [B, H, G, dv], [B, H, G]
};

static inline float bf16_to_float(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline float load_f(const float* p, int64_t i) { return p[i]; }
static inline float load_f(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

// ---------------------------------------------------------------- the portable path (fp32 arithmetic)
template <typename T>
static void scores_portable(const float* q, int64_t gn, int64_t dk, const T* K, int64_t krs, int64_t m, float* s, float* row) {
  std::memset(s, 0, sizeof(float) * 16 * m);
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t c = 0; c < dk; ++c) row[c] = load_f(K + j * krs, c);
    for (int64_t g = 0; g < gn; ++g) {
      float d = 0.f;
      const float* qg = q + g * dk;
#pragma omp simd reduction(+ : d)
      for (int64_t c = 0; c < dk; ++c) d += qg[c] * row[c];
      s[16 * j + g] = d;
    }
  }
}
static void softmax_portable(float* s, int64_t m, int64_t gn, float scale, float* mrun, float* lrun, float* alpha) {
  for (int64_t g = 0; g < gn; ++g) {
    float mx = NEG_INF;
    for (int64_t j = 0; j < m; ++j) {
      const float x = s[16 * j + g] * scale;
      s[16 * j + g] = x;
      if (x > mx) mx = x;  // a NaN score is skipped here and makes its p NaN below
    }
    const float mnew = std::max(mrun[g], mx), sub = mnew == NEG_INF ? 0.f : mnew;
    float sum = 0.f;
    for (int64_t j = 0; j < m; ++j) {
      const float p = std::exp(s[16 * j + g] - sub);
      s[16 * j + g] = p;
      sum += p;
    }
    alpha[g] = std::exp(mrun[g] - sub);
    lrun[g] = lrun[g] * alpha[g] + sum;
    mrun[g] = mnew;
  }
}
template <typename T>
static void values_portable(const float* s, const T* V, int64_t vrs, int64_t m, int64_t dv, int64_t gn, float* oc, float* row) {
  std::memset(oc, 0, sizeof(float) * 16 * dv);
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t c = 0; c < dv; ++c) row[c] = load_f(V + j * vrs, c);
    for (int64_t g = 0; g < gn; ++g) {
      const float p = s[16 * j + g];
      float* og = oc + g * dv;
#pragma omp simd
      for (int64_t c = 0; c < dv; ++c) og[c] += p * row[c];
    }
  }
}

// ---------------------------------------------------------------- one portion
// keys [j0, j1) of segment sg into slot `slot`: acc [16, dv] (rows < gn), m, l
static void portion(const Plan& P, int64_t sg, int64_t j0, int64_t j1, int64_t slot, Scratch& w) {
  const int64_t i = P.seg_i[sg], b = P.seg_b[sg], h = P.seg_h[sg], g0 = P.seg_g0[sg], gn = P.seg_gn[sg];
  const int64_t dk = P.dk, dv = P.dv, CH = std::min(P.chunk, j1 - j0), es = P.bf16 ? 2 : 4;  // scratch for the chunks this portion has
  const int64_t dkp = (dk + 31) / 32 * 32, cap = (CH + 63) / 64 * 64;
  const float* q = P.q + ((b * P.H + h) * P.G + g0) * dk;
  float* acc = P.acc + slot * 16 * dv;
  float* mrun = P.mpart + slot * 16;
  float* lrun = P.lpart + slot * 16;
  alignas(64) float alpha[16];
  for (int g = 0; g < 16; ++g) alpha[g] = 1.f;  // (set by the softmax; only SKIP_SOFTMAX timings leave it so)
  for (int g = 0; g < 16; ++g) { mrun[g] = NEG_INF; lrun[g] = 0.f; }
  float* s = w.s.get(cap * 16);
  float* oc = w.oc.get(16 * dv + std::max(dk, dv));  // + one converted row for the portable path
  float* row = oc + 16 * dv;
  uint16_t* qb = w.q.get(16 * dkp);
  uint16_t* pa = w.pa.get(cap / 16 * 1024);  // [steps, 16, 32], or PV_DIRECT's [steps16, 2, 16, 32]
  uint16_t* vb = w.vb.get(cap / 32 * ((dv + 15) / 16) * 512);
  uint16_t* kt = w.kt.get(16 * dkp);
  uint16_t* vt = w.vt.get(16 * dv);
  if (P.isa == AMX) {
    amx::pack_q(q, gn, dk, qb);
  } else if (P.isa == AMX_EMULATED) {
    amx_emu::pack_q(q, gn, dk, qb);
  } else if (P.isa == AVX512BF16) {
    std::memset(qb, 0, sizeof(uint16_t) * 16 * dkp);
    for (int64_t g = 0; g < gn; ++g)
      for (int64_t c = 0; c < dk; ++c) qb[g * dkp + c] = c10::BFloat16(q[g * dk + c]).x;  // round to nearest even
  }
  const char* kbase = P.k[i] + h * P.khs[i] * es;
  const char* vbase = P.v[i] + h * P.vhs[i] * es;
  const bool own_v = !(P.v[i] == P.k[i] && P.vrs[i] == P.krs[i] && P.vhs[i] == P.khs[i]);  // MLA: V is K's first dv columns
  const int64_t tuning = P.tuning;
  uint64_t sink = 0;
  const bool amx_isa = P.isa == AMX || P.isa == AMX_EMULATED;
  const int64_t krow = P.krs[i] * es, vrow = P.vrs[i] * es, ahead = (tuning & PACED_FAR ? 2 : 1) * CH;
  Pacer pf;  // no streams unless PACED: every tick returns at once
  if (amx_isa && (tuning & PACED)) {
    pf.l1 = tuning & PACED_L1;
    pf.add(kbase + j0 * krow, kbase + j1 * krow);
    if (own_v) pf.add(vbase + j0 * vrow, vbase + j1 * vrow);
  }
  const bool burst = (tuning & QK_PREFETCH) && !pf.on();
  for (int64_t c0 = j0; c0 < j1; c0 += CH) {
    const int64_t m = std::min(CH, j1 - c0);
    const char* K = kbase + c0 * P.krs[i] * es;
    const char* V = vbase + c0 * P.vrs[i] * es;
    if (P.isa == PORTABLE) {
      if (P.bf16) scores_portable(q, gn, dk, reinterpret_cast<const uint16_t*>(K), P.krs[i], m, s, row);
      else scores_portable(q, gn, dk, reinterpret_cast<const float*>(K), P.krs[i], m, s, row);
      softmax_portable(s, m, gn, P.scale, mrun, lrun, alpha);
      if (P.bf16) values_portable(s, reinterpret_cast<const uint16_t*>(V), P.vrs[i], m, dv, gn, oc, row);
      else values_portable(s, reinterpret_cast<const float*>(V), P.vrs[i], m, dv, gn, oc, row);
    } else {
      const uint16_t* Kb = reinterpret_cast<const uint16_t*>(K);
      const uint16_t* Vb = reinterpret_cast<const uint16_t*>(V);
      const bool direct = P.permuted;
      const bool linear = tuning & LINEAR_FIRST;
      const uint16_t* Vpf = burst && own_v ? Vb : nullptr;
      if (pf.on()) {  // this chunk's products carry the lines up to `ahead` keys past its end
        const int64_t e = std::min(j1, c0 + m + ahead), blocks = (m + 15) / 16;
        const char* target[2] = {kbase + e * krow, vbase + e * vrow};
        const int64_t qk = blocks * (dk / 32), pv = direct ? blocks * (dv / 16) : (m + 31) / 32 * (dv / 16);
        pf.plan(target, qk + pv);
      }
      if (linear) {  // read the chunk once in address order: V into vb, then what of K the packing did not read
        if (!direct && !(tuning & SKIP_PACK_V)) avx::pack_v(Vb, P.vrs[i], m, dv, vb);
        sink ^= own_v || direct ? avx::touch(Kb, P.krs[i], m, 0, dk) : avx::touch(Kb, P.krs[i], m, dv, dk);
        if (own_v && direct) sink ^= avx::touch(Vb, P.vrs[i], m, 0, dv);
      }
      if (!(tuning & SKIP_SCORES)) {
        if (P.isa == AMX) amx::scores(qb, Kb, P.krs[i], m, dk, s, kt, Vpf, P.vrs[i], dv, burst, pf);
        else if (P.isa == AMX_EMULATED) amx_emu::scores(qb, Kb, P.krs[i], m, dk, s, kt, Vpf, P.vrs[i], dv, burst, pf);
        else avx::scores(qb, dkp, gn, Kb, P.krs[i], m, dk, s);
      }
      if (!(tuning & SKIP_SOFTMAX)) {
        avx::softmax(s, m, gn, P.scale, mrun, lrun, alpha);
        if (direct) avx::pack_p_spread(s, m, pa);
        else avx::pack_p(s, m, pa);
      }
      if (!linear && !direct && !(tuning & SKIP_PACK_V)) avx::pack_v(Vb, P.vrs[i], m, dv, vb);
      if (!(tuning & SKIP_VALUES)) {
        if (direct && P.isa == AMX) amx::values_direct(pa, Vb, P.vrs[i], m, dv, vt, oc, pf);
        else if (direct) amx_emu::values_direct(pa, Vb, P.vrs[i], m, dv, vt, oc, pf);
        else if (P.isa == AMX) amx::values(pa, vb, m, dv, oc, pf);
        else if (P.isa == AMX_EMULATED) amx_emu::values(pa, vb, m, dv, oc, pf);
        else avx::values(pa, vb, m, dv, gn, oc);
      }
    }
    for (int64_t g = 0; g < gn; ++g) {
      float* ag = acc + g * dv;
      const float* og = oc + g * dv;
      const float a = alpha[g];
      if (c0 == j0) std::memcpy(ag, og, sizeof(float) * dv);
      else {
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) ag[c] = ag[c] * a + og[c];
      }
    }
  }
  g_sink.fetch_xor(sink, std::memory_order_relaxed);  // the touched bytes' fold: the loads must happen
}

// segment sg's portions (slots u + sg for the ranges u that meet it) into (o, lse)
static void merge(const Plan& P, int64_t sg, const std::vector<int64_t>& starts) {
  const int64_t b = P.seg_b[sg], h = P.seg_h[sg], g0 = P.seg_g0[sg], gn = P.seg_gn[sg], dv = P.dv;
  float* o = P.o + ((b * P.H + h) * P.G + g0) * dv;
  float* lse = P.lse + (b * P.H + h) * P.G + g0;
  const int64_t a = P.cum[sg], e = P.cum[sg + 1];
  std::vector<int64_t> slots;
  if (e > a) {
    int64_t t = std::upper_bound(starts.begin(), starts.end(), a) - starts.begin() - 1;
    for (; t + 1 < (int64_t)starts.size() && starts[t] < e; ++t)
      if (starts[t + 1] > starts[t]) slots.push_back(t + sg);
  }
  for (int64_t g = 0; g < gn; ++g) {
    float M = NEG_INF;
    for (int64_t sl : slots) M = std::max(M, P.mpart[sl * 16 + g]);
    const float sub = M == NEG_INF ? 0.f : M;
    float L = 0.f;
    for (int64_t sl : slots) L += std::exp(P.mpart[sl * 16 + g] - sub) * P.lpart[sl * 16 + g];
    float* og = o + g * dv;
    if (L == 0.f) {  // no keys, or every score -inf: the empty partial
      std::fill(og, og + dv, 0.f);
      lse[g] = NEG_INF;
      continue;
    }
    std::fill(og, og + dv, 0.f);
    for (int64_t sl : slots) {
      const float wgt = std::exp(P.mpart[sl * 16 + g] - sub) / L;
      const float* ag = P.acc + (sl * 16 + g) * dv;
#pragma omp simd
      for (int64_t c = 0; c < dv; ++c) og[c] += wgt * ag[c];
    }
    if (P.permuted) {  // each group of 32 columns as [16 even | 16 odd] -> in order
      float tmp[32];
      for (int64_t c0 = 0; c0 < dv; c0 += 32) {
        std::memcpy(tmp, og + c0, sizeof(tmp));
        for (int n = 0; n < 16; ++n) { og[c0 + 2 * n] = tmp[n]; og[c0 + 2 * n + 1] = tmp[16 + n]; }
      }
    }
    lse[g] = sub + std::log(L);
  }
}

// the keys of range u (starts[u] .. starts[u + 1] - 1 of the key space), portions into slots u + sg
static void range_work(const Plan& P, int64_t u, const std::vector<int64_t>& starts, Scratch& w) {
  const int64_t a = starts[u], e = starts[u + 1], S = (int64_t)P.seg_b.size();
  if (a >= e) return;
  int64_t sg = std::upper_bound(P.cum.begin(), P.cum.end(), a) - P.cum.begin() - 1;
  for (; sg < S && P.cum[sg] < e; ++sg) {
    const int64_t j0 = std::max(a, P.cum[sg]) - P.cum[sg], j1 = std::min(e, P.cum[sg + 1]) - P.cum[sg];
    if (j0 < j1) portion(P, sg, j0, j1, u + sg, w);
  }
}

// one thread's share: range t (next == nullptr), or ranges taken from *next until none is left
// the AMX tile state of this thread, configured for the call and released however it ends
struct TileGuard {
  bool on;
  explicit TileGuard(bool amx) : on(amx) { if (on) amx::configure(); }
  ~TileGuard() { if (on) amx::release(); }
};

static void thread_work(const Plan& P, int64_t t, const std::vector<int64_t>& starts, std::atomic<int64_t>* next) {
  const int64_t R = (int64_t)starts.size() - 1;
  Scratch& w = scratch();
  TileGuard tiles(P.isa == AMX);
  if (next == nullptr) range_work(P, t, starts, w);
  else
    for (int64_t u = next->fetch_add(1, std::memory_order_relaxed); u < R; u = next->fetch_add(1, std::memory_order_relaxed))
      range_work(P, u, starts, w);
}

// caller-thread buffers for the slots and q, reused across calls (no page faults in a decode step)
static float* slot_buffer(size_t floats) {
  static thread_local Buf<float> b;
  return b.get(floats);
}
static float* q_buffer(size_t floats) {
  static thread_local Buf<float> b;
  return b.get(floats);
}

// One call's inputs as plain pointers (filled by describe(); the worker holds it with no tensors)
struct SeqDesc {
  const char* k;
  const char* v;
  int64_t n, khs, krs, vhs, vrs, row;  // strides in elements; row: the sequence's q row
};
struct Request {
  const void* q;  // [B, H, G, dk] contiguous, bf16 or fp32
  bool q_bf16, bf16;
  int64_t B, H, G, dk, dv, chunk, isa, threads;
  float scale;
  std::vector<SeqDesc> seqs;
  float *o, *lse;  // [B, H, G, dv], [B, H, G] contiguous fp32
};

// q [B, H, G, dk]; for the listed rows `rows[i]`, keys ks[i] [H, n_i, dk] and values vs[i] [H, n_i, dv]
// (unit last stride, any head and row strides); the outputs o, lse. Checks every shape and dtype.
static Request describe(const at::Tensor& q, const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs,
                        const std::vector<int64_t>& rows, int64_t chunk, double scale, int64_t isa, int64_t threads, const at::Tensor& o,
                        const at::Tensor& lse) {
  TORCH_CHECK(q.dim() == 4, "q must be [B, kv_heads, group, dk], got ", q.sizes());
  TORCH_CHECK(q.device().is_cpu() && o.device().is_cpu() && lse.device().is_cpu(), "q and the outputs must be in host memory");
  TORCH_CHECK(q.is_contiguous() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat), "q must be contiguous bf16 or fp32");
  TORCH_CHECK(ks.size() == vs.size() && ks.size() == rows.size(), "one (k, v) per listed row");
  TORCH_CHECK(chunk >= 1 && chunk <= (1 << 20), "chunk must be 1 to 2^20 keys, got ", chunk);
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), dk = q.size(3);
  const int64_t dv = vs.empty() ? (o.dim() == 4 ? o.size(3) : -1) : vs[0].size(2);
  TORCH_CHECK(o.is_contiguous() && o.scalar_type() == at::kFloat && o.sizes() == at::IntArrayRef({B, H, G, dv}),
              "out_o must be contiguous fp32 [B, H, G, dv] = [", B, ", ", H, ", ", G, ", ", dv, "], got ", o.sizes());
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.sizes() == at::IntArrayRef({B, H, G}),
              "out_lse must be contiguous fp32 [B, H, G] = [", B, ", ", H, ", ", G, "], got ", lse.sizes());
  Request r;
  r.q = q.data_ptr();
  r.q_bf16 = q.scalar_type() == at::kBFloat16;
  r.bf16 = !ks.empty() && ks[0].scalar_type() == at::kBFloat16;
  r.B = B; r.H = H; r.G = G; r.dk = dk; r.dv = dv; r.chunk = chunk; r.threads = std::max<int64_t>(1, threads); r.scale = (float)scale;
  r.isa = choose(isa, r.bf16, dk, dv);
  std::vector<char> seen(B, 0);
  for (size_t i = 0; i < ks.size(); ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < B, "row ", rows[i], " outside the batch of ", B);
    TORCH_CHECK(!seen[rows[i]], "row ", rows[i], " listed twice");
    seen[rows[i]] = 1;
    TORCH_CHECK(ks[i].device().is_cpu() && vs[i].device().is_cpu(), "keys and values must be in host memory (row ", rows[i], ")");
    TORCH_CHECK(ks[i].dim() == 3 && vs[i].dim() == 3 && ks[i].size(0) == H && vs[i].size(0) == H, "k, v must be [kv_heads, n, dim]");
    TORCH_CHECK(ks[i].size(2) == dk && vs[i].size(2) == dv && ks[i].size(1) == vs[i].size(1), "k width must equal q's, v widths equal");
    TORCH_CHECK(ks[i].scalar_type() == ks[0].scalar_type() && vs[i].scalar_type() == ks[0].scalar_type(), "one dtype for the batch");
    TORCH_CHECK(ks[i].scalar_type() == at::kBFloat16 || ks[i].scalar_type() == at::kFloat, "keys must be bf16 or fp32");
    TORCH_CHECK(ks[i].stride(2) == 1 && vs[i].stride(2) == 1, "rows must have unit stride");
    r.seqs.push_back({static_cast<const char*>(ks[i].data_ptr()), static_cast<const char*>(vs[i].data_ptr()), ks[i].size(1), ks[i].stride(0),
                      ks[i].stride(1), vs[i].stride(0), vs[i].stride(1), rows[i]});
  }
  r.o = o.data_ptr<float>();
  r.lse = lse.data_ptr<float>();
  return r;
}

// Runs one request on r.threads threads (OpenMP, the calling thread included). Returns the keys
// attended (sum over listed sequences of n). Throws std::runtime_error if a thread failed.
static int64_t run_request(const Request& r) {
  const int64_t B = r.B, H = r.H, G = r.G, dk = r.dk, dv = r.dv;
  Plan P;
  P.H = H; P.G = G; P.dk = dk; P.dv = dv; P.chunk = r.chunk; P.scale = r.scale; P.bf16 = r.bf16; P.isa = r.isa;
  P.tuning = g_tuning.load(std::memory_order_relaxed);
  if (P.tuning & TEST_FAIL) throw std::runtime_error("a failure asked for by the TEST_FAIL tuning");
  P.permuted = (P.isa == AMX || P.isa == AMX_EMULATED) && (P.tuning & PV_DIRECT) && dv % 32 == 0;
  if (r.q_bf16) {  // q in fp32 for the packings (exact)
    float* qf = q_buffer(B * H * G * dk);
    const uint16_t* qb = static_cast<const uint16_t*>(r.q);
    for (int64_t i = 0; i < B * H * G * dk; ++i) qf[i] = bf16_to_float(qb[i]);
    P.q = qf;
  } else {
    P.q = static_cast<const float*>(r.q);
  }
  P.o = r.o;
  P.lse = r.lse;
  std::vector<char> listed(B, 0);
  int64_t keys = 0;
  P.cum.push_back(0);
  for (size_t i = 0; i < r.seqs.size(); ++i) {
    const SeqDesc& x = r.seqs[i];
    listed[x.row] = 1;
    keys += x.n;
    P.k.push_back(x.k); P.v.push_back(x.v);
    P.khs.push_back(x.khs); P.krs.push_back(x.krs); P.vhs.push_back(x.vhs); P.vrs.push_back(x.vrs);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t g0 = 0; g0 < G; g0 += 16) {
        P.seg_i.push_back(i); P.seg_b.push_back(x.row); P.seg_h.push_back(h);
        P.seg_g0.push_back(g0); P.seg_gn.push_back(std::min<int64_t>(16, G - g0));
        P.cum.push_back(P.cum.back() + x.n);
      }
  }
  for (int64_t b = 0; b < B; ++b)
    if (!listed[b]) {
      std::fill(r.o + b * H * G * dv, r.o + (b + 1) * H * G * dv, 0.f);
      std::fill(r.lse + b * H * G, r.lse + (b + 1) * H * G, NEG_INF);
    }
  const int64_t S = (int64_t)P.seg_b.size(), W = P.cum.back();
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(r.threads, W / 64));
  const bool dynamic = P.tuning & DYNAMIC_SPLIT;
  // ranges: one per thread, or (dynamic) up to SPLIT_PER_THREAD per thread of >= SPLIT_MIN_KEYS keys
  const int64_t R = dynamic ? std::max<int64_t>(T, std::min<int64_t>(T * SPLIT_PER_THREAD, W / SPLIT_MIN_KEYS)) : T;
  float* slots = slot_buffer((size_t)(R + S) * 16 * (dv + 2));
  P.acc = slots;
  P.mpart = slots + (R + S) * 16 * dv;
  P.lpart = P.mpart + (R + S) * 16;
  std::vector<int64_t> starts(R + 1);
  if (dynamic)
    for (int64_t u = 0; u <= R; ++u) starts[u] = W * u / R;
  std::atomic<int64_t> next{0};
  std::string error;
#pragma omp parallel num_threads(T)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    if (!dynamic) {
#pragma omp single
      {
        starts.assign(n + 1, 0);  // the team may be smaller than asked for
        for (int64_t u = 0; u <= n; ++u) starts[u] = W * u / n;
      }
    }
    try {
      thread_work(P, t, starts, dynamic ? &next : nullptr);
    } catch (const std::exception& ex) {
#pragma omp critical
      error = ex.what();
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t sg = 0; sg < S; ++sg) merge(P, sg, starts);
  }
  if (!error.empty()) throw std::runtime_error("CPU attention failed: " + error);
  return keys;
}

// The first `budget` bytes a request will read, in the order its threads take them (sequence by
// sequence, each head's keys then its values; MLA's values are its keys' first columns, read once),
// read once by its `r.threads` threads while its q has not arrived: the native worker's pre-read
// (cpu_worker.h), which fills the caches with what the call reads first during the time it would
// otherwise spin. Each thread reads its share in 64 KiB pieces and stops at the first piece after
// `ready` reaches `value`. Returns the bytes read. Reads only: the call's results do not change.
static int64_t preread(const Request& r, const volatile int32_t* ready, int32_t value, int64_t budget) {
  const int64_t es = r.bf16 ? 2 : 4;
  std::vector<const char*> base;
  std::vector<int64_t> cum{0};
  auto add = [&](const char* p, int64_t n) {
    n = std::min(n, budget - cum.back());
    if (n > 0) { base.push_back(p); cum.push_back(cum.back() + n); }
  };
  for (const SeqDesc& x : r.seqs) {
    if (x.n == 0) continue;
    for (int64_t h = 0; h < r.H && cum.back() < budget; ++h) {
      const char* k = x.k + h * x.khs * es;
      const int64_t kb = ((x.n - 1) * x.krs + r.dk) * es;
      add(k, kb);
      const char* v = x.v + h * x.vhs * es;
      if (!(v >= k && v < k + kb)) add(v, ((x.n - 1) * x.vrs + r.dv) * es);
    }
    if (cum.back() >= budget) break;
  }
  const int64_t total = cum.back(), T = std::max<int64_t>(1, r.threads), piece = 64 << 10;
  if (total == 0) return 0;
  const bool wide = wsnative::cpu_avx512bf16();
  int64_t done = 0;
  uint64_t sink = 0;
#pragma omp parallel num_threads(T) reduction(+ : done) reduction(^ : sink)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t a = total * t / n;
    const int64_t e = total * (t + 1) / n;
    size_t i = std::upper_bound(cum.begin(), cum.end(), a) - cum.begin() - 1;
    while (a < e && (int32_t)((uint32_t)*ready - (uint32_t)value) < 0) {
      const int64_t hi = std::min({e, a + piece, cum[i + 1]});
      const char* p = base[i] + (a - cum[i]);
      sink ^= wide ? wsnative::fold_avx512(p, hi - a) : wsnative::fold_plain(p, hi - a);
      done += hi - a;
      a = hi;
      if (a == cum[i + 1]) ++i;
    }
  }
  static volatile uint64_t keep;
  keep = sink;  // the loads must happen
  return done;
}

}  // namespace ws

#include "cpu_worker.h"

using namespace ws;

// Returns o [B, H, G, dv] fp32 and lse [B, H, G] fp32 (natural log), into out_o / out_lse if given;
// rows not listed get the empty partial (0, -inf).
std::vector<at::Tensor> attend(at::Tensor q, std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, std::vector<int64_t> rows,
                               int64_t chunk, double scale, int64_t isa, int64_t threads, std::optional<at::Tensor> out_o,
                               std::optional<at::Tensor> out_lse, int64_t dv) {
  TORCH_CHECK(q.dim() == 4, "q must be [B, kv_heads, group, dk], got ", q.sizes());
  if (!q.is_contiguous()) q = q.contiguous();
  if (dv < 0) dv = vs.empty() ? q.size(3) : vs[0].size(2);
  auto fopt = q.options().dtype(at::kFloat);
  at::Tensor o = out_o.has_value() ? *out_o : at::empty({q.size(0), q.size(1), q.size(2), dv}, fopt);
  at::Tensor lse = out_lse.has_value() ? *out_lse : at::empty({q.size(0), q.size(1), q.size(2)}, fopt);
  if (q.dim() == 4 && q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kFloat) q = q.to(at::kFloat);
  const Request r = describe(q, ks, vs, rows, chunk, scale, isa, threads, o, lse);
  run_request(r);
  return {o, lse};
}

// every byte of the contiguous tensors read once (writescope/native/read_probe.h)
int64_t read_tensors(std::vector<at::Tensor> ts, int64_t threads) {
  std::vector<const char*> base;
  std::vector<int64_t> bytes;
  for (auto& t : ts) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "read_probe reads contiguous tensors in host memory");
    base.push_back(static_cast<const char*>(t.data_ptr()));
    bytes.push_back(t.numel() * t.element_size());
  }
  return wsnative::read_probe(base, bytes, threads);
}

int64_t path_for(int64_t isa, bool bf16, int64_t dk, int64_t dv) { return choose(isa, bf16, dk, dv); }
int64_t set_tuning(int64_t flags) { return ws::g_tuning.exchange(flags); }
int64_t get_tuning() { return ws::g_tuning.load(); }
int64_t best() { return best_isa(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Worker> worker(m, "Worker");
  wsnative::bind_flag_worker<AttentionJob>(m, worker);  // the constructor, close, take_error, totals, take_done, traces; wait_flag
  worker.def("submit",
             [](Worker& w, at::Tensor q, std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, std::vector<int64_t> rows, int64_t chunk,
                double scale, int64_t isa, at::Tensor out_o, at::Tensor out_lse, at::Tensor flags, int64_t ready_index, int32_t ready_value,
                int64_t done_index, int32_t done_value) {
               // the caller keeps q, the keys, values and outputs alive until the done flag reaches done_value
               Request r = describe(q, ks, vs, rows, chunk, scale, isa, w.threads(), out_o, out_lse);
               w.submit(AttentionJob{std::move(r)}, wsnative::flag_ptr(flags, ready_index), ready_value, wsnative::flag_ptr(flags, done_index),
                        done_value);
             },
             "queue one layer's CPU attention (returns at once)", py::arg("q"), py::arg("ks"), py::arg("vs"), py::arg("rows"), py::arg("chunk"),
             py::arg("scale"), py::arg("isa"), py::arg("out_o"), py::arg("out_lse"), py::arg("flags"), py::arg("ready_index"),
             py::arg("ready_value"), py::arg("done_index"), py::arg("done_value"));
  // the GIL is released: the GPU part of the step is launched from the main thread meanwhile
  m.def("attend", &attend, "batched CPU decode attention", py::arg("q"), py::arg("ks"), py::arg("vs"), py::arg("rows"), py::arg("chunk"),
        py::arg("scale"), py::arg("isa") = -1, py::arg("threads") = 1, py::arg("out_o") = py::none(), py::arg("out_lse") = py::none(),
        py::arg("dv") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("path_for", &path_for, "the path attend takes for these inputs (0 portable, 1 avx512bf16, 2 amx, 3 amx-emulated)");
  m.def("best", &best, "the best path this CPU and OS offer");
  m.def("set_tuning", &set_tuning, "benchmarks: set the bf16 paths' tuning flags (cpu_kernel.cpp, Tuning); returns the old");
  m.def("tuning", &get_tuning, "the bf16 paths' tuning flags now in use");
  m.def("read_probe", &read_tensors, "read every byte of the tensors once (a rate probe); returns a checksum", py::arg("ts"), py::arg("threads"),
        py::call_guard<py::gil_scoped_release>());
}
