// Fused element-wise ops of a Llama layer (add + RMSNorm, SiLU * up, NeoX RoPE), bf16 and fp32.
//
// At batch 1 a layer's element-wise work is tiny; what costs is the count of torch ops (each a
// few microseconds of Python and dispatcher), ~30 per layer in the torch reference.  Each op here
// is one pybind11 call, one pass over the data, vectorized (AVX-512 with or without BF16, else AVX2,
// else scalar; picked at run time) and parallel over tokens only when a batch is big enough to pay
// for the threads.
// engine/layers/fused.py dispatches here and keeps the torch code as reference and fallback.
#include "ops.h"
#include "vec.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace fused {
namespace {

using cpuserve::bf16_to_float;
using cpuserve::float_to_bf16;

struct NormArgs {
  const void* x;
  int64_t ldx;
  const void* res_in;  // null: no residual
  int64_t ld_res_in;
  void* res_out;  // null: do not store x + residual
  int64_t ld_res_out;
  const void* w;
  void* out;
  int64_t ld_out;
  int64_t h;
  float eps;
  bool bf16;
};

struct SiluArgs {
  const void* in;
  int64_t ld_in;
  void* out;
  int64_t ld_out;
  int64_t d;
  bool bf16;
};

struct RopeArgs {
  struct Part {
    const void* src;
    int64_t ld_src;
    void* dst;
    int64_t ld_dst;
    int64_t heads;
  } part[2];
  const int64_t* positions;
  const float* cos_sin;
  int64_t ld_cs;
  int64_t half;
  bool bf16;
};

}  // namespace
}  // namespace fused

// Each kernel of fused_impl.h stamped out over each vector type of vec.h, inside that type's target.
#define FUSED_NS scalar
#define FUSED_VEC cpuserve::VecScalar
#include "fused_impl.h"
#undef FUSED_NS
#undef FUSED_VEC

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX512)
#define FUSED_NS avx512
#define FUSED_VEC cpuserve::Vec512
#include "fused_impl.h"
#undef FUSED_NS
#undef FUSED_VEC
CPUSERVE_TARGET_END

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX512_BF16)
#define FUSED_NS avx512bf16
#define FUSED_VEC cpuserve::Vec512Bf16
#include "fused_impl.h"
#undef FUSED_NS
#undef FUSED_VEC
CPUSERVE_TARGET_END

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX2)
#define FUSED_NS avx2
#define FUSED_VEC cpuserve::Vec256
#include "fused_impl.h"
#undef FUSED_NS
#undef FUSED_VEC
CPUSERVE_TARGET_END

namespace fused {
namespace {

using cpuserve::cpu_supports;
using cpuserve::kAvx2;
using cpuserve::kAvx512;
using cpuserve::kAvx512Bf16;
using cpuserve::kScalar;

// The paths this file has, best first.
constexpr int kPaths[] = {kAvx512Bf16, kAvx512, kAvx2, kScalar};

bool isa_supported(int isa) {
  for (int p : kPaths)
    if (p == isa) return cpu_supports(isa);
  return false;
}

int best_isa() {
  static const int best = [] {
    for (int p : kPaths)
      if (cpu_supports(p)) return p;
    return static_cast<int>(kScalar);
  }();
  return best;
}

int g_forced_isa = -1;  // tests pin a path with fused_set_isa

int isa() { return g_forced_isa >= 0 ? g_forced_isa : best_isa(); }

// Rows times row length below which one thread does all rows.
constexpr int64_t kParallelMinElems = 1 << 15;

template <typename Fn>
void for_rows(int64_t rows, int64_t row_elems, Fn fn) {
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), rows));
  if (rows * row_elems < kParallelMinElems || threads <= 1 || omp_in_parallel()) {
    fn(0, rows);
    return;
  }
#pragma omp parallel  // the whole team, rows on its first `threads` (work_spans.h: Team size)
  {
    const int t = omp_get_thread_num(), n = std::min(threads, omp_get_num_threads());
    const int64_t r0 = rows * t / n, r1 = rows * (t + 1) / n;
    if (t < n && r0 < r1) fn(r0, r1);
  }
}

void norm_rows(const NormArgs& a, int64_t r0, int64_t r1) {
  switch (isa()) {
    case kAvx512Bf16: avx512bf16::add_rms_norm_rows(a, r0, r1); break;
    case kAvx512: avx512::add_rms_norm_rows(a, r0, r1); break;
    case kAvx2: avx2::add_rms_norm_rows(a, r0, r1); break;
    default: scalar::add_rms_norm_rows(a, r0, r1); break;
  }
}

// Whether the kernels take t: a CPU tensor of `dtype` with `dims` dims (and a contiguous last dim
// when `unit_stride`).  The ops answer None/false for anything else, and engine/layers/fused.py
// runs its torch reference instead, so Python need not inspect the tensors on the hot path.
bool usable(const torch::Tensor& t, int64_t dims, at::ScalarType dtype, bool unit_stride) {
  return t.defined() && t.dim() == dims && t.scalar_type() == dtype && t.device().is_cpu() &&
         (!unit_stride || dims == 0 || t.stride(dims - 1) == 1 || t.size(dims - 1) <= 1);
}

bool model_dtype(const torch::Tensor& x) {
  return x.defined() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// x [T, H] (any strides; out-of-place callers pass contiguous copies when needed), weight [H].
bool norm_usable(const torch::Tensor& x, const torch::Tensor& w, bool unit_stride) {
  return model_dtype(x) && usable(x, 2, x.scalar_type(), unit_stride) && usable(w, 1, x.scalar_type(), false) &&
         w.size(0) == x.size(1);
}

torch::Tensor unit_stride(const torch::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); }

NormArgs norm_args(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  NormArgs a{};
  a.x = x.data_ptr();
  a.ldx = x.stride(0);
  a.w = w.data_ptr();
  a.h = x.size(1);
  a.eps = static_cast<float>(eps);
  a.bf16 = x.scalar_type() == at::kBFloat16;
  return a;
}

}  // namespace
}  // namespace fused

using namespace fused;

void fused_set_isa(int64_t isa) {
  TORCH_CHECK(isa < 0 || isa_supported(static_cast<int>(isa)), "fused: instruction set path ", isa, " not supported here");
  g_forced_isa = static_cast<int>(isa);
}

float fused_exp_row(const float* x, float shift, float scale, float* out, int64_t n) {
  switch (isa()) {
    case kAvx512Bf16:
    case kAvx512: return avx512::exp_shifted_row(x, shift, scale, out, n);
    case kAvx2: return avx2::exp_shifted_row(x, shift, scale, out, n);
    default: return scalar::exp_shifted_row(x, shift, scale, out, n);
  }
}

std::vector<int64_t> fused_isas() {
  std::vector<int64_t> out;
  for (int i = kScalar; i < cpuserve::kNumIsas; ++i)
    if (isa_supported(i)) out.push_back(i);
  return out;
}

c10::optional<torch::Tensor> fused_rms_norm(const torch::Tensor& x_in, const torch::Tensor& weight_in, double eps) {
  if (!norm_usable(x_in, weight_in, false)) return c10::nullopt;
  const torch::Tensor x = unit_stride(x_in), weight = weight_in.contiguous();
  NormArgs a = norm_args(x, weight, eps);
  torch::Tensor out = torch::empty({x.size(0), x.size(1)}, x.options());
  a.out = out.data_ptr();
  a.ld_out = out.stride(0);
  for_rows(x.size(0), a.h, [&](int64_t r0, int64_t r1) { norm_rows(a, r0, r1); });
  return out;
}

c10::optional<std::tuple<torch::Tensor, torch::Tensor>> fused_add_rms_norm(const torch::Tensor& x_in,
                                                                           const torch::Tensor& residual_in,
                                                                           const torch::Tensor& weight_in, double eps) {
  if (!norm_usable(x_in, weight_in, false) || !usable(residual_in, 2, x_in.scalar_type(), false) ||
      residual_in.sizes() != x_in.sizes())
    return c10::nullopt;
  const torch::Tensor x = unit_stride(x_in), residual = unit_stride(residual_in), weight = weight_in.contiguous();
  NormArgs a = norm_args(x, weight, eps);
  torch::Tensor out = torch::empty({x.size(0), x.size(1)}, x.options());
  torch::Tensor sum = torch::empty({x.size(0), x.size(1)}, x.options());
  a.res_in = residual.data_ptr();
  a.ld_res_in = residual.stride(0);
  a.res_out = sum.data_ptr();
  a.ld_res_out = sum.stride(0);
  a.out = out.data_ptr();
  a.ld_out = out.stride(0);
  for_rows(x.size(0), a.h, [&](int64_t r0, int64_t r1) { norm_rows(a, r0, r1); });
  return std::make_tuple(out, sum);
}

bool fused_add_rms_norm_(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight_in, double eps) {
  if (!norm_usable(x, weight_in, true) || !usable(residual, 2, x.scalar_type(), true) || residual.sizes() != x.sizes())
    return false;
  const torch::Tensor weight = weight_in.contiguous();
  NormArgs a = norm_args(x, weight, eps);
  a.res_in = residual.data_ptr();
  a.ld_res_in = residual.stride(0);
  a.res_out = residual.data_ptr();
  a.ld_res_out = residual.stride(0);
  a.out = x.data_ptr();
  a.ld_out = x.stride(0);
  for_rows(x.size(0), a.h, [&](int64_t r0, int64_t r1) { norm_rows(a, r0, r1); });
  return true;
}

c10::optional<torch::Tensor> fused_silu_and_mul(const torch::Tensor& x_in) {
  if (!model_dtype(x_in) || !usable(x_in, 2, x_in.scalar_type(), false) || x_in.size(1) % 2) return c10::nullopt;
  const torch::Tensor x = unit_stride(x_in);
  const int64_t d = x.size(1) / 2;
  torch::Tensor out = torch::empty({x.size(0), d}, x.options());
  SiluArgs a{x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), d, x.scalar_type() == at::kBFloat16};
  for_rows(x.size(0), 2 * d, [&](int64_t r0, int64_t r1) {
    switch (isa()) {
      case kAvx512Bf16: avx512bf16::silu_and_mul_rows(a, r0, r1); break;
      case kAvx512: avx512::silu_and_mul_rows(a, r0, r1); break;
      case kAvx2: avx2::silu_and_mul_rows(a, r0, r1); break;
      default: scalar::silu_and_mul_rows(a, r0, r1); break;
    }
  });
  return out;
}

c10::optional<std::tuple<torch::Tensor, torch::Tensor>> fused_rope(const torch::Tensor& positions,
                                                                   const torch::Tensor& q_in,
                                                                   const torch::Tensor& k_in,
                                                                   const torch::Tensor& cos_sin, int64_t head_size,
                                                                   bool inplace) {
  if (!model_dtype(q_in) || !usable(q_in, 2, q_in.scalar_type(), inplace) ||
      !usable(k_in, 2, q_in.scalar_type(), inplace) || k_in.size(0) != q_in.size(0) ||
      !usable(positions, 1, at::kLong, false) || positions.size(0) != q_in.size(0) ||
      !usable(cos_sin, 2, at::kFloat, true) || cos_sin.size(1) != head_size || head_size <= 0 || head_size % 2 ||
      q_in.size(1) % head_size || k_in.size(1) % head_size)
    return c10::nullopt;
  const torch::Tensor q = inplace ? q_in : unit_stride(q_in), k = inplace ? k_in : unit_stride(k_in);
  const torch::Tensor pos_t = positions.contiguous();
  const int64_t t = q.size(0);
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "rope: position ", pos[i], " outside the cos_sin cache");
  torch::Tensor qo = inplace ? q : torch::empty({t, q.size(1)}, q.options());
  torch::Tensor ko = inplace ? k : torch::empty({t, k.size(1)}, k.options());
  RopeArgs a{};
  a.part[0] = {q.data_ptr(), q.stride(0), qo.data_ptr(), qo.stride(0), q.size(1) / head_size};
  a.part[1] = {k.data_ptr(), k.stride(0), ko.data_ptr(), ko.stride(0), k.size(1) / head_size};
  a.positions = pos;
  a.cos_sin = cos_sin.data_ptr<float>();
  a.ld_cs = cos_sin.stride(0);
  a.half = head_size / 2;
  a.bf16 = q.scalar_type() == at::kBFloat16;
  for_rows(t, q.size(1) + k.size(1), [&](int64_t r0, int64_t r1) {
    switch (isa()) {
      case kAvx512Bf16: avx512bf16::rope_rows(a, r0, r1); break;
      case kAvx512: avx512::rope_rows(a, r0, r1); break;
      case kAvx2: avx2::rope_rows(a, r0, r1); break;
      default: scalar::rope_rows(a, r0, r1); break;
    }
  });
  return std::make_tuple(qo, ko);
}
