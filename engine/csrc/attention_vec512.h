// AVX-512 paged-attention tile operations (see attention_common.h for the loop).
//
// bf16 model dtype (Bf16Ops): every dot product is _mm512_dpbf16_ps with fp32
// accumulation.  The K tile is stored transposed as bf16 pairs, kt[p][n] =
// (K[n][2p], K[n][2p+1]), so one dpbf16 of a broadcast query pair against kt[p]
// adds that pair's contribution to 16 keys' scores.  The V tile is stored with key
// pairs interleaved, v[j][d] = (V[2j][d], V[2j+1][d]), so one dpbf16 of a broadcast
// probability pair adds two keys to 16 outputs.  These are exactly AMX's B-tile
// (VNNI) layouts, which is why the AMX path reuses load_q/prep_kv/softmax/store.
// fp32 model dtype, and bf16 where FMAs beat dpbf16 (F32Ops, attention_fma_impl.h over Vec512):
// the same products in fp32 FMAs on a transposed fp32 K tile (V rows in natural order).
// fp8 caches are dequantised on load (x * scale, rounded to the model dtype as the
// reference does) into per-thread rows, then take the same path.  int8 caches: attention_vnni.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>

#include "attention_common.h"
#include "vec.h"

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX512_BF16)

namespace cpuserve_attn {
namespace v512 {

using cpuserve::Vec512;
using V = cpuserve::Vec512Bf16;  // attention_fma_impl.h's vector: Vec512, rounding to bf16 in one instruction

static inline __mmask16 mask16(int n) { return Vec512::mask(n); }
static inline __mmask32 mask32(int n) {
  return n >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : n <= 0 ? static_cast<__mmask32>(0) : static_cast<__mmask32>((1u << n) - 1);
}
static inline __mmask64 mask64(int n) {
  return n >= 64 ? ~static_cast<__mmask64>(0) : n <= 0 ? static_cast<__mmask64>(0) : (static_cast<__mmask64>(1) << n) - 1;
}

// fp8 / int8 row (D values) -> bf16(x * scale), Dp values (zero padded).
static inline void dequant_row_bf16(const uint8_t* src, int D, int Dp, KvKind kind, float scale, uint16_t* dst) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int d0 = 0; d0 < Dp; d0 += 32) {
    const __m512 lo = _mm512_mul_ps(Vec512::widen8(src + d0, D - d0, elem8(kind)), sc);
    const __m512 hi = _mm512_mul_ps(Vec512::widen8(src + d0 + 16, D - d0 - 16, elem8(kind)), sc);
    _mm512_store_si512(dst + d0, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

using cpuserve::RowReduce16;

// Online-softmax update of one tile: scores -> probabilities (bf16 pairs or fp32), 16 rows at a
// time.  The running max, sum and rescale of the 16 rows are vectors, so a tile costs no scalar
// exp and no per-row horizontal reduction (a 1024-token prompt's attention: softmax was ~40%).
template <bool BF16>
static inline void softmax_tile(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512 c = _mm512_set1_ps(p.scale * kLog2e);
  alignas(64) float mb[16];
  for (int r0 = 0; r0 < R; r0 += 16) {
    const int nr = std::min(16, R - r0);
    __mmask32 vis[16];
    RowReduce16<true> mx;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m512 h[2];
      for (int j = 0; j < 2; ++j) {
        const int r = r0 + 2 * i + j;
        if (r - r0 >= nr) {
          h[j] = ninf;
          continue;
        }
        const int lim = masked ? std::min(n, s.pos[r] - k0 + 1) : KT;  // keys [0, lim) are visible
        vis[2 * i + j] = mask32(lim);
        const __m512 x0 = _mm512_mask_blend_ps(mask16(lim), ninf, _mm512_load_ps(s.S + r * KT));
        const __m512 x1 = _mm512_mask_blend_ps(mask16(lim - 16), ninf, _mm512_load_ps(s.S + r * KT + 16));
        h[j] = _mm512_max_ps(x0, x1);
      }
      mx.pair(i, h[0], h[1]);
    }
    const __m512 m_old = _mm512_load_ps(s.m + r0);
    const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(mx.finish(), scale));
    const __mmask16 seen = _mm512_cmp_ps_mask(m_new, ninf, _CMP_NEQ_OQ);  // some key visible so far
    const __m512 alpha = _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.0f),
                                              Vec512::exp2(_mm512_mul_ps(_mm512_sub_ps(m_old, m_new), _mm512_set1_ps(kLog2e))));
    _mm512_store_ps(mb, _mm512_maskz_mul_ps(seen, m_new, _mm512_set1_ps(kLog2e)));
    RowReduce16<false> sum;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m512 h[2];
      for (int j = 0; j < 2; ++j) {
        const int r = r0 + 2 * i + j;
        if (r - r0 >= nr) {
          h[j] = _mm512_setzero_ps();
          continue;
        }
        const __m512 m = _mm512_set1_ps(mb[2 * i + j]);
        const __mmask32 v = vis[2 * i + j];
        const __m512 p0 = _mm512_maskz_mov_ps(static_cast<__mmask16>(v), Vec512::exp2(_mm512_fmsub_ps(_mm512_load_ps(s.S + r * KT), c, m)));
        const __m512 p1 = _mm512_maskz_mov_ps(static_cast<__mmask16>(v >> 16), Vec512::exp2(_mm512_fmsub_ps(_mm512_load_ps(s.S + r * KT + 16), c, m)));
        h[j] = _mm512_add_ps(p0, p1);
        if (BF16) {
          _mm512_store_si512(static_cast<uint16_t*>(s.P) + r * KT, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        } else {
          _mm512_store_ps(static_cast<float*>(s.P) + r * KT, p0);
          _mm512_store_ps(static_cast<float*>(s.P) + r * KT + 16, p1);
        }
      }
      sum.pair(i, h[0], h[1]);
    }
    const __mmask16 rows = mask16(nr);
    _mm512_mask_store_ps(s.l + r0, rows, _mm512_fmadd_ps(_mm512_load_ps(s.l + r0), alpha, sum.finish()));
    _mm512_mask_store_ps(s.m + r0, rows, m_new);
    _mm512_mask_store_ps(s.alpha + r0, rows, alpha);
  }
}

static inline void fp32_softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
  softmax_tile<false>(p, s, R, k0, n, masked);
}

#include "attention_fma_impl.h"

// ---------------------------------------------------------------- bf16 model dtype

template <int RB>
static inline void qk_block_bf16(const int32_t* q, int qs, const int32_t* kt, int npairs, float* S) {
  __m512 acc[RB][2];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int pp = 0; pp < npairs; ++pp) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + pp * KT);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + pp * KT + 16);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(q[r * qs + pp]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) {
    _mm512_store_ps(S + r * KT, acc[r][0]);
    _mm512_store_ps(S + r * KT + 16, acc[r][1]);
  }
}

// O[r][0, 16 NV) = O * alpha + P V for RB rows of bf16 probability pairs (KT / 2 dwords a row),
// one dpbf16 per key pair and 16 outputs: load_v(j, vv) gives key pair j's NV vectors of V pairs
// (vv[c] = (V[2j][16c + i], V[2j + 1][16c + i]) in lane i), from a tile or interleaved from the rows.
template <int RB, int NV, class LoadV>
static inline void pv_pairs_dpbf16(const int32_t* P, int npairs, float* O, int Dp, const float* alpha, LoadV load_v) {
  __m512 acc[RB][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_load_ps(O + r * Dp + 16 * c), a);
  }
  for (int j = 0; j < npairs; ++j) {
    __m512bh vv[NV];
    load_v(j, vv);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(P[r * (KT / 2) + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) _mm512_store_ps(O + r * Dp + 16 * c, acc[r][c]);
}

template <int NV>
static inline void pv_rows_bf16(const int32_t* P, const int32_t* v, int Dp, int npairs, float* O, const float* alpha, int rb) {
  with_rows_upto<kPvRows>(rb, [&](auto rows) {  // rb <= kPvRows: pv_tiles' row blocks
    pv_pairs_dpbf16<decltype(rows)::value, NV>(P, npairs, O, Dp, alpha, [&](int j, __m512bh* vv) {
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) vv[c] = (__m512bh)_mm512_load_si512(v + j * Dp + 16 * c);
    });
  });
}

// V tile from KT bf16 rows (null past the tile's keys: zeros), key pairs interleaved as
// dpbf16 takes them: v[j][d] = (V[2j][d], V[2j+1][d]), [KT / 2][Dp] int32.
static inline void interleave_v_pairs(const uint16_t* const* vrows, int D, int Dp, int32_t* v) {
  const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                          36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  for (int j = 0; j < KT / 2; ++j) {
    const uint16_t* a = vrows[2 * j];
    const uint16_t* b = vrows[2 * j + 1];
    int32_t* dst = v + j * Dp;
    for (int d0 = 0; d0 < Dp; d0 += 32) {
      const __mmask32 mk = mask32(D - d0);
      const __m512i va = a ? _mm512_maskz_loadu_epi16(mk, a + d0) : _mm512_setzero_si512();
      const __m512i vb = b ? _mm512_maskz_loadu_epi16(mk, b + d0) : _mm512_setzero_si512();
      _mm512_store_si512(dst + d0, _mm512_permutex2var_epi16(va, idx_lo, vb));
      _mm512_store_si512(dst + d0 + 16, _mm512_permutex2var_epi16(va, idx_hi, vb));
    }
  }
}

struct Bf16Ops {
  static void begin(const AttnParams&, Scratch&, int) {}
  static void end() {}

  __attribute__((noinline)) static void load_q(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    (void)ntok;
    uint16_t* q = static_cast<uint16_t*>(s.q);
    const uint16_t* src = static_cast<const uint16_t*>(p.q);
    const int rows = (R + 15) / 16 * 16;
    for (int r = 0; r < rows; ++r) {
      uint16_t* dst = q + static_cast<int64_t>(r) * p.Dp;
      if (r >= R) {
        for (int d0 = 0; d0 < p.Dp; d0 += 32) _mm512_store_si512(dst + d0, _mm512_setzero_si512());
        continue;
      }
      const uint16_t* row = src + q_offset(p, tok, kvh, r);
      for (int d0 = 0; d0 < p.Dp; d0 += 32) _mm512_store_si512(dst + d0, _mm512_maskz_loadu_epi16(mask32(p.D - d0), row + d0));
    }
  }

  __attribute__((noinline)) static void prep_kv(const AttnParams& p, Scratch& s, const int32_t* bt_row, int kvh, int k0, int n) {
    const uint8_t* rows[KT];
    gather_rows(p, bt_row, kvh, k0, n, rows);
    const int D = p.D, Dp = p.Dp;
    const uint16_t* krows[KT];
    const uint16_t* vrows[KT];
    for (int i = 0; i < KT; ++i) {
      if (i >= n) {
        krows[i] = vrows[i] = nullptr;
        continue;
      }
      const uint8_t* base = rows[i];
      if (p.kv_kind == KvKind::kSame) {
        krows[i] = reinterpret_cast<const uint16_t*>(base);
        vrows[i] = krows[i] + D;
      } else {
        uint16_t* kd = static_cast<uint16_t*>(s.krow) + i * Dp;
        uint16_t* vd = static_cast<uint16_t*>(s.vrow) + i * Dp;
        dequant_row_bf16(base, D, Dp, p.kv_kind, row_k_scale(p, base), kd);
        dequant_row_bf16(base + D, D, Dp, p.kv_kind, row_v_scale(p, base), vd);
        krows[i] = kd;
        vrows[i] = vd;
      }
    }
    int32_t* kt = static_cast<int32_t*>(s.kt);
    for (int h = 0; h < KT / 16; ++h) {
      if (h * 16 >= n) {
        for (int pp = 0; pp < Dp / 2; ++pp) _mm512_store_si512(kt + pp * KT + h * 16, _mm512_setzero_si512());
        continue;
      }
      for (int c = 0; c < Dp / 32; ++c) {
        const __mmask32 mk = mask32(D - c * 32);
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          const uint16_t* row = krows[h * 16 + i];
          r[i] = row ? _mm512_maskz_loadu_epi16(mk, row + c * 32) : _mm512_setzero_si512();
        }
        Vec512::transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_store_si512(kt + (c * 16 + j) * KT + h * 16, r[j]);
      }
    }
    interleave_v_pairs(vrows, D, Dp, static_cast<int32_t*>(s.v));
  }

  __attribute__((noinline)) static void qk(const AttnParams& p, Scratch& s, int R, int n) {
    (void)n;
    const int32_t* q = static_cast<const int32_t*>(s.q);
    const int32_t* kt = static_cast<const int32_t*>(s.kt);
    const int qs = p.Dp / 2, npairs = p.D / 2;
    int r0 = 0;
    for (; r0 + 8 <= R; r0 += 8) qk_block_bf16<8>(q + r0 * qs, qs, kt, npairs, s.S + r0 * KT);
    if (r0 < R)
      with_rows_upto<7>(R - r0, [&](auto rows) { qk_block_bf16<decltype(rows)::value>(q + r0 * qs, qs, kt, npairs, s.S + r0 * KT); });
  }

  __attribute__((noinline)) static void softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
    softmax_tile<true>(p, s, R, k0, n, masked);
  }

  __attribute__((noinline)) static void pv(const AttnParams& p, Scratch& s, int R, int n) {
    const int Dp = p.Dp, npairs = (n + 1) / 2;
    const int32_t* P = static_cast<const int32_t*>(s.P);
    const int32_t* v = static_cast<const int32_t*>(s.v);
    pv_tiles(R, p.D, [&](int r0, int rb, int d0, auto nv) {
      pv_rows_bf16<decltype(nv)::value>(P + r0 * (KT / 2), v + d0, Dp, npairs, s.O + static_cast<int64_t>(r0) * Dp + d0, s.alpha + r0, rb);
    });
  }

  __attribute__((noinline)) static void store(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    (void)ntok;
    uint16_t* out = static_cast<uint16_t*>(p.out);
    for (int r = 0; r < R; ++r) {
      uint16_t* dst = out + o_offset(p, tok, kvh, r);
      const __m512 inv = _mm512_set1_ps(1.0f / s.l[r]);
      const float* o = s.O + static_cast<int64_t>(r) * p.Dp;
      for (int d0 = 0; d0 < p.D; d0 += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d0), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + d0), inv)));
    }
  }
};

// Few query rows (decode: one token's GQA group, R <= 8).  Storing transposed K and
// interleaved V tiles costs more than the dot products when only a handful of rows
// reuse them, so these read the cache rows directly and transpose / interleave in
// registers right before the dpbf16s (or FMAs: Bf16FmaDecodeOps below).

// 16 bf16 pairs -> fp32 of each pair's first (*lo) and second (*hi) value.
static inline void split_bf16_pairs(__m512i t, __m512* lo, __m512* hi) {
  *lo = _mm512_castsi512_ps(_mm512_slli_epi32(t, 16));
  *hi = _mm512_castsi512_ps(_mm512_and_si512(t, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// S[r][0, KT) for RB query rows against up to KT keys' rows read in place: per 16 keys and 32
// dims, the rows are transposed in registers as bf16 pairs, then each pair meets the broadcast
// query either in one dpbf16 (q: bf16 pairs, qs pairs apart) or, kFma, split into two fp32
// vectors, one FMA each (q: fp32, qs floats apart, zero past D).
template <int RB, bool kFma>
static inline void qk_direct(const void* qv, int qs, const void* const* krows, int D, int n, float* S) {
  // NS partial sums per row: with few rows, one accumulator per row is a chain of dependent
  // dpbf16s / FMAs, latency- not throughput-bound; ~8-12 independent chains keep both pipes busy.
  constexpr int NS = kFma ? (RB >= 7 ? 1 : RB >= 4 ? 2 : RB >= 2 ? 4 : 8) : (RB >= 7 ? 1 : RB >= 5 ? 2 : RB == 4 ? 3 : 4);
  const int32_t* q2 = static_cast<const int32_t*>(qv);
  const float* qf = static_cast<const float*>(qv);
  for (int h = 0; h < KT / 16; ++h) {
    if (h * 16 >= n) {
      for (int r = 0; r < RB; ++r) _mm512_store_ps(S + r * KT + h * 16, _mm512_setzero_ps());
      continue;
    }
    __m512 acc[RB][NS];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
      for (int i = 0; i < NS; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int c = 0; c * 32 < D; ++c) {
      const __mmask32 mk = mask32(D - c * 32);
      __m512i t[16];
      if (h * 16 + 16 <= n) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          t[i] = _mm512_maskz_loadu_epi16(mk, static_cast<const uint16_t*>(krows[h * 16 + i]) + c * 32);
      } else {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          const uint16_t* row = static_cast<const uint16_t*>(krows[h * 16 + i]);
          t[i] = h * 16 + i < n ? _mm512_maskz_loadu_epi16(mk, row + c * 32) : _mm512_setzero_si512();
        }
      }
      Vec512::transpose16(t);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        if constexpr (kFma) {
          __m512 lo, hi;
          split_bf16_pairs(t[j], &lo, &hi);
          const int d = c * 32 + 2 * j;
#pragma GCC unroll 8
          for (int r = 0; r < RB; ++r) {
            acc[r][(2 * j) % NS] = _mm512_fmadd_ps(lo, _mm512_set1_ps(qf[r * qs + d]), acc[r][(2 * j) % NS]);
            acc[r][(2 * j + 1) % NS] = _mm512_fmadd_ps(hi, _mm512_set1_ps(qf[r * qs + d + 1]), acc[r][(2 * j + 1) % NS]);
          }
        } else {
#pragma GCC unroll 8
          for (int r = 0; r < RB; ++r)
            acc[r][j % NS] = _mm512_dpbf16_ps(acc[r][j % NS], (__m512bh)t[j], (__m512bh)_mm512_set1_epi32(q2[r * qs + c * 16 + j]));
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      __m512 sum = acc[r][0];
#pragma GCC unroll 8
      for (int i = 1; i < NS; ++i) sum = _mm512_add_ps(sum, acc[r][i]);
      _mm512_store_ps(S + r * KT + h * 16, sum);
    }
  }
}

// O[:, d0 : d0 + 16 NV] = O * alpha + P V for RB rows, V pairs interleaved in registers from the rows.
template <int RB, int NV>
static inline void pv_direct_bf16(const int32_t* P, const void* const* vrows, int d0, int Dp, int n, float* O,
                                  const float* alpha) {
  const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                          36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  constexpr int kLoads = NV >= 2 ? NV / 2 : 1;
  const __mmask32 mk = NV >= 2 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>(0xFFFFu);
  pv_pairs_dpbf16<RB, NV>(P, (n + 1) / 2, O + d0, Dp, alpha, [&](int j, __m512bh* vv) {
    const uint16_t* a = static_cast<const uint16_t*>(vrows[2 * j]) + d0;
    const bool has_b = 2 * j + 1 < n;
    const uint16_t* b = has_b ? static_cast<const uint16_t*>(vrows[2 * j + 1]) + d0 : nullptr;
#pragma GCC unroll 2
    for (int k = 0; k < kLoads; ++k) {
      const __m512i va = _mm512_maskz_loadu_epi16(mk, a + 32 * k);
      const __m512i vb = has_b ? _mm512_maskz_loadu_epi16(mk, b + 32 * k) : _mm512_setzero_si512();
      vv[2 * k] = (__m512bh)_mm512_permutex2var_epi16(va, idx_lo, vb);
      if (NV >= 2) vv[2 * k + 1] = (__m512bh)_mm512_permutex2var_epi16(va, idx_hi, vb);
    }
  });
}

template <int RB>
static inline void pv_direct_rows(const int32_t* P, const void* const* vrows, int D, int Dp, int n, float* O, const float* alpha) {
  int d0 = 0;
  if (RB <= 6)
    for (; d0 + 64 <= D; d0 += 64) pv_direct_bf16<RB, 4>(P, vrows, d0, Dp, n, O, alpha);
  for (; d0 + 32 <= D; d0 += 32) pv_direct_bf16<RB, 2>(P, vrows, d0, Dp, n, O, alpha);
  if (d0 < D) pv_direct_bf16<RB, 1>(P, vrows, d0, Dp, n, O, alpha);
}

struct Bf16DecodeOps {
  static constexpr int kMaxRows = 8;
  static void begin(const AttnParams&, Scratch&, int) {}
  static void end() {}
  static void load_q(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    Bf16Ops::load_q(p, s, tok, ntok, kvh, R);
  }

  __attribute__((noinline)) static void prep_kv(const AttnParams& p, Scratch& s, const int32_t* bt_row, int kvh, int k0, int n) {
    const uint8_t* rows[KT];
    gather_rows(p, bt_row, kvh, k0, n, rows);
    const int D = p.D, Dp = p.Dp;
    for (int i = 0; i < n; ++i) {
      if (p.kv_kind == KvKind::kSame) {
        s.krows[i] = rows[i];
        s.vrows[i] = rows[i] + D * 2;
      } else {
        uint16_t* kd = static_cast<uint16_t*>(s.krow) + i * Dp;
        uint16_t* vd = static_cast<uint16_t*>(s.vrow) + i * Dp;
        dequant_row_bf16(rows[i], D, Dp, p.kv_kind, row_k_scale(p, rows[i]), kd);
        dequant_row_bf16(rows[i] + D, D, Dp, p.kv_kind, row_v_scale(p, rows[i]), vd);
        s.krows[i] = kd;
        s.vrows[i] = vd;
      }
    }
  }

  __attribute__((noinline)) static void qk(const AttnParams& p, Scratch& s, int R, int n) {
    const int32_t* q = static_cast<const int32_t*>(s.q);
    const int qs = p.Dp / 2;
    with_rows_upto<8>(R, [&](auto rb) { qk_direct<decltype(rb)::value, false>(q, qs, s.krows, p.D, n, s.S); });
  }

  static void softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
    Bf16Ops::softmax(p, s, R, k0, n, masked);
  }

  __attribute__((noinline)) static void pv(const AttnParams& p, Scratch& s, int R, int n) {
    const int32_t* P = static_cast<const int32_t*>(s.P);
    with_rows_upto<8>(R, [&](auto rb) { pv_direct_rows<decltype(rb)::value>(P, s.vrows, p.D, p.Dp, n, s.O, s.alpha); });
  }

  static void store(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    Bf16Ops::store(p, s, tok, ntok, kvh, R);
  }
};

// bf16 model and cache, few query rows, fp32 FMAs instead of dpbf16.  On cores whose dpbf16 is
// several uops (Intel's without AMX in use: one per ~2.2 cycles against two FMAs a cycle, while
// AMD's Zen 4 / 5 run it as fast as an FMA) two FMAs on bf16 widened in registers do the same 32
// multiply-adds in less time.  attention.cpp picks this or Bf16DecodeOps by timing both
// instructions once.  Same reads as Bf16DecodeOps: K and V rows straight from the cache.

struct Bf16FmaDecodeOps {
  static constexpr int kMaxRows = Bf16DecodeOps::kMaxRows;
  static void begin(const AttnParams&, Scratch&, int) {}
  static void end() {}

  static void load_q(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    F32Ops::load_q(p, s, tok, ntok, kvh, R);  // fp32, zero past D: the last 32-wide K chunk may reach there
  }

  static void prep_kv(const AttnParams& p, Scratch& s, const int32_t* bt_row, int kvh, int k0, int n) {
    Bf16DecodeOps::prep_kv(p, s, bt_row, kvh, k0, n);
  }

  __attribute__((noinline)) static void qk(const AttnParams& p, Scratch& s, int R, int n) {
    const float* q = static_cast<const float*>(s.q);
    with_rows_upto<8>(R, [&](auto rb) { qk_direct<decltype(rb)::value, true>(q, p.Dp, s.krows, p.D, n, s.S); });
  }

  __attribute__((noinline)) static void softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
    softmax_tile<false>(p, s, R, k0, n, masked);
  }

  __attribute__((noinline)) static void pv(const AttnParams& p, Scratch& s, int R, int n) {
    const float* P = static_cast<const float*>(s.P);
    with_rows_upto<8>(R, [&](auto rb) { pv_direct<decltype(rb)::value, false>(P, s.vrows, p.D, p.Dp, n, s.O, s.alpha); });
  }

  static void store(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    Bf16Ops::store(p, s, tok, ntok, kvh, R);
  }
};

// Time of one dpbf16 over one FMA on this core, each in 12 independent chains (throughput,
// not latency), best of 5 alternating runs of 24k instructions: ~0.1 ms, once per process.
// ~1 on AMD Zen 4 / 5; ~4.4 on a Sapphire Rapids-class Xeon whose AMX is not in use.
template <bool DP>
__attribute__((noinline)) static double time_dot_chains() {
  __m512 a[12];
  for (auto& x : a) x = _mm512_setzero_ps();
  __m512bh b = (__m512bh)_mm512_set1_epi16(0x3a00);  // 2^-11: the sums stay finite
  __m512 f = _mm512_set1_ps(1.0f / 2048);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 2000; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) a[k] = DP ? _mm512_dpbf16_ps(a[k], b, b) : _mm512_fmadd_ps(a[k], f, f);
    __asm__ volatile("" : "+v"(b), "+v"(f));
  }
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512 sum = a[0];
  for (int k = 1; k < 12; ++k) sum = _mm512_add_ps(sum, a[k]);
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return t;
}

static double dpbf16_fma_time_ratio() {
  double dp = 1e30, fma = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    dp = std::min(dp, time_dot_chains<true>());
    fma = std::min(fma, time_dot_chains<false>());
  }
  return dp / std::max(fma, 1e-12);
}

}  // namespace v512
}  // namespace cpuserve_attn

CPUSERVE_TARGET_END
