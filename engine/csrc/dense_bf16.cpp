// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a dense bf16 weight and bf16 activations, small M:
// the decode steps of a model served from a Hugging Face directory as it is (no packed copy).
//
// Decode reads every weight once a step, so the kernel is a streaming read of W: each unit of work
// is 16 output columns (16 weight rows, read once), taken in 4-row tiles, each tile against up to 4
// activation rows at a time with AVX512-BF16's `vdpbf16ps` (pairs of bf16 products summed into
// fp32 lanes); more activation rows pass over the tile again from cache.  Work splits over the
// caller's OpenMP team as qlinear.cpp's does (work_spans.h).  Only the AVX512-BF16 path exists:
// elsewhere dense_bf16_supported() is false and engine/layers/linear.py keeps torch's F.linear,
// which the tests compare this kernel with.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>

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

torch::Tensor dense_bf16_forward(const torch::Tensor& x_in, const torch::Tensor& weight,
                                 const c10::optional<torch::Tensor>& bias, bool out_float32) {
  TORCH_CHECK(dense_bf16_supported(), "dense_bf16_forward needs AVX512-BF16");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x: bf16 [M, K]");
  const torch::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "weight: contiguous bf16 [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "weight's K ", weight.size(1), " != x's ", k);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n),
              "bias: contiguous bf16 [N]");
  torch::Tensor y = torch::empty({m, n}, x.options().dtype(out_float32 ? at::kFloat : at::kBFloat16));
  if (m == 0 || n == 0) return y;
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                  bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr, y.data_ptr(), m, n,
                  k, x.stride(0), n, out_float32};
  const int64_t units = (n + kUnitRows - 1) / kUnitRows;
  const int threads = cpuserve_par::product_threads(units, n * k * 2);
  if (threads == 1 || omp_in_parallel()) {
    for (int64_t u = 0; u < units; ++u) unit(p, u);
    return y;
  }
  cpuserve_par::WorkSpans spans(units, threads);
#pragma omp parallel  // the whole team, the work on its first `threads` (work_spans.h: Team size)
  {
    const int me = omp_get_thread_num();
    if (me < std::min(threads, omp_get_num_threads())) spans.run(me, [&](int64_t u) { unit(p, u); });
  }
  return y;
}
