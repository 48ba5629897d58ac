// The persistent native worker for the CPU attention (writescope/attention/cpu_worker.py drives it):
// writescope/native/flag_worker.h's FlagWorker over one layer's attention Request per job.
//
// A job waits until its q is in host memory (the ready flag), attends on the worker's OpenMP team,
// writes (o, lse) where the Request says (pinned memory) and sets its done flag; a failed job
// fills (o, lse) with NaN. While a job waits for its q, its team may read ahead the first bytes it
// will read (preread, cpu_kernel.cpp). Each job counts the keys it attended.
#pragma once
#include <algorithm>
#include <array>
#include <limits>

#include "flag_worker.h"

namespace ws {

using wsnative::reached;
using wsnative::wait_flag;

struct AttentionJob {
  static constexpr size_t COUNTS = 1;  // keys attended
  static constexpr const char* NAME = "the CPU attention worker";
  static constexpr const char* INPUT = "q";
  Request r;

  std::array<int64_t, 1> run() { return {run_request(r)}; }
  void poison() {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::fill(r.o, r.o + r.B * r.H * r.G * r.dv, nan);
    std::fill(r.lse, r.lse + r.B * r.H * r.G, nan);
  }
  int64_t preread(const volatile int32_t* ready, int32_t value, int64_t budget) { return ws::preread(r, ready, value, budget); }
};

using Worker = wsnative::FlagWorker<AttentionJob>;

}  // namespace ws
