// AVX-512 VNNI paged attention over an int8 cache (see attention_common.h for the loop): decode
// units with both products in vpdpbusd (Int8DecodeOps), prompt units with K . q in vpdpbusd and
// P . V in vec512's fp32 FMAs or dpbf16 (Int8PrefillOps).  The int8 row layout is kv_cache.h's.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "attention_common.h"
#include "attention_vec512.h"
#include "vec.h"

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX512_BF16_VNNI)

namespace cpuserve_attn {
namespace v512 {

// Decode over an int8 cache reads half the bytes of a bf16 one, and both products run as VNNI
// int8 dot products (vpdpbusd: 64 multiply-adds, u8 x s8, per instruction).  K . q: each query
// row is rounded to int8 with its own scale (max |q| / 127); the keys' rows are transposed in
// registers 16 keys x 64 values at a time, and their sign bits flipped to make them the unsigned
// operand (k + 128), which adds 128 * sum(q) to every score, taken back out before the two scales.
// P . V: the probabilities, times the keys' V scales, rounded to u8 per row and tile of 32 keys.

// Keys h * 16 .. h * 16 + 15 of a tile, values [64c, 64c + 64) (zero past D), sign bits flipped and
// transposed: t[j] holds the 16 keys' values 4j .. 4j + 3 as u8.  Every krows entry must point at a
// readable row: past the tile's n keys the callers repeat its first row (scores of keys past n are
// scaled by a zero key scale and masked), so the loads need no branch per key.
static inline void keys_u8_transposed(const void* const* krows, int h, int c, int D, __m512i t[16]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __mmask64 mk = mask64(D - c * 64);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    t[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, static_cast<const int8_t*>(krows[h * 16 + i]) + c * 64), flip);
  Vec512::transpose16(t);
}

// S[r][0, KT) for RB int8 query rows (qs bytes apart, zero past D) against up to KT int8 key rows.
template <int RB>
static inline void qk_int8(const int8_t* q, int qs, const float* qsc, const int32_t* qsum, const void* const* krows,
                           const float* ksc, int D, int n, float* S) {
  // Independent accumulator chains: one per row alone would wait on vpdpbusd's latency.
  constexpr int NS = RB >= 6 ? 1 : RB >= 3 ? 2 : RB == 2 ? 4 : 8;
  const int32_t* qr[RB];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) qr[r] = reinterpret_cast<const int32_t*>(q + static_cast<int64_t>(r) * qs);
  for (int h = 0; h < KT / 16; ++h) {
    if (h * 16 >= n) {
      for (int r = 0; r < RB; ++r) _mm512_store_ps(S + r * KT + h * 16, _mm512_setzero_ps());
      continue;
    }
    __m512i acc[RB][NS];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < NS; ++i) acc[r][i] = _mm512_setzero_si512();
    for (int c = 0; c * 64 < D; ++c) {
      __m512i t[16];
      keys_u8_transposed(krows, h, c, D, t);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r)
          acc[r][j % NS] = _mm512_dpbusd_epi32(acc[r][j % NS], t[j], _mm512_set1_epi32(qr[r][c * 16 + j]));
    }
    const __m512 ks = _mm512_load_ps(ksc + h * 16);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      __m512i sum = acc[r][0];
#pragma GCC unroll 8
      for (int i = 1; i < NS; ++i) sum = _mm512_add_epi32(sum, acc[r][i]);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(128 * qsum[r])));
      _mm512_store_ps(S + r * KT + h * 16, _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(qsc[r])), ks));
    }
  }
}

// O[r] = O[r] * alpha[r] + psc[r] * sum_j Pq[r][j] V[j] for RB <= 4 rows.  Pq: each row's
// probabilities (times the keys' V scales) rounded to u8 against the tile's largest (scale psc),
// four keys to a dword, KT bytes a row.  Four keys' int8 V rows are interleaved in registers so
// that each dword lane holds the four keys' values of one dimension; the lanes come out in the
// order 16L + 4k + i (128-bit lane L of the k-th vector) and are put back with a 4 x 4 transpose
// of 128-bit lanes per 64 dimensions.
template <int RB>
static inline void pv_int8_rows(const int32_t* Pq, const float* psc, const void* const* vrows, int D, int Dp, int n,
                                float* O, const float* alpha) {
  const int ngroups = (n + 3) / 4;
  for (int c = 0; c * 64 < D; ++c) {
    const __mmask64 mk = mask64(D - c * 64);
    __m512i acc[RB][4];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_si512();
    for (int g = 0; g < ngroups; ++g) {
      __m512i v[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
        v[i] = _mm512_maskz_loadu_epi8(mk, static_cast<const int8_t*>(vrows[4 * g + i]) + c * 64);
      const __m512i t0 = _mm512_unpacklo_epi8(v[0], v[1]), t1 = _mm512_unpackhi_epi8(v[0], v[1]);
      const __m512i t2 = _mm512_unpacklo_epi8(v[2], v[3]), t3 = _mm512_unpackhi_epi8(v[2], v[3]);
      const __m512i u[4] = {_mm512_unpacklo_epi16(t0, t2), _mm512_unpackhi_epi16(t0, t2), _mm512_unpacklo_epi16(t1, t3),
                            _mm512_unpackhi_epi16(t1, t3)};
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const __m512i pb = _mm512_set1_epi32(Pq[r * KT + g]);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpbusd_epi32(acc[r][k], pb, u[k]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512 f0 = _mm512_cvtepi32_ps(acc[r][0]), f1 = _mm512_cvtepi32_ps(acc[r][1]);
      const __m512 f2 = _mm512_cvtepi32_ps(acc[r][2]), f3 = _mm512_cvtepi32_ps(acc[r][3]);
      const __m512 lo01 = _mm512_shuffle_f32x4(f0, f1, 0x44), hi01 = _mm512_shuffle_f32x4(f0, f1, 0xEE);
      const __m512 lo23 = _mm512_shuffle_f32x4(f2, f3, 0x44), hi23 = _mm512_shuffle_f32x4(f2, f3, 0xEE);
      const __m512 nat[4] = {_mm512_shuffle_f32x4(lo01, lo23, 0x88), _mm512_shuffle_f32x4(lo01, lo23, 0xDD),
                             _mm512_shuffle_f32x4(hi01, hi23, 0x88), _mm512_shuffle_f32x4(hi01, hi23, 0xDD)};
      const __m512 a = _mm512_set1_ps(alpha[r]), sc = _mm512_set1_ps(psc[r]);
      float* o = O + static_cast<int64_t>(r) * Dp + c * 64;
#pragma GCC unroll 4
      for (int L = 0; L < 4; ++L)
        if (c * 64 + 16 * L < D) _mm512_store_ps(o + 16 * L, _mm512_fmadd_ps(nat[L], sc, _mm512_mul_ps(_mm512_load_ps(o + 16 * L), a)));
    }
  }
}

struct Int8DecodeOps {
  static constexpr int kMaxRows = 8;
  static void begin(const AttnParams&, Scratch&, int) {}
  static void end() {}

  // Query rows -> int8 rows of Dq = D rounded up to 64 bytes (zero padded), with scale and sum.
  __attribute__((noinline)) static void load_q(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    (void)ntok;
    const int Dq = (p.D + 63) / 64 * 64;
    int8_t* q = static_cast<int8_t*>(s.q);
    alignas(64) float row[256];
    for (int r = 0; r < R; ++r) {
      const int64_t off = q_offset(p, tok, kvh, r);
      __m512 amax = _mm512_setzero_ps();
      for (int d0 = 0; d0 < Dq; d0 += 16) {
        const __mmask16 mk = mask16(p.D - d0);
        const __m512 x = p.model_bf16 ? Vec512::widen_bf16(_mm256_maskz_loadu_epi16(mk, static_cast<const uint16_t*>(p.q) + off + d0))
                                      : _mm512_maskz_loadu_ps(mk, static_cast<const float*>(p.q) + off + d0);
        _mm512_store_ps(row + d0, x);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(x));
      }
      const float m = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
      __m512i sum = _mm512_setzero_si512();
      for (int d0 = 0; d0 < Dq; d0 += 16) {
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(row + d0), inv));
        sum = _mm512_add_epi32(sum, qi);
        _mm_store_si128(reinterpret_cast<__m128i*>(q + r * Dq + d0), _mm512_cvtepi32_epi8(qi));
      }
      s.qsc[r] = m / 127.f;
      s.qsum[r] = _mm512_reduce_add_epi32(sum);
    }
  }

  // The tile's row pointers and scales, up to 16 rows of a block at a time: the pointers as one
  // vector sum, the scales with two gathers.
  __attribute__((noinline)) static void prep_kv(const AttnParams& p, Scratch& s, const int32_t* bt_row, int kvh, int k0, int n) {
    const int64_t row_bytes = p.kv_so * p.kv_elt;
    const __m512i offs = _mm512_mullo_epi32(_mm512_set1_epi32(static_cast<int>(row_bytes)),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i k_at = _mm512_add_epi32(offs, _mm512_set1_epi32(2 * p.D));
    const __m512i v_at = _mm512_add_epi32(offs, _mm512_set1_epi32(2 * p.D + 4));
    const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(offs));
    const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(offs, 1));
    const __m512i to_v = _mm512_set1_epi64(p.D);
    for_each_block_run(p, bt_row, kvh, k0, k0 + n, [&](const uint8_t* first, int i, int m) {
      for (int j = 0; j < m; j += 16) {
        const uint8_t* row = first + j * row_bytes;
        const __mmask16 mk = mask16(m - j);
        _mm512_mask_storeu_ps(s.ksc + i + j, mk, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, k_at, row, 1));
        _mm512_mask_storeu_ps(s.vsc + i + j, mk, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, v_at, row, 1));
        const __m512i base = _mm512_set1_epi64(reinterpret_cast<int64_t>(row));
        const __m512i k0p = _mm512_add_epi64(base, lo), k1p = _mm512_add_epi64(base, hi);
        _mm512_mask_storeu_epi64(s.krows + i + j, static_cast<__mmask8>(mk), k0p);
        _mm512_mask_storeu_epi64(s.krows + i + j + 8, static_cast<__mmask8>(mk >> 8), k1p);
        _mm512_mask_storeu_epi64(s.vrows + i + j, static_cast<__mmask8>(mk), _mm512_add_epi64(k0p, to_v));
        _mm512_mask_storeu_epi64(s.vrows + i + j + 8, static_cast<__mmask8>(mk >> 8), _mm512_add_epi64(k1p, to_v));
      }
    });
    for (int i = n; i < KT; ++i) {  // keys past n: zero scales, and a readable row (see keys_u8_transposed)
      s.ksc[i] = s.vsc[i] = 0.f;
      s.krows[i] = s.krows[0];
      s.vrows[i] = s.vrows[0];
    }
  }

  __attribute__((noinline)) static void qk(const AttnParams& p, Scratch& s, int R, int n) {
    const int8_t* q = static_cast<const int8_t*>(s.q);
    const int Dq = (p.D + 63) / 64 * 64;
    with_rows_upto<8>(R, [&](auto rb) { qk_int8<decltype(rb)::value>(q, Dq, s.qsc, s.qsum, s.krows, s.ksc, p.D, n, s.S); });
  }

  __attribute__((noinline)) static void softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
    softmax_tile<false>(p, s, R, k0, n, masked);
  }

  // P (softmax has summed it already) times the keys' V scales, rounded to u8 per row in place
  // (the row's first KT bytes), then the int8 products four rows at a time.
  __attribute__((noinline)) static void pv(const AttnParams& p, Scratch& s, int R, int n) {
    float* P = static_cast<float*>(s.P);
    for (int r = 0; r < R; ++r) {
      const __m512 p0 = _mm512_mul_ps(_mm512_load_ps(P + r * KT), _mm512_load_ps(s.vsc));
      const __m512 p1 = _mm512_mul_ps(_mm512_load_ps(P + r * KT + 16), _mm512_load_ps(s.vsc + 16));
      const float m = _mm512_reduce_max_ps(_mm512_max_ps(p0, p1));
      const __m512 inv = _mm512_set1_ps(m > 0.f ? 255.f / m : 0.f);
      uint8_t* q = reinterpret_cast<uint8_t*>(P + r * KT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(p0, inv))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(p1, inv))));
      s.psc[r] = m / 255.f;
    }
    for (int r0 = 0; r0 < R; r0 += 4) {
      const int32_t* Pq = reinterpret_cast<const int32_t*>(P + r0 * KT);
      float* O = s.O + static_cast<int64_t>(r0) * p.Dp;
      with_rows_upto<4>(R - r0, [&](auto rows) {
        pv_int8_rows<decltype(rows)::value>(Pq, s.psc + r0, s.vrows, p.D, p.Dp, n, O, s.alpha + r0);
      });
    }
  }

  static void store(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) { F32Ops::store(p, s, tok, ntok, kvh, R); }
};

// S[r][0, KT) for RB int8 query rows against a tile of keys already transposed to kt[Dq / 4][KT]
// dwords (four u8 values of one key each, as qk_int8 builds them in registers).
template <int RB>
static inline void qk_int8_tile(const int8_t* q, int qs, const float* qsc, const int32_t* qsum, const int32_t* kt,
                                const float* ksc, int ngroups, float* S) {
  __m512i acc[RB][2];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const int32_t* q4 = reinterpret_cast<const int32_t*>(q);
  for (int j = 0; j < ngroups; ++j) {
    const __m512i k0 = _mm512_load_si512(kt + j * KT), k1 = _mm512_load_si512(kt + j * KT + 16);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512i qb = _mm512_set1_epi32(q4[r * (qs / 4) + j]);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], k0, qb);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], k1, qb);
    }
  }
  const __m512 ks0 = _mm512_load_ps(ksc), ks1 = _mm512_load_ps(ksc + 16);
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const __m512i corr = _mm512_set1_epi32(128 * qsum[r]);
    const __m512 sq = _mm512_set1_ps(qsc[r]);
    _mm512_store_ps(S + r * KT, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], corr)), sq), ks0));
    _mm512_store_ps(S + r * KT + 16, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], corr)), sq), ks1));
  }
}

// Prompt units (more query rows than the decode path takes, up to UNIT_ROWS) over an int8 cache.
// K . q as the decode path computes it (query rows rounded to int8, VNNI products with the keys
// as stored), but each tile's keys are transposed once into scratch for all the unit's rows,
// where F32Ops dequantised and transposed them to fp32 for FMAs with 4x fewer products per
// instruction.  P . V (kBf16Pv false) as F32Ops: fp32 probabilities against V rows dequantised
// to fp32 (rounding the probabilities to u8 as well, tried, cost greedy agreement on prompts);
// or (kBf16Pv true) as Bf16Ops: bf16 probabilities against the V rows dequantised to bf16 pairs,
// with dpbf16 (32 products an instruction, where an FMA does 16), which is the faster where a
// dpbf16 costs about one FMA (AMD Zen 4 / 5; bf16_with_fma in attention.cpp picks).
template <bool kBf16Pv>
struct Int8PrefillOps {
  static void begin(const AttnParams&, Scratch&, int) {}
  static void end() {}

  static void load_q(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    Int8DecodeOps::load_q(p, s, tok, ntok, kvh, R);
  }

  __attribute__((noinline)) static void prep_kv(const AttnParams& p, Scratch& s, const int32_t* bt_row, int kvh, int k0, int n) {
    const uint8_t* rows[KT];
    gather_rows(p, bt_row, kvh, k0, n, rows);
    for (int i = n; i < KT; ++i) rows[i] = rows[0];  // keys past n: a readable row, scaled by ksc = 0 and masked
    const int D = p.D, Dp = p.Dp;
    for (int i = 0; i < KT; ++i) s.ksc[i] = i < n ? row_k_scale(p, rows[i]) : 0.f;
    if (kBf16Pv) {
      const uint16_t* vrows[KT];
      for (int i = 0; i < KT; ++i) {
        if (i >= n) {
          vrows[i] = nullptr;
          continue;
        }
        uint16_t* vd = static_cast<uint16_t*>(s.vrow) + i * Dp;
        dequant_row_bf16(rows[i] + D, D, Dp, p.kv_kind, row_v_scale(p, rows[i]), vd);
        vrows[i] = vd;
      }
      interleave_v_pairs(vrows, D, Dp, static_cast<int32_t*>(s.v));
    } else {
      float* v = static_cast<float*>(s.v);
      for (int i = 0; i < KT; ++i) {
        float* vd = v + i * Dp;
        if (i >= n) {
          for (int d0 = 0; d0 < Dp; d0 += 16) _mm512_store_ps(vd + d0, _mm512_setzero_ps());
          continue;
        }
        row_to_f32(rows[i] + D, false, p.kv_kind, row_v_scale(p, rows[i]), false, D, Dp, vd);
      }
    }
    int32_t* kt = static_cast<int32_t*>(s.kt);
    const void* const* krows = reinterpret_cast<const void* const*>(rows);
    for (int h = 0; h < KT / 16; ++h) {
      for (int c = 0; c * 64 < D; ++c) {
        __m512i t[16];
        if (h * 16 < n) {
          keys_u8_transposed(krows, h, c, D, t);
        } else {
          for (int j = 0; j < 16; ++j) t[j] = _mm512_setzero_si512();
        }
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm512_store_si512(kt + (c * 16 + j) * KT + h * 16, t[j]);
      }
    }
  }

  __attribute__((noinline)) static void qk(const AttnParams& p, Scratch& s, int R, int n) {
    (void)n;
    const int8_t* q = static_cast<const int8_t*>(s.q);
    const int32_t* kt = static_cast<const int32_t*>(s.kt);
    const int Dq = (p.D + 63) / 64 * 64, ng = Dq / 4;
    int r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) qk_int8_tile<8>(q + r0 * Dq, Dq, s.qsc + r0, s.qsum + r0, kt, s.ksc, ng, s.S + r0 * KT);
    if (r0 < R)
      with_rows_upto<8>(R - r0, [&](auto rb) {
        qk_int8_tile<decltype(rb)::value>(q + r0 * Dq, Dq, s.qsc + r0, s.qsum + r0, kt, s.ksc, ng, s.S + r0 * KT);
      });
  }

  static void softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
    if (kBf16Pv) return Bf16Ops::softmax(p, s, R, k0, n, masked);
    F32Ops::softmax(p, s, R, k0, n, masked);
  }
  static void pv(const AttnParams& p, Scratch& s, int R, int n) {
    if (kBf16Pv) return Bf16Ops::pv(p, s, R, n);
    F32Ops::pv(p, s, R, n);
  }
  static void store(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) { F32Ops::store(p, s, tok, ntok, kvh, R); }
};

}  // namespace v512
}  // namespace cpuserve_attn

CPUSERVE_TARGET_END
