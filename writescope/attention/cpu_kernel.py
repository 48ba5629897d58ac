"""A CPU decode-attention kernel over the compute region (C++, OpenMP; built on first use).

Why: torch's CPU flash-attention op is called once per sequence (the compute regions are separate
allocations), each call a parallel region, and it reached 27-35 GB/s under DMA contention on the
H200 host against 86 GB/s of read bandwidth (benchmarks/results/scheduler.md). This kernel attends
a whole batch in one parallel region: tasks are (sequence, KV head, chunk of ``CHUNK`` keys), each
reading its K rows once (scores of the G query heads sharing the KV head), then its V rows once,
in float32; it writes one partial (o, lse) per task, merged by lse afterwards (exact, as the
other partials; docs/DESIGN.md section 4).

Inputs are the compute region's per-head rows in place: K ``[Hkv, n, dk]`` and V ``[Hkv, n, dv]``
with unit stride along the last dim (any row and head strides: MLA's V is a view of the first 512
of the latent's 576 columns); bf16 or fp32. The
reference is :func:`writescope.attention.partial.attend_blocks` (plain torch), tested against it.

``kernel_available()`` is False where the extension cannot be built (no C++ compiler); callers
then use the flash op. Selected with ``WRITESCOPE_CPU_ATTENTION=kernel`` (default: ``flash``):
exact, but on the 2-core CI machine 1.8-2.7x slower than the flash op (benchmarks/
cpu_kernel_vs_flash.py, output in benchmarks/results/cpu_kernel_vs_flash_ci.log; the inner loops are plain C++ left to the compiler's vectoriser, no AMX);
it has not run on the H200 host. Tuning it (AMX or AVX512-BF16 tiles for the two products) is
what would make one call per batch pay.
"""

from __future__ import annotations

import os
import warnings

import torch

CHUNK = 512  # keys per task

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <limits>

// a row of n values as float32 into out (bf16: the 16 high bits of a float32)
static inline void row_to_float(const float* src, float* out, int64_t n) { std::memcpy(out, src, sizeof(float) * n); }
static inline void row_to_float(const at::BFloat16* src, float* out, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  #pragma omp simd
  for (int64_t c = 0; c < n; ++c) o[c] = static_cast<uint32_t>(s[c]) << 16;
}

template <typename T>
static void run(const float* q, int64_t B, int64_t H, int64_t G, int64_t dk, int64_t dv,
                const std::vector<const T*>& kp, const std::vector<const T*>& vp,
                const std::vector<int64_t>& khs, const std::vector<int64_t>& vhs,
                const std::vector<int64_t>& krs, const std::vector<int64_t>& vrs,
                const std::vector<int64_t>& n, const std::vector<int64_t>& task_seq,
                const std::vector<int64_t>& task_head, const std::vector<int64_t>& task_start,
                int64_t chunk, float scale, float* o, float* lse) {
  const int64_t T_ = (int64_t)task_seq.size();
  at::parallel_for(0, T_, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(chunk * G), acc(G * dv), qf(G * dk), kf(dk), vf(dv);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = task_seq[t], h = task_head[t], j0 = task_start[t];
      const int64_t m = std::min(chunk, n[b] - j0);
      const T* K = kp[b] + h * khs[b] + j0 * krs[b];
      const T* V = vp[b] + h * vhs[b] + j0 * vrs[b];
      const float* Q = q + ((b * H + h) * G) * dk;
      for (int64_t i = 0; i < G * dk; ++i) qf[i] = Q[i] * scale;
      for (int64_t j = 0; j < m; ++j) {            // scores: each K row read and converted once for the G heads
        row_to_float(K + j * krs[b], kf.data(), dk);
        const float* k = kf.data();
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * dk;
          float d = 0.f;
          #pragma omp simd reduction(+:d)
          for (int64_t c = 0; c < dk; ++c) d += qg[c] * k[c];
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
        row_to_float(V + j * vrs[b], vf.data(), dv);
        const float* v = vf.data();
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * chunk + j];
          float* a = acc.data() + g * dv;
          #pragma omp simd
          for (int64_t c = 0; c < dv; ++c) a[c] += p * v[c];
        }
      }
      std::memcpy(o + t * G * dv, acc.data(), sizeof(float) * G * dv);
    }
  });
}

std::vector<at::Tensor> attend(at::Tensor q, std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, int64_t chunk, double scale) {
  TORCH_CHECK(!ks.empty() && ks.size() == vs.size() && (int64_t)ks.size() == q.size(0), "one (k, v) per query row, at least one");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), dk = q.size(3);
  const int64_t dv = vs[0].size(2);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ks[b].dim() == 3 && vs[b].dim() == 3 && ks[b].size(0) == H && vs[b].size(0) == H, "k, v must be [Hkv, n, dim]");
    TORCH_CHECK(ks[b].size(2) == dk && vs[b].size(2) == dv && ks[b].size(1) == vs[b].size(1), "k width must equal q's, v widths equal");
    TORCH_CHECK(ks[b].scalar_type() == ks[0].scalar_type() && vs[b].scalar_type() == ks[0].scalar_type(), "one dtype for the batch");
    TORCH_CHECK(ks[b].stride(2) == 1 && vs[b].stride(2) == 1, "rows must have unit stride");
  }
  std::vector<int64_t> n(B), khs(B), vhs(B), krs(B), vrs(B), ts, th, tst;
  for (int64_t b = 0; b < B; ++b) {
    n[b] = ks[b].size(1); khs[b] = ks[b].stride(0); vhs[b] = vs[b].stride(0); krs[b] = ks[b].stride(1); vrs[b] = vs[b].stride(1);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < n[b]; j += chunk) { ts.push_back(b); th.push_back(h); tst.push_back(j); }
  }
  auto qf = q.to(at::kFloat).contiguous();
  auto o = at::empty({(int64_t)ts.size(), G, dv}, q.options().dtype(at::kFloat));
  auto lse = at::empty({(int64_t)ts.size(), G}, q.options().dtype(at::kFloat));
  if (ks[0].scalar_type() == at::kBFloat16) {
    std::vector<const at::BFloat16*> kp(B), vp(B);
    for (int64_t b = 0; b < B; ++b) { kp[b] = ks[b].data_ptr<at::BFloat16>(); vp[b] = vs[b].data_ptr<at::BFloat16>(); }
    run<at::BFloat16>(qf.data_ptr<float>(), B, H, G, dk, dv, kp, vp, khs, vhs, krs, vrs, n, ts, th, tst, chunk, (float)scale, o.data_ptr<float>(), lse.data_ptr<float>());
  } else {
    std::vector<const float*> kp(B), vp(B);
    for (int64_t b = 0; b < B; ++b) { kp[b] = ks[b].data_ptr<float>(); vp[b] = vs[b].data_ptr<float>(); }
    run<float>(qf.data_ptr<float>(), B, H, G, dk, dv, kp, vp, khs, vhs, krs, vrs, n, ts, th, tst, chunk, (float)scale, o.data_ptr<float>(), lse.data_ptr<float>());
  }
  return {o, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released: the GPU part of the step is launched from the main thread meanwhile
  m.def("attend", &attend, "batched CPU decode attention partials", py::call_guard<py::gil_scoped_release>());
}
"""

_EXT = None
_FAILED = False


def _extension():
    global _EXT, _FAILED
    if _EXT is None and not _FAILED:
        try:
            from torch.utils.cpp_extension import load_inline

            _EXT = load_inline("writescope_cpu_attention", cpp_sources=[_SOURCE], extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing"],
                               extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # noqa: BLE001 - no compiler, or the build failed: the flash op is used
            _FAILED = True
            warnings.warn(f"the CPU attention kernel could not be built ({str(e)[:200]}); using torch's flash op", stacklevel=2)
    return _EXT


def kernel_available() -> bool:
    return _extension() is not None


def kernel_selected() -> bool:
    """``WRITESCOPE_CPU_ATTENTION=kernel`` and the kernel builds."""
    return os.environ.get("WRITESCOPE_CPU_ATTENTION", "flash").lower() == "kernel" and kernel_available()


def usable(q: torch.Tensor, kv: list) -> bool:
    """The kernel handles these inputs: one dtype (bf16 or fp32) for the batch's keys and values,
    K as wide as q, rows with unit last stride, at least one sequence with keys."""
    if q.dtype not in (torch.float32, torch.bfloat16):
        return False
    dtypes = {t.dtype for x in kv if x is not None for t in x}
    if len(dtypes) != 1 or dtypes.pop() not in (torch.float32, torch.bfloat16):
        return False  # (no keys at all: nothing for the kernel to do either)
    for x in kv:
        if x is None:
            continue
        k, v = x
        if k.shape[-1] != q.shape[-1] or k.stride(-1) != 1 or v.stride(-1) != 1:
            return False
    return True


def kernel_partials(q: torch.Tensor, kv: list, scale: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Partials per non-empty sequence i: ``{i: (o [c_i, Hkv, G, dv], lse [c_i, Hkv, G])}``
    float32, one row per chunk of ``CHUNK`` keys (c_i = ceil(n_i / CHUNK)). All sequences in one
    call and one parallel region.

    Args:
        q: ``[B, Hkv, G, dk]``; kv: per sequence ``(k [Hkv, n, dk], v [Hkv, n, dv])`` or None.
    """
    rows = [i for i, x in enumerate(kv) if x is not None]
    if not rows:
        return {}
    qs = q[rows]
    o, lse = _extension().attend(qs, [kv[i][0] for i in rows], [kv[i][1] for i in rows], CHUNK, float(scale))
    # tasks are ordered (sequence, head, chunk): each sequence's block viewed as [chunk, head, ...]
    H, out, t = q.shape[1], {}, 0
    for i in rows:
        c = -(-kv[i][0].shape[1] // CHUNK)
        out[i] = (o[t : t + H * c].view(H, c, *o.shape[1:]).transpose(0, 1), lse[t : t + H * c].view(H, c, lse.shape[1]).transpose(0, 1))
        t += H * c
    return out
