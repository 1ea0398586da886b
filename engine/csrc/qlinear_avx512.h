// AVX-512 VNNI kernels of qlinear.cpp: the activation quantizers and the packed-block and
// row-int8 products in 512-bit registers (16 output rows of a group a vector, `vpdpbusd`).
//
// Included by qlinear.cpp only, after its helpers (Problem, QuantRow, ActTiles, BlockRef, the
// scalar stores); its functions join qlinear.cpp's internal namespace.
#pragma once

namespace qlinear {
namespace {

CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline __m512 load_x16_avx512(const void* x, bool bf16, int64_t i) {
  if (bf16) return cpuserve::Vec512::load_bf16_ps(static_cast<const uint16_t*>(x) + i);
  return _mm512_loadu_ps(static_cast<const float*>(x) + i);
}

// high_digit, 16 lanes at a time.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline __m512i high_digit_avx512(__m512i q) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(1.f / 128.f)));
}

// Block b's int8 digits (one plane, or two for 16-bit activations) from its scale's inverse;
// returns the digits (q0 + q1 lanes), whose sum is the block's digit sum.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline __m512i quantize_block_avx512(const QuantRow& r, int b, __m512 v0, __m512 v1, float id) {
  const __m512 vid = _mm512_set1_ps(id);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));  // MXCSR default: nearest even
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
  int8_t* qb = r.q + b * r.q_stride;
  if (r.digits == 2) {
    const __m512i h0 = high_digit_avx512(q0), h1 = high_digit_avx512(q1);
    const __m512i l0 = _mm512_sub_epi32(q0, _mm512_slli_epi32(h0, 7));
    const __m512i l1 = _mm512_sub_epi32(q1, _mm512_slli_epi32(h1, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(h0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(h1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 32), _mm512_cvtepi32_epi8(l0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 48), _mm512_cvtepi32_epi8(l1));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(q1));
  }
  return _mm512_add_epi32(q0, q1);
}

// Each lane of 16 blocks' values the maximum over its run of `span` lanes (1 or 8).
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline __m512 span_max16(__m512 v, int span) {
  if (span == 1) return v;
  v = _mm512_max_ps(v, _mm512_permute_ps(v, 0xb1));  // neighbours
  v = _mm512_max_ps(v, _mm512_permute_ps(v, 0x4e));  // pairs in a 128-bit lane
  return _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));  // 128-bit lanes in a 256-bit half
}

// Same results as quantize_row_scalar.  Blocks go 16 at a time: their absolute maxima, scales
// and digit sums are vectors (cpuserve::RowReduce16), where one block at a time paid two
// horizontal reductions and a division in a dependent chain.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) void quantize_row_avx512(const QuantRow& r) {
  const int nb = static_cast<int>(r.k / kBlock);
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const float qmax = r.digits == 2 ? kQmax16 : kQmax8;
  auto load = [&](int blk, int half) { return load_x16_avx512(r.x, r.bf16, static_cast<int64_t>(blk) * kBlock + 16 * half); };
  int b = 0;
  for (; b + 16 <= nb; b += 16) {
    cpuserve::RowReduce16<true> amax;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m512 a[2];
      for (int j = 0; j < 2; ++j)
        a[j] = _mm512_max_ps(_mm512_and_ps(load(b + 2 * i + j, 0), absmask), _mm512_and_ps(load(b + 2 * i + j, 1), absmask));
      amax.pair(i, a[0], a[1]);
    }
    const __m512 d = _mm512_div_ps(span_max16(amax.finish(), r.span), _mm512_set1_ps(qmax));
    const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.f), d);
    alignas(64) float ids[16];
    _mm512_store_ps(ids, id);
    cpuserve::RowReduce16<false> sum;  // integer digit sums, exact in float (< 2^24)
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      __m512 t[2];
      for (int j = 0; j < 2; ++j) {
        const int blk = b + 2 * i + j;
        t[j] = _mm512_cvtepi32_ps(quantize_block_avx512(r, blk, load(blk, 0), load(blk, 1), ids[2 * i + j]));
      }
      sum.pair(i, t[0], t[1]);
    }
    const __m512 sums = sum.finish();
    const __m512 s = _mm512_mul_ps(d, sums);
    if (r.d_stride == 1) {
      _mm512_storeu_ps(r.d + b, d);
      _mm512_storeu_ps(r.s + b, s);
      _mm512_storeu_si512(r.sum + b, _mm512_cvtps_epi32(sums));
    } else {
      const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(r.d_stride));
      const int64_t first = static_cast<int64_t>(b) * r.d_stride;
      _mm512_i32scatter_ps(r.d + first, at, d, 4);
      _mm512_i32scatter_ps(r.s + first, at, s, 4);
      _mm512_i32scatter_epi32(r.sum + first, at, _mm512_cvtps_epi32(sums), 4);
    }
  }
  for (; b < nb; b += r.span) {
    __m512 mx = _mm512_setzero_ps();
    for (int i = b; i < b + r.span; ++i)
      mx = _mm512_max_ps(mx, _mm512_max_ps(_mm512_and_ps(load(i, 0), absmask), _mm512_and_ps(load(i, 1), absmask)));
    const float d = _mm512_reduce_max_ps(mx) / qmax;
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int i = b; i < b + r.span; ++i) {
      const int32_t sum = _mm512_reduce_add_epi32(quantize_block_avx512(r, i, load(i, 0), load(i, 1), id));
      r.d[i * r.d_stride] = d;
      r.sum[i * r.d_stride] = sum;
      r.s[i * r.d_stride] = r.s_of(d, sum);
    }
  }
}

// quantize_row16_scalar's results, 16 values at a time.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) void quantize_row16_avx512(const void* x, bool bf16, int64_t k, int8_t* q, float* d, int32_t* sums) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 amax = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) amax = _mm512_max_ps(amax, _mm512_and_ps(load_x16_avx512(x, bf16, j), absmask));
  const float dd = _mm512_reduce_max_ps(amax) / kQmax16;
  const __m512 id = _mm512_set1_ps(dd != 0.f ? 1.f / dd : 0.f);
  __m512i hi_sum = _mm512_setzero_si512(), lo_sum = _mm512_setzero_si512();
  for (int64_t c = 0; c < k / kChunk; ++c) {
    int8_t* qc = q + rows16_chunk(c, 0);
#pragma GCC unroll 4
    for (int i = 0; i < kChunk / 16; ++i) {
      const __m512i qv = _mm512_cvtps_epi32(_mm512_mul_ps(load_x16_avx512(x, bf16, c * kChunk + 16 * i), id));
      const __m512i hi = high_digit_avx512(qv);
      const __m512i lo = _mm512_sub_epi32(qv, _mm512_slli_epi32(hi, 7));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qc + 16 * i), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qc + kRows16Low + 16 * i), _mm512_cvtepi32_epi8(lo));
      hi_sum = _mm512_add_epi32(hi_sum, hi);
      lo_sum = _mm512_add_epi32(lo_sum, lo);
    }
  }
  *d = dd;
  sums[0] = _mm512_reduce_add_epi32(hi_sum);
  sums[1] = _mm512_reduce_add_epi32(lo_sum);
}

CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline void store16_avx512(const Problem& p, int t, int64_t col, int valid, __m512 v) {
  const __mmask16 mask = valid >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << valid) - 1);
  if (p.bias) {
    __m512 bv;
    if (p.bias_bf16)
      bv = cpuserve::Vec512::widen_bf16(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p.bias) + col));
    else
      bv = _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p.bias) + col);
    v = _mm512_add_ps(v, bv);
  }
  if (p.amax != nullptr) {  // qlinear_argmax / qlinear_rows_argmax: this row's lanes instead of a store
    ArgmaxLanes& a = *p.amax;
    const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(col)),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512 b = _mm512_load_ps(a.best + t * 16);
    const __m512i c = _mm512_load_si512(a.col + t * 16);
    const __mmask16 take = _mm512_mask_cmp_ps_mask(mask, v, b, _CMP_GT_OQ) |
                           (_mm512_mask_cmp_ps_mask(mask, v, b, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(cols, c));
    _mm512_store_ps(a.best + t * 16, _mm512_mask_mov_ps(b, take, v));
    _mm512_store_si512(a.col + t * 16, _mm512_mask_mov_epi32(c, take, cols));
    if (_mm512_mask_cmp_ps_mask(mask, v, v, _CMP_UNORD_Q)) a.nan = true;
    return;
  }
  if (p.out_bf16) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_add_epi32(
        u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i h = _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(rounded, 16), _mm512_set1_epi32(0x7fc0));
    _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(p.out) + t * p.ldo + col, mask, h);
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + t * p.ldo + col, mask, v);
  }
}

// The AVX2 kernels (one group at a time, so one sequential weight stream) prefetch this far ahead
// of it.  The hardware prefetchers keep up at batch 1, but once a few activation rows make the loop
// compute-heavier they fall behind.  Prefetches past the end of the buffer are harmless (they
// never fault).
#ifndef QL_PREFETCH
#define QL_PREFETCH 8192
#endif
#ifndef QL_PREFETCH_HINT
#define QL_PREFETCH_HINT _MM_HINT_T0
#endif
constexpr int kPrefetchBytes = QL_PREFETCH;

// MT activation rows against NG adjacent 16-row groups.  Each 64-byte chunk of a group-block is
// loaded once for all MT rows, and each broadcast activation word serves all NG groups.  With one
// row (batch-1 decode) a weight vector meets only DIGITS dot products, which makes the kernel
// issue-bound once its weights are in cache; two groups share the broadcasts there, and each sum
// runs in two chains.  The integer sums are exact in any order, and each (row, group)'s float
// accumulation is the same two FMAs per block whatever NG and MT, so every tiling gives the same bits.
// A nibble chunk's high bits (Q5: bit 4; Q6: bits 4-5) from the group-block's plane vectors
// (layout in qlinear.h): chunk c's low-nibble elements (half 0) or high-nibble ones (half 1).
// Q2_K: step c's whole quants, bits 2c..2c+1 of the half's plane.
template <int QT>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline __m512i plane_bits_avx512(const __m512i* plane, int c, int half) {
  if (QT == kQ2_K) return _mm512_and_si512(_mm512_srli_epi16(plane[half], 2 * c), _mm512_set1_epi8(0x03));
  if (layout(QT).plane_chunks == 1) {  // bit c (half 0) or 4 + c (half 1) of each byte -> bit 4
    const __m512i v = half == 0 ? _mm512_slli_epi16(plane[0], 4 - c) : _mm512_srli_epi16(plane[0], c);
    return _mm512_and_si512(v, _mm512_set1_epi8(0x10));
  }
  const int sh = 4 - 2 * c;  // bits 2c..2c+1 of the half's plane -> bits 4-5
  const __m512i v = sh >= 0 ? _mm512_slli_epi16(plane[half], sh) : _mm512_srli_epi16(plane[half], -sh);
  return _mm512_and_si512(v, _mm512_set1_epi8(0x30));
}

// 16 fp16 values at `at`, and 16 bytes (signed or not), as floats.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline __m512 half16_avx512(const uint8_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline __m512 bytes16_avx512(const uint8_t* at, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// The 16 rows' scale d and offset m of group-block `br`, elements [16h, 16h + 16) (row_scale in
// 16 lanes; the offset, Q4_1/Q5_1's m, multiplies the activation block's xs; the K types' mins
// meet the activations at the super-block's end, and every zero offset comes off in integers).
template <int QT>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline void block_scales_avx512(const BlockRef& br, int h, __m512& dv, __m512& mv) {
  constexpr Layout L = layout(QT);
  if (QT == kQ4_K || QT == kQ5_K) {
    dv = _mm512_mul_ps(half16_avx512(br.fields + kFieldD), bytes16_avx512(header_scales(br.fields, QT, br.sub, 0), false));
    mv = _mm512_setzero_ps();  // super_block_mins_avx512
  } else if (QT == kQ6_K || QT == kQ3_K) {  // their offset is taken off in integers (Problem::xsh): no mv
    dv = _mm512_mul_ps(half16_avx512(br.fields + kFieldD), bytes16_avx512(header_scales(br.fields, QT, br.sub, h), true));
    mv = _mm512_setzero_ps();
  } else if (QT == kQ2_K) {  // the scale in each byte's low nibble; the mins at the super-block's end
    const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(header_scales(br.fields, QT, br.sub, h)));
    dv = _mm512_mul_ps(half16_avx512(br.fields + kFieldD), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(sm, _mm_set1_epi8(15)))));
    mv = _mm512_setzero_ps();
  } else if (QT == kIQ4_XS || QT == kIQ3_S || QT == kIQ3_XXS) {  // their offset 128 is taken off in integers: no mv
    dv = _mm512_mul_ps(half16_avx512(br.fields + kFieldD), bytes16_avx512(header_scales(br.fields, QT, br.sub, 0), true));
    if (QT == kIQ3_XXS) dv = _mm512_mul_ps(dv, _mm512_set1_ps(scale_factor(QT)));
    mv = _mm512_setzero_ps();
  } else {
    dv = half16_avx512(br.fields + kFieldD);
    mv = L.has_m ? half16_avx512(br.fields + kFieldM) : _mm512_setzero_ps();
  }
}

// Q4_K / Q5_K: for the 16 rows, the sum over the super-block's sub-blocks s of min_s * xsum_s
// (the activation row's block sums), exact in int32, so that the offsets cost one FMA by -dmin a
// super-block instead of one by -dmin * min a block (on Zen 4 FMAs share the multiply pipes with
// vpdpbusd); Q2_K the same over its 16 halves (their sums Problem::xsh, the mins the high nibbles
// of its scale-and-min bytes).  8-bit activations (|sum| < 2^12): the mins as int16 pairs, two
// entries a vpdpwssd; 15-bit ones: one vpmulld an entry.
template <int QT>
constexpr int kMinEntries = QT == kQ2_K ? 2 * kSuperBlocks : kSuperBlocks;
template <int QT>
struct SuperBlockMins {
  __m512i v[kMinEntries<QT>];
};
template <int QT, int DIGITS>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline SuperBlockMins<QT> super_block_mins_avx512(const uint8_t* header) {
  SuperBlockMins<QT> m;
  auto entry = [header](int s) {  // the 16 rows' min bytes of entry s (Q2_K: the high nibbles of its scale bytes)
    if (QT == kQ2_K)
      return _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header_scales(header, QT, s / 2, s % 2))), 4),
                           _mm_set1_epi8(15));
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(header_mins(header, s)));
  };
  for (int s = 0; s < kMinEntries<QT>; s += (DIGITS == 1 ? 2 : 1)) {
    const __m128i a = entry(s);
    if (DIGITS == 1) {  // lane r: (min_s, min_s+1) of row r as int16
      const __m128i b = entry(s + 1);
      m.v[s / 2] = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(a, b)), _mm_unpackhi_epi8(a, b), 1));
    } else {
      m.v[s] = _mm512_cvtepu8_epi32(a);
    }
  }
  return m;
}
// The sum for the activation row whose super-block's first block is at tb0 (its blocks `stride` apart).
template <int QT, int DIGITS>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline __m512i super_block_min_sum_avx512(const SuperBlockMins<QT>& m, const Problem& p, int64_t tb0, int64_t stride) {
  auto act = [&](int s) {  // entry s's activation sum: Q2_K block s / 2's half s % 2
    return QT == kQ2_K ? p.xsh[2 * (tb0 + s / 2 * stride) + s % 2] : p.xsum[tb0 + s * stride];
  };
  __m512i sum = _mm512_setzero_si512();
  for (int s = 0; s < kMinEntries<QT>; s += (DIGITS == 1 ? 2 : 1)) {
    if (DIGITS == 1) {
      const uint32_t pair = static_cast<uint16_t>(act(s)) | static_cast<uint32_t>(act(s + 1)) << 16;
      sum = _mm512_dpwssd_epi32(sum, m.v[s / 2], _mm512_set1_epi32(static_cast<int32_t>(pair)));
    } else {
      sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(m.v[s], _mm512_set1_epi32(act(s))));
    }
  }
  return sum;
}

// acc + w (unsigned bytes) . the 4 signed bytes at x in every lane, the broadcast taken by the
// instruction's memory operand: GCC issues _mm512_set1_epi32(*x) as a separate vpbroadcastd.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) inline __m512i dpbusd_bcast_avx512(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

template <int QT, int NG, int MT, int DIGITS>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) void group_tile_avx512(const Problem& p, int64_t g, int t0, int pass, int passes) {
  constexpr Layout L = layout(QT);
  // Independent integer sums per (group, row, digit): with one row two chains (alternate chunks);
  // split types keep their two halves apart instead (which are two chains as well).
  constexpr int kSums = (MT == 1 || L.split) ? 2 : 1;
  constexpr int kChunks = block_steps(QT);
  const int nb = p.nb;
  const int64_t gstride = static_cast<int64_t>(nb) * p.gbytes;
  const uint8_t* wg = p.w + g * gstride;
  const ActTiles tiles{p.xtile, p.k, DIGITS};
  const int h = tiles.height(p.m, t0);  // rows t0 .. t0 + MT in a tile of h: block b's at xt + b * h rows
  const int8_t* xt = p.xq + tiles.q(t0);
  const int64_t dt = tiles.d(t0);
  // K types: sb sums a super-block's terms without the activation scale (shared by its blocks,
  // act_span), which multiplies the sum once, into `out`, at the super-block's end.  `out` stays
  // in memory, read and written once a super-block, so that the 8-row tile's registers hold the sums.
  __m512 acc[NG][MT], sb[NG][MT];
  alignas(64) float out[NG][MT][16] = {};
  for (int i = 0; i < NG; ++i)
    for (int t = 0; t < MT; ++t) acc[i][t] = sb[i][t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut_bytes(QT))));
  // The same block of the NG groups the next tile reads, into L2, spread over the passes (as the
  // row-int8 kernel below does): a fixed distance ahead of each of the NG interleaved streams
  // missed the start of every other pair's second group.
  PrefetchTurn turn(pass, passes);
  for (int b = 0; b < nb; ++b) {
    const BlockRef br = block_at<QT>(wg, b);
    if (turn.next())
      for (int i = 0; i < NG; ++i)
        for (int off = 0; off < p.gbytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wg + static_cast<int64_t>(b) * p.gbytes + (NG + i) * gstride + off),
                       _MM_HINT_T1);
    __m512i s[NG][MT][DIGITS][kSums];
    for (int i = 0; i < NG; ++i)
      for (int t = 0; t < MT; ++t)
        for (int d = 0; d < DIGITS; ++d)
          for (int h = 0; h < kSums; ++h) s[i][t][d][h] = _mm512_setzero_si512();
    __m512i plane[NG][2];
    if (L.plane_chunks)
      for (int i = 0; i < NG; ++i)
        for (int c = 0; c < L.plane_chunks; ++c) plane[i][c] = _mm512_loadu_si512(br.q + i * gstride + plane_at(QT) + c * 64);
    for (int c = 0; c < kChunks; ++c) {
      // Q8_0: chunk c holds bytes [4c, 4c + 4) of each row's block.  The rest: its low nibbles are
      // elements [4c, 4c + 4) of the block, its high nibbles [16 + 4c, 16 + 4c + 4), each with its
      // high bits from the plane.
      __m512i w[NG][2];
      for (int i = 0; i < NG; ++i) {
        if (L.quant_chunks == 0) {  // Q2_K: the plane alone
          for (int half = 0; half < 2; ++half) w[i][half] = plane_bits_avx512<QT>(plane[i], c, half);
          continue;
        }
        const __m512i v = _mm512_loadu_si512(br.q + i * gstride + c * 64);
        if (QT == kQ8_0) {
          w[i][0] = v;
        } else {
          w[i][0] = _mm512_and_si512(v, low4);
          w[i][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if (L.plane_chunks)
            for (int half = 0; half < 2; ++half)
              w[i][half] = _mm512_or_si512(w[i][half], plane_bits_avx512<QT>(plane[i], c, half));
          if (L.lut)  // nibble -> its value + 128
            for (int half = 0; half < 2; ++half) w[i][half] = _mm512_shuffle_epi8(lut, w[i][half]);
        }
      }
      const int h0 = L.split ? 0 : c % kSums, h1 = L.split ? 1 : h0;
      for (int t = 0; t < MT; ++t) {
        const int8_t* xb = xt + (static_cast<int64_t>(b) * h + t) * kBlock * DIGITS;
        for (int d = 0; d < DIGITS; ++d) {
          const int32_t* xw = reinterpret_cast<const int32_t*>(xb + d * kBlock);
          if (NG == 1) {
            s[0][t][d][h0] = dpbusd_bcast_avx512(s[0][t][d][h0], w[0][0], xw + c);
            if (QT != kQ8_0) s[0][t][d][h1] = dpbusd_bcast_avx512(s[0][t][d][h1], w[0][1], xw + 4 + c);
            continue;
          }
          const __m512i x0 = _mm512_set1_epi32(xw[c]);
          for (int i = 0; i < NG; ++i) s[i][t][d][h0] = _mm512_dpbusd_epi32(s[i][t][d][h0], w[i][0], x0);
          if (QT != kQ8_0) {
            const __m512i x1 = _mm512_set1_epi32(xw[4 + c]);
            for (int i = 0; i < NG; ++i) s[i][t][d][h1] = _mm512_dpbusd_epi32(s[i][t][d][h1], w[i][1], x1);
          }
        }
      }
    }
    for (int i = 0; i < NG; ++i) {
      const BlockRef bi{br.q + i * gstride, br.fields + i * gstride, br.sub};
      __m512 dv[2], mv[2];
      for (int h = 0; h < (L.split ? 2 : 1); ++h) block_scales_avx512<QT>(bi, h, dv[h], mv[h]);
#pragma GCC unroll 8
      for (int t = 0; t < MT; ++t) {
        const int64_t tb = dt + static_cast<int64_t>(b) * h + t;
        __m512i dsum[kSums];  // the digits combined
        for (int h = 0; h < kSums; ++h)
          dsum[h] = DIGITS == 2 ? _mm512_add_epi32(_mm512_slli_epi32(s[i][t][0][h], 7), s[i][t][DIGITS - 1][h]) : s[i][t][0][h];
        __m512& a = L.kquant ? sb[i][t] : acc[i][t];
        if (L.split) {
          for (int h = 0; h < 2; ++h) {
            const __m512i s = L.zero ? _mm512_sub_epi32(dsum[h], _mm512_set1_epi32(p.xsh[2 * tb + h])) : dsum[h];
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dv[h], a);
          }
        } else {
          __m512i sum = dsum[0];
          if (kSums == 2) sum = _mm512_add_epi32(sum, dsum[kSums - 1]);
          // the weights are value + zero: remove zero * sum(x_q) in integers (no FMA by the offset)
          if (!L.has_m) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(L.zero * p.xsum[tb]));
          a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), L.kquant ? dv[0] : _mm512_mul_ps(dv[0], _mm512_set1_ps(p.xd[tb])), a);
          if (L.has_m && !L.kquant) a = _mm512_fmadd_ps(mv[0], _mm512_set1_ps(p.xs[tb]), a);
        }
      }
      if (L.kquant && br.sub == kSuperBlocks - 1) {  // the super-block's end: (sb - dmin * mins) * xd into out
        SuperBlockMins<QT> mins;
        if (L.has_m) mins = super_block_mins_avx512<QT, DIGITS>(bi.fields);
#pragma GCC unroll 8
        for (int t = 0; t < MT; ++t) {
          const int64_t tb = dt + static_cast<int64_t>(b) * h + t;
          if (L.has_m)
            sb[i][t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(super_block_min_sum_avx512<QT, DIGITS>(mins, p, tb - (kSuperBlocks - 1) * h, h)),
                                        half16_avx512(bi.fields + kFieldM), sb[i][t]);
          _mm512_store_ps(out[i][t], _mm512_fmadd_ps(sb[i][t], _mm512_set1_ps(p.xd[tb]), _mm512_load_ps(out[i][t])));
          sb[i][t] = _mm512_setzero_ps();
        }
      }
    }
  }
  for (int i = 0; i < NG; ++i) {
    const int64_t col = (g + i) * kGroupRows;
    const int valid = static_cast<int>(std::min<int64_t>(kGroupRows, p.n - col));
    for (int t = 0; t < MT; ++t) {
      if constexpr (L.kquant) acc[i][t] = _mm512_load_ps(out[i][t]);
      store16_avx512(p, t0 + t, col, valid, acc[i][t]);
    }
  }
}

// Groups [g0, g1): one activation row takes them in pairs (a lone last group on its own); more
// rows take one group at a time, in tiles of rows.
template <int QT, int DIGITS>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) void group_range_qt_avx512(const Problem& p, int64_t g0, int64_t g1) {
  if (p.m == 1) {
    int64_t g = g0;
    for (; g + 2 <= g1; g += 2) group_tile_avx512<QT, 2, 1, DIGITS>(p, g, 0, 0, 1);
    if (g < g1) group_tile_avx512<QT, 1, 1, DIGITS>(p, g, 0, 0, 1);
    return;
  }
  // Tiles of 8 rows with 8-bit activations (each weight chunk unpacked once for 8 rows), of 4 with
  // 15-bit ones (two digit planes: the sums of more rows no longer fit the registers); the
  // activations are quantized into tiles of the same height (Problem::xtile).
  constexpr int kTile = block_tile_rows(DIGITS);
  const int passes = p.m / 4 + (p.m % 4 != 0) - (DIGITS == 1 ? p.m / 8 : 0);
  for (int64_t g = g0; g < g1; ++g) {
    int t = 0, pass = 0;
    for (; t + kTile <= p.m; t += kTile, ++pass) group_tile_avx512<QT, 1, kTile, DIGITS>(p, g, t, pass, passes);
    if (kTile > 4 && p.m - t >= 4) {
      group_tile_avx512<QT, 1, 4, DIGITS>(p, g, t, pass++, passes);
      t += 4;
    }
    switch (p.m - t) {
      case 3: group_tile_avx512<QT, 1, 3, DIGITS>(p, g, t, pass, passes); break;
      case 2: group_tile_avx512<QT, 1, 2, DIGITS>(p, g, t, pass, passes); break;
      case 1: group_tile_avx512<QT, 1, 1, DIGITS>(p, g, t, pass, passes); break;
      default: break;
    }
  }
}

template <int QT>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) void group_range_digits_avx512(const Problem& p, int64_t g0, int64_t g1) {
  p.digits == 2 ? group_range_qt_avx512<QT, 2>(p, g0, g1) : group_range_qt_avx512<QT, 1>(p, g0, g1);
}

CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) void group_range_avx512(const Problem& p, int64_t g0, int64_t g1) {
  dispatch_qtype(p.qtype, [&](auto qt) { group_range_digits_avx512<decltype(qt)::value>(p, g0, g1); });
}

// Row-scaled int8 weights: NG adjacent groups (16 output rows each) times MT activation rows.  A
// weight vector serves MT rows and a broadcast activation word NG groups, so there are fewer loads
// per dot product than in the block kernel above, and the only per-block float work is one
// convert and one FMA (the weight scale is per row, applied once at the end).  2 x 6 tiles: the
// fastest shape measured (benchmarks/HISTORY.md).
template <int NG, int MT>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) void rows_tile_avx512(const Problem& p, int64_t g, int t0, int pass, int passes) {
  const int nb = p.nb;
  const int64_t gstride = static_cast<int64_t>(nb) * kRowsBlockBytes;
  const uint8_t* wg = p.w + g * gstride;
  const ActTiles tiles{kRowsTile, p.k, 1};
  const int8_t* xt = p.xq + tiles.q(t0);  // this tile (MT rows), block by block
  const float* dt = p.xd + tiles.d(t0);
  __m512 acc[NG][MT];
  for (int i = 0; i < NG; ++i)
    for (int t = 0; t < MT; ++t) acc[i][t] = _mm512_setzero_ps();
  // The next NG groups' weights into L2 while these compute, which the hardware prefetchers do
  // not do across the group boundary, spread over the passes.
  PrefetchTurn turn(pass, passes);
  for (int b = 0; b < nb; ++b, xt += MT * kBlock, dt += MT) {
    const uint8_t* wb = wg + static_cast<int64_t>(b) * kRowsBlockBytes;
    if (turn.next())
      for (int i = 0; i < NG; ++i)
        for (int off = 0; off < kRowsBlockBytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(wb + (NG + i) * gstride + off), _MM_HINT_T1);
    __m512i s[NG][MT];
    for (int i = 0; i < NG; ++i)
      for (int t = 0; t < MT; ++t) s[i][t] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      __m512i wv[NG];
      for (int i = 0; i < NG; ++i) wv[i] = _mm512_loadu_si512(wb + i * gstride + c * 64);
      for (int t = 0; t < MT; ++t) {
        int32_t word;
        std::memcpy(&word, xt + t * kBlock + c * 4, 4);
        const __m512i xb = _mm512_set1_epi32(word);
        for (int i = 0; i < NG; ++i) s[i][t] = _mm512_dpbusd_epi32(s[i][t], wv[i], xb);
      }
    }
    for (int t = 0; t < MT; ++t) {
      const __m512 d = _mm512_set1_ps(dt[t]);
      for (int i = 0; i < NG; ++i) acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][t]), d, acc[i][t]);
    }
  }
  for (int i = 0; i < NG; ++i) {
    const int64_t col = (g + i) * kGroupRows;
    const int valid = static_cast<int>(std::min<int64_t>(kGroupRows, p.n - col));
    const __m512 ws = _mm512_loadu_ps(p.wscale + col);
    for (int t = 0; t < MT; ++t)
      store16_avx512(p, t0 + t, col, valid, _mm512_mul_ps(_mm512_sub_ps(acc[i][t], _mm512_set1_ps(p.xcorr[t0 + t])), ws));
  }
}

template <int NG>
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) void rows_groups_avx512(const Problem& p, int64_t g) {
  static_assert(kRowsTile == 6, "the tail cases below");
  const int passes = (p.m + kRowsTile - 1) / kRowsTile;
  int t = 0, pass = 0;
  for (; t + kRowsTile <= p.m; t += kRowsTile, ++pass) rows_tile_avx512<NG, kRowsTile>(p, g, t, pass, passes);
  switch (p.m - t) {
    case 5: rows_tile_avx512<NG, 5>(p, g, t, pass, passes); break;
    case 4: rows_tile_avx512<NG, 4>(p, g, t, pass, passes); break;
    case 3: rows_tile_avx512<NG, 3>(p, g, t, pass, passes); break;
    case 2: rows_tile_avx512<NG, 2>(p, g, t, pass, passes); break;
    case 1: rows_tile_avx512<NG, 1>(p, g, t, pass, passes); break;
    default: break;
  }
}

// Groups [g0, g1) in pairs (a lone last group on its own).
CPUSERVE_TARGET(CPUSERVE_ISA_AVX512_VNNI) void rows_range_avx512(const Problem& p, int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + 2 <= g1; g += 2) rows_groups_avx512<2>(p, g);
  if (g < g1) rows_groups_avx512<1>(p, g);
}

}  // namespace
}  // namespace qlinear
