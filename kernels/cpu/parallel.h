// Private to kernels/cpu: a small persistent thread pool and ParallelFor over it.
//
// One process-wide pool of (hardware threads - 1) workers; the calling thread works too. Threads
// are created once (first use), so a call costs a condition-variable wake-up, not thread creation,
// which matters for decode where every op is small. A call that finds the pool busy (another
// thread's op, or a ParallelFor nested inside a worker) runs its range inline on the caller, so
// calls are reentrant and never deadlock. TANDEM_CPU_THREADS=<n> caps the threads (1: serial).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::kernels::cpu::internal {

class ThreadPool {
 public:
  static ThreadPool& Get() {
    static ThreadPool pool(DefaultThreads());
    return pool;
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  // Threads a job can use, the caller included.
  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(c) once for every chunk c in [0, num_chunks), spread over the pool; returns when all
  // are done. Runs everything on the caller when the pool is busy.
  void Run(int64_t num_chunks, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> submit(submit_mu_, std::try_to_lock);
    if (!submit.owns_lock() || workers_.empty() || num_chunks <= 1) {
      for (int64_t c = 0; c < num_chunks; ++c) fn(c);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      num_chunks_ = num_chunks;
      next_chunk_.store(0, std::memory_order_relaxed);
      job_open_ = true;
      ++generation_;
    }
    wake_.notify_all();
    Drain();
    // Close the job: workers that have not woken yet (a busy machine) skip it, so the caller
    // waits only for those already running chunks.
    std::unique_lock<std::mutex> lock(mu_);
    job_open_ = false;
    done_.wait(lock, [this] { return active_workers_ == 0; });
    fn_ = nullptr;
  }

 private:
  explicit ThreadPool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  static int DefaultThreads() {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("TANDEM_CPU_THREADS")) {
      const int v = std::atoi(env);
      if (v > 0) n = v;
    }
    return std::clamp(n, 1, 256);
  }

  void Drain() {
    for (;;) {
      const int64_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed);
      if (c >= num_chunks_) return;
      (*fn_)(c);
    }
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (!job_open_) continue;
        ++active_workers_;
      }
      Drain();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (--active_workers_ == 0) done_.notify_one();
      }
    }
  }

  std::mutex submit_mu_;  // one job at a time; held by the submitting thread
  std::mutex mu_;         // guards everything below except next_chunk_
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t num_chunks_ = 0;
  std::atomic<int64_t> next_chunk_{0};
  int active_workers_ = 0;  // workers inside Drain() of the open job
  bool job_open_ = false;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// Calls fn(begin, end) over disjoint subranges covering [0, n). `grain` is the smallest range
// worth a thread; a range of at most `grain` items runs inline on the caller.
inline void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  ThreadPool& pool = ThreadPool::Get();
  // A few chunks per thread balance uneven work (ragged attention rows) without much overhead.
  const int64_t max_chunks = static_cast<int64_t>(pool.num_threads()) * 4;
  const int64_t chunks = std::min(max_chunks, (n + grain - 1) / grain);
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  pool.Run(chunks, [&](int64_t c) { fn(n * c / chunks, n * (c + 1) / chunks); });
}

}  // namespace tandem::kernels::cpu::internal
