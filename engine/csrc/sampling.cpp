// Sampler kernels (engine/sampler.py):
// - top-k / top-p cut-offs for the rows its ranked candidates did not settle: a selection per
//   row, O(vocab), instead of sorting the vocabulary.  A flat distribution (high temperature,
//   an unfamiliar prompt) under top_p = 0.95 keeps tens of thousands of tokens, which a sort
//   of the vocabulary pays for on every row.
// - greedy argmax: one vector pass (AVX-512, AVX2 or scalar) a row, a few microseconds, where
//   torch's CPU argmax costs a measurable share of a decode step.
// - the whole draw of sampled rows (sample_rows, below): temperature, the cut-offs, min-p and
//   the inverse-CDF lookup in one buffer a row.
// - grammar masks (mask_logits_): -inf where a row's bitmask disallows the token, 16 tokens a
//   vector.
#include "isa.h"
#include "ops.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
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
// `tail` is mass left out of e (the sampler passes only its candidates): it counts toward
// top-p's total when there is no top-k cut, and never holds the cut.
float row_threshold(const float* e, int64_t V, int64_t k, double p, std::vector<float>& bucket, double tail = 0.0) {
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
    total = tail;
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
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512) int64_t argmax_avx512(const float* x, int64_t n) {
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
CPUSERVE_TARGET(CPUSERVE_ISA_AVX2) int64_t argmax_avx2(const float* x, int64_t n) {
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

using cpuserve::kAvx2;
using cpuserve::kAvx512;
using cpuserve::kScalar;

// The paths this file has, best first.
constexpr int kArgmaxPaths[] = {kAvx512, kAvx2, kScalar};

int64_t argmax_row(int isa, const float* x, int64_t n) {
  switch (isa) {
    case kAvx512: return argmax_avx512(x, n);
    case kAvx2: return argmax_avx2(x, n);
    default: return argmax_scalar(x, n);
  }
}

// ---------------------------------------------------------------- the draw (sample_rows)
//
// engine/sampler.py's temperature / top-k / top-p / min-p / inverse-CDF draw for one row at a
// time, without the whole-vocabulary temporaries its torch ops make.  The same arithmetic: e =
// exp((logit - max) / temperature) (so the best token's e is 1), the top-k / top-p cut of
// row_threshold, min-p as e >= min_p (min_p of the largest probability, after the cut), then
// the first token whose cumulative kept mass exceeds u times the total, found chunk by chunk.

constexpr int64_t kDrawChunk = 1024;  // sampler.py's DRAW_CHUNK
// e below this counts as zero: a -inf logit (a banned token) comes out of the vector exp, which
// clamps its input, as ~1.6e-38, and must never be drawn.
constexpr float kMinWeight = 2e-38f;
// A top-k / top-p cut is looked for among the candidates, the tokens with e >= a floor: the
// highest of these under which the cut must fall (k candidates for top-k; p of the mass for
// top-p).  A peaked row has a few to a few hundred above 2^-8; a flat row under a wide nucleus,
// or a top_k beyond every floor, is looked at whole.
constexpr int kCensusFloors = 4;
constexpr float kCensusValues[kCensusFloors] = {1.f / (1 << 4), 1.f / (1 << 8), 1.f / (1 << 12), 1.f / (1 << 16)};

// Whole vectors of floor_census below; returns where the scalar tail starts.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512) int64_t floor_census_avx512(const float* e, int64_t V, int64_t* count, float* mass) {
  __m512 m[kCensusFloors];
  __m512i c[kCensusFloors];
  for (int f = 0; f < kCensusFloors; ++f) m[f] = _mm512_setzero_ps(), c[f] = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(e + i);
    for (int f = 0; f < kCensusFloors; ++f) {
      const __mmask16 k = _mm512_cmp_ps_mask(v, _mm512_set1_ps(kCensusValues[f]), _CMP_GE_OQ);
      m[f] = _mm512_mask_add_ps(m[f], k, m[f], v);
      c[f] = _mm512_mask_sub_epi32(c[f], k, c[f], _mm512_set1_epi32(-1));
    }
  }
  for (int f = 0; f < kCensusFloors; ++f) count[f] += _mm512_reduce_add_epi32(c[f]), mass[f] += _mm512_reduce_add_ps(m[f]);
  return i;
}

// Whole vectors of gather_candidates below: appends at *n; returns where the scalar tail starts.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512) int64_t gather_avx512(const float* e, int64_t V, float floor, float* vals,
                                                         int32_t* idx, int64_t* n) {
  const __m512 fl = _mm512_set1_ps(floor);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t i = 0, out = *n;
  for (; i + 16 <= V; i += 16, at = _mm512_add_epi32(at, _mm512_set1_epi32(16))) {
    const __m512 v = _mm512_loadu_ps(e + i);
    const __mmask16 k = _mm512_cmp_ps_mask(v, fl, _CMP_GE_OQ);
    if (!k) continue;
    _mm512_mask_compressstoreu_ps(vals + out, k, v);
    _mm512_mask_compressstoreu_epi32(idx + out, k, at);
    out += __builtin_popcount(k);
  }
  *n = out;
  return i;
}

struct DrawScratch {
  std::vector<float> e, cand, bucket;
  std::vector<int32_t> cand_idx;
  std::vector<double> chunk;  // kept mass per chunk
};

// Count and mass of e >= each of kCensusValues.
void floor_census(const float* e, int64_t V, int64_t* count, double* mass) {
  float m[kCensusFloors] = {0.f};
  for (int f = 0; f < kCensusFloors; ++f) count[f] = 0;
  int64_t i = 0;
  if (argmax_best_isa() == kAvx512) i = floor_census_avx512(e, V, count, m);
  for (; i < V; ++i)
    for (int f = 0; f < kCensusFloors; ++f)
      if (e[i] >= kCensusValues[f]) ++count[f], m[f] += e[i];
  for (int f = 0; f < kCensusFloors; ++f) mass[f] = m[f];
}

// Values >= floor into s.cand, their indices into s.cand_idx; returns their mass.
double gather_candidates(const float* e, int64_t V, float floor, DrawScratch& s) {
  s.cand.resize(V);
  s.cand_idx.resize(V);
  int64_t n = 0, i = 0;
  if (argmax_best_isa() == kAvx512) i = gather_avx512(e, V, floor, s.cand.data(), s.cand_idx.data(), &n);
  for (; i < V; ++i)
    if (e[i] >= floor) s.cand[n] = e[i], s.cand_idx[n++] = static_cast<int32_t>(i);
  s.cand.resize(n);
  s.cand_idx.resize(n);
  double mass = 0.0;
  for (float v : s.cand) mass += v;
  return mass;
}

// The first index whose cumulative kept mass (e >= thr) exceeds u times the kept total, with
// chunk[c] the kept mass of chunk c.  Rounding can leave the target past the chosen chunk's
// last kept token: the scan then goes on, and at worst ends on the last kept token.
int64_t draw_index(const float* e, int64_t V, float thr, const std::vector<double>& chunk, double u) {
  double total = 0.0;
  for (double m : chunk) total += m;
  const double target = std::min(u * total, std::nextafter(total, 0.0));
  double cum = 0.0;
  size_t c = 0;
  for (; c + 1 < chunk.size() && cum + chunk[c] <= target; ++c) cum += chunk[c];
  int64_t last = -1;
  for (int64_t i = static_cast<int64_t>(c) * kDrawChunk; i < V; ++i) {
    if (e[i] < thr) continue;
    cum += e[i];
    last = i;
    if (cum > target) return i;
  }
  for (int64_t i = static_cast<int64_t>(c) * kDrawChunk - 1; last < 0 && i >= 0; --i)
    if (e[i] >= thr) last = i;
  return std::max<int64_t>(last, 0);
}

// One row: (the token drawn, the smallest e kept).  A row whose maximum is NaN or -inf has no
// distribution: its argmax comes back.
std::pair<int64_t, float> sample_row(const float* x, int64_t V, float temperature, int64_t k, float p, float min_p,
                                     double u, DrawScratch& s) {
  const int64_t best = argmax_row(static_cast<int>(argmax_best_isa()), x, V);
  const float m = x[best];
  if (std::isnan(m) || m == -INFINITY) return {best, 0.f};
  s.e.resize(V);
  float* e = s.e.data();
  const int64_t chunks = (V + kDrawChunk - 1) / kDrawChunk;
  s.chunk.assign(chunks, 0.0);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t at = c * kDrawChunk;
    total += s.chunk[c] = fused_exp_row(x + at, m, 1.f / temperature, e + at, std::min(kDrawChunk, V - at));
  }
  const bool top_k = k > 0 && k < V, cut = top_k || p < 1.f;
  float thr = kMinWeight;
  if (cut || min_p > 0.f) {
    float floor = std::max(min_p, kMinWeight);
    bool in_candidates = !cut;
    if (cut) {
      int64_t count[kCensusFloors];
      double above[kCensusFloors];
      floor_census(e, V, count, above);
      for (int f = 0; f < kCensusFloors && !in_candidates; ++f)
        if (top_k ? count[f] >= k : above[f] >= p * total) in_candidates = true, floor = kCensusValues[f];
    }
    const double mass = in_candidates ? gather_candidates(e, V, floor, s) : 0.0;
    const int64_t n = in_candidates ? static_cast<int64_t>(s.cand.size()) : 0;  // s.cand is the last row's otherwise
    if (cut)
      thr = std::max(thr, in_candidates ? row_threshold(s.cand.data(), n, top_k ? k : 0, p, s.bucket, top_k ? 0.0 : total - mass)
                                        : row_threshold(e, V, k, p, s.bucket));
    thr = std::max(thr, min_p);
    std::fill(s.chunk.begin(), s.chunk.end(), 0.0);
    if (in_candidates) {
      for (int64_t j = 0; j < n; ++j)
        if (s.cand[j] >= thr) s.chunk[s.cand_idx[j] / kDrawChunk] += s.cand[j];
    } else {
      for (int64_t i = 0; i < V; ++i)
        if (e[i] >= thr) s.chunk[i / kDrawChunk] += e[i];
    }
  }
  return {draw_index(e, V, thr, s.chunk, u), thr};
}

// ---------------------------------------------------------------- logprobs (logprobs_rows)

// Whole vectors of x from `from` on: calls offer(i) for each element above floor() (which
// offers raise); returns where the scalar tail starts.
template <typename Offer, typename Floor>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512) int64_t top_k_scan_avx512(const float* x, int64_t V, int64_t from, Offer offer,
                                                             Floor floor) {
  int64_t i = from;
  __m512 fl = _mm512_set1_ps(floor());
  for (; i + 16 <= V; i += 16) {
    __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), fl, _CMP_GT_OQ);
    if (!above) continue;
    for (; above; above &= above - 1) offer(i + __builtin_ctz(above));
    fl = _mm512_set1_ps(floor());
  }
  return i;
}

// The k largest of x (values descending, equal values by index), into vals / ids: a sorted list
// of k, and only elements above its smallest are looked at one by one.
void row_top_k(const float* x, int64_t V, int64_t k, float* vals, int64_t* ids) {
  int64_t n = 0;
  auto offer = [&](int64_t i) {
    if (n == k && !(x[i] > vals[k - 1])) return;
    int64_t j = n < k ? n++ : k - 1;
    for (; j > 0 && x[i] > vals[j - 1]; --j) vals[j] = vals[j - 1], ids[j] = ids[j - 1];
    vals[j] = x[i], ids[j] = i;
  };
  int64_t i = 0;
  if (k > 0 && argmax_best_isa() == kAvx512) {
    for (; i < V && n < k; ++i) offer(i);
    i = top_k_scan_avx512(x, V, i, [&](int64_t at) { offer(at); }, [&] { return vals[k - 1]; });
  }
  for (; k > 0 && i < V; ++i) offer(i);
}


// ---------------------------------------------------------------- grammar masks (mask_logits_)
//
// One logits row under a bitmask: tokens [0, n) whose bit is clear become -inf.  Returns the
// largest logit left (-inf: none).  The AVX-512 path takes 16 tokens at a time as a masked load
// (inside a JSON string a grammar allows most of the vocabulary, so a bit a token costs).

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float mask_row_scalar(float* x, const uint32_t* bits, int64_t from, int64_t n) {
  float best = kNegInf;
  for (int64_t t = from; t < n;) {
    const uint32_t word = bits[t / 32] >> (t % 32);
    const int64_t len = std::min<int64_t>(32 - t % 32, n - t);
    if (word == 0) {  // nothing allowed here: most of a row, where a grammar allows a few tokens
      std::fill(x + t, x + t + len, kNegInf);
    } else {
      for (int64_t j = 0; j < len; ++j) {
        if (word >> j & 1u)
          best = std::max(best, x[t + j]);
        else
          x[t + j] = kNegInf;
      }
    }
    t += len;
  }
  return best;
}

CPUSERVE_TARGET(CPUSERVE_ISA_AVX512) float mask_row_avx512(float* x, const uint32_t* bits, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __m512 best = neg_inf;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __mmask16 keep = static_cast<__mmask16>(bits[i / 32] >> (i % 32));
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, keep, x + i);
    _mm512_storeu_ps(x + i, v);
    best = _mm512_max_ps(best, v);
  }
  return std::max(_mm512_reduce_max_ps(best), i < n ? mask_row_scalar(x, bits, i, n) : kNegInf);
}

}  // namespace

int64_t argmax_best_isa() {
  static const int isa = [] {
    for (int p : kArgmaxPaths)
      if (cpuserve::cpu_supports(p)) return p;
    return static_cast<int>(kScalar);
  }();
  return isa;
}

std::vector<int64_t> argmax_isas() {
  std::vector<int64_t> out;
  for (int p : kArgmaxPaths)
    if (cpuserve::cpu_supports(p)) out.insert(out.begin(), p);
  return out;
}

torch::Tensor argmax_rows(const torch::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
              "argmax_rows: x must be a float32 CPU matrix with contiguous rows");
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  TORCH_CHECK(V > 0, "argmax_rows: rows must not be empty");
  const std::vector<int64_t> paths = argmax_isas();
  TORCH_CHECK(isa < 0 || std::find(paths.begin(), paths.end(), isa) != paths.end(), "argmax_rows: path ", isa,
              " is not supported on this CPU");
  const int path = static_cast<int>(isa < 0 ? argmax_best_isa() : isa);
  torch::Tensor out = torch::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // Rows split over threads, four at least a thread, only when there are enough of them to pay
  // for waking the pool; the whole team takes part (work_spans.h: Team size).
#pragma omp parallel for schedule(static, 4) if (R >= 8 && omp_get_max_threads() > 1 && !omp_in_parallel())
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
#pragma omp parallel if (R > 1 && omp_get_max_threads() > 1 && !omp_in_parallel())  // the whole team (work_spans.h)
  {
    std::vector<float> bucket;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < R; ++r) op[r] = row_threshold(ep + r * V, V, kp[r], pp[r], bucket);
  }
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> sample_rows(const torch::Tensor& logits, const torch::Tensor& temperature,
                                                     const torch::Tensor& top_k, const torch::Tensor& top_p,
                                                     const torch::Tensor& min_p, const torch::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.device().is_cpu(),
              "sample_rows: logits must be a float32 CPU matrix with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(V > 0, "sample_rows: rows must not be empty");
  auto per_row = [R](const torch::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == R && t.scalar_type() == type && t.device().is_cpu(), "sample_rows: ", name,
                " must be ", type, " [rows]");
    return t.contiguous();
  };
  const torch::Tensor tc = per_row(temperature, at::kFloat, "temperature"), kc = per_row(top_k, at::kLong, "top_k"),
                      pc = per_row(top_p, at::kFloat, "top_p"), mc = per_row(min_p, at::kFloat, "min_p"),
                      uc = per_row(u, at::kFloat, "u");
  const float *tp = tc.data_ptr<float>(), *pp = pc.data_ptr<float>(), *mp = mc.data_ptr<float>(), *up = uc.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(tp[r] > 0.f && pp[r] > 0.f && pp[r] <= 1.f && mp[r] >= 0.f && mp[r] <= 1.f && up[r] >= 0.f && up[r] < 1.f,
                "sample_rows: row ", r, " needs temperature > 0, top_p in (0, 1], min_p in [0, 1], u in [0, 1)");
  torch::Tensor ids = torch::empty({R}, logits.options().dtype(at::kLong)), kept = torch::empty({R}, logits.options());
  int64_t* ip = ids.data_ptr<int64_t>();
  float* thp = kept.data_ptr<float>();
  const float* xp = logits.data_ptr<float>();
#pragma omp parallel if (R > 1 && omp_get_max_threads() > 1 && !omp_in_parallel())  // the whole team (work_spans.h)
  {
    static thread_local DrawScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < R; ++r)
      std::tie(ip[r], thp[r]) = sample_row(xp + r * ld, V, tp[r], kp[r], pp[r], mp[r], up[r], scratch);
  }
  return {ids, kept};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> logprobs_rows(const torch::Tensor& logits,
                                                                      const torch::Tensor& chosen, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.device().is_cpu(),
              "logprobs_rows: logits must be a float32 CPU matrix with contiguous rows");
  const int64_t R = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(V > 0 && k >= 0 && k <= V, "logprobs_rows: need 0 <= k <= vocabulary size");
  TORCH_CHECK(chosen.dim() == 1 && chosen.size(0) == R && chosen.scalar_type() == at::kLong, "logprobs_rows: chosen must be int64 [rows]");
  const torch::Tensor cc = chosen.contiguous();
  const int64_t* cp = cc.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(cp[r] >= 0 && cp[r] < V, "logprobs_rows: chosen token out of range");
  torch::Tensor lp = torch::empty({R}, logits.options()), top_lp = torch::empty({R, k}, logits.options()),
                top_ids = torch::empty({R, k}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  float *lpp = lp.data_ptr<float>(), *tvp = top_lp.data_ptr<float>();
  int64_t* tip = top_ids.data_ptr<int64_t>();
#pragma omp parallel if (R > 1 && omp_get_max_threads() > 1 && !omp_in_parallel())  // the whole team (work_spans.h)
  {
    static thread_local std::vector<float> e;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < R; ++r) {
      const float* x = xp + r * ld;
      const float m = x[argmax_row(static_cast<int>(argmax_best_isa()), x, V)];
      e.resize(V);
      // log_softmax(x)[i] = x[i] - lse; a NaN or infinite maximum leaves lse = m, as torch would give NaN / -inf
      const float lse = std::isfinite(m) ? m + std::log(fused_exp_row(x, m, 1.f, e.data(), V)) : m;
      lpp[r] = x[cp[r]] - lse;
      row_top_k(x, V, k, tvp + r * k, tip + r * k);
      for (int64_t j = 0; j < k; ++j) tvp[r * k + j] -= lse;
    }
  }
  return {lp, top_ids, top_lp};
}

torch::Tensor mask_logits_(torch::Tensor& logits, const torch::Tensor& bits, const torch::Tensor& rows,
                           int64_t vocab_size, int64_t isa) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.device().is_cpu(),
              "mask_logits_: logits must be a float32 CPU matrix with contiguous rows");
  TORCH_CHECK(bits.dim() == 2 && bits.scalar_type() == at::kInt && bits.is_contiguous(),
              "mask_logits_: bits must be a contiguous int32 matrix");
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == bits.size(0) && rows.scalar_type() == at::kLong,
              "mask_logits_: rows must be int64 [bits rows]");
  const std::vector<int64_t> paths = argmax_isas();
  TORCH_CHECK(isa < 0 || std::find(paths.begin(), paths.end(), isa) != paths.end(), "mask_logits_: path ", isa,
              " is not supported on this CPU");
  const bool avx512 = (isa < 0 ? argmax_best_isa() : isa) == kAvx512;
  const int64_t M = bits.size(0), W = bits.size(1), V = logits.size(1), ld = logits.stride(0);
  const int64_t allowed_end = std::min({V, std::max<int64_t>(vocab_size, 0), W * 32});
  const torch::Tensor rc = rows.contiguous();
  const int64_t* rp = rc.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(rp[m] >= 0 && rp[m] < logits.size(0), "mask_logits_: row ", rp[m], " out of range");
  torch::Tensor alive = torch::empty({M}, logits.options().dtype(at::kBool));
  bool* ap = alive.data_ptr<bool>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  float* lp = logits.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float* x = lp + rp[m] * ld;
    const float best = avx512 ? mask_row_avx512(x, bp + m * W, allowed_end) : mask_row_scalar(x, bp + m * W, 0, allowed_end);
    std::fill(x + allowed_end, x + V, kNegInf);
    ap[m] = best > kNegInf;
  }
  return alive;
}
