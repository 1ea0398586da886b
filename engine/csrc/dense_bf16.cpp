// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a dense bf16 weight and bf16 activations: the
// projections of a model served from a Hugging Face directory as it is.  Two layouts:
// - packed (dense_bf16_pack, below): W repacked once at load so that 16 output rows' element pairs
//   are one vector; serves every batch size.  The engine uses it for every weight it owns alone.
// - W as it is (this first part), small M: a weight tied to the token embedding, which must keep
//   its rows for the lookup.
//
// Both multiply with AVX512-BF16's `vdpbf16ps` (pairs of bf16 products summed into fp32 lanes) and
// split their units of work over the caller's OpenMP team as qlinear.cpp's do (work_spans.h).  As
// it is, a unit is 16 weight rows in 4-row tiles, each against up to 4 activation rows, reduced
// across lanes at the end; packed, a unit is 4 groups of 16 rows against 6 activation rows at a
// time, each lane one output.  Only the AVX512-BF16 path exists: elsewhere dense_bf16_supported()
// is false and engine/layers/linear.py keeps torch's F.linear, which the tests compare both with.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "ops.h"
#include "vec.h"
#include "work_spans.h"

namespace {

constexpr int kUnitRows = 16;  // output columns (weight rows) per unit of work
constexpr int kTileN = 4;      // weight rows a tile holds in registers
constexpr int kTileM = 4;      // activation rows a tile holds in registers

struct Problem {
  const uint16_t* x;
  const uint16_t* w;
  const uint16_t* bias;  // bf16 [N] or null
  void* y;
  int64_t m, n, k, ldx, ldy;
  bool out_float32;
};

inline void store(const Problem& p, int64_t t, int64_t col, float v) {
  if (p.bias != nullptr) v += cpuserve::bf16_to_float(p.bias[col]);
  if (p.out_float32)
    static_cast<float*>(p.y)[t * p.ldy + col] = v;
  else
    static_cast<uint16_t*>(p.y)[t * p.ldy + col] = cpuserve::float_to_bf16(v);
}

// Rows [n0, n0 + NT) of W against activation rows [t0, t0 + MT).
template <int NT, int MT>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_BF16) void tile(const Problem& p, int64_t n0, int64_t t0) {
  __m512 acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int t = 0; t < MT; ++t) acc[i][t] = _mm512_setzero_ps();
  const uint16_t* w = p.w + n0 * p.k;
  const uint16_t* x = p.x + t0 * p.ldx;
  int64_t c = 0;
  for (; c + 32 <= p.k; c += 32) {
    __m512bh wv[NT];
    for (int i = 0; i < NT; ++i) wv[i] = (__m512bh)_mm512_loadu_si512(w + i * p.k + c);
    for (int t = 0; t < MT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * p.ldx + c);
      for (int i = 0; i < NT; ++i) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv[i], xv);
    }
  }
  if (c < p.k) {  // the last k % 32 elements, zeros past the end
    const __mmask32 mask = (__mmask32{1} << (p.k - c)) - 1;
    __m512bh wv[NT];
    for (int i = 0; i < NT; ++i) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + i * p.k + c);
    for (int t = 0; t < MT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + t * p.ldx + c);
      for (int i = 0; i < NT; ++i) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv[i], xv);
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int t = 0; t < MT; ++t) store(p, t0 + t, n0 + i, _mm512_reduce_add_ps(acc[i][t]));
}

template <int NT>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_BF16) void rows_tile(const Problem& p, int64_t n0) {
  int64_t t = 0;
  for (; t + kTileM <= p.m; t += kTileM) tile<NT, kTileM>(p, n0, t);
  switch (p.m - t) {
    case 3: tile<NT, 3>(p, n0, t); break;
    case 2: tile<NT, 2>(p, n0, t); break;
    case 1: tile<NT, 1>(p, n0, t); break;
    default: break;
  }
}

CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_BF16) void unit(const Problem& p, int64_t u) {
  const int64_t n1 = std::min(p.n, (u + 1) * kUnitRows);
  int64_t n0 = u * kUnitRows;
  for (; n0 + kTileN <= n1; n0 += kTileN) rows_tile<kTileN>(p, n0);
  for (; n0 < n1; ++n0) rows_tile<1>(p, n0);
}

}  // namespace

bool dense_bf16_supported() { return cpuserve::cpu_supports(cpuserve::kAvx512Bf16); }

namespace {

// Both entry points' checks of x and the bias; returns x with unit column stride.
torch::Tensor checked_x(const torch::Tensor& x_in, int64_t n, const c10::optional<torch::Tensor>& bias, const char* who) {
  TORCH_CHECK(dense_bf16_supported(), who, " needs AVX512-BF16");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x: bf16 [M, K]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n),
              "bias: contiguous bf16 [N]");
  return x_in.stride(1) == 1 ? x_in : x_in.contiguous();
}

torch::Tensor output(const torch::Tensor& x, int64_t n, bool out_float32) {
  return torch::empty({x.size(0), n}, x.options().dtype(out_float32 ? at::kFloat : at::kBFloat16));
}

}  // namespace

torch::Tensor dense_bf16_forward(const torch::Tensor& x_in, const torch::Tensor& weight,
                                 const c10::optional<torch::Tensor>& bias, bool out_float32) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "weight: contiguous bf16 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const torch::Tensor x = checked_x(x_in, n, bias, "dense_bf16_forward");
  TORCH_CHECK(x.size(1) == k, "weight's K ", k, " != x's ", x.size(1));
  torch::Tensor y = output(x, n, out_float32);
  if (x.size(0) == 0 || n == 0) return y;
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                  bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr, y.data_ptr(), x.size(0), n,
                  k, x.stride(0), n, out_float32};
  cpuserve_par::run_units((n + kUnitRows - 1) / kUnitRows, n * k * 2, [&](int64_t u) { unit(p, u); });
  return y;
}

// ---------------------------------------------------------------- packed layout (all batch sizes)
namespace {

// W packed as [N/16][K/2][16 lanes][2]: output row n = 16 g + lane, element pair kp.  A group's
// pairs are one contiguous stream, and a vdpbf16ps against a broadcast activation pair adds one
// pair of products to 16 outputs: no horizontal reductions, any number of activation rows.
struct PackedProblem {
  const uint16_t* x;
  const uint32_t* w;  // pairs
  const uint16_t* bias;
  void* y;
  int64_t m, n, kp, ldx, ldy;
  bool out_float32;
};

CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_BF16) inline void store16(const PackedProblem& p, int64_t t, int64_t col, __m512 v) {
  const __mmask16 mk = cpuserve::Vec512::mask(static_cast<int>(std::min<int64_t>(16, p.n - col)));
  if (p.bias != nullptr)
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p.bias + col)), 16)));
  if (p.out_float32)
    _mm512_mask_storeu_ps(static_cast<float*>(p.y) + t * p.ldy + col, mk, v);
  else
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.y) + t * p.ldy + col, mk, (__m256i)_mm512_cvtneps_pbh(v));
}

template <int NG, int MT>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_BF16) void packed_tile(const PackedProblem& p, int64_t g, int64_t t0) {
  __m512 acc[NG][MT];
  for (int i = 0; i < NG; ++i)
    for (int t = 0; t < MT; ++t) acc[i][t] = _mm512_setzero_ps();
  const uint32_t* w = p.w + g * p.kp * 16;
  const uint16_t* x = p.x + t0 * p.ldx;
  const int64_t lx = p.ldx;
  for (int64_t kp = 0; kp < p.kp; ++kp) {
    __m512bh wv[NG];
    for (int i = 0; i < NG; ++i) wv[i] = (__m512bh)_mm512_loadu_si512(w + (i * p.kp + kp) * 16);
    for (int t = 0; t < MT; ++t) {
      int32_t pair;  // (x's rows may start at any even offset: a memcpy, not a dereference)
      std::memcpy(&pair, x + t * lx + 2 * kp, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int i = 0; i < NG; ++i) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], wv[i], xv);
    }
  }
  for (int i = 0; i < NG; ++i)
    for (int t = 0; t < MT; ++t) store16(p, t0 + t, (g + i) * 16, acc[i][t]);
}

template <int NG, int MT>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_BF16) void packed_tail(const PackedProblem& p, int64_t g, int64_t t, int left) {
  if constexpr (MT > 0) {
    if (left == MT) packed_tile<NG, MT>(p, g, t);
    else packed_tail<NG, MT - 1>(p, g, t, left);
  }
}

template <int NG, int MT>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_BF16) void packed_rows(const PackedProblem& p, int64_t g) {
  int64_t t = 0;
  for (; t + MT <= p.m; t += MT) packed_tile<NG, MT>(p, g, t);
  if (t < p.m) packed_tail<NG, MT - 1>(p, g, t, static_cast<int>(p.m - t));
}

// Unit u: groups [4u, 4u + 4), in tiles of 4 groups x 6 activation rows (24 accumulators; the
// fastest of 2x8, 3x8, 4x4 and 4x6 at 16-256 rows, benchmarks/HISTORY.md).
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_BF16) void packed_unit(const PackedProblem& p, int64_t u) {
  const int64_t groups = (p.n + 15) / 16, g1 = std::min(groups, 4 * u + 4);
  int64_t g = 4 * u;
  if (g + 4 <= g1) packed_rows<4, 6>(p, g);
  else
    for (; g < g1; ++g) packed_rows<1, 6>(p, g);
}

// Group g of the packed layout from W's rows 16 g ... 16 g + 15: per 16 element pairs, the rows'
// 64-byte pieces transposed in registers, so that pair i's 16 lanes are one store.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_BF16) void pack_group(const uint32_t* src, int64_t n, int64_t kp, int64_t g, uint32_t* dst) {
  for (int64_t c = 0; c < kp; c += 16) {
    const int valid = static_cast<int>(std::min<int64_t>(16, kp - c));
    const __mmask16 mk = cpuserve::Vec512::mask(valid);
    __m512i r[16];
    for (int lane = 0; lane < 16; ++lane) {
      const int64_t row = g * 16 + lane;
      r[lane] = row < n ? _mm512_maskz_loadu_epi32(mk, src + row * kp + c) : _mm512_setzero_si512();
    }
    cpuserve::Vec512::transpose16(r);
    for (int j = 0; j < valid; ++j) _mm512_storeu_si512(dst + (g * kp + c + j) * 16, r[j]);
  }
}

}  // namespace

torch::Tensor dense_bf16_pack(const torch::Tensor& weight_in) {
  TORCH_CHECK(dense_bf16_supported(), "dense_bf16_pack needs AVX512-BF16");
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kBFloat16 && weight_in.size(1) % 2 == 0,
              "weight: bf16 [N, K], K even");
  const torch::Tensor weight = weight_in.contiguous();
  const int64_t n = weight.size(0), kp = weight.size(1) / 2, groups = (n + 15) / 16;
  torch::Tensor packed = torch::empty({groups, kp, 16, 2}, weight.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(weight.data_ptr());
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) pack_group(src, n, kp, g, dst);
  return packed;
}

torch::Tensor dense_bf16_packed_forward(const torch::Tensor& x_in, const torch::Tensor& packed, int64_t n,
                                        const c10::optional<torch::Tensor>& bias, bool out_float32) {
  const torch::Tensor x = checked_x(x_in, n, bias, "dense_bf16_packed_forward");
  TORCH_CHECK(packed.dim() == 4 && packed.size(3) == 2 && packed.size(2) == 16 && packed.is_contiguous(), "packed: [N/16, K/2, 16, 2]");
  const int64_t k = x.size(1);
  TORCH_CHECK(packed.size(1) * 2 == k && packed.size(0) * 16 >= n && packed.size(0) * 16 < n + 16,
              "packed weight [", packed.size(0) * 16, ", ", packed.size(1) * 2, "] does not match K ", k, " and N ", n);
  torch::Tensor y = output(x, n, out_float32);
  if (x.size(0) == 0 || n == 0) return y;
  const PackedProblem p{reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint32_t*>(packed.data_ptr()),
                        bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr, y.data_ptr(), x.size(0), n,
                        k / 2, x.stride(0), n, out_float32};
  cpuserve_par::run_units((packed.size(0) + 3) / 4, n * k * 2, [&](int64_t u) { packed_unit(p, u); });
  return y;
}
