// The persistent native worker for host-resident MoE experts (writescope/moe/expert_worker.py
// drives it): writescope/native/flag_worker.h's FlagWorker over one MoE layer's host experts per
// job. Included by cpu_experts.cpp after the kernel (compute, describe_weights, choose).
//
// A job's inputs (host memory; on CUDA pinned, written by the GPU stream before it sets the ready
// flag): x [T, D] (bf16 or fp32) the layer's tokens, slot [T, K] int32 the host pack slot of each
// (token, k-th routed expert) that the CPU computes or -1, rw [T, K] fp32 the routing weights.
// Once its ready flag is set, the job groups the assignments with slot >= 0 by slot (ascending
// slots, tokens ascending within a slot), gathers those rows of x, runs the host-expert kernel on
// them (compute: each hit expert's weights read once) and writes
//   y[t] = sum over t's assignments with slot >= 0, in ascending slot order, of
//          rw[t, k] * expert_slot(x[t])   (each term as host_experts_forward gives it, in x's dtype)
// accumulated in fp32 into y [T, D] fp32 (exactly 0 for a token with no CPU assignment), then sets
// its done flag. A slot outside [-1, E) fails the job (y NaN, the error recorded). Each job counts
// the weight bytes it read (distinct slots x one expert's w13 + w2 bytes) and the experts computed.
#pragma once
#include <omp.h>
#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "flag_worker.h"

namespace wsmoe {

struct JobScratch {  // the worker thread's buffers, reused across jobs
  Buf<char> xg, yg;  // gathered x rows and their expert outputs [n, D], x's dtype
  Buf<float> rwg;    // [n] routing weights of the gathered rows
  Buf<int64_t> token, off, order;  // [n] token of each gathered row; [T + 1] offsets and [n] rows per token
};
static JobScratch& job_scratch() {
  static thread_local JobScratch s;
  return s;
}

struct ExpertJob {
  static constexpr size_t COUNTS = 2;  // weight bytes read, experts computed
  static constexpr const char* NAME = "the host-expert worker";
  static constexpr const char* INPUT = "inputs";
  Weights W;
  const void* x;       // [T, D], W's dtype
  const int32_t* slot;  // [T, K]
  const float* rw;     // [T, K]
  float* y;            // [T, D]
  int64_t T, K, isa, threads;

  std::array<int64_t, 2> run() {
    const int64_t D = W.D, es = W.bf16 ? 2 : 4, TK = T * K;
    // the slots read once: every later pass uses these checked values, whatever happens to the buffer
    const std::vector<int32_t> slot(this->slot, this->slot + TK);
    std::vector<int64_t> count(W.E, 0);
    for (int64_t i = 0; i < TK; ++i) {
      const int32_t s = slot[i];
      if (s < -1 || s >= W.E)
        throw std::runtime_error("slot " + std::to_string(s) + " of token " + std::to_string(i / K) + " (k = " + std::to_string(i % K) +
                                 ") outside [-1, " + std::to_string(W.E) + ") (w13 holds " + std::to_string(W.E) + " experts)");
      if (s >= 0) ++count[s];
    }
    std::vector<int64_t> slots, counts, fill(W.E, 0);
    int64_t n = 0;
    for (int64_t s = 0; s < W.E; ++s) {
      fill[s] = n;
      if (count[s] > 0) { slots.push_back(s); counts.push_back(count[s]); }
      n += count[s];
    }
    JobScratch& js = job_scratch();
    char* xg = js.xg.get(std::max<int64_t>(1, n * D * es));
    char* yg = js.yg.get(std::max<int64_t>(1, n * D * es));
    float* rwg = js.rwg.get(std::max<int64_t>(1, n));
    int64_t* token = js.token.get(std::max<int64_t>(1, n));
    int64_t* off = js.off.get(T + 1);
    int64_t* order = js.order.get(std::max<int64_t>(1, n));
    std::fill(off, off + T + 1, 0);
    for (int64_t t = 0; t < T; ++t)  // by slot, tokens ascending within a slot
      for (int64_t k = 0; k < K; ++k) {
        const int32_t s = slot[t * K + k];
        if (s < 0) continue;
        const int64_t r = fill[s]++;
        token[r] = t;
        rwg[r] = rw[t * K + k];
        ++off[t + 1];
      }
    for (int64_t t = 0; t < T; ++t) off[t + 1] += off[t];
    {
      std::vector<int64_t> at(off, off + T);
      for (int64_t r = 0; r < n; ++r) order[at[token[r]]++] = r;  // each token's rows, ascending (slot order)
    }
    const int64_t team = std::max<int64_t>(1, threads);
    const char* xs = static_cast<const char*>(x);
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t r = 0; r < n; ++r) std::memcpy(xg + r * D * es, xs + token[r] * D * es, D * es);
    compute(W, xg, n, slots, counts, rwg, yg, isa, threads);
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* yt = y + t * D;
      std::fill(yt, yt + D, 0.f);
      for (int64_t j = off[t]; j < off[t + 1]; ++j) {
        const int64_t r = order[j];
        if (W.bf16) {
          const uint16_t* row = reinterpret_cast<const uint16_t*>(yg) + r * D;
#pragma omp simd
          for (int64_t c = 0; c < D; ++c) yt[c] += bf16_to_float(row[c]);
        } else {
          const float* row = reinterpret_cast<const float*>(yg) + r * D;
#pragma omp simd
          for (int64_t c = 0; c < D; ++c) yt[c] += row[c];
        }
      }
    }
    const int64_t expert_bytes = (2 * W.I * D + D * W.I) * es;
    return {(int64_t)slots.size() * expert_bytes, (int64_t)slots.size()};
  }

  void poison() { std::fill(y, y + T * W.D, std::numeric_limits<float>::quiet_NaN()); }
  int64_t preread(const volatile int32_t*, int32_t, int64_t) { return 0; }  // the slots come with the inputs: nothing to read ahead
};

using ExpertWorker = wsnative::FlagWorker<ExpertJob>;

// One job from the tensors (all in host memory: x [T, D] contiguous bf16 or fp32, slot [T, K]
// int32, rw [T, K] fp32, y [T, D] fp32, all contiguous; the weights as describe_weights takes
// them, in x's dtype). isa: the path asked for (-1 auto), lowered as for forward; a path this CPU
// lacks is refused here. Throws (c10::Error) naming what does not match.
static ExpertJob describe_job(const at::Tensor& x, const at::Tensor& slot, const at::Tensor& rw, const at::Tensor& w13, const at::Tensor& w2,
                              const at::Tensor& y, int64_t isa, int64_t threads) {
  TORCH_CHECK(x.device().is_cpu() && slot.device().is_cpu() && rw.device().is_cpu() && y.device().is_cpu(), "x, slot, rw and y must be in host memory");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, D] tensor, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32, got ", x.scalar_type());
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(slot.dim() == 2 && slot.size(0) == T && slot.scalar_type() == at::kInt && slot.is_contiguous(), "slot must be contiguous int32 [T, K] with T = ",
              T, ", got ", slot.sizes(), " ", slot.scalar_type());
  const int64_t K = slot.size(1);
  TORCH_CHECK(rw.sizes() == slot.sizes() && rw.scalar_type() == at::kFloat && rw.is_contiguous(), "rw must be contiguous fp32 [", T, ", ", K, "], got ",
              rw.sizes(), " ", rw.scalar_type());
  TORCH_CHECK(y.dim() == 2 && y.size(0) == T && y.size(1) == D && y.scalar_type() == at::kFloat && y.is_contiguous(), "y must be contiguous fp32 [", T,
              ", ", D, "], got ", y.sizes(), " ", y.scalar_type());
  ExpertJob j;
  j.W = describe_weights(w13, w2, x.scalar_type(), D);
  j.x = x.data_ptr();
  j.slot = slot.data_ptr<int32_t>();
  j.rw = rw.data_ptr<float>();
  j.y = y.data_ptr<float>();
  j.T = T; j.K = K;
  j.isa = choose(isa, j.W.bf16, D, j.W.I);
  j.threads = std::max<int64_t>(1, threads);
  return j;
}

}  // namespace wsmoe
