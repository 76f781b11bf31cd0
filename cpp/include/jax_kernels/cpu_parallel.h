// CPU threading for the kernels: parallel_for splits [0, n) into one contiguous chunk per thread
// of a small persistent pool whose idle workers sleep. Every index is handled by exactly one
// thread with the same code, so results never depend on the thread count or on scheduling.
//
// Not OpenMP: its default spin-wait keeps idle workers burning the cores XLA's own threads
// need, which made every op about 10x slower on a loaded 2-core machine. Waiting threads spin
// briefly before they sleep (JAX_KERNELS_SPIN_US microseconds, 200 by default; 0 sleeps at
// once): a sleeping core of a virtual machine may be handed to another guest, and waking it
// for the next call then cost a dense conv2d on 2 vCPUs a third of its time.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace jax_kernels {
namespace detail {
inline void cpu_relax() {
#if defined(__SSE2__)
  _mm_pause();
#endif
}

// Spins until done() or `microseconds` have passed; returns done().
template <class Done>
bool spin_until(int64_t microseconds, Done&& done) {
  if (microseconds <= 0) return done();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(microseconds);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}
}  // namespace detail
}  // namespace jax_kernels

namespace jax_kernels {

// The caller's floating-point control state, which workers adopt for a task: XLA's CPU threads
// flush subnormals to zero, and a chunk must not round differently on a worker thread.
struct FloatControl {
#if defined(__SSE__)
  unsigned csr = _mm_getcsr();
  void apply() const { _mm_setcsr(csr); }
#else
  void apply() const {}
#endif
};

class ThreadPool {
 public:
  // Threads in all, the caller included: JAX_KERNELS_NUM_THREADS, else the hardware's count.
  static ThreadPool& instance() {
    static ThreadPool pool(configured_threads());
    return pool;
  }

  int threads() const { return int(workers_.size()) + 1; }

  // Runs task(c) for c in [0, chunks), chunks <= threads(), and returns when all are done.
  // Returns false without running anything when the pool is busy (a concurrent or nested
  // call); the caller then runs the work itself. If chunks throw (std::bad_alloc, ...), every
  // chunk still finishes before the task goes out of scope, and the first exception is rethrown
  // here, on the caller's thread, as a single-threaded run would throw it.
  bool try_run(int chunks, const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      control_ = FloatControl{};
      chunks_ = chunks;
      pending_.store(chunks - 1);
      failure_ = nullptr;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    std::exception_ptr failure;
    try {
      task(0);
    } catch (...) {
      failure = std::current_exception();
    }
    detail::spin_until(spin_us_, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [&] { return pending_.load() == 0; });
      task_ = nullptr;
      if (!failure) failure = failure_;
      failure_ = nullptr;
    }
    if (failure) std::rethrow_exception(failure);
    return true;
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

 private:
  explicit ThreadPool(int threads) : spin_us_(configured_spin_us()) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }

  static int configured_threads() {
    if (const char* env = std::getenv("JAX_KERNELS_NUM_THREADS")) {
      const int n = std::atoi(env);
      if (n > 0) return n;
    }
    return std::max(1u, std::thread::hardware_concurrency());
  }

  static int64_t configured_spin_us() {
    if (const char* env = std::getenv("JAX_KERNELS_SPIN_US")) {
      const long n = std::atol(env);
      if (n >= 0) return n;
    }
    return 200;
  }

  void work(int index) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* task;
      FloatControl control;
      detail::spin_until(spin_us_, [&] {
        return stop_.load(std::memory_order_acquire) ||
               generation_.load(std::memory_order_acquire) != seen;
      });
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
        if (stop_.load()) return;
        seen = generation_.load();
        if (index >= chunks_) continue;
        task = task_;
        control = control_;
      }
      control.apply();
      std::exception_ptr failure;
      try {
        (*task)(index);
      } catch (...) {  // an exception must not leave a worker: the caller rethrows it
        failure = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure && !failure_) failure_ = failure;
      if (pending_.fetch_sub(1) == 1) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex busy_;   // one parallel_for at a time
  std::mutex mutex_;  // guards the fields below
  std::condition_variable wake_, done_;
  const std::function<void(int)>* task_ = nullptr;
  FloatControl control_;
  int chunks_ = 0;
  std::atomic<int> pending_{0};            // written under mutex_; read by the spinning caller
  std::exception_ptr failure_;  // the first exception a worker's chunk threw
  std::atomic<uint64_t> generation_{0};    // written under mutex_; read by spinning workers
  std::atomic<bool> stop_{false};          // written under mutex_; read by spinning workers
  int64_t spin_us_;                        // how long waiting threads spin before they sleep
};

// Threads parallel_for may use, the caller included (for sizing work splits).
inline int parallel_threads() { return ThreadPool::instance().threads(); }

// Calls body(begin, end) on disjoint chunks covering [0, n). Runs serially when the work is
// below `grain` items per extra thread, where waking threads would cost more than it saves.
template <class Body>
void parallel_for(int64_t n, int64_t grain, Body&& body) {
  if (n <= 0) return;
  ThreadPool& pool = ThreadPool::instance();
  const int64_t chunks =
      std::min<int64_t>(pool.threads(), std::max<int64_t>(1, n / std::max<int64_t>(grain, 1)));
  if (chunks > 1) {
    const std::function<void(int)> task = [&](int c) {
      const int64_t begin = n * c / chunks, end = n * (c + 1) / chunks;
      if (begin < end) body(begin, end);
    };
    if (pool.try_run(int(chunks), task)) return;
  }
  body(int64_t{0}, n);
}

// Calls body(begin, end) on disjoint runs covering [0, n), `grain` items at a time, each run
// taken by whichever thread is free next (an atomic counter), so that a thread slowed down (a
// busy or descheduled core) takes fewer runs instead of holding up the others. The runs do not
// depend on the thread count; which thread runs one does, so a body must compute each item the
// same way on any thread (per-thread scratch is fine when every item rewrites what it reads).
template <class Body>
void parallel_for_dynamic(int64_t n, int64_t grain, Body&& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t runs = (n + grain - 1) / grain;
  ThreadPool& pool = ThreadPool::instance();
  const int64_t chunks = std::min<int64_t>(pool.threads(), runs);
  if (chunks > 1) {
    std::atomic<int64_t> next{0};
    const std::function<void(int)> task = [&](int) {
      for (int64_t run; (run = next.fetch_add(1)) < runs;)
        body(run * grain, std::min(n, (run + 1) * grain));
    };
    if (pool.try_run(int(chunks), task)) return;
  }
  body(int64_t{0}, n);
}

}  // namespace jax_kernels
