// A persistent native worker driven by int32 flags in pinned memory (writescope/native/flag_worker.py
// drives it from Python): the generic part of the CPU attention worker (attention/cpu_worker.h)
// and of the host-expert worker (moe/expert_worker.h).
//
// Jobs are queued by submit() and run in order on an Executor's thread, which never touches
// Python: the worker's own (made with it), or one shared by several workers, also of other
// extension modules (writescope/native/team.py: the attention and the expert jobs of a decode step
// on one thread and so on one OpenMP team, in the order they were submitted, which is the order the
// stream needs them in). A job first waits until its inputs are in host memory: the int32 `ready`
// flag reaches the job's value (set there by the GPU stream after the inputs' copies, or by the
// host). It then runs on the executor thread's OpenMP team (that thread and threads - 1 more),
// writes its outputs (pinned memory) and sets the int32 `done` flag to the job's value after them
// (a release store): a GPU stream or a host waits on that flag. A job whose inputs have not come
// INPUT_WAIT_S after its submit gives up (an error), so no job holds a shared thread forever, nor
// a backlog behind one longer than that. Flag values are sequence numbers compared modulo 2^32 (a
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
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace wsnative {

static inline bool reached(const volatile int32_t* flag, int32_t value) { return (int32_t)((uint32_t)*flag - (uint32_t)value) >= 0; }

// A task run on an executor's thread: fn(arg, stopping), where *stopping becomes nonzero once the
// executor is closing (a task waiting for something that may never come gives up then). A plain C
// function pointer and a void*: an executor made by one extension module runs tasks of another.
using TaskFn = void (*)(void* arg, const std::atomic<int32_t>* stopping);

// One std::thread, started once, that runs posted tasks in order (never touching Python). cpus:
// the CPUs the thread may run on, set before its first task (its OpenMP team, made on the first
// parallel region, inherits the mask); empty: wherever the process may.
class Executor {
 public:
  explicit Executor(std::vector<int64_t> cpus = {}) : cpus_(std::move(cpus)), thread_([this] { loop(); }) {}
  ~Executor() { close(); }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // queue fn(arg); false once the executor is closed (nothing queued)
  bool post(TaskFn fn, void* arg) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return false;
      tasks_.push_back({fn, arg});
    }
    cv_.notify_one();
    return true;
  }

  // run what is queued (each task sees stopping set), then stop the thread; every caller returns
  // after the thread has stopped
  void close() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      stopping_.store(1, std::memory_order_release);
    }
    cv_.notify_one();
    std::lock_guard<std::mutex> j(join_mu_);
    if (thread_.joinable()) thread_.join();
  }

  bool pinned() const { return pinned_.load(); }
  int64_t tasks_run() const { return tasks_run_.load(); }

 private:
  void loop() {
    if (!cpus_.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int64_t c : cpus_)
        if (c >= 0 && c < CPU_SETSIZE) CPU_SET((int)c, &set);
      pinned_ = pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;  // refused: the thread stays where it was
    }
    for (;;) {
      std::pair<TaskFn, void*> t;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        t = tasks_.front();
        tasks_.pop_front();
      }
      t.first(t.second, &stopping_);  // not under the lock: the task may take its worker's, which submit holds while posting
      tasks_run_ += 1;
    }
  }

  const std::vector<int64_t> cpus_;
  std::atomic<bool> pinned_{false};
  std::atomic<int64_t> tasks_run_{0};
  std::atomic<int32_t> stopping_{0};
  std::mutex mu_, join_mu_;
  std::condition_variable cv_;
  std::deque<std::pair<TaskFn, void*>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members above exist
};

// Executor::post through a plain function pointer (what a worker of another module calls)
static bool executor_post(void* executor, TaskFn fn, void* arg) { return static_cast<Executor*>(executor)->post(fn, arg); }
using PostFn = bool (*)(void*, TaskFn, void*);

static constexpr double INPUT_WAIT_S = 60.0;  // the longest a job waits for its inputs (writescope/native/flag_worker.py's WAIT_SECONDS)

template <typename J>
class FlagWorker {
 public:
  using Counts = std::array<int64_t, J::COUNTS>;
  struct Done {
    int32_t value;  // the job's done value
    double seconds;  // from seeing its inputs to its done flag
    Counts counts;
  };

  // cpus: the CPUs the worker's own executor thread and its OpenMP team may run on (empty:
  // wherever the process may; unused with a shared executor, whose own CPUs stand).
  // preread_bytes: while a job waits for its inputs, its team reads up to this many of the bytes it
  // will read first (J::preread); 0: it only spins.
  // executor, post: a shared Executor's address and its module's executor_post (as integers, from
  // Python); 0: the worker makes its own. A shared executor must outlive the worker (team.py: the
  // Python worker holds the team).
  explicit FlagWorker(int64_t threads, std::vector<int64_t> cpus = {}, int64_t preread_bytes = 0, int64_t executor = 0, int64_t post = 0)
      : threads_(std::max<int64_t>(1, threads)), preread_bytes_(std::max<int64_t>(0, preread_bytes)) {
    TORCH_CHECK((executor == 0) == (post == 0), "give both the executor's address and its post function, or neither");
    if (executor == 0) {
      own_ = std::make_unique<Executor>(std::move(cpus));
      executor_ = own_.get();
      post_ = &executor_post;
    } else {
      executor_ = reinterpret_cast<void*>(executor);
      post_ = reinterpret_cast<PostFn>(post);
    }
  }
  ~FlagWorker() { close(); }
  FlagWorker(const FlagWorker&) = delete;
  FlagWorker& operator=(const FlagWorker&) = delete;

  void submit(J job, int32_t* ready, int32_t ready_value, int32_t* done, int32_t done_value) {
    std::lock_guard<std::mutex> lk(mu_);  // held while posting: the task posted takes this job, the queue's last
    TORCH_CHECK(!stop_, J::NAME, " is closed");
    jobs_.push_back({std::move(job), ready, ready_value, done, done_value, std::chrono::steady_clock::now()});
    if (!post_(executor_, &FlagWorker::task, this)) {
      jobs_.pop_back();
      TORCH_CHECK(false, J::NAME, ": its CPU team is closed");
    }
    ++pending_;
  }

  // Finishes the queued jobs whose inputs are (or become) ready and stops; a job still waiting for
  // them when stopping gives up (its done flag is set, with an error) instead of waiting forever.
  // With a shared executor the jobs queued there before this worker's wait their turn (each gives
  // up after INPUT_WAIT_S at most without its inputs).
  void close() {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (!stop_) {
        stop_ = true;
        stopping_.store(true, std::memory_order_release);
      }
      idle_.wait(lk, [&] { return pending_ == 0; });
    }
    if (own_) own_->close();
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
  bool pinned() const { return own_ && own_->pinned(); }  // a shared executor's: its team's (team.py)
  bool shared() const { return !own_; }
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
    std::chrono::steady_clock::time_point submitted;  // INPUT_WAIT_S counts from here: a backlog behind a job whose inputs never come gives up within it
  };

  void fail(const std::string& what) {
    std::lock_guard<std::mutex> lk(mu_);
    if (error_.empty()) error_ = what;
    has_error_.store(true, std::memory_order_release);
  }

  static void task(void* self, const std::atomic<int32_t>* stopping) { static_cast<FlagWorker*>(self)->run_one(stopping); }

  // One posted task: the oldest queued job, on the executor's thread.
  void run_one(const std::atomic<int32_t>* executor_stopping) {
    std::optional<Queued> one;  // the job taken (J need not be default-constructible)
    {
      std::lock_guard<std::mutex> lk(mu_);
      one.emplace(std::move(jobs_.front()));  // one task is posted per job, in order
      jobs_.pop_front();
    }
    Queued& j = *one;
    const bool tracing = tracing_.load(std::memory_order_relaxed);
    const int64_t taken_ns = tracing ? now_ns() : 0;
    bool ready = true, timed_out = false;
    // the inputs arrive within the layer: spin, then yield; the stop requests read without a lock
    // (the issuing thread takes this worker's to submit; a spinning waiter taking it each round
    // held submit up)
    for (int64_t spins = 0; !reached(j.ready, j.ready_value); ++spins) {
      if (spins == 1024 && preread_bytes_ > 0) {  // still no inputs after a short spin: read what the job reads first
        try {
          preread_total_ += j.job.preread(j.ready, j.ready_value, preread_bytes_);
        } catch (const std::exception&) {  // a failed pre-read costs nothing but its time
        }
      }
      if (spins > 4096) {
        if ((stopping_.load(std::memory_order_acquire) || executor_stopping->load(std::memory_order_acquire)) && !reached(j.ready, j.ready_value)) {
          ready = false;
          break;
        }
        if ((spins & 1023) == 0 && std::chrono::steady_clock::now() - j.submitted > std::chrono::duration<double>(INPUT_WAIT_S) &&
            !reached(j.ready, j.ready_value)) {
          ready = false; timed_out = true;
          break;
        }
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
    if (!ready)
      fail(timed_out ? std::string(J::NAME) + ": a job's " + J::INPUT + " did not come in " + std::to_string((int)INPUT_WAIT_S) + " s; it gave up"
                     : std::string(J::NAME) + " was closed while a job waited for its " + J::INPUT);
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
      if (tracing) {  // before the flag: whoever sees the job done finds its entry
        if (trace_.size() == MAX_TRACE) trace_.pop_front();  // unread entries beyond that are dropped
        trace_.push_back({j.done_value, taken_ns, seen_ns, now_ns()});
      }
    }
    std::atomic_thread_fence(std::memory_order_release);  // the outputs before the flag
    *j.done = j.done_value;
    one.reset();  // the job's own resources, before close() may return
    std::lock_guard<std::mutex> lk(mu_);  // notified under the lock: close() (and the worker's destruction) waits for it
    --pending_;
    idle_.notify_all();
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  static constexpr size_t MAX_TRACE = 1 << 16;

  const int64_t threads_;
  const int64_t preread_bytes_;
  std::atomic<int64_t> preread_total_{0};
  std::atomic<bool> stopping_{false}, has_error_{false};
  std::mutex mu_;
  std::condition_variable idle_;  // pending_ reached 0
  std::deque<Queued> jobs_;
  int64_t pending_ = 0;  // tasks posted and not yet finished
  bool stop_ = false;
  std::string error_;
  int64_t jobs_done_ = 0;
  double seconds_ = 0.0;
  Counts counts_{};
  std::deque<Done> done_log_;
  std::atomic<bool> tracing_{false};
  std::deque<std::tuple<int32_t, int64_t, int64_t, int64_t>> trace_;
  void* executor_ = nullptr;
  PostFn post_ = nullptr;
  std::unique_ptr<Executor> own_;  // last: destroyed (its thread joined) first, after close()
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
// seconds, *counts)], set_trace, take_trace, threads, pinned, shared, preread_total; and the
// module's Executor (address, post_address, pinned, tasks_run, close) and wait_flag(flags, index,
// value, timeout_s) (GIL released). The job's submit is bound by its module.
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
  cls.def(py::init<int64_t, std::vector<int64_t>, int64_t, int64_t, int64_t>(), py::arg("threads"), py::arg("cpus") = std::vector<int64_t>{},
          py::arg("preread_bytes") = 0, py::arg("executor") = 0, py::arg("post") = 0)
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
      .def_property_readonly("shared", &W::shared)
      .def_property_readonly("preread_total", &W::preread_total);
  {  // the executor a team of workers shares (writescope/native/team.py)
    py::class_<Executor>(m, "Executor", py::module_local())  // each module binds its own: the same C++ type in two modules
        .def(py::init<std::vector<int64_t>>(), py::arg("cpus") = std::vector<int64_t>{})
        .def("close", &Executor::close, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("pinned", &Executor::pinned)
        .def_property_readonly("tasks_run", &Executor::tasks_run)
        .def_property_readonly("address", [](Executor& e) { return reinterpret_cast<int64_t>(&e); })
        .def_property_readonly("post_address", [](Executor&) { return reinterpret_cast<int64_t>(&executor_post); });
  }
  m.def("wait_flag", [](at::Tensor flags, int64_t index, int32_t value, double timeout_s) { return wait_flag(flag_ptr(flags, index), value, timeout_s); },
        "wait (GIL released) until flags[index] reaches value; False after timeout_s", py::call_guard<py::gil_scoped_release>());
}

}  // namespace wsnative
