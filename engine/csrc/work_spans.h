// Splitting a parallel loop's units among the threads of one OpenMP region: each thread owns a
// contiguous span and takes units from its front; a thread whose span is empty takes units from
// the back of the fullest other span.
//
// Why not a static split: on shared hosts two threads given equal halves do not finish together
// (each waits on the other by turns, ~20% of a matmul region).  Why not `schedule(dynamic)` over
// chunks: every chunk starts on weights nobody prefetched (the kernels prefetch the groups that
// follow inside their own range), which cost as much as the balance won.  Owning a span keeps each
// thread's walk contiguous, so only stolen units start cold (measurements: benchmarks/HISTORY.md).
//
// Team size: every parallel region of the extension runs on the caller's whole OpenMP team (no
// `num_threads` clause), and a kernel that wants fewer threads leaves the rest of the team idle
// in the region.  libgomp ends the pool threads that a smaller team leaves out and starts new ones
// for the next bigger team, so regions of varying sizes made a thread or more per region (on a
// 16-core Xeon, batch-1 decode steps ran 19x slower on 8 threads than on 2).  torch's
// at::parallel_for keeps the whole team for the same reason (pytorch#32008).
// tests/engine/test_openmp_team.py checks that the threads stay.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include <omp.h>

namespace cpuserve_par {

// Weight bytes (times activation rows) per thread below which more threads cost more to wake than
// they save: small products run on fewer threads, the smallest on the caller's alone.
constexpr int64_t kParallelMinBytes = 96 * 1024;

// Threads for a product of `units` stealable units and `work` bytes of weights (times activation
// rows): one per kParallelMinBytes at most, since on many-core hosts a small matrix is not worth
// waking every thread of the pool; at least one, at most the team.
inline int product_threads(int64_t units, int64_t work) {
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(omp_get_max_threads()), units, work / kParallelMinBytes})));
}

class WorkSpans {
 public:
  // Units [0, units) over `threads` spans of (nearly) equal length.
  WorkSpans(int64_t units, int threads) : threads_(threads), spans_(new Span[threads]) {
    for (int i = 0; i < threads; ++i) spans_[i].bounds.store(pack(units * i / threads, units * (i + 1) / threads));
  }

  // Called by thread `me` of the region: fn(unit) for its own units, front first, then for units
  // taken from the back of others' spans until none is left.  Each unit runs exactly once.
  template <typename Fn>
  void run(int me, const Fn& fn) {
    for (int64_t u; (u = take(me, /*front=*/true)) >= 0;) fn(u);
    for (;;) {
      int victim = -1;
      int64_t most = 0;
      for (int i = 0; i < threads_; ++i) {
        const int64_t left = length(spans_[i].bounds.load(std::memory_order_relaxed));
        if (left > most) most = left, victim = i;
      }
      if (victim < 0) return;
      const int64_t u = take(victim, /*front=*/false);
      if (u >= 0) fn(u);
    }
  }

 private:
  // A span's [front, back) packed in one word, so that owner and thief claim units with one CAS.
  struct alignas(64) Span {
    std::atomic<uint64_t> bounds;
  };
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }
  static int64_t front(uint64_t b) { return static_cast<int64_t>(b & 0xffffffffu); }
  static int64_t back(uint64_t b) { return static_cast<int64_t>(b >> 32); }
  static int64_t length(uint64_t b) { return back(b) - front(b); }

  // One unit off span i's front or back, or -1 when the span is empty.
  int64_t take(int i, bool from_front) {
    std::atomic<uint64_t>& bounds = spans_[i].bounds;
    uint64_t b = bounds.load(std::memory_order_relaxed);
    while (length(b) > 0) {
      const uint64_t next = from_front ? pack(front(b) + 1, back(b)) : pack(front(b), back(b) - 1);
      if (bounds.compare_exchange_weak(b, next, std::memory_order_relaxed))
        return from_front ? front(b) : back(b) - 1;
    }
    return -1;
  }

  int threads_;
  std::unique_ptr<Span[]> spans_;
};

// fn(u) for every unit of a product over product_threads(units, work) threads of the caller's
// team (stolen from each other's spans), or on the caller's thread alone when that is one thread
// or the caller is already inside a parallel region.
template <typename Fn>
void run_units(int64_t units, int64_t work, const Fn& fn) {
  const int threads = product_threads(units, work);
  if (threads == 1 || omp_in_parallel()) {
    for (int64_t u = 0; u < units; ++u) fn(u);
    return;
  }
  WorkSpans spans(units, threads);
#pragma omp parallel  // the whole team, the work on its first `threads` (Team size, above)
  {
    const int me = omp_get_thread_num();
    if (me < std::min(threads, omp_get_num_threads())) spans.run(me, fn);
  }
}

}  // namespace cpuserve_par
