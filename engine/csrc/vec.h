// The vector layer under every kernel: VecScalar, Vec256 (AVX2) and Vec512 (AVX-512) with one
// set of loads, stores, arithmetic, horizontal reductions, transposes, exp and bf16 / fp8 / int8
// widening.  A kernel written once over `V` (fused_impl.h, attention_fma_impl.h) is stamped out per
// type; hand-written kernels call the static register-level helpers (Vec256::hsum(__m256),
// Vec512::widen_bf16(__m256i), ...).
// Each type's functions carry its target (isa.h), so any file may include this one.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"

namespace cpuserve {

// ---------------------------------------------------------------- scalar bfloat16

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// The 8-bit element formats a row can be widened from (values match attention's KvKind).
enum class Elem8 : int { kE4M3 = 1, kE5M2 = 2, kInt8 = 3 };

// Cephes-style expf (exp_lanes below): x = n ln2 + r, e^r by a degree-7 polynomial, times 2^n.
// Inputs are clamped to [-87, 88.37] so 2^n stays a normal float; above that the result is inf.
namespace exp_consts {
constexpr float kHi = 88.3762626647949f, kLo = -87.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500E-4f, kP1 = 1.3981999507E-3f, kP2 = 8.3334519073E-3f;
constexpr float kP3 = 4.1665795894E-2f, kP4 = 1.6666665459E-1f, kP5 = 5.0000001201E-1f;
}  // namespace exp_consts

// exp over a vector type's lanes (Vec256, Vec512), written once: x clamped to [kLo, kHi], n =
// round(x log2 e), r = x - n ln 2 (in two parts), e^r by the polynomial, times 2^n by the type's
// ldexp; lanes above kHi give inf.  Inlined into each type's target-specific exp, whose operations
// it calls.
template <class V>
inline __attribute__((always_inline)) V exp_lanes(V a) {
  using namespace exp_consts;
  V x = V::min(V::max(a, V::set1(kLo)), V::set1(kHi));
  const V n = V::round(V::mul(x, V::set1(kLog2e)));
  x = V::fnmadd(n, V::set1(kLn2Hi), x);
  x = V::fnmadd(n, V::set1(kLn2Lo), x);
  V y = V::set1(kP0);
  y = V::fmadd(y, x, V::set1(kP1));
  y = V::fmadd(y, x, V::set1(kP2));
  y = V::fmadd(y, x, V::set1(kP3));
  y = V::fmadd(y, x, V::set1(kP4));
  y = V::fmadd(y, x, V::set1(kP5));
  y = V::fmadd(y, V::mul(x, x), V::add(x, V::set1(1.f)));
  return V::above(a, V::set1(kHi), V::ldexp(y, n), V::set1(INFINITY));
}

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

}  // namespace cpuserve

// ---------------------------------------------------------------- AVX2: 8 floats

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX2)
namespace cpuserve {

struct Vec256 {
  static constexpr int kWidth = 8;
  static constexpr int kRegisters = 16;  // ymm registers a kernel's accumulators and operands share
  __m256 v;

  // 8 bf16 -> 8 fp32 (exact: a bf16 is the top half of an fp32).
  static __m256 widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  static __m256 load_bf16_ps(const uint16_t* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // round to nearest even in the low 16 bits of each lane; NaN -> 0x7fc0
  static __m256i bf16_bits(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7fc0), nan);
  }
  // 8 fp32 -> 8 bf16 (bf16_bits, packed)
  static __m128i to_bf16(__m256 f) {
    const __m256i b = bf16_bits(f);
    return _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  }
  // 8 fp8 (or int8) values -> exact fp32.  e5m2 is the top byte of an fp16; e4m3fn's 7 magnitude
  // bits shifted into an fp16 are the value * 2^-8 (denormals included), and 0x7f / 0xff are NaN
  // (e4m3fn has no infinity).
  static __m256 widen8(const uint8_t* src, Elem8 kind) {
    if (kind == Elem8::kInt8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
    const __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    if (kind == Elem8::kE5M2) return _mm256_cvtph_ps(_mm_slli_epi16(u, 8));
    const __m128i mag = _mm_and_si128(u, _mm_set1_epi16(0x7f));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x80)), 8));
    const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
    const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
    return _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
  }
  // 8 x 8 transpose: r[i][j] -> r[j][i].
  static void transpose(Vec256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i].v, r[2 * i + 1].v);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i].v, r[2 * i + 1].v);
    }
    for (int i = 0; i < 2; ++i) {
      s[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int c = 0; c < 4; ++c) {
      r[c].v = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
      r[c + 4].v = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
    }
  }
  static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
  }
  static __m256 exp(__m256 a) { return exp_lanes(Vec256{a}).v; }

  static Vec256 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec256 load_bf16(const uint16_t* p) { return {load_bf16_ps(p)}; }
  static Vec256 load8(const uint8_t* p, Elem8 kind) { return {widen8(p, kind)}; }
  static void store(float* p, Vec256 a) { _mm256_storeu_ps(p, a.v); }
  static void store_bf16(uint16_t* p, Vec256 a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(a.v)); }
  static Vec256 round_bf16(Vec256 a) { return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a.v), 16))}; }
  static Vec256 zero() { return {_mm256_setzero_ps()}; }
  static Vec256 set1(float f) { return {_mm256_set1_ps(f)}; }
  static Vec256 add(Vec256 a, Vec256 b) { return {_mm256_add_ps(a.v, b.v)}; }
  static Vec256 sub(Vec256 a, Vec256 b) { return {_mm256_sub_ps(a.v, b.v)}; }
  static Vec256 mul(Vec256 a, Vec256 b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static Vec256 div(Vec256 a, Vec256 b) { return {_mm256_div_ps(a.v, b.v)}; }
  static Vec256 neg(Vec256 a) { return {_mm256_xor_ps(a.v, _mm256_set1_ps(-0.f))}; }
  static Vec256 fmadd(Vec256 a, Vec256 b, Vec256 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec256 fnmadd(Vec256 a, Vec256 b, Vec256 c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b
  static Vec256 min(Vec256 a, Vec256 b) { return {_mm256_min_ps(a.v, b.v)}; }
  static Vec256 max(Vec256 a, Vec256 b) { return {_mm256_max_ps(a.v, b.v)}; }
  static Vec256 round(Vec256 a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  // y * 2^n for integral n in [-126, 128], from the exponent bits (n = 128 gives inf)
  static Vec256 ldexp(Vec256 y, Vec256 n) {
    return {_mm256_mul_ps(y.v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23)))};
  }
  static Vec256 above(Vec256 a, Vec256 b, Vec256 x, Vec256 y) {  // lanes where a > b: y, else x
    return {_mm256_blendv_ps(x.v, y.v, _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ))};
  }
  static float reduce_add(Vec256 a) { return hsum(a.v); }
  static Vec256 exp(Vec256 a) { return {exp(a.v)}; }
};

}  // namespace cpuserve
CPUSERVE_TARGET_END

// ---------------------------------------------------------------- AVX-512: 16 floats

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX512)
namespace cpuserve {

struct Vec512 {
  static constexpr int kWidth = 16;
  static constexpr int kRegisters = 32;  // zmm registers a kernel's accumulators and operands share
  __m512 v;

  static __mmask16 mask(int n) {  // the first n of 16 lanes
    return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
  }
  // 16 bf16 -> 16 fp32 (exact: a bf16 is the top half of an fp32).
  static __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static __m512 load_bf16_ps(const uint16_t* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static __m512i bf16_bits(__m512 f) {  // round to nearest even; NaN -> 0x7fc0
    const __m512i u = _mm512_castps_si512(f);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(r, 16), _mm512_set1_epi32(0x7fc0));
  }
  // 16 fp8 (or int8) values (n valid, rest 0) -> exact fp32; formats as Vec256::widen8.
  static __m512 widen8(const uint8_t* src, int n, Elem8 kind) {
    if (kind == Elem8::kInt8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask(n), src)));
    const __m256i u = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask(n), src));
    if (kind == Elem8::kE5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(u, 8));
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi16(0x7f));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8));
    const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f));
    return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
  // 16 x 16 transpose of 32-bit elements: r[i][j] -> r[j][i].
  static void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
      const __m512i b = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
      const __m512i e = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
      const __m512i f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
      r[c] = _mm512_shuffle_i32x4(a, b, 0x88);
      r[c + 8] = _mm512_shuffle_i32x4(a, b, 0xdd);
      r[c + 4] = _mm512_shuffle_i32x4(e, f, 0x88);
      r[c + 12] = _mm512_shuffle_i32x4(e, f, 0xdd);
    }
  }
  template <class T>  // Vec512 or a type derived from it
  static void transpose(T r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; ++i) t[i] = _mm512_castps_si512(r[i].v);
    transpose16(t);
    for (int i = 0; i < 16; ++i) r[i].v = _mm512_castsi512_ps(t[i]);
  }
  static float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
  static float hmax(__m512 v) { return _mm512_reduce_max_ps(v); }
  static __m512 exp(__m512 a) { return exp_lanes(Vec512{a}).v; }
  // 2^t for t <= 0, the softmax's exp (scores pre-multiplied by log2 e): t is clamped at -126, so
  // the result is never 0 but ~1e-38 at the bottom (callers zero masked lanes); degree-6 Taylor
  // polynomial of 2^f on [-0.5, 0.5], |rel err| ~ 1.2e-7.  Cheaper than exp: no range reduction by ln 2.
  static __m512 exp2(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.5403530393381609e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
  }

  static Vec512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec512 load_bf16(const uint16_t* p) { return {load_bf16_ps(p)}; }
  static Vec512 load8(const uint8_t* p, Elem8 kind) { return {widen8(p, 16, kind)}; }
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
  static Vec512 fnmadd(Vec512 a, Vec512 b, Vec512 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a b
  static Vec512 min(Vec512 a, Vec512 b) { return {_mm512_min_ps(a.v, b.v)}; }
  static Vec512 max(Vec512 a, Vec512 b) { return {_mm512_max_ps(a.v, b.v)}; }
  static Vec512 round(Vec512 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  static Vec512 ldexp(Vec512 y, Vec512 n) { return {_mm512_scalef_ps(y.v, n.v)}; }  // y * 2^n, n integral
  static Vec512 above(Vec512 a, Vec512 b, Vec512 x, Vec512 y) {  // lanes where a > b: y, else x
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), x.v, y.v)};
  }
  static float reduce_add(Vec512 a) { return hsum(a.v); }
  static Vec512 exp(Vec512 a) { return {exp(a.v)}; }
};

// Row reductions of 16 rows at once: v[r] holds row r's 16 partial values; the result's lane r is
// row r's max (or sum).  A shuffle tree (16 -> 8 -> 4 -> 2 -> 1 vectors) costs ~3 ops a row where a
// horizontal reduction per row costs ~9, and its rows do not wait on each other.  Feed rows in
// pairs with pair(), then finish().
template <bool MAX>
struct RowReduce16 {
  static inline __m512 op(__m512 a, __m512 b) { return MAX ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); }
  __m512 u[8];
  // Rows 2i and 2i + 1: each 128-bit lane of u[i] holds half a row's reduction.
  inline void pair(int i, __m512 a, __m512 b) {
    u[i] = op(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  inline __m512 finish() const {
    __m512 w[4];
    for (int i = 0; i < 4; ++i)  // lane L of w[i]: row 4i + L's four partials
      w[i] = op(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88), _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    const __m512 y0 = op(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 y1 = op(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    const __m512 z = op(_mm512_unpacklo_ps(y0, y1), _mm512_unpackhi_ps(y0, y1));
    // z's element 4L + j is row L + {0, 8, 4, 12}[j]
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 13, 9, 5, 1, 14, 10, 6, 2, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, z);
  }
};

}  // namespace cpuserve
CPUSERVE_TARGET_END

// ---------------------------------------------------------------- AVX-512 + BF16

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX512_BF16)
namespace cpuserve {

// Vec512 with vcvtneps2bf16 rounding 16 floats to bf16 in one instruction where Vec512 spends seven
// integer ops.  The instruction flushes denormal results to zero, the one place where this type's
// results may differ from the others (by less than 1e-38).
struct Vec512Bf16 : Vec512 {
  Vec512Bf16() = default;
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

}  // namespace cpuserve
CPUSERVE_TARGET_END
