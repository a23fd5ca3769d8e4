// The process's one CPU thread pool, shared by every kernel of the localmoe CPU library
// (kernels/_cpu/__init__.py builds all the kernel sources into one shared object).
//
// No OpenMP: libgomp's long spin-waiting made 2 threads 6x slower than 1 on a shared machine.
// The caller and the workers take chunks of [0, total) from an atomic counter, so a core busy
// with another process just takes fewer chunks; idle workers spin ~50 us (decode calls come every
// few tens of us), then sleep on a condition variable. `pool()` is an inline function, so its
// static is one object for the whole library, whichever source includes this header.
#pragma once

#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace localmoe {

struct Job {
  void (*fn)(const void* ctx, int64_t begin, int64_t end);
  const void* ctx;
  int64_t total, chunk, nchunks;
};

class Pool {
 public:
  // Runs job over `threads` threads (the caller included); returns when every chunk is done.
  void run(const Job& job, int threads) {
    const int helpers = static_cast<int>(std::min<int64_t>(threads - 1, job.nchunks - 1));
    if (helpers <= 0) {
      job.fn(job.ctx, 0, job.total);
      return;
    }
    std::lock_guard<std::mutex> serial(call_mu_);  // one job at a time (other callers queue)
    for (; workers_ < helpers; ++workers_) std::thread([this, id = workers_] { loop(id); }).detach();
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = job;
      next_.store(0, std::memory_order_relaxed);
      open_ = true;
      wanted_ = helpers;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work();
    {
      std::lock_guard<std::mutex> lk(mu_);
      open_ = false;  // no worker joins after this; those inside finish their chunk
    }
    for (int spin = 0; active_.load(std::memory_order_acquire) != 0; ++spin) {
      if (spin < 1 << 14) _mm_pause();
      else std::this_thread::yield();
    }
  }

  const pid_t pid = getpid();

 private:
  void work() {
    for (int64_t c; (c = next_.fetch_add(1, std::memory_order_relaxed)) < job_.nchunks;)
      job_.fn(job_.ctx, c * job_.chunk, std::min(job_.total, (c + 1) * job_.chunk));
  }

  void loop(int id) {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      // Spin ~50 us for the next call, then sleep.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      for (int spin = 1; generation_.load(std::memory_order_acquire) == seen; ++spin) {
        _mm_pause();
        if (spin % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
      seen = generation_.load(std::memory_order_relaxed);
      if (!open_ || id >= wanted_) continue;
      active_.fetch_add(1, std::memory_order_acq_rel);
      lk.unlock();
      work();
      active_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  int workers_ = 0;  // detached threads, never joined: the pool lives as long as the process
  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> active_{0};
  Job job_{};
  bool open_ = false;
  int wanted_ = 0;
};

inline Pool& pool() {
  // Never destroyed (detached workers use it until exit); a forked child, which inherits the
  // object but not the threads, gets a fresh one.
  static std::atomic<Pool*> current{nullptr};
  static std::mutex mu;
  Pool* p = current.load(std::memory_order_acquire);
  if (p == nullptr || p->pid != getpid()) {
    std::lock_guard<std::mutex> lk(mu);
    p = current.load(std::memory_order_relaxed);
    if (p == nullptr || p->pid != getpid()) current.store(p = new Pool(), std::memory_order_release);
  }
  return *p;
}

// fn(ctx, begin, end) over chunks of `chunk` items of [0, total), on `threads` threads.
inline void parallel(void (*fn)(const void*, int64_t, int64_t), const void* ctx, int64_t total, int64_t chunk,
                     int threads) {
  chunk = std::max<int64_t>(chunk, 1);
  pool().run(Job{fn, ctx, total, chunk, (total + chunk - 1) / chunk}, threads);
}

constexpr int64_t kChunkBytes = 64 << 10;  // weight bytes per chunk of work (a few microseconds)

}  // namespace localmoe
