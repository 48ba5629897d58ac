// A persistent native worker for the CPU attention (writescope/attention/cpu_worker.py drives it).
//
// One std::thread, started once, that never touches Python: jobs (one layer's Request each) are
// queued by submit() and run in order. A job first waits until its q is in host memory: the int32
// `ready` flag in pinned memory reaches the job's value (set there by the GPU stream after q's copy,
// or by the host). It then attends on its OpenMP team (the worker thread and threads - 1 more),
// writes (o, lse) where the Request says (pinned memory), and sets the int32 `done` flag to the
// job's value after its outputs (a release store): a GPU stream or a host waits on that flag. Flag
// values are sequence numbers compared modulo 2^32 (a signed difference). A failed job records
// its error (the first one is kept until taken), fills its outputs with NaN and still sets its done
// flag, so nothing waits forever and nothing reads stale results as if they were right.
// With set_trace(true) each job also records when the worker took it from the queue, when it saw
// its q (the ready flag) and when it was done (just before its done flag), in steady_clock nanoseconds (CLOCK_MONOTONIC
// on Linux, Python's time.perf_counter_ns): writescope/bench/timeline.py lays them beside the GPU's.
#pragma once
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <vector>
#include <mutex>
#include <string>
#include <thread>

namespace ws {

static inline bool reached(const volatile int32_t* flag, int32_t value) { return (int32_t)((uint32_t)*flag - (uint32_t)value) >= 0; }

class Worker {
 public:
  // cpus: the CPUs the worker thread and its OpenMP team may run on (their threads inherit the worker
  // thread's mask when they are made, on its first job); empty: wherever the process may.
  // preread_bytes: while a job waits for its q, its team reads up to this many of the bytes it will
  // read first (cpu_kernel.cpp, preread); 0: it only spins
  explicit Worker(int64_t threads, std::vector<int64_t> cpus = {}, int64_t preread_bytes = 0)
      : threads_(std::max<int64_t>(1, threads)), cpus_(std::move(cpus)), preread_bytes_(std::max<int64_t>(0, preread_bytes)),
        thread_([this] { loop(); }) {}
  ~Worker() { close(); }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void submit(Request r, int32_t* ready, int32_t ready_value, int32_t* done, int32_t done_value) {
    r.threads = threads_;
    {
      std::lock_guard<std::mutex> lk(mu_);
      TORCH_CHECK(!stop_, "the CPU attention worker is closed");
      jobs_.push_back({std::move(r), ready, ready_value, done, done_value});
    }
    cv_.notify_one();
  }

  // Finishes the queued jobs whose q is (or becomes) ready and stops; a job still waiting for its q
  // when stopping gives up (its done flag is set, with an error) instead of waiting forever.
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

  // (jobs done, seconds attending, keys attended) since the start
  std::tuple<int64_t, double, int64_t> totals() {
    std::lock_guard<std::mutex> lk(mu_);
    return {jobs_done_, seconds_, keys_};
  }

  // the jobs finished since the last call: (done value, seconds, keys) each, in order
  std::vector<std::tuple<int32_t, double, int64_t>> take_done() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::tuple<int32_t, double, int64_t>> out(done_log_.begin(), done_log_.end());
    done_log_.clear();
    return out;
  }

  int64_t threads() const { return threads_; }
  bool pinned() const { return pinned_.load(); }
  int64_t preread_total() const { return preread_total_.load(); }  // bytes pre-read since the start

  // Record each job's times from now on (on) or stop (off; what was recorded stays until taken).
  void set_trace(bool on) { tracing_.store(on, std::memory_order_relaxed); }

  // the jobs recorded since the last call: (done value, taken, q seen, done), ns of steady_clock, in order
  std::vector<std::tuple<int32_t, int64_t, int64_t, int64_t>> take_trace() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::tuple<int32_t, int64_t, int64_t, int64_t>> out(trace_.begin(), trace_.end());
    trace_.clear();
    return out;
  }

 private:
  struct Job {
    Request r;
    volatile int32_t* ready;
    int32_t ready_value;
    volatile int32_t* done;
    int32_t done_value;
  };

  static void poison(const Request& r) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::fill(r.o, r.o + r.B * r.H * r.G * r.dv, nan);
    std::fill(r.lse, r.lse + r.B * r.H * r.G, nan);
  }

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
      Job j;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        j = std::move(jobs_.front());
        jobs_.pop_front();
      }
      const bool tracing = tracing_.load(std::memory_order_relaxed);
      const int64_t taken_ns = tracing ? now_ns() : 0;
      bool ready = true;
      // q arrives within the layer: spin, then yield; the stop request read without the lock, which
      // the issuing thread takes to submit (a spinning waiter taking it each round held submit up)
      for (int64_t spins = 0; !reached(j.ready, j.ready_value); ++spins) {
        if (spins == 1024 && preread_bytes_ > 0) {  // still no q after a short spin: read what the job reads first
          try {
            preread_total_ += preread(j.r, j.ready, j.ready_value, preread_bytes_);
          } catch (const std::exception& e) {  // a failed pre-read costs nothing but its time
          }
        }
        if (spins > 4096) {
          if (stopping_.load(std::memory_order_acquire) && !reached(j.ready, j.ready_value)) { ready = false; break; }
          std::this_thread::yield();
        } else {
          _mm_pause();
        }
      }
      std::atomic_thread_fence(std::memory_order_acquire);  // q's bytes after the flag that says they are there
      const auto t0 = std::chrono::steady_clock::now();
      const int64_t seen_ns = tracing ? now_ns() : 0;
      int64_t keys = 0;
      bool ok = ready;
      if (!ready) fail("the CPU attention worker was closed while a job waited for its q");
      else {
        try {
          keys = run_request(j.r);
        } catch (const std::exception& e) {
          fail(e.what());
          ok = false;
        }
      }
      if (!ok) poison(j.r);  // whoever consumes a failed job's outputs sees NaN, not stale memory
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      {
        std::lock_guard<std::mutex> lk(mu_);
        jobs_done_ += 1; seconds_ += dt; keys_ += keys;
        if (done_log_.size() == 4096) done_log_.pop_front();  // unread entries beyond that are dropped
        done_log_.push_back({j.done_value, dt, keys});
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
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::string error_;
  int64_t jobs_done_ = 0, keys_ = 0;
  double seconds_ = 0.0;
  std::deque<std::tuple<int32_t, double, int64_t>> done_log_;
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

}  // namespace ws
