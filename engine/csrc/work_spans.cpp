// Test hook for work_spans.h: which thread ran each unit, with one thread held back so that the
// others must take its units.  It names its team size, which no serving path does (work_spans.h).
#include "ops.h"
#include "work_spans.h"

#include <omp.h>

#include <chrono>
#include <thread>

torch::Tensor work_spans_trace(int64_t units, int64_t threads, int64_t stalled_thread, int64_t stall_us,
                               int64_t unit_us) {
  TORCH_CHECK(units >= 0 && units < (int64_t{1} << 31) && threads >= 1, "work_spans_trace: bad sizes");
  torch::Tensor runs = torch::zeros({units}, torch::kInt64), owner = torch::full({units}, -1, torch::kInt64);
  std::vector<std::atomic<int64_t>> count(units);
  int64_t* who = owner.data_ptr<int64_t>();
  cpuserve_par::WorkSpans spans(units, static_cast<int>(threads));
#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num();
    if (me == stalled_thread) std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
    spans.run(me, [&](int64_t u) {
      count[u].fetch_add(1);
      who[u] = me;
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(unit_us);
      while (std::chrono::steady_clock::now() < until) {
      }
    });
  }
  for (int64_t u = 0; u < units; ++u) runs[u] = count[u].load();
  return torch::stack({runs, owner});
}
