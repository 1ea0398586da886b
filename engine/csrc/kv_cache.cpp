// KV-cache writes: reshape_and_cache puts a step's new keys and values into their slots (the
// model's dtype copied as it is; fp8 as x / scale, bit-exact with torch's conversion; int8 rounded
// per row, its scale after the row), and the cache checks of kv_cache.h.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "isa.h"
#include "kv_cache.h"
#include "ops.h"
#include "vec.h"

namespace cpuserve_attn {

void check_kv_cache(const at::Tensor& kv_cache, int64_t D) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(3) == 2 * D && kv_cache.stride(3) == 1,
              "kv cache must be [blocks, kv_heads, block, 2 * head_size] with a contiguous last dim");
  const int64_t row = kv_cache.scalar_type() == at::kChar ? 2 * D + kInt8ScaleBytes : 2 * D;
  TORCH_CHECK(kv_cache.stride(2) >= row && kv_cache.stride(1) >= kv_cache.size(2) * kv_cache.stride(2) &&
                  kv_cache.stride(0) >= kv_cache.size(1) * kv_cache.stride(1),
              kv_cache.scalar_type() == at::kChar
                  ? "int8 kv cache rows need their scales after them (allocate it with the backend's allocate_kv_cache)"
                  : "kv cache rows overlap");
}

KvKind kv_kind_of(const at::Tensor& kv_cache, at::ScalarType model) {
  const auto t = kv_cache.scalar_type();
  if (t == at::kFloat8_e4m3fn) return KvKind::kE4M3;
  if (t == at::kFloat8_e5m2) return KvKind::kE5M2;
  if (t == at::kChar) return KvKind::kI8;
  TORCH_CHECK(t == model, "kv cache dtype ", t, " does not match model dtype ", model);
  return KvKind::kSame;
}

}  // namespace cpuserve_attn

// ------------------------------------------------------------------ AVX-512 row writes

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX512)
namespace cpuserve_attn {
namespace v512 {

using cpuserve::Vec512;
static inline __mmask16 mask16(int n) { return Vec512::mask(n); }

// KV-cache write: D values (bf16 or fp32) -> fp8(x / scale), bit-exact with c10's
// scalar conversions (fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value, which
// torch's .to(float8) uses): same three branches (overflow/NaN, denormal via a float
// add, round-to-nearest-even on the bits), evaluated for 16 lanes and blended.
static inline __m128i fp8x16_from_ps(__m512 f, KvKind kind) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(bits, sign);
  const bool e4m3 = kind == KvKind::kE4M3;
  const uint32_t fp8_max = e4m3 ? (1087u << 20) : (143u << 23);
  const uint32_t min_normal = e4m3 ? (121u << 23) : (113u << 23);
  const uint32_t denorm_mask = e4m3 ? (141u << 23) : (134u << 23);
  const int mshift = e4m3 ? 20 : 21;
  const uint32_t bias = e4m3 ? ((static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu) : ((static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu);
  // normal range
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, mshift), _mm512_set1_epi32(1));
  __m512i norm = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>(bias))), odd), mshift);
  norm = _mm512_and_si512(norm, _mm512_set1_epi32(0xFF));
  if (e4m3)  // rounding may carry into the NaN pattern: saturate
    norm = _mm512_mask_mov_epi32(norm, _mm512_cmpeq_epi32_mask(norm, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7e));
  // denormal range
  const __m512 dm = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(denorm_mask)));
  const __m512i den = _mm512_and_si512(
      _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), dm)), _mm512_set1_epi32(static_cast<int>(denorm_mask))),
      _mm512_set1_epi32(0xFF));
  // overflow / inf / NaN
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
  const __m512i big = _mm512_mask_mov_epi32(_mm512_set1_epi32(e4m3 ? 0x7e : 0x7c), is_nan, _mm512_set1_epi32(0x7f));
  __m512i r = _mm512_mask_mov_epi32(norm, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(min_normal))), den);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(fp8_max))), big);
  r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
  return _mm512_cvtepi32_epi8(r);
}

static void store_fp8_row(const void* src, bool src_bf16, uint8_t* dst, int D, float scale, KvKind kind) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int d = 0; d < D; d += 16) {
    const __mmask16 mk = mask16(D - d);
    __m512 x;
    if (src_bf16) {
      const __m256i h = _mm256_maskz_loadu_epi16(mk, static_cast<const uint16_t*>(src) + d);
      x = Vec512::widen_bf16(h);
    } else {
      x = _mm512_maskz_loadu_ps(mk, static_cast<const float*>(src) + d);
    }
    _mm_mask_storeu_epi8(dst + d, mk, fp8x16_from_ps(_mm512_div_ps(x, sc), kind));
  }
}

// int8 cache write: one row of D values (bf16 or fp32) -> round(x * 127 / max|x|), its scale
// max|x| / 127 (0 for a zero row).  Bit-exact with ref.quantize_int8_rows: the same fp32
// division and product, rounded half to even.
static void store_int8_row(const void* src, bool src_bf16, int8_t* dst, int D, float* scale) {
  alignas(64) float row[256];
  __m512 amax = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 16) {
    const __mmask16 mk = mask16(D - d);
    const __m512 x = src_bf16 ? Vec512::widen_bf16(_mm256_maskz_loadu_epi16(mk, static_cast<const uint16_t*>(src) + d))
                              : _mm512_maskz_loadu_ps(mk, static_cast<const float*>(src) + d);
    _mm512_store_ps(row + d, x);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(x));
  }
  const float m = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
  for (int d = 0; d < D; d += 16)
    _mm_mask_storeu_epi8(dst + d, mask16(D - d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(row + d), inv))));
  *scale = m / 127.f;
}

}  // namespace v512
}  // namespace cpuserve_attn
CPUSERVE_TARGET_END

// ------------------------------------------------------------------ portable row writes, and the op
namespace cpuserve_attn {
namespace {

// Portable v512::store_fp8_row: c10's conversion, one value at a time.
void store_fp8_row(const void* src, bool src_bf16, uint8_t* dst, int D, float scale, KvKind kind) {
  const auto row = [&](const auto* x, auto fp8) {
    using F8 = decltype(fp8);
    for (int d = 0; d < D; ++d) dst[d] = F8(static_cast<float>(x[d]) / scale).x;
  };
  const auto as_fp8 = [&](auto fp8) {
    if (src_bf16)
      row(static_cast<const c10::BFloat16*>(src), fp8);
    else
      row(static_cast<const float*>(src), fp8);
  };
  if (kind == KvKind::kE4M3)
    as_fp8(c10::Float8_e4m3fn());
  else
    as_fp8(c10::Float8_e5m2());
}

// Portable v512::store_int8_row (same arithmetic; nearbyint rounds half to even).
void store_int8_row(const void* src, bool src_bf16, int8_t* dst, int D, float* scale) {
  const auto row = [&](const auto* x) {
    float m = 0.f;
    for (int d = 0; d < D; ++d) m = std::max(m, std::fabs(static_cast<float>(x[d])));
    const float inv = m > 0.f ? 127.f / m : 0.f;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[d]) * inv));
    *scale = m / 127.f;
  };
  if (src_bf16)
    row(static_cast<const c10::BFloat16*>(src));
  else
    row(static_cast<const float*>(src));
}

}  // namespace
}  // namespace cpuserve_attn

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping,
                       double k_scale, double v_scale) {
  using namespace cpuserve_attn;
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type(),
              "key and value must be [tokens, kv_heads, head_size] of one dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value last dim must be contiguous");
  const int64_t T = key.size(0), Hkv = key.size(1), D = key.size(2);
  check_kv_cache(kv_cache, D);
  const int64_t NB = kv_cache.size(0), B = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(1) == Hkv, "kv cache shape does not match key");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.is_contiguous(),
              "slot_mapping must be [tokens]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt, "slot_mapping must be int");
  const auto src_t = key.scalar_type(), dst_t = kv_cache.scalar_type();
  const bool fp8 = dst_t == at::kFloat8_e4m3fn || dst_t == at::kFloat8_e5m2;
  const bool int8 = dst_t == at::kChar;
  TORCH_CHECK(fp8 || int8 ? (src_t == at::kBFloat16 || src_t == at::kFloat) : src_t == dst_t,
              "cannot store ", src_t, " keys into a ", dst_t, " cache");
  std::vector<int64_t> slots(T);
  if (slot_mapping.scalar_type() == at::kLong) {
    std::memcpy(slots.data(), slot_mapping.data_ptr<int64_t>(), T * sizeof(int64_t));
  } else {
    const int32_t* s = slot_mapping.data_ptr<int32_t>();
    for (int64_t t = 0; t < T; ++t) slots[t] = s[t];
  }
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] < NB * B, "slot ", slots[t], " out of range");

  const int64_t src_elt = key.element_size(), dst_elt = kv_cache.element_size();
  const uint8_t* kp = static_cast<const uint8_t*>(key.data_ptr());
  const uint8_t* vp = static_cast<const uint8_t*>(value.data_ptr());
  uint8_t* cache = static_cast<uint8_t*>(kv_cache.data_ptr());
  const int64_t k_st = key.stride(0), k_sh = key.stride(1), v_st = value.stride(0), v_sh = value.stride(1);
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  const bool src_bf16 = src_t == at::kBFloat16;
  const KvKind kind = dst_t == at::kFloat8_e4m3fn ? KvKind::kE4M3 : KvKind::kE5M2;
  const bool use_vec = cpuserve::cpu_supports(cpuserve::Isa::kAvx512);
  const auto int8_row = use_vec ? &v512::store_int8_row : &store_int8_row;
  const auto fp8_row = use_vec ? &v512::store_fp8_row : &store_fp8_row;
  const int64_t c_sb = kv_cache.stride(0), c_sh = kv_cache.stride(1), c_so = kv_cache.stride(2);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, Hkv * D));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t blk = slot / B, off = slot % B;
      for (int64_t h = 0; h < Hkv; ++h) {
        uint8_t* dst = cache + (blk * c_sb + h * c_sh + off * c_so) * dst_elt;
        const uint8_t* ks_row = kp + (t * k_st + h * k_sh) * src_elt;
        const uint8_t* vs_row = vp + (t * v_st + h * v_sh) * src_elt;
        if (int8) {
          float sc[2];
          int8_row(ks_row, src_bf16, reinterpret_cast<int8_t*>(dst), D, &sc[0]);
          int8_row(vs_row, src_bf16, reinterpret_cast<int8_t*>(dst + D), D, &sc[1]);
          std::memcpy(dst + 2 * D, sc, sizeof(sc));
        } else if (fp8) {
          fp8_row(ks_row, src_bf16, dst, D, ks, kind);
          fp8_row(vs_row, src_bf16, dst + D, D, vs, kind);
        } else {
          std::memcpy(dst, ks_row, D * dst_elt);
          std::memcpy(dst + D * dst_elt, vs_row, D * dst_elt);
        }
      }
    }
  });
}
