// The CPU decode-attention kernel (writescope/attention/cpu_kernel.py builds and documents it).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <limits>
#include <type_traits>

// a row of n values as float32 into out (bf16: the 16 high bits of a float32)
static inline void row_to_float(const float* src, float* out, int64_t n) { std::memcpy(out, src, sizeof(float) * n); }
static inline void row_to_float(const at::BFloat16* src, float* out, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  #pragma omp simd
  for (int64_t c = 0; c < n; ++c) o[c] = static_cast<uint32_t>(s[c]) << 16;
}

// one call's inputs: q [B, H, G, dk] float32, per sequence b its keys and values in place (row
// strides krs, vrs; head strides khs, vhs; n[b] keys), and the tasks (sequence, KV head, first key)
template <typename T>
struct Batch {
  const float* q; int64_t H, G, dk, dv, chunk; float scale;
  std::vector<const T*> kp, vp;
  std::vector<int64_t> khs, vhs, krs, vrs, n, task_seq, task_head, task_start;
  float* o; float* lse;  // [tasks, G, dv], [tasks, G]
};

// task t: its m keys K and values V (row strides krs, vrs), its G queries times the scale into qf
template <typename T>
struct Task { int64_t m, krs, vrs; const T* K; const T* V; };
template <typename T>
static Task<T> task(const Batch<T>& a, int64_t t, float* qf) {
  const int64_t b = a.task_seq[t], h = a.task_head[t], j0 = a.task_start[t];
  const float* Q = a.q + ((b * a.H + h) * a.G) * a.dk;
  for (int64_t i = 0; i < a.G * a.dk; ++i) qf[i] = Q[i] * a.scale;
  return {std::min(a.chunk, a.n[b] - j0), a.krs[b], a.vrs[b], a.kp[b] + h * a.khs[b] + j0 * a.krs[b], a.vp[b] + h * a.vhs[b] + j0 * a.vrs[b]};
}

template <typename T>
static void run(const Batch<T>& a) {
  const int64_t G = a.G, dk = a.dk, dv = a.dv, chunk = a.chunk;
  float* o = a.o; float* lse = a.lse;
  at::parallel_for(0, (int64_t)a.task_seq.size(), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(chunk * G), acc(G * dv), qf(G * dk), kf(dk), vf(dv);
    for (int64_t t = t0; t < t1; ++t) {
      const Task<T> k = task(a, t, qf.data());
      const int64_t m = k.m;
      const T* K = k.K;
      const T* V = k.V;
      for (int64_t j = 0; j < m; ++j) {            // scores: each K row read and converted once for the G heads
        row_to_float(K + j * k.krs, kf.data(), dk);
        const float* kr = kf.data();
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * dk;
          float d = 0.f;
          #pragma omp simd reduction(+:d)
          for (int64_t c = 0; c < dk; ++c) d += qg[c] * kr[c];
          s[g * chunk + j] = d;
        }
      }
      for (int64_t g = 0; g < G; ++g) {            // softmax per head over the chunk
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < m; ++j) mx = std::max(mx, s[g * chunk + j]);
        float sum = 0.f;
        for (int64_t j = 0; j < m; ++j) { float e = std::exp(s[g * chunk + j] - mx); s[g * chunk + j] = e; sum += e; }
        lse[t * G + g] = mx + std::log(sum);
        for (int64_t j = 0; j < m; ++j) s[g * chunk + j] /= sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < m; ++j) {            // values: each V row read and converted once for the G heads
        row_to_float(V + j * k.vrs, vf.data(), dv);
        const float* v = vf.data();
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * chunk + j];
          float* ag = acc.data() + g * dv;
          #pragma omp simd
          for (int64_t c = 0; c < dv; ++c) ag[c] += p * v[c];
        }
      }
      std::memcpy(o + t * G * dv, acc.data(), sizeof(float) * G * dv);
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define WRITESCOPE_AVX512 1

// the AVX-512 path: the two products as register-blocked outer products (fp32 FMAs), a vector exp
static inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16(const at::BFloat16* p, __mmask16 m) {  // bf16 -> fp32: the 16 high bits
  const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite split of ln2),
// e^r by its degree-7 Taylor polynomial (truncation < 6e-9 relative), times 2^n by scalef
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // a NaN stays NaN (max returns its second operand); e^-87 is still a normal float
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once (45 shuffles and adds, against ~128
// for 16 separate reductions): pairs of vectors, then quads, then across the 128-bit lanes
static inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per lane: one partial of each of v[4i .. 4i + 3]
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// scores of GB heads (from g0) x JB keys (from j): s[g * chunk + j] = q_g . k_j (16-wide
// multiply-adds along the key's columns, each accumulator reduced at the end)
template <int GB, int JB, typename T>
static inline void qk_block(const float* qf, int64_t dk, const T* K, int64_t krs, int64_t j, int64_t g0, float* s, int64_t chunk) {
  __m512 acc[GB][JB];
  #pragma GCC unroll 16
  for (int gb = 0; gb < GB; ++gb)
    #pragma GCC unroll 8
    for (int jb = 0; jb < JB; ++jb) acc[gb][jb] = _mm512_setzero_ps();
  for (int64_t c = 0; c < dk; c += 16) {
    const __mmask16 m = tail_mask(dk - c);
    __m512 kv[JB];
    #pragma GCC unroll 8
    for (int jb = 0; jb < JB; ++jb) kv[jb] = load16(K + (j + jb) * krs + c, m);
    #pragma GCC unroll 8
    for (int jb = 0; jb < JB; ++jb)  // the keys two blocks ahead (past the chunk's end: a hint, never a fault; the address as an integer)
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(K) + ((j + 2 * JB + jb) * krs + c) * sizeof(T)), _MM_HINT_T0);
    #pragma GCC unroll 16
    for (int gb = 0; gb < GB; ++gb) {
      const __m512 qv = _mm512_maskz_loadu_ps(m, qf + (g0 + gb) * dk + c);
      #pragma GCC unroll 8
      for (int jb = 0; jb < JB; ++jb) acc[gb][jb] = _mm512_fmadd_ps(qv, kv[jb], acc[gb][jb]);
    }
  }
  constexpr int N = GB * JB, N16 = N / 16 * 16;  // reduced 16 at a time, the rest one by one
  alignas(64) float r[N];
  const __m512* a = &acc[0][0];
  #pragma GCC unroll 2
  for (int i = 0; i < N16; i += 16) _mm512_store_ps(r + i, reduce16(a + i));
  #pragma GCC unroll 16
  for (int i = N16; i < N; ++i) r[i] = _mm512_reduce_add_ps(a[i]);
  #pragma GCC unroll 8
  for (int gb = 0; gb < GB; ++gb)
    #pragma GCC unroll 8
    for (int jb = 0; jb < JB; ++jb) s[(g0 + gb) * chunk + j + jb] = r[gb * JB + jb];
}

// o[g, c0 : c0 + 16 CB] = inv[g] * sum_j p[j, g] v_j[c0 : ...] for GB heads from g0 (pt: [m, G])
template <int GB, int CB, typename T>
static inline void pv_block(const float* pt, int64_t G, const T* V, int64_t vrs, int64_t m, int64_t dv, int64_t c0, int64_t g0,
                            const float* inv, float* o) {
  __m512 acc[GB][CB];
  __mmask16 mk[CB];
  #pragma GCC unroll 8
  for (int cb = 0; cb < CB; ++cb) mk[cb] = tail_mask(dv - c0 - 16 * cb);
  #pragma GCC unroll 16
  for (int gb = 0; gb < GB; ++gb)
    #pragma GCC unroll 8
    for (int cb = 0; cb < CB; ++cb) acc[gb][cb] = _mm512_setzero_ps();
  for (int64_t j = 0; j < m; ++j) {
    __m512 vv[CB];
    #pragma GCC unroll 8
    for (int cb = 0; cb < CB; ++cb) vv[cb] = load16(V + j * vrs + c0 + 16 * cb, mk[cb]);
    const float* p = pt + j * G + g0;
    #pragma GCC unroll 16
    for (int gb = 0; gb < GB; ++gb) {
      const __m512 pb = _mm512_set1_ps(p[gb]);
      #pragma GCC unroll 8
      for (int cb = 0; cb < CB; ++cb) acc[gb][cb] = _mm512_fmadd_ps(pb, vv[cb], acc[gb][cb]);
    }
  }
  #pragma GCC unroll 16
  for (int gb = 0; gb < GB; ++gb)
    #pragma GCC unroll 8
    for (int cb = 0; cb < CB; ++cb)
      _mm512_mask_storeu_ps(o + (g0 + gb) * dv + c0 + 16 * cb, mk[cb], _mm512_mul_ps(acc[gb][cb], _mm512_set1_ps(inv[g0 + gb])));
}

// heads g0 .. g0 + GB of one task: scores, then (after the softmax) values, with 8-24
// accumulators: 8 heads x 3 keys (or 3 x 16 columns), 4 x 6, 2 x 8, 1 x 8. Chosen over 16 heads x 1
// (which loads every head's query for each key) by trying the shapes on the 2-core development
// machine (benchmarks/results/cpu_kernel.md)
template <int GB>
constexpr int inner_block() { return GB >= 8 ? 3 : GB >= 4 ? 6 : 8; }
template <int GB, typename T>
static void qk_heads(const float* qf, int64_t dk, const T* K, int64_t krs, int64_t m, int64_t g0, float* s, int64_t chunk,
                     const T* V, int64_t vrs, int64_t dv) {
  constexpr int JB = inner_block<GB>();
  int64_t j = 0;
  for (; j + JB <= m; j += JB) {
    qk_block<GB, JB>(qf, dk, K, krs, j, g0, s, chunk);
    if (V != nullptr)  // values in rows of their own (not MLA's latent): into the cache for the value pass
      for (int jb = 0; jb < JB; ++jb)
        for (int64_t c = 0; c < dv; c += 64 / (int64_t)sizeof(T)) _mm_prefetch(reinterpret_cast<const char*>(V + (j + jb) * vrs + c), _MM_HINT_T1);
  }
  for (; j < m; ++j) qk_block<GB, 1>(qf, dk, K, krs, j, g0, s, chunk);
}
template <int GB, typename T>
static void pv_heads(const float* pt, int64_t G, const T* V, int64_t vrs, int64_t m, int64_t dv, int64_t g0, const float* inv, float* o) {
  constexpr int CB = inner_block<GB>();
  for (int64_t c0 = 0; c0 < dv; c0 += 16 * CB) pv_block<GB, CB>(pt, G, V, vrs, m, dv, c0, g0, inv, o);
}
// G heads in blocks of 8, 4, 2, 1
template <typename F>
static void head_blocks(int64_t G, F&& f) {
  int64_t g0 = 0;
  for (; g0 + 8 <= G; g0 += 8) f(std::integral_constant<int, 8>{}, g0);
  if (g0 + 4 <= G) { f(std::integral_constant<int, 4>{}, g0); g0 += 4; }
  if (g0 + 2 <= G) { f(std::integral_constant<int, 2>{}, g0); g0 += 2; }
  if (g0 + 1 <= G) { f(std::integral_constant<int, 1>{}, g0); g0 += 1; }
}

template <typename T>
static void run_avx512(const Batch<T>& a) {
  const int64_t G = a.G, dk = a.dk, dv = a.dv, chunk = a.chunk;
  float* lse = a.lse;
  at::parallel_for(0, (int64_t)a.task_seq.size(), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(chunk * G), pt(chunk * G), qf(G * dk), inv(G);
    for (int64_t t = t0; t < t1; ++t) {
      const Task<T> k = task(a, t, qf.data());
      const int64_t m = k.m;
      const T* Vp = k.V == k.K && k.vrs == k.krs ? nullptr : k.V;  // values in rows of their own: prefetched by the first head block
      head_blocks(G, [&](auto gb, int64_t g0) {
        qk_heads<decltype(gb)::value>(qf.data(), dk, k.K, k.krs, m, g0, s.data(), chunk, g0 == 0 ? Vp : nullptr, k.vrs, dv);
      });
      for (int64_t g = 0; g < G; ++g) {            // softmax per head over the chunk (unnormalised; 1 / sum applied to o)
        float* sg = s.data() + g * chunk;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < m; ++j) mx = std::max(mx, sg[j]);
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t j = 0; j < m; j += 16) {
          const __mmask16 mk = tail_mask(m - j);
          const __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + j), vmx)));
          _mm512_mask_storeu_ps(sg + j, mk, e);
          vsum = _mm512_add_ps(vsum, e);
        }
        const float sum = _mm512_reduce_add_ps(vsum);
        lse[t * G + g] = mx + std::log(sum);
        inv[g] = 1.f / sum;
        for (int64_t j = 0; j < m; ++j) pt[j * G + g] = sg[j];
      }
      float* out = a.o + t * G * dv;
      head_blocks(G, [&](auto gb, int64_t g0) { pv_heads<decltype(gb)::value>(pt.data(), G, k.V, k.vrs, m, dv, g0, inv.data(), out); });
    }
  });
}
#endif

// the batch's tasks in order (sequence, KV head, chunk), then the AVX-512 path or the plain loops
template <typename T>
static void dispatch(const at::Tensor& q, const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs, int64_t chunk,
                     float scale, bool portable, at::Tensor& o, at::Tensor& lse) {
  const int64_t B = q.size(0);
  Batch<T> a{q.data_ptr<float>(), q.size(1), q.size(2), q.size(3), vs[0].size(2), chunk, scale};
  for (int64_t b = 0; b < B; ++b) {
    a.kp.push_back(ks[b].data_ptr<T>()); a.vp.push_back(vs[b].data_ptr<T>());
    a.n.push_back(ks[b].size(1)); a.khs.push_back(ks[b].stride(0)); a.vhs.push_back(vs[b].stride(0));
    a.krs.push_back(ks[b].stride(1)); a.vrs.push_back(vs[b].stride(1));
    for (int64_t h = 0; h < a.H; ++h)
      for (int64_t j = 0; j < a.n[b]; j += chunk) { a.task_seq.push_back(b); a.task_head.push_back(h); a.task_start.push_back(j); }
  }
  a.o = o.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
#ifdef WRITESCOPE_AVX512
  if (!portable) return run_avx512(a);
#endif
  run(a);
}

std::vector<at::Tensor> attend(at::Tensor q, std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, int64_t chunk, double scale, bool portable) {
  TORCH_CHECK(!ks.empty() && ks.size() == vs.size() && (int64_t)ks.size() == q.size(0), "one (k, v) per query row, at least one");
  TORCH_CHECK(chunk >= 1, "chunk must be >= 1 key, got ", chunk);
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), dk = q.size(3);
  const int64_t dv = vs[0].size(2);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ks[b].dim() == 3 && vs[b].dim() == 3 && ks[b].size(0) == H && vs[b].size(0) == H, "k, v must be [Hkv, n, dim]");
    TORCH_CHECK(ks[b].size(2) == dk && vs[b].size(2) == dv && ks[b].size(1) == vs[b].size(1), "k width must equal q's, v widths equal");
    TORCH_CHECK(ks[b].scalar_type() == ks[0].scalar_type() && vs[b].scalar_type() == ks[0].scalar_type(), "one dtype for the batch");
    TORCH_CHECK(ks[b].stride(2) == 1 && vs[b].stride(2) == 1, "rows must have unit stride");
  }
  auto qf = q.to(at::kFloat).contiguous();
  int64_t tasks = 0;
  for (int64_t b = 0; b < B; ++b) tasks += H * ((ks[b].size(1) + chunk - 1) / chunk);
  auto o = at::empty({tasks, G, dv}, q.options().dtype(at::kFloat));
  auto lse = at::empty({tasks, G}, q.options().dtype(at::kFloat));
  if (ks[0].scalar_type() == at::kBFloat16)
    dispatch<at::BFloat16>(qf, ks, vs, chunk, (float)scale, portable, o, lse);
  else
    dispatch<float>(qf, ks, vs, chunk, (float)scale, portable, o, lse);
  return {o, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released: the GPU part of the step is launched from the main thread meanwhile
  m.def("attend", &attend, "batched CPU decode attention partials", py::arg("q"), py::arg("ks"), py::arg("vs"), py::arg("chunk"),
        py::arg("scale"), py::arg("portable") = false, py::call_guard<py::gil_scoped_release>());
#ifdef WRITESCOPE_AVX512
  m.attr("avx512") = true;
#else
  m.attr("avx512") = false;
#endif
}
