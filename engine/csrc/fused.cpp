// Fused element-wise ops of a Llama layer (add + RMSNorm, SiLU * up, NeoX RoPE), bf16 and fp32.
//
// At batch 1 a layer's element-wise work is tiny; what costs is the count of torch ops (each a
// few microseconds of Python and dispatcher), ~30 per layer in the torch reference.  Each op here
// is one pybind11 call, one pass over the data, vectorized (AVX-512 with or without BF16, else AVX2,
// else scalar; picked at run time) and parallel over tokens only when a batch is big enough to pay
// for the threads.
// engine/layers/fused.py dispatches here and keeps the torch code as reference and fallback.
#include "bf16.h"
#include "ops.h"

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

// ---------------------------------------------------------------- vector types

struct VecScalar {
  static constexpr int kWidth = 1;
  float v;
  static VecScalar load(const float* p) { return {*p}; }
  static VecScalar load_bf16(const uint16_t* p) { return {bf16_to_float(*p)}; }
  static void store(float* p, VecScalar a) { *p = a.v; }
  static void store_bf16(uint16_t* p, VecScalar a) { *p = float_to_bf16(a.v); }
  static VecScalar round_bf16(VecScalar a) { return {bf16_to_float(float_to_bf16(a.v))}; }
  static VecScalar zero() { return {0.f}; }
  static VecScalar set1(float f) { return {f}; }
  static VecScalar add(VecScalar a, VecScalar b) { return {a.v + b.v}; }
  static VecScalar sub(VecScalar a, VecScalar b) { return {a.v - b.v}; }
  static VecScalar mul(VecScalar a, VecScalar b) { return {a.v * b.v}; }
  static VecScalar div(VecScalar a, VecScalar b) { return {a.v / b.v}; }
  static VecScalar neg(VecScalar a) { return {-a.v}; }
  static VecScalar fmadd(VecScalar a, VecScalar b, VecScalar c) { return {a.v * b.v + c.v}; }
  static VecScalar exp(VecScalar a) { return {std::exp(a.v)}; }
  static float reduce_add(VecScalar a) { return a.v; }
};

}  // namespace
}  // namespace fused

#define FUSED_NS scalar
#define FUSED_VEC VecScalar
#include "fused_impl.h"
#undef FUSED_NS
#undef FUSED_VEC

// Cephes-style expf: x = n ln2 + r, e^r by a degree-7 polynomial, 2^n from the exponent bits.
// Inputs are clamped to [-87, 88.37] so 2^n stays a normal float; above that the result is inf.
#define FUSED_EXP_CONSTANTS                                                                   \
  constexpr float kExpHi = 88.3762626647949f, kExpLo = -87.0f, kLog2e = 1.44269504088896341f; \
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;                            \
  constexpr float kP0 = 1.9875691500E-4f, kP1 = 1.3981999507E-3f, kP2 = 8.3334519073E-3f;     \
  constexpr float kP3 = 4.1665795894E-2f, kP4 = 1.6666665459E-1f, kP5 = 5.0000001201E-1f;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace fused {
namespace {
struct Vec512 {
  static constexpr int kWidth = 16;
  __m512 v;
  static Vec512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec512 load_bf16(const uint16_t* p) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
  }
  static __m512i bf16_bits(__m512 f) {  // round to nearest even; NaN -> 0x7fc0
    const __m512i u = _mm512_castps_si512(f);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(r, 16), _mm512_set1_epi32(0x7fc0));
  }
  static void store(float* p, Vec512 a) { _mm512_storeu_ps(p, a.v); }
  static void store_bf16(uint16_t* p, Vec512 a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(a.v)));
  }
  static Vec512 round_bf16(Vec512 a) { return {_mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(a.v), 16))}; }
  static Vec512 zero() { return {_mm512_setzero_ps()}; }
  static Vec512 set1(float f) { return {_mm512_set1_ps(f)}; }
  static Vec512 add(Vec512 a, Vec512 b) { return {_mm512_add_ps(a.v, b.v)}; }
  static Vec512 sub(Vec512 a, Vec512 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static Vec512 mul(Vec512 a, Vec512 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static Vec512 div(Vec512 a, Vec512 b) { return {_mm512_div_ps(a.v, b.v)}; }
  static Vec512 neg(Vec512 a) { return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)))}; }
  static Vec512 fmadd(Vec512 a, Vec512 b, Vec512 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static float reduce_add(Vec512 a) { return _mm512_reduce_add_ps(a.v); }
  static Vec512 exp(Vec512 a) {
    FUSED_EXP_CONSTANTS
    __m512 x = _mm512_min_ps(_mm512_max_ps(a.v, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), x);
    __m512 y = _mm512_set1_ps(kP0);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP1));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP2));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP3));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP4));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    // above the clamp e^x overflows float: inf, so silu(-large) is -0 as in torch
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, _mm512_set1_ps(kExpHi), _CMP_GT_OQ), _mm512_scalef_ps(y, n),
                                 _mm512_set1_ps(INFINITY))};
  }
};
}  // namespace
}  // namespace fused
#define FUSED_NS avx512
#define FUSED_VEC Vec512
#include "fused_impl.h"
#undef FUSED_NS
#undef FUSED_VEC
#pragma GCC pop_options

// AVX-512 plus its BF16 extension: vcvtneps2bf16 rounds 16 floats to bf16 in one instruction where
// Vec512 spends seven integer ops.  32 rows of the default model, one thread, per call from Python
// (~1 us of which is the call): add + RMSNorm 5.5 -> 4.3 us, RoPE 5.8 -> 4.3 us, SiLU * up 21 ->
// 16.5 us.  The instruction flushes denormal results to zero, the one place where this path may
// differ from the others (by less than 1e-38).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
namespace fused {
namespace {
struct Vec512Bf16 : Vec512 {
  Vec512Bf16(Vec512 a) : Vec512(a) {}  // Vec512's arithmetic, with the two roundings below
  static __m256i bf16(__m512 f) {  // round to nearest even; NaN -> 0x7fc0, the bits every other path gives
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f));
    return _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), h, _mm256_set1_epi16(0x7fc0));
  }
  static void store_bf16(uint16_t* p, Vec512 a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16(a.v)); }
  static Vec512 round_bf16(Vec512 a) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16(a.v)), 16))};
  }
};
}  // namespace
}  // namespace fused
#define FUSED_NS avx512bf16
#define FUSED_VEC Vec512Bf16
#include "fused_impl.h"
#undef FUSED_NS
#undef FUSED_VEC
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fused {
namespace {
struct Vec256 {
  static constexpr int kWidth = 8;
  __m256 v;
  static Vec256 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec256 load_bf16(const uint16_t* p) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16))};
  }
  static __m256i bf16_bits(__m256 f) {  // round to nearest even in the low 16 bits of each lane
    const __m256i u = _mm256_castps_si256(f);
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7fc0), nan);
  }
  static void store(float* p, Vec256 a) { _mm256_storeu_ps(p, a.v); }
  static void store_bf16(uint16_t* p, Vec256 a) {
    const __m256i b = bf16_bits(a.v);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static Vec256 round_bf16(Vec256 a) { return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.v), 16))}; }
  static Vec256 zero() { return {_mm256_setzero_ps()}; }
  static Vec256 set1(float f) { return {_mm256_set1_ps(f)}; }
  static Vec256 add(Vec256 a, Vec256 b) { return {_mm256_add_ps(a.v, b.v)}; }
  static Vec256 sub(Vec256 a, Vec256 b) { return {_mm256_sub_ps(a.v, b.v)}; }
  static Vec256 mul(Vec256 a, Vec256 b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static Vec256 div(Vec256 a, Vec256 b) { return {_mm256_div_ps(a.v, b.v)}; }
  static Vec256 neg(Vec256 a) { return {_mm256_xor_ps(a.v, _mm256_set1_ps(-0.f))}; }
  static Vec256 fmadd(Vec256 a, Vec256 b, Vec256 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static float reduce_add(Vec256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static Vec256 exp(Vec256 a) {
    FUSED_EXP_CONSTANTS
    __m256 x = _mm256_min_ps(_mm256_max_ps(a.v, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), x);
    __m256 y = _mm256_set1_ps(kP0);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP1));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP2));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP4));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return {_mm256_blendv_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY),
                             _mm256_cmp_ps(a.v, _mm256_set1_ps(kExpHi), _CMP_GT_OQ))};
  }
};
}  // namespace
}  // namespace fused
#define FUSED_NS avx2
#define FUSED_VEC Vec256
#include "fused_impl.h"
#undef FUSED_NS
#undef FUSED_VEC
#pragma GCC pop_options

namespace fused {
namespace {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

bool isa_supported(int isa) {
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvx512:
      return isa_supported(kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case kAvx512Bf16: return isa_supported(kAvx512) && __builtin_cpu_supports("avx512bf16");
    default: return false;
  }
}

int best_isa() {
  static const int best = isa_supported(kAvx512Bf16) ? kAvx512Bf16
                          : isa_supported(kAvx512)   ? kAvx512
                          : isa_supported(kAvx2)     ? kAvx2
                                                     : kScalar;
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
  for (int i = kScalar; i <= kAvx512Bf16; ++i)
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
