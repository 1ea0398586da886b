// AVX2 + FMA paged-attention tile operations (see attention_common.h for the loop): the fp32
// tiles of attention_fma_impl.h over Vec256 (F32Ops), and decode units that read the cache rows
// in place (DecodeOps for bf16, Int8DecodeOps for int8 caches).  fp8 caches are dequantised
// through F16C.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_common.h"
#include "vec.h"

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX2)

namespace cpuserve_attn {
namespace v256 {

using cpuserve::Vec256;
using V = Vec256;

// exp(x) for x <= 0 (softmax): exactly 0 below -87, where Vec256::exp stops at e^-87.
static inline __m256 exp_ps(__m256 x) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), Vec256::exp(x));
}

// Online softmax of one tile, row by row: s.S (unscaled scores) -> s.P (fp32), s.alpha, s.m, s.l.
static inline void fp32_softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
  const __m256 scale = _mm256_set1_ps(p.scale);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  float* P = static_cast<float*>(s.P);
  for (int r = 0; r < R; ++r) {
    __m256 x[4];
    for (int c = 0; c < 4; ++c) x[c] = _mm256_mul_ps(_mm256_load_ps(s.S + r * KT + 8 * c), scale);
    if (masked) {
      const int lim = std::min(n, s.pos[r] - k0 + 1);
      for (int c = 0; c < 4; ++c) {
        const __m256i vis = _mm256_cmpgt_epi32(_mm256_set1_epi32(lim - 8 * c), lane);
        x[c] = _mm256_blendv_ps(ninf, x[c], _mm256_castsi256_ps(vis));
      }
    }
    const float mx = Vec256::hmax(_mm256_max_ps(_mm256_max_ps(x[0], x[1]), _mm256_max_ps(x[2], x[3])));
    const float m_old = s.m[r];
    const float m_new = std::max(m_old, mx);
    if (m_new == -std::numeric_limits<float>::infinity()) {
      s.alpha[r] = 1.f;
      for (int c = 0; c < 4; ++c) _mm256_store_ps(P + r * KT + 8 * c, _mm256_setzero_ps());
      continue;
    }
    const float alpha = std::exp(m_old - m_new);
    const __m256 mn = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      const __m256 pc = exp_ps(_mm256_sub_ps(x[c], mn));
      sum = _mm256_add_ps(sum, pc);
      _mm256_store_ps(P + r * KT + 8 * c, pc);
    }
    s.l[r] = s.l[r] * alpha + Vec256::hsum(sum);
    s.m[r] = m_new;
    s.alpha[r] = alpha;
  }
}

#include "attention_fma_impl.h"

// Decode: few query rows (one token's GQA group, R <= kMaxRows), bf16 model and cache.
// The tile path above widens every K and V row to fp32 in scratch and transposes K, which
// costs more than the dot products when only a handful of rows reuse each key; here the
// cache rows are read in place.  QK: a chunk of 16 bf16 splits into its even and odd
// values as fp32 with one shift and one AND (bf16 is the top half of fp32), and the query
// is stored split the same way, so a key's dot product with a row is two FMAs per chunk;
// the 8 lanes are summed across 8 keys at once.  PV: V rows widened in natural order,
// a broadcast probability times 8 outputs per FMA.
// 16 bf16 at p -> fp32 of the even-indexed ones (*even) and of the odd-indexed ones (*odd).
static inline void split_bf16x16(const uint16_t* p, __m256* even, __m256* odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

static inline __m256 sum8_lanes(const float* t) {  // t: 8 vectors a0..a7 -> (sum a0, ..., sum a7)
  const __m256 t0 = _mm256_hadd_ps(_mm256_load_ps(t), _mm256_load_ps(t + 8));
  const __m256 t1 = _mm256_hadd_ps(_mm256_load_ps(t + 16), _mm256_load_ps(t + 24));
  const __m256 t2 = _mm256_hadd_ps(_mm256_load_ps(t + 32), _mm256_load_ps(t + 40));
  const __m256 t3 = _mm256_hadd_ps(_mm256_load_ps(t + 48), _mm256_load_ps(t + 56));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 16 int8 at p -> fp32 of values 0-7 (*lo) and 8-15 (*hi).
static inline void widen_int8x16(const int8_t* p, __m256* lo, __m256* hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
}

// S[r][g*8 .. g*8+8) for RB rows, T: RB x 64 floats.  bf16 cache: q split per 16-value chunk (8
// even, then 8 odd).  int8 cache (I8): q in natural order, each key's score times its row scale ksc.
template <int RB, bool I8 = false>
static inline void qk_direct(const float* q, int qs, const void* const* krows, int D, int n, float* S, float* T,
                             const float* ksc = nullptr) {
  constexpr int NA = RB <= 6 ? 2 : 1;  // independent FMA chains per row
  for (int g = 0; g < KT / 8; ++g) {
    if (g * 8 >= n) {
      for (int r = 0; r < RB; ++r) _mm256_store_ps(S + r * KT + g * 8, _mm256_setzero_ps());
      continue;
    }
    for (int j = 0; j < 8; ++j) {
      if (g * 8 + j >= n) {
        for (int r = 0; r < RB; ++r) _mm256_store_ps(T + r * 64 + j * 8, _mm256_setzero_ps());
        continue;
      }
      __m256 acc[RB][NA];
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
        for (int a = 0; a < NA; ++a) acc[r][a] = _mm256_setzero_ps();
      for (int c = 0; c * 16 < D; ++c) {
        __m256 ke, ko;
        if (I8)
          widen_int8x16(static_cast<const int8_t*>(krows[g * 8 + j]) + c * 16, &ke, &ko);
        else
          split_bf16x16(static_cast<const uint16_t*>(krows[g * 8 + j]) + c * 16, &ke, &ko);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          const float* qc = q + r * qs + c * 16;
          acc[r][0] = _mm256_fmadd_ps(ke, _mm256_load_ps(qc), acc[r][0]);
          acc[r][NA - 1] = _mm256_fmadd_ps(ko, _mm256_load_ps(qc + 8), acc[r][NA - 1]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r)
        _mm256_store_ps(T + r * 64 + j * 8, NA == 2 ? _mm256_add_ps(acc[r][0], acc[r][NA - 1]) : acc[r][0]);
    }
    for (int r = 0; r < RB; ++r) {
      const __m256 sums = sum8_lanes(T + r * 64);
      _mm256_store_ps(S + r * KT + g * 8, I8 ? _mm256_mul_ps(sums, _mm256_loadu_ps(ksc + g * 8)) : sums);
    }
  }
}

// I8: an int8 cache (any model dtype), read in place the same way: its rows widened to fp32 in
// registers (two instructions per 8 values, as for bf16) at half the bytes; each key's K scale
// multiplies its scores and its V scale its probabilities.
template <bool I8>
struct DecodeOpsT {
  static constexpr int kMaxRows = 8;
  static void begin(const AttnParams&, Scratch&, int) {}
  static void end() {}

  __attribute__((noinline)) static void load_q(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    (void)ntok;
    float* q = static_cast<float*>(s.q);
    const size_t esz = p.model_bf16 ? 2 : 4;
    for (int r = 0; r < R; ++r) {
      float* dst = q + static_cast<int64_t>(r) * p.Dp;
      if (I8) {  // natural order, fp32
        const uint8_t* row = static_cast<const uint8_t*>(p.q) + q_offset(p, tok, kvh, r) * esz;
        row_to_f32(row, p.model_bf16, KvKind::kSame, 1.f, false, p.D, p.Dp, dst);
        continue;
      }
      const uint16_t* row = static_cast<const uint16_t*>(p.q) + q_offset(p, tok, kvh, r);
      for (int c = 0; c * 16 < p.D; ++c) {
        __m256 even, odd;
        split_bf16x16(row + c * 16, &even, &odd);
        _mm256_store_ps(dst + c * 16, even);
        _mm256_store_ps(dst + c * 16 + 8, odd);
      }
    }
  }

  __attribute__((noinline)) static void prep_kv(const AttnParams& p, Scratch& s, const int32_t* bt_row, int kvh, int k0, int n) {
    const uint8_t* rows[KT];
    gather_rows(p, bt_row, kvh, k0, n, rows);
    for (int i = 0; i < n; ++i) {
      s.krows[i] = rows[i];
      s.vrows[i] = rows[i] + p.D * p.kv_elt;
      if (I8) {
        s.ksc[i] = row_k_scale(p, rows[i]);
        s.vsc[i] = row_v_scale(p, rows[i]);
      }
    }
    if (I8)
      for (int i = n; i < KT; ++i) s.ksc[i] = s.vsc[i] = 0.f;
  }

  __attribute__((noinline)) static void qk(const AttnParams& p, Scratch& s, int R, int n) {
    const float* q = static_cast<const float*>(s.q);
    float* T = static_cast<float*>(s.krow);
    with_rows_upto<8>(R, [&](auto rb) { qk_direct<decltype(rb)::value, I8>(q, p.Dp, s.krows, p.D, n, s.S, T, s.ksc); });
  }

  static void softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
    F32Ops::softmax(p, s, R, k0, n, masked);
  }

  __attribute__((noinline)) static void pv(const AttnParams& p, Scratch& s, int R, int n) {
    float* P = static_cast<float*>(s.P);
    if (I8)  // softmax has summed P already: the V scales only weight the values
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < KT; j += 8)
          _mm256_store_ps(P + r * KT + j, _mm256_mul_ps(_mm256_load_ps(P + r * KT + j), _mm256_load_ps(s.vsc + j)));
    with_rows_upto<8>(R, [&](auto rb) { pv_direct<decltype(rb)::value, I8>(P, s.vrows, p.D, p.Dp, n, s.O, s.alpha); });
  }

  static void store(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    F32Ops::store(p, s, tok, ntok, kvh, R);
  }
};
using DecodeOps = DecodeOpsT<false>;
using Int8DecodeOps = DecodeOpsT<true>;

}  // namespace v256
}  // namespace cpuserve_attn

CPUSERVE_TARGET_END
