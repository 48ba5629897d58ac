// The host-expert kernel (writescope/moe/cpu_experts.py builds and documents it).
//
// One call computes every host expert of one MoE layer's step: groups g (one expert, slot s_g
// in the packed w13 [E, 2I, D] / w2 [E, D, I], m_g consecutive token rows of x [n, D]) give
// y[rows of g] = rw * down(silu(gate(x)) * up(x)). Work plan, so each weight byte is read once:
//   pack     the tokens in the layout the path needs (AMX: xb pairs; portable bf16: fp32 rows)
//   phase 1  units of 16 features of one expert (16 gate + 16 up rows of w13), in runs of consecutive
//            units that the threads take from an atomic counter as each finishes its last (about
//            SPLIT_PER_THREAD runs per thread; a thread slowed by another on its core takes fewer
//            instead of holding up the call; set_split(false): one equal range per thread):
//            h = silu(g) * u for all the expert's tokens, in bf16
//   barrier
//   phase 2  units of 32 output features of one expert (32 rows of w2), likewise: y = rw h W2^T
// compute() runs one call without the GIL or a torch tensor: the Python binding (forward) and the
// native host-expert worker (expert_worker.h, bound as ExpertWorker) both call it.
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "read_probe.h"
#include "scratch.h"
#include "cpu_experts_avx512.h"
#include "cpu_experts_amx.h"

namespace wsmoe {

using namespace wsnative;  // the paths (Isa), the CPU-flag checks

// The path for these inputs: the requested one (-1: the best this CPU has), lowered where the
// inputs need it (AMX: bf16, D % 32 == 0, I % 32 == 0; AVX512-BF16: bf16)
static int64_t choose(int64_t req, bool bf16, int64_t D, int64_t I) {
  return choose_isa(req, bf16, D % 32 == 0 && I % 32 == 0, "WRITESCOPE_EXPERT_ISA");
}

// ---------------------------------------------------------------- scratch
struct Caller {  // the calling thread's buffers, reused across calls (no page faults in a decode step)
  Buf<uint16_t> xb, hb;
  Buf<float> xf, hf;
};
struct Worker {  // each OpenMP thread's
  Buf<float> a, b, row;
};
static Caller& caller() {
  static thread_local Caller c;
  return c;
}
static Worker& worker() {
  static thread_local Worker w;
  return w;
}

// ---------------------------------------------------------------- the plan of one call
struct Plan {
  int64_t D, I, isa;
  bool bf16;
  const char *x, *w13, *w2;  // x [n, D] contiguous; w13, w2 with strides below (elements)
  int64_t e13, r13, e2, r2;  // expert and row strides of w13 and w2
  std::vector<int64_t> slot, start, count, xoff, hoff;  // per group with tokens (xoff, hoff: AMX)
  const float* rw;  // [n] routing weights
  char* y;          // [n, D], x's dtype
  uint16_t *xb, *hb, *h;  // AMX: xb, hb; AVX512-BF16: h [n, I]
  float *xf, *hf;         // portable: x in fp32 (bf16 inputs), h [n, I] fp32
  int64_t units1, units2;  // per group: ceil(I / 16), ceil(D / 32)
};

static inline float bf16_to_float(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline float to_f(float v) { return v; }
static inline float to_f(uint16_t v) { return bf16_to_float(v); }
static inline void from_f(float v, float* p) { *p = v; }
static inline void from_f(float v, uint16_t* p) { *p = c10::BFloat16(v).x; }  // nearest even
static inline float silu_mul(float g, float u) { return g / (1.f + std::exp(-g)) * u; }

// ---------------------------------------------------------------- the portable path (fp32 arithmetic)
static float dot(const float* a, const float* b, int64_t K) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < K; ++c) s += a[c] * b[c];
  return s;
}
template <typename T>
static const float* row_f(const T* r, int64_t K, float* buf) {
  if constexpr (std::is_same_v<T, float>) return r;
  for (int64_t c = 0; c < K; ++c) buf[c] = to_f(r[c]);
  return buf;
}
// phase 1 unit: features f0 .. f0 + 15 of one expert, its m tokens xf [m, D] -> hf [m, I]
// (h rounded to bf16 for bf16 weights, as torch's bf16 expert rounds it)
template <typename T>
static void gate_up_portable(const T* W13, int64_t ldw, int64_t D, int64_t I, int64_t f0, const float* xf, int64_t m, float* hf, Worker& w) {
  const int64_t nr = std::min<int64_t>(16, I - f0);
  float* g = w.a.get(16 * m);
  float* u = w.b.get(16 * m);
  float* row = w.row.get(D);
  for (int64_t i = 0; i < nr; ++i) {
    const float* rg = row_f(W13 + (f0 + i) * ldw, D, row);
    for (int64_t t = 0; t < m; ++t) g[t * 16 + i] = dot(rg, xf + t * D, D);
    const float* ru = row_f(W13 + (I + f0 + i) * ldw, D, row);
    for (int64_t t = 0; t < m; ++t) u[t * 16 + i] = dot(ru, xf + t * D, D);
  }
  for (int64_t t = 0; t < m; ++t)
    for (int64_t i = 0; i < nr; ++i) {
      const float h = silu_mul(g[t * 16 + i], u[t * 16 + i]);
      hf[t * I + f0 + i] = std::is_same_v<T, float> ? h : bf16_to_float(c10::BFloat16(h).x);
    }
}
// phase 2 unit: output features d0 .. d0 + 31 of one expert for its m tokens -> y rows, times rw
template <typename T>
static void down_portable(const T* W2, int64_t ldw, int64_t D, int64_t I, int64_t d0, const float* hf, int64_t m, const float* rw, T* y, Worker& w) {
  const int64_t nr = std::min<int64_t>(32, D - d0);
  float* row = w.row.get(I);
  for (int64_t i = 0; i < nr; ++i) {
    const float* r = row_f(W2 + (d0 + i) * ldw, I, row);
    for (int64_t t = 0; t < m; ++t) from_f(rw[t] * dot(r, hf + t * I, I), y + t * D + d0 + i);
  }
}

// ---------------------------------------------------------------- one thread's share
template <typename T>
static void pack_group(const Plan& P, int64_t g) {
  const int64_t s = P.start[g], m = P.count[g];
  const T* x = reinterpret_cast<const T*>(P.x) + s * P.D;
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (P.isa == AMX || P.isa == AMX_EMULATED) avx::pack_tokens(x, P.D, m, P.D, P.xb + P.xoff[g]);
    else if (P.isa == PORTABLE)
      for (int64_t i = 0; i < m * P.D; ++i) P.xf[s * P.D + i] = bf16_to_float(x[i]);
  }
}

template <typename T>
static void unit1(const Plan& P, int64_t u, Worker& w) {
  const int64_t g = u / P.units1, f0 = (u % P.units1) * 16, s = P.start[g], m = P.count[g];
  const T* W13 = reinterpret_cast<const T*>(P.w13) + P.slot[g] * P.e13;
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (P.isa == AMX) return amx::gate_up_unit(W13, P.r13, P.D, P.I, f0, P.xb + P.xoff[g], (m + 15) / 16, P.hb + P.hoff[g], w.a.get(1024));
    if (P.isa == AMX_EMULATED) return amx_emu::gate_up_unit(W13, P.r13, P.D, P.I, f0, P.xb + P.xoff[g], (m + 15) / 16, P.hb + P.hoff[g], w.a.get(1024));
    if (P.isa == AVX512BF16) {
      const uint16_t* x = reinterpret_cast<const uint16_t*>(P.x) + s * P.D;
      return avx::gate_up_unit(W13, P.r13, P.D, P.I, f0, x, P.D, m, P.h + s * P.I, P.I, w.a.get((avx::TC + 4) * 16), w.b.get((avx::TC + 4) * 16));
    }
  }
  const float* xf = std::is_same_v<T, float> ? reinterpret_cast<const float*>(P.x) : P.xf;
  gate_up_portable(W13, P.r13, P.D, P.I, f0, xf + s * P.D, m, P.hf + s * P.I, w);
}

template <typename T>
static void unit2(const Plan& P, int64_t u, Worker& w) {
  const int64_t g = u / P.units2, d0 = (u % P.units2) * 32, s = P.start[g], m = P.count[g];
  const T* W2 = reinterpret_cast<const T*>(P.w2) + P.slot[g] * P.e2;
  T* y = reinterpret_cast<T*>(P.y) + s * P.D;
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (P.isa == AMX) return amx::down_unit(W2, P.r2, P.I, d0, P.hb + P.hoff[g], m, P.rw + s, y, P.D, w.a.get(1024));
    if (P.isa == AMX_EMULATED) return amx_emu::down_unit(W2, P.r2, P.I, d0, P.hb + P.hoff[g], m, P.rw + s, y, P.D, w.a.get(1024));
    if (P.isa == AVX512BF16) return avx::down_unit(W2, P.r2, P.D, P.I, d0, P.h + s * P.I, P.I, m, P.rw + s, y, P.D, w.a.get((avx::TC + 4) * 32));
  }
  down_portable(W2, P.r2, P.D, P.I, d0, P.hf + s * P.I, m, P.rw + s, y, w);
}

constexpr int64_t SPLIT_PER_THREAD = 4;
static std::atomic<bool> g_dynamic{true};  // set_split: the runs from a counter (true) or one equal range per thread

// units [0, U) for thread t of n: its equal range, or (dynamic) runs of `run` units from *next
template <typename F>
static void units(int64_t U, int64_t t, int64_t n, bool dynamic, std::atomic<int64_t>& next, F&& f) {
  if (!dynamic) {
    for (int64_t u = U * t / n; u < U * (t + 1) / n; ++u) f(u);
    return;
  }
  const int64_t run = std::max<int64_t>(1, U / (n * SPLIT_PER_THREAD));
  for (int64_t a = next.fetch_add(run, std::memory_order_relaxed); a < U; a = next.fetch_add(run, std::memory_order_relaxed))
    for (int64_t u = a; u < std::min(U, a + run); ++u) f(u);
}

template <typename T>
static void run(const Plan& P, int64_t threads, std::string& error) {
  const int64_t G = (int64_t)P.slot.size(), U1 = G * P.units1, U2 = G * P.units2;
  const bool dynamic = g_dynamic.load(std::memory_order_relaxed);
  std::atomic<int64_t> next1{0}, next2{0};
  std::atomic<bool> failed{false};  // a phase-1 failure on any thread: no thread starts phase 2 (h is not all there)
#pragma omp parallel num_threads(threads)
  {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    Worker& w = worker();
    if (P.isa == AMX) amx::configure();
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; ++g) pack_group<T>(P, g);  // cannot throw: outside the try (a worksharing loop must end on every thread)
    try {
      units(U1, t, n, dynamic, next1, [&](int64_t u) { unit1<T>(P, u, w); });
    } catch (const std::exception& ex) {
      failed.store(true, std::memory_order_relaxed);
#pragma omp critical
      error = ex.what();
    }
#pragma omp barrier
    try {
      if (!failed.load(std::memory_order_relaxed)) units(U2, t, n, dynamic, next2, [&](int64_t u) { unit2<T>(P, u, w); });
    } catch (const std::exception& ex) {
#pragma omp critical
      error = ex.what();
    }
    if (P.isa == AMX) amx::release();
  }
}

// The packed host weights of one call, read in place: w13 [E, 2I, D], w2 [E, D, I]
struct Weights {
  const char *w13, *w2;
  int64_t E, D, I, e13, r13, e2, r2;  // expert and row strides in elements
  bool bf16;
};

// w13 [E, 2I, D] and w2 [E, D, I] of dtype `dtype` (unit last stride, any row and expert strides,
// on the CPU), for inputs of width D. Throws (c10::Error) naming what does not match.
static Weights describe_weights(const at::Tensor& w13, const at::Tensor& w2, at::ScalarType dtype, int64_t D) {
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0), "w13 must be [E, 2I, D] and w2 [E, D, I]");
  const int64_t E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == D && w2.size(1) == D && w2.size(2) == I, "w13 ", w13.sizes(), " and w2 ", w2.sizes(),
              " do not match D = ", D);
  TORCH_CHECK(w13.scalar_type() == dtype && w2.scalar_type() == dtype, "weights and x must have one dtype");
  TORCH_CHECK(w13.stride(2) == 1 && w2.stride(2) == 1 && w13.device().is_cpu() && w2.device().is_cpu(), "weight rows must have unit stride, on the CPU");
  Weights W;
  W.w13 = static_cast<const char*>(w13.data_ptr());
  W.w2 = static_cast<const char*>(w2.data_ptr());
  W.E = E; W.D = D; W.I = I;
  W.e13 = w13.stride(0); W.r13 = w13.stride(1); W.e2 = w2.stride(0); W.r2 = w2.stride(1);
  W.bf16 = dtype == at::kBFloat16;
  return W;
}

// The host experts of one call on `threads` threads (OpenMP, the calling thread included; neither
// the GIL nor a torch tensor is touched, so the native worker calls it too): x [n, D] contiguous in
// the weights' dtype, grouped: group g = counts[g] consecutive rows for the expert in slot slots[g];
// rw [n] fp32; y [n, D] contiguous in x's dtype: row i = rw[i] * expert(x[i]) (gate/up in fp32, h
// rounded to x's dtype, down in fp32, times rw, rounded once to x's dtype). isa: a path from
// choose(). Throws (c10::Error / std::runtime_error) on a bad slot or count or a failed thread.
static void compute(const Weights& W, const void* x, int64_t n, const std::vector<int64_t>& slots, const std::vector<int64_t>& counts,
                    const float* rw, void* y, int64_t isa, int64_t threads) {
  TORCH_CHECK(slots.size() == counts.size(), "one count per slot");
  TORCH_CHECK(threads >= 1, "threads must be >= 1, got ", threads);
  const int64_t D = W.D, I = W.I;
  Plan P;
  P.D = D; P.I = I; P.bf16 = W.bf16;
  P.isa = isa;
  int64_t total = 0, xsz = 0, hsz = 0;
  for (size_t g = 0; g < slots.size(); ++g) {
    TORCH_CHECK(slots[g] >= 0 && slots[g] < W.E, "slot ", slots[g], " outside [0, ", W.E, ")");
    TORCH_CHECK(counts[g] >= 0, "count ", counts[g], " < 0");
    if (counts[g] > 0) {
      P.slot.push_back(slots[g]); P.start.push_back(total); P.count.push_back(counts[g]);
      P.xoff.push_back(xsz); P.hoff.push_back(hsz);
      const int64_t nb = (counts[g] + 15) / 16;
      xsz += nb * (D / 32) * 512;
      hsz += nb * (I / 32) * 512;
    }
    total += counts[g];
  }
  TORCH_CHECK(total == n, "the counts sum to ", total, ", x has ", n, " rows");
  if (n == 0 || D == 0) return;
  P.x = static_cast<const char*>(x);
  P.w13 = W.w13;
  P.w2 = W.w2;
  P.e13 = W.e13; P.r13 = W.r13; P.e2 = W.e2; P.r2 = W.r2;
  P.rw = rw;
  P.y = static_cast<char*>(y);
  P.units1 = (I + 15) / 16;
  P.units2 = (D + 31) / 32;
  Caller& c = caller();
  P.xb = P.hb = P.h = nullptr;
  P.xf = P.hf = nullptr;
  if (P.isa == AMX || P.isa == AMX_EMULATED) { P.xb = c.xb.get(xsz); P.hb = c.hb.get(hsz); }
  else if (P.isa == AVX512BF16) P.h = c.hb.get(n * I);
  else { P.hf = c.hf.get(n * I); if (P.bf16) P.xf = c.xf.get(n * D); }
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(threads, (int64_t)P.slot.size() * P.units1));
  std::string error;
  if (P.bf16) run<uint16_t>(P, T, error);
  else run<float>(P, T, error);
  if (!error.empty()) throw std::runtime_error("host-expert kernel failed: " + error);
}

}  // namespace wsmoe

#include "expert_worker.h"

using namespace wsmoe;

// x [n, D] (bf16 or fp32, contiguous); w13 [E, 2I, D], w2 [E, D, I] (x's dtype, unit last stride,
// any row and expert strides: read in place); group g = counts[g] consecutive rows of x for the
// expert in slot slots[g]; rw [n] fp32. Returns (y [n, D] in x's dtype, the path that ran).
std::tuple<at::Tensor, int64_t> forward(at::Tensor x, at::Tensor w13, at::Tensor w2, std::vector<int64_t> slots, std::vector<int64_t> counts,
                                        at::Tensor rw, int64_t isa, int64_t threads) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous [n, D] CPU tensor, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32, got ", x.scalar_type());
  const int64_t n = x.size(0), D = x.size(1);
  const Weights W = describe_weights(w13, w2, x.scalar_type(), D);
  TORCH_CHECK(rw.dim() == 1 && rw.size(0) == n && rw.scalar_type() == at::kFloat && rw.is_contiguous(), "rw must be contiguous fp32 [n]");
  const int64_t path = choose(isa, W.bf16, D, W.I);
  at::Tensor y = at::empty({n, D}, x.options());
  compute(W, x.data_ptr(), n, slots, counts, rw.data_ptr<float>(), y.data_ptr(), path, threads);
  return {y, path};
}

int64_t path_for(int64_t isa, bool bf16, int64_t D, int64_t I) { return choose(isa, bf16, D, I); }
int64_t best() { return best_isa(); }
bool set_split(bool dynamic) { return g_dynamic.exchange(dynamic); }

// a plain read of t's bytes: the rate the kernel's weight reads are compared with (native/read_probe.h)
int64_t read_bytes(at::Tensor t, int64_t threads) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "read_bytes needs a contiguous CPU tensor");
  return wsnative::read_probe({static_cast<const char*>(t.data_ptr())}, {t.numel() * t.element_size()}, threads);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<ExpertWorker> worker(m, "ExpertWorker");
  wsnative::bind_flag_worker<ExpertJob>(m, worker);  // the constructor, close, take_error, totals, take_done, traces; wait_flag
  worker.def("submit",
             [](ExpertWorker& w, at::Tensor x, at::Tensor slot, at::Tensor rw, at::Tensor w13, at::Tensor w2, at::Tensor y, int64_t isa,
                at::Tensor flags, int64_t ready_index, int32_t ready_value, int64_t done_index, int32_t done_value) {
               // the caller keeps every tensor alive until the done flag reaches done_value
               ExpertJob j = describe_job(x, slot, rw, w13, w2, y, isa, w.threads());
               w.submit(j, wsnative::flag_ptr(flags, ready_index), ready_value, wsnative::flag_ptr(flags, done_index), done_value);
             },
             "queue one MoE layer's host experts (returns at once)", py::arg("x"), py::arg("slot"), py::arg("rw"), py::arg("w13"), py::arg("w2"),
             py::arg("y"), py::arg("isa"), py::arg("flags"), py::arg("ready_index"), py::arg("ready_value"), py::arg("done_index"),
             py::arg("done_value"));
  // the GIL is released: other Python threads (the GPU side of the step) run meanwhile
  m.def("forward", &forward, "every host expert of one MoE step", py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("slots"), py::arg("counts"),
        py::arg("rw"), py::arg("isa") = -1, py::arg("threads") = 1, py::call_guard<py::gil_scoped_release>());
  m.def("path_for", &path_for, "the path forward takes for these inputs (0 portable, 1 avx512bf16, 2 amx, 3 amx-emulated)");
  m.def("best", &best, "the best path this CPU and OS offer");
  m.def("set_split", &set_split, "units from a counter (True, the default) or one equal range per thread; returns the previous",
        py::arg("dynamic"));
  m.def("read_bytes", &read_bytes, "a plain multi-threaded read of a tensor's bytes", py::call_guard<py::gil_scoped_release>());
}
