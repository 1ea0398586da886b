// Sampler kernels (engine/sampler.py):
// - top-k / top-p cut-offs for the rows its ranked candidates did not settle: a selection per
//   row, O(vocab), instead of sorting the vocabulary.  A flat distribution (high temperature,
//   an unfamiliar prompt) under top_p = 0.95 keeps tens of thousands of tokens; torch's sort of
//   49,152 of them cost ~2.4 ms a row here.
// - greedy argmax: torch's CPU argmax took ~0.44 ms for 32 rows of 49,152 logits (~2% of a
//   32-row decode step); one AVX-512 pass takes a few microseconds a row.  On AVX2-only hosts the
//   scalar scan took 1.3-3.8 ms for those rows (a 2-core Zen 3; torch's 2.0 ms), the AVX2 pass
//   0.14 ms.
#include "ops.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

namespace {

// Buckets of e by its float bits (e >= 0, so the bits order like the values): exponent and
// the top 3 mantissa bits, 2048 buckets each spanning a factor of ~1.09.
constexpr int kShift = 20;
constexpr int kBuckets = 1 << (31 - kShift);

inline int bucket_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return static_cast<int>(u >> kShift);
}

// The value at which the descending cumulative mass of v reaches target (it and every larger
// value are inside), by weighted quickselect: split around a pivot into [> pivot][== pivot]
// [< pivot] and follow the part where the mass reaches the target.
float weighted_select(std::vector<float>& v, double target) {
  auto lo = v.begin(), hi = v.end();
  float last = v.empty() ? 0.f : *std::min_element(lo, hi);
  while (hi - lo > 0) {
    const float a = *lo, b = lo[(hi - lo) / 2], c = hi[-1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of three
    const auto gt = std::partition(lo, hi, [pivot](float x) { return x > pivot; });
    const auto eq = std::partition(gt, hi, [pivot](float x) { return x == pivot; });
    double mass_gt = 0.0;
    for (auto it = lo; it != gt; ++it) mass_gt += *it;
    if (gt != lo && mass_gt >= target) {
      hi = gt;
      continue;
    }
    const double mass_eq = static_cast<double>(eq - gt) * pivot;
    if (mass_gt + mass_eq >= target) return pivot;
    target -= mass_gt + mass_eq;
    lo = eq;
    last = pivot;
  }
  return last;  // only when rounding left the target above the mass: the smallest value seen
}

// e: one row of unnormalised probabilities (exp(logit - max)), all >= 0.  The smallest e a
// token may have and survive top-k (the k-th largest) and then top-p (the token at which the
// descending cumulative mass of the top-k set reaches p of it: it and every larger one
// stay).  Tokens equal to a cut-off all stay.  One pass builds a histogram of counts and
// mass by bucket; only the bucket where a cut falls is looked at element by element.
float row_threshold(const float* e, int64_t V, int64_t k, double p, std::vector<float>& bucket) {
  std::vector<int64_t> count(kBuckets, 0);
  std::vector<double> mass(kBuckets, 0.0);
  for (int64_t i = 0; i < V; ++i) {
    const int b = bucket_of(e[i]);
    count[b] += 1;
    mass[b] += e[i];
  }
  auto gather = [&](int b, float at_least) {
    bucket.clear();
    for (int64_t i = 0; i < V; ++i)
      if (bucket_of(e[i]) == b && e[i] >= at_least) bucket.push_back(e[i]);
  };
  float floor = 0.f;
  int bk = -1;  // the bucket holding the k-th largest
  double total = 0.0, partial_k = 0.0;
  if (k > 0 && k < V) {
    int64_t above = 0;
    for (int b = kBuckets - 1; b >= 0; --b) {
      if (above + count[b] >= k) {
        bk = b;
        break;
      }
      above += count[b];
      total += mass[b];
    }
    gather(bk, 0.f);
    const int64_t need = k - above;  // 1 <= need <= bucket size
    std::nth_element(bucket.begin(), bucket.begin() + (need - 1), bucket.end(), std::greater<float>());
    floor = bucket[need - 1];
    for (float v : bucket)
      if (v >= floor) partial_k += v;
    total += partial_k;
  } else {
    for (int b = 0; b < kBuckets; ++b) total += mass[b];
  }
  if (p >= 1.0) return floor;
  double target = p * total;
  const int lowest = bk >= 0 ? bk : 0;
  for (int b = kBuckets - 1; b >= lowest; --b) {
    const double m = b == bk ? partial_k : mass[b];
    if (count[b] == 0 || (m < target && b > lowest)) {
      target -= m;
      continue;
    }
    gather(b, b == bk ? floor : 0.f);
    return std::max(weighted_select(bucket, target), floor);
  }
  return floor;
}

// torch.argmax's answer for one row: the first maximum, or the first NaN if there is one.
// Scans [from, n) on from the first maximum `best` of [0, from), which holds no NaN.
int64_t argmax_scalar(const float* x, int64_t n, int64_t from = 0, int64_t best = 0) {
  for (int64_t i = from; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// 16 lanes each keep their first maximum (strict >); the smallest index among the lanes holding
// the overall maximum is then the row's first.  A NaN anywhere defers to the scalar scan.
__attribute__((target("avx512f"))) int64_t argmax_avx512(const float* x, int64_t n) {
  if (n < 16 || n >= (int64_t{1} << 31)) return argmax_scalar(x, n);
  __m512 best = _mm512_loadu_ps(x);
  __m512i best_i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx = best_i;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    idx = _mm512_add_epi32(idx, step);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
  }
  if (nan) return argmax_scalar(x, n);
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 at_max = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  return argmax_scalar(x, n, i, _mm512_mask_reduce_min_epi32(at_max, best_i));  // then the tail
}

// argmax_avx512 in 8-lane halves, two vectors a step (independent compare/blend chains).
__attribute__((target("avx2"))) int64_t argmax_avx2(const float* x, int64_t n) {
  if (n < 16 || n >= (int64_t{1} << 31)) return argmax_scalar(x, n);
  __m256 best0 = _mm256_loadu_ps(x), best1 = _mm256_loadu_ps(x + 8);
  __m256i idx0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx1 = _mm256_add_epi32(idx0, _mm256_set1_epi32(8));
  __m256i best_i0 = idx0, best_i1 = idx1;
  const __m256i step = _mm256_set1_epi32(16);
  __m256 nan = _mm256_cmp_ps(best0, best1, _CMP_UNORD_Q);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    idx0 = _mm256_add_epi32(idx0, step);
    idx1 = _mm256_add_epi32(idx1, step);
    const __m256 gt0 = _mm256_cmp_ps(v0, best0, _CMP_GT_OQ), gt1 = _mm256_cmp_ps(v1, best1, _CMP_GT_OQ);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
    best0 = _mm256_blendv_ps(best0, v0, gt0);
    best1 = _mm256_blendv_ps(best1, v1, gt1);
    best_i0 = _mm256_blendv_epi8(best_i0, idx0, _mm256_castps_si256(gt0));
    best_i1 = _mm256_blendv_epi8(best_i1, idx1, _mm256_castps_si256(gt1));
  }
  if (_mm256_movemask_ps(nan)) return argmax_scalar(x, n);
  alignas(32) float vals[16];
  alignas(32) int32_t ids[16];
  _mm256_store_ps(vals, best0);
  _mm256_store_ps(vals + 8, best1);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ids), best_i0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ids + 8), best_i1);
  int lane = 0;
  for (int l = 1; l < 16; ++l)
    if (vals[l] > vals[lane] || (vals[l] == vals[lane] && ids[l] < ids[lane])) lane = l;
  return argmax_scalar(x, n, i, ids[lane]);  // then the tail
}

enum ArgmaxIsa { kArgmaxScalar = 0, kArgmaxAvx2 = 1, kArgmaxAvx512 = 2 };

int64_t argmax_row(int isa, const float* x, int64_t n) {
  switch (isa) {
    case kArgmaxAvx512: return argmax_avx512(x, n);
    case kArgmaxAvx2: return argmax_avx2(x, n);
    default: return argmax_scalar(x, n);
  }
}

}  // namespace

int64_t argmax_best_isa() {
  static const int isa = __builtin_cpu_supports("avx512f") ? kArgmaxAvx512
                         : __builtin_cpu_supports("avx2") ? kArgmaxAvx2
                                                          : kArgmaxScalar;
  return isa;
}

torch::Tensor argmax_rows(const torch::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
              "argmax_rows: x must be a float32 CPU matrix with contiguous rows");
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  TORCH_CHECK(V > 0, "argmax_rows: rows must not be empty");
  const int64_t best = argmax_best_isa();
  TORCH_CHECK(isa <= best, "argmax_rows: path ", isa, " is not supported on this CPU (best: ", best, ")");
  const int path = static_cast<int>(isa < 0 ? best : isa);
  torch::Tensor out = torch::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // Rows split over threads only when there are enough of them to pay for waking the pool.
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), R / 4)));
#pragma omp parallel for num_threads(threads) if (threads > 1 && !omp_in_parallel())
  for (int64_t r = 0; r < R; ++r) op[r] = argmax_row(path, xp + r * ld, V);
  return out;
}


torch::Tensor sampling_thresholds(const torch::Tensor& e, const torch::Tensor& top_k, const torch::Tensor& top_p) {
  TORCH_CHECK(e.dim() == 2 && e.scalar_type() == at::kFloat && e.is_contiguous() && e.device().is_cpu(),
              "sampling_thresholds: e must be a contiguous float32 CPU matrix");
  const int64_t R = e.size(0), V = e.size(1);
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == R && top_k.scalar_type() == at::kLong,
              "sampling_thresholds: top_k must be int64 [rows]");
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == R && top_p.scalar_type() == at::kFloat,
              "sampling_thresholds: top_p must be float32 [rows]");
  const torch::Tensor kc = top_k.contiguous(), pc = top_p.contiguous();
  torch::Tensor out = torch::empty({R}, e.options());
  const float* ep = e.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  const float* pp = pc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), R)));
#pragma omp parallel num_threads(threads) if (threads > 1 && !omp_in_parallel())
  {
    std::vector<float> bucket;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < R; ++r) op[r] = row_threshold(ep + r * V, V, kp[r], pp[r], bucket);
  }
  return out;
}
