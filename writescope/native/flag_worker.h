// A persistent native worker driven by int32 flags in pinned memory (writescope/native/flag_worker.py
// drives it from Python): the generic part of the CPU attention worker (attention/cpu_worker.h)
// and of the host-expert worker (moe/expert_worker.h).
//
// One std::thread, started once, that never touches Python: jobs are queued by submit() and run
// in order. A job first waits until its inputs are in host memory: the int32 `ready` flag reaches
// the job's value (set there by the GPU stream after the inputs' copies, or by the host). It then
// runs on its OpenMP team (the worker thread and threads - 1 more), writes its outputs (pinned
// memory) and sets the int32 `done` flag to the job's value after them (a release store): a GPU
// stream or a host waits on that flag. Flag values are sequence numbers compared modulo 2^32 (a
// signed difference). A failed job records its error (the first one is kept until taken), fills
// its outputs with NaN and still sets its done flag, so nothing waits forever and nothing reads
// stale results as if they were right.
// With set_trace(true) each job also records when the worker took it from the queue, when it saw
// its inputs (the ready flag) and when it was done (just before its done flag), in steady_clock
// nanoseconds (CLOCK_MONOTONIC on Linux, Python's time.perf_counter_ns): writescope/bench/timeline.py
// lays them beside the GPU's.
//
// The job type J (moved into the queue, run on the worker thread, never taking the GIL) has:
//   static constexpr size_t COUNTS;          what run() counts (attention: keys; experts: bytes, experts)
//   static constexpr const char* NAME;       the worker in errors ("the CPU attention worker")
//   static constexpr const char* INPUT;      what the job waits for in errors ("q")
//   std::array<int64_t, COUNTS> run();       the work; throws std::exception on failure
//   void poison();                           fill the outputs with NaN (after a failure)
//   int64_t preread(const volatile int32_t* ready, int32_t value, int64_t budget);
//       read ahead (up to budget bytes, stopping once ready reaches value) while the inputs have
//       not come; returns the bytes read (called only with preread_bytes > 0)
#pragma once
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace wsnative {

static inline bool reached(const volatile int32_t* flag, int32_t value) { return (int32_t)((uint32_t)*flag - (uint32_t)value) >= 0; }

template <typename J>
class FlagWorker {
 public:
  using Counts = std::array<int64_t, J::COUNTS>;
  struct Done {
    int32_t value;  // the job's done value
    double seconds;  // from seeing its inputs to its done flag
    Counts counts;
  };

  // cpus: the CPUs the worker thread and its OpenMP team may run on (their threads inherit the worker
  // thread's mask when they are made, on its first job); empty: wherever the process may.
  // preread_bytes: while a job waits for its inputs, its team reads up to this many of the bytes it
  // will read first (J::preread); 0: it only spins
  explicit FlagWorker(int64_t threads, std::vector<int64_t> cpus = {}, int64_t preread_bytes = 0)
      : threads_(std::max<int64_t>(1, threads)), cpus_(std::move(cpus)), preread_bytes_(std::max<int64_t>(0, preread_bytes)),
        thread_([this] { loop(); }) {}
  ~FlagWorker() { close(); }
  FlagWorker(const FlagWorker&) = delete;
  FlagWorker& operator=(const FlagWorker&) = delete;

  void submit(J job, int32_t* ready, int32_t ready_value, int32_t* done, int32_t done_value) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      TORCH_CHECK(!stop_, J::NAME, " is closed");
      jobs_.push_back({std::move(job), ready, ready_value, done, done_value});
    }
    cv_.notify_one();
  }

  // Finishes the queued jobs whose inputs are (or become) ready and stops; a job still waiting for
  // them when stopping gives up (its done flag is set, with an error) instead of waiting forever.
  void close() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;
      stop_ = true;
      stopping_.store(true, std::memory_order_release);
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  std::string take_error() {
    if (!has_error_.load(std::memory_order_acquire)) return {};  // no lock on the issuing thread's path
    std::lock_guard<std::mutex> lk(mu_);
    has_error_.store(false, std::memory_order_relaxed);
    std::string e;
    e.swap(error_);
    return e;
  }

  // (jobs done, seconds running, the counts summed) since the start
  std::tuple<int64_t, double, Counts> totals() {
    std::lock_guard<std::mutex> lk(mu_);
    return {jobs_done_, seconds_, counts_};
  }

  // the jobs finished since the last call, in order (the last 4096 are kept)
  std::vector<Done> take_done() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<Done> out(done_log_.begin(), done_log_.end());
    done_log_.clear();
    return out;
  }

  int64_t threads() const { return threads_; }
  bool pinned() const { return pinned_.load(); }
  int64_t preread_total() const { return preread_total_.load(); }  // bytes pre-read since the start

  // Record each job's times from now on (on) or stop (off; what was recorded stays until taken).
  void set_trace(bool on) { tracing_.store(on, std::memory_order_relaxed); }

  // the jobs recorded since the last call: (done value, taken, inputs seen, done), ns of steady_clock, in order
  std::vector<std::tuple<int32_t, int64_t, int64_t, int64_t>> take_trace() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::tuple<int32_t, int64_t, int64_t, int64_t>> out(trace_.begin(), trace_.end());
    trace_.clear();
    return out;
  }

 private:
  struct Queued {
    J job;
    volatile int32_t* ready;
    int32_t ready_value;
    volatile int32_t* done;
    int32_t done_value;
  };

  void fail(const std::string& what) {
    std::lock_guard<std::mutex> lk(mu_);
    if (error_.empty()) error_ = what;
    has_error_.store(true, std::memory_order_release);
  }

  // the worker thread onto cpus_ (before its OpenMP team exists: the team inherits the mask); a CPU
  // list the OS refuses leaves the thread where it was
  void pin() {
    if (cpus_.empty()) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int64_t c : cpus_)
      if (c >= 0 && c < CPU_SETSIZE) CPU_SET((int)c, &set);
    pinned_ = pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
  }

  void loop() {
    pin();
    for (;;) {
      std::optional<Queued> one;  // the job taken (J need not be default-constructible)
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        one.emplace(std::move(jobs_.front()));
        jobs_.pop_front();
      }
      Queued& j = *one;
      const bool tracing = tracing_.load(std::memory_order_relaxed);
      const int64_t taken_ns = tracing ? now_ns() : 0;
      bool ready = true;
      // the inputs arrive within the layer: spin, then yield; the stop request read without the
      // lock, which the issuing thread takes to submit (a spinning waiter taking it each round held
      // submit up)
      for (int64_t spins = 0; !reached(j.ready, j.ready_value); ++spins) {
        if (spins == 1024 && preread_bytes_ > 0) {  // still no inputs after a short spin: read what the job reads first
          try {
            preread_total_ += j.job.preread(j.ready, j.ready_value, preread_bytes_);
          } catch (const std::exception&) {  // a failed pre-read costs nothing but its time
          }
        }
        if (spins > 4096) {
          if (stopping_.load(std::memory_order_acquire) && !reached(j.ready, j.ready_value)) { ready = false; break; }
          std::this_thread::yield();
        } else {
          _mm_pause();
        }
      }
      std::atomic_thread_fence(std::memory_order_acquire);  // the inputs' bytes after the flag that says they are there
      const auto t0 = std::chrono::steady_clock::now();
      const int64_t seen_ns = tracing ? now_ns() : 0;
      Counts counts{};
      bool ok = ready;
      if (!ready) fail(std::string(J::NAME) + " was closed while a job waited for its " + J::INPUT);
      else {
        try {
          counts = j.job.run();
        } catch (const std::exception& e) {
          fail(e.what());
          ok = false;
          counts = Counts{};
        }
      }
      if (!ok) j.job.poison();  // whoever consumes a failed job's outputs sees NaN, not stale memory
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      {
        std::lock_guard<std::mutex> lk(mu_);
        jobs_done_ += 1; seconds_ += dt;
        for (size_t i = 0; i < counts.size(); ++i) counts_[i] += counts[i];
        if (done_log_.size() == 4096) done_log_.pop_front();  // unread entries beyond that are dropped
        done_log_.push_back({j.done_value, dt, counts});
      }
      if (tracing) {  // before the flag: whoever sees the job done finds its entry
        const int64_t done_ns = now_ns();
        std::lock_guard<std::mutex> lk(mu_);
        if (trace_.size() == MAX_TRACE) trace_.pop_front();  // unread entries beyond that are dropped
        trace_.push_back({j.done_value, taken_ns, seen_ns, done_ns});
      }
      std::atomic_thread_fence(std::memory_order_release);  // the outputs before the flag
      *j.done = j.done_value;
    }
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  static constexpr size_t MAX_TRACE = 1 << 16;

  const int64_t threads_;
  const std::vector<int64_t> cpus_;
  const int64_t preread_bytes_;
  std::atomic<int64_t> preread_total_{0};
  std::atomic<bool> pinned_{false};
  std::atomic<bool> stopping_{false}, has_error_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> jobs_;
  bool stop_ = false;
  std::string error_;
  int64_t jobs_done_ = 0;
  double seconds_ = 0.0;
  Counts counts_{};
  std::deque<Done> done_log_;
  std::atomic<bool> tracing_{false};
  std::deque<std::tuple<int32_t, int64_t, int64_t, int64_t>> trace_;
  std::thread thread_;  // last: started once the members above exist
};

// Host side of a wait: returns once flag reaches value (True) or after timeout_s (False); the GIL is
// released by the binding.
static bool wait_flag(const volatile int32_t* flag, int32_t value, double timeout_s) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t spins = 0; !reached(flag, value); ++spins) {
    if (spins > 4096) {
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::yield();
    } else {
      _mm_pause();
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return true;
}

// flags[index] of a contiguous int32 host vector (the flags a worker and its Python side share)
static int32_t* flag_ptr(const at::Tensor& flags, int64_t index) {
  TORCH_CHECK(flags.scalar_type() == at::kInt && flags.is_contiguous() && flags.dim() == 1, "flags must be a contiguous int32 vector");
  TORCH_CHECK(index >= 0 && index < flags.numel(), "flag index ", index, " outside ", flags.numel(), " flags");
  TORCH_CHECK(flags.device().is_cpu(), "flags must be in host memory");
  return flags.data_ptr<int32_t>() + index;
}

// The bindings every FlagWorker<J> shares, on `cls` (py::class_<FlagWorker<J>>): the constructor,
// close (GIL released), take_error, totals -> (jobs, seconds, *counts), take_done -> [(done value,
// seconds, *counts)], set_trace, take_trace, threads, pinned, preread_total; and the module's
// wait_flag(flags, index, value, timeout_s) (GIL released). The job's submit is bound by its module.
template <typename J, typename Cls>
static void bind_flag_worker(py::module_& m, Cls& cls) {
  using W = FlagWorker<J>;
  auto flat = [](auto head, const typename W::Counts& c) {
    py::tuple t(std::tuple_size<decltype(head)>::value + c.size());
    size_t i = 0;
    std::apply([&](auto&&... h) { ((t[i++] = py::cast(h)), ...); }, head);
    for (int64_t v : c) t[i++] = py::cast(v);
    return t;
  };
  cls.def(py::init<int64_t, std::vector<int64_t>, int64_t>(), py::arg("threads"), py::arg("cpus") = std::vector<int64_t>{},
          py::arg("preread_bytes") = 0)
      .def("close", &W::close, py::call_guard<py::gil_scoped_release>())
      .def("take_error", &W::take_error)
      .def("totals", [flat](W& w) {
        auto [jobs, secs, counts] = w.totals();
        return flat(std::make_tuple(jobs, secs), counts);
      })
      .def("take_done", [flat](W& w) {
        py::list out;
        for (const auto& d : w.take_done()) out.append(flat(std::make_tuple(d.value, d.seconds), d.counts));
        return out;
      })
      .def("set_trace", &W::set_trace, py::arg("on"))
      .def("take_trace", &W::take_trace)
      .def_property_readonly("threads", &W::threads)
      .def_property_readonly("pinned", &W::pinned)
      .def_property_readonly("preread_total", &W::preread_total);
  m.def("wait_flag", [](at::Tensor flags, int64_t index, int32_t value, double timeout_s) { return wait_flag(flag_ptr(flags, index), value, timeout_s); },
        "wait (GIL released) until flags[index] reaches value; False after timeout_s", py::call_guard<py::gil_scoped_release>());
}

}  // namespace wsnative
