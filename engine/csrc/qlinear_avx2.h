// AVX2 kernels of qlinear.cpp, stamped out twice by including this file with different macros:
//   QL_NS      namespace of this copy
//   QL_TARGET  GCC target attribute of its functions
//   QL_VNNI    1: AVX-VNNI `vpdpbusd`; 0: `vpmaddubsw` + `vpmaddwd`
// (GCC cannot give one template instantiation a different target than another, hence the copies.)
//
// Same packed layout as the AVX-512 path, in 256-bit halves: rows 0-7 of a group are the low 32
// bytes of each 64-byte chunk, rows 8-15 the high 32.  Without VNNI the 8 Q4 nibble products of a
// block are summed in int16, which cannot overflow (8 * 2 * 15 * 127 < 32768; 5- and 6-bit quants
// in runs of 4 and 2, see dot_words), and Q8_0 goes
// through the sign trick on the signed weights (|w| <= 128, so one `vpmaddubsw` pair fits int16), as
// do the lut types' looked-up bytes.
// Both hold for either activation digit (|a| <= 127, |b| <= 64).
//
// Included by qlinear.cpp only, after its helpers (Problem, store8).

namespace qlinear {
namespace QL_NS {

// Integer dots of 8 rows (lanes) with `count` int8 x words xw[0..count) against the weight
// vectors w[0..count) (Q8_0 and the lut types' bytes: unsigned value + 128 with VNNI, signed value
// without; the rest: unsigned quants of 4-6 bits).  Without VNNI, `vpmaddubsw` pairs are summed in int16 in runs short enough
// not to overflow: 2 * (2^bits - 1) * 127 per pair, 8 of them for 4 bits, 4 for 5, 2 for 6.
template <int QT>
QL_TARGET inline __m256i dot_words(const __m256i* w, const int32_t* xw, int count) {
#if QL_VNNI
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int c = 0; c < count; c += 2) {
    s0 = _mm256_dpbusd_avx_epi32(s0, w[c], _mm256_set1_epi32(xw[c]));
    s1 = _mm256_dpbusd_avx_epi32(s1, w[c + 1], _mm256_set1_epi32(xw[c + 1]));
  }
  return _mm256_add_epi32(s0, s1);
#else
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m256i s = _mm256_setzero_si256();
  if (layout(QT).zero == 128) {
    for (int c = 0; c < count; ++c) {
      const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xw[c]), w[c]);
      s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[c]), xs), ones16));
    }
    return s;
  }
  constexpr int kRun = 8 >> layout(QT).plane_chunks;
  for (int c0 = 0; c0 < count; c0 += kRun) {
    __m256i s16 = _mm256_setzero_si256();
    for (int c = c0; c < c0 + kRun && c < count; ++c)
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(xw[c])));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(s16, ones16));
  }
  return s;
#endif
}

// A nibble chunk's high bits (Q2_K: its step c's quants), 8 rows (plane_bits_avx512 in 256 bits).
template <int QT>
QL_TARGET inline __m256i plane_bits(const __m256i* plane, int c, int half) {
  if (QT == kQ2_K) return _mm256_and_si256(_mm256_srli_epi16(plane[half], 2 * c), _mm256_set1_epi8(0x03));
  if (layout(QT).plane_chunks == 1) {
    const __m256i v = half == 0 ? _mm256_slli_epi16(plane[0], 4 - c) : _mm256_srli_epi16(plane[0], c);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
  }
  const int sh = 4 - 2 * c;
  const __m256i v = sh >= 0 ? _mm256_slli_epi16(plane[half], sh) : _mm256_srli_epi16(plane[half], -sh);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x30));
}

// 8 fp16 values at `at`, and 8 bytes (signed or not), as floats.
QL_TARGET inline __m256 half8(const uint8_t* at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))); }
QL_TARGET inline __m256 bytes8(const uint8_t* at, bool is_signed) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

// Integer dots of rows [8h, 8h + 8) (one activation row's `DIGITS` digit planes at xb) with the
// weight vectors w[c0, c0 + count) against x words [c0, c0 + count), the digits combined.
template <int QT, int DIGITS>
QL_TARGET inline __m256i digits_dot(const __m256i* w, const int8_t* xb, int c0, int count) {
  __m256i s = dot_words<QT>(w + c0, reinterpret_cast<const int32_t*>(xb) + c0, count);
  if (DIGITS == 2)
    s = _mm256_add_epi32(_mm256_slli_epi32(s, 7), dot_words<QT>(w + c0, reinterpret_cast<const int32_t*>(xb + kBlock) + c0, count));
  return s;
}

// Rows [8h, 8h + 8)'s scale d and offset m of group-block `br`, elements [16 part, 16 part + 16)
// (block_scales_avx512 in 8 lanes).
template <int QT>
QL_TARGET inline void block_scales(const BlockRef& br, int h, int part, __m256& dv, __m256& mv) {
  constexpr Layout L = layout(QT);
  if (QT == kQ4_K || QT == kQ5_K) {
    dv = _mm256_mul_ps(half8(br.fields + kFieldD + h * 16), bytes8(header_scales(br.fields, QT, br.sub, 0) + h * 8, false));
    mv = _mm256_setzero_ps();  // the mins meet the activations at the super-block's end
  } else if (QT == kQ6_K || QT == kQ3_K) {  // their offset is taken off in integers (Problem::xsh): no mv
    dv = _mm256_mul_ps(half8(br.fields + kFieldD + h * 16), bytes8(header_scales(br.fields, QT, br.sub, part) + h * 8, true));
    mv = _mm256_setzero_ps();
  } else if (QT == kQ2_K) {  // the scale in each byte's low nibble; the mins at the super-block's end
    const __m128i sm = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(header_scales(br.fields, QT, br.sub, part) + h * 8));
    dv = _mm256_mul_ps(half8(br.fields + kFieldD + h * 16), _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_cvtepu8_epi32(sm), _mm256_set1_epi32(15))));
    mv = _mm256_setzero_ps();
  } else if (QT == kIQ4_XS || QT == kIQ3_S || QT == kIQ3_XXS) {  // their offset 128 is taken off in integers: no mv
    dv = _mm256_mul_ps(half8(br.fields + kFieldD + h * 16), bytes8(header_scales(br.fields, QT, br.sub, 0) + h * 8, true));
    if (QT == kIQ3_XXS) dv = _mm256_mul_ps(dv, _mm256_set1_ps(scale_factor(QT)));
    mv = _mm256_setzero_ps();
  } else {
    dv = half8(br.fields + kFieldD + h * 16);
    mv = L.has_m ? half8(br.fields + kFieldM + h * 16) : _mm256_setzero_ps();
  }
}

template <int QT, int MT, int DIGITS>
QL_TARGET void group_half(const Problem& p, int64_t g, int t0, int h, int pass, int passes) {
  constexpr Layout L = layout(QT);
  const uint8_t* wg = p.w + g * p.nb * static_cast<int64_t>(p.gbytes);
  const int nb = p.nb;
  __m256 acc[MT], sb[MT];  // sb: a K type's super-block sum (group_tile_avx512)
  for (int t = 0; t < MT; ++t) acc[t] = sb[t] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  PrefetchTurn turn(h == 0 ? pass : -1, passes);  // the second half re-reads the group from cache
  for (int b = 0; b < nb; ++b) {
    const BlockRef br = block_at<QT>(wg, b);
    const uint8_t* gb = br.q;
    if (turn.next() && kPrefetchBytes > 0)
      for (int off = 0; off < p.gbytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wg + static_cast<int64_t>(b) * p.gbytes + kPrefetchBytes + off), QL_PREFETCH_HINT);
    __m256i w[8];
    if (QT == kQ8_0) {
      for (int c = 0; c < 8; ++c) w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + c * 64 + h * 32));
#if !QL_VNNI
      for (int c = 0; c < 8; ++c) w[c] = _mm256_xor_si256(w[c], _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
    } else {
      __m256i plane[2];
      for (int c = 0; c < L.plane_chunks; ++c)
        plane[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + plane_at(QT) + c * 64 + h * 32));
      for (int c = 0; c < 4; ++c) {
        if (L.quant_chunks == 0) {  // Q2_K: the plane alone
          w[c] = plane_bits<QT>(plane, c, 0);
          w[4 + c] = plane_bits<QT>(plane, c, 1);
          continue;
        }
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + c * 64 + h * 32));
        w[c] = _mm256_and_si256(v, low4);
        w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if (L.plane_chunks) {
          w[c] = _mm256_or_si256(w[c], plane_bits<QT>(plane, c, 0));
          w[4 + c] = _mm256_or_si256(w[4 + c], plane_bits<QT>(plane, c, 1));
        }
      }
      if (L.lut) {  // nibble -> its value + 128; without VNNI the signed value, as Q8_0's above
        const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lut_bytes(QT))));
        for (int c = 0; c < 8; ++c) w[c] = _mm256_shuffle_epi8(lut, w[c]);
#if !QL_VNNI
        for (int c = 0; c < 8; ++c) w[c] = _mm256_xor_si256(w[c], _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
      }
    }
    __m256 dv[2], mv[2];
    for (int part = 0; part < (L.split ? 2 : 1); ++part) block_scales<QT>(br, h, part, dv[part], mv[part]);
    for (int t = 0; t < MT; ++t) {
      const int64_t row = t0 + t, tb = row * nb + b;
      const int8_t* xb = p.xq + row * p.ldq + b * kBlock * DIGITS;
      __m256& a = L.kquant ? sb[t] : acc[t];
      if (L.split) {
        for (int part = 0; part < 2; ++part) {
          const __m256i dot = digits_dot<QT, DIGITS>(w, xb, 4 * part, 4);
          const __m256i s = L.zero ? _mm256_sub_epi32(dot, _mm256_set1_epi32(p.xsh[2 * tb + part])) : dot;
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dv[part], a);
        }
      } else {
        __m256i s = digits_dot<QT, DIGITS>(w, xb, 0, 8);
        // the weights are value + zero: remove zero * sum(x_q) (without VNNI, 128 is off already: signed bytes)
        if (!L.has_m && (L.zero != 128 || QL_VNNI)) s = _mm256_sub_epi32(s, _mm256_set1_epi32(L.zero * p.xsum[tb]));
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), L.kquant ? dv[0] : _mm256_mul_ps(dv[0], _mm256_set1_ps(p.xd[tb])), a);
        if (L.has_m && !L.kquant) a = _mm256_fmadd_ps(mv[0], _mm256_set1_ps(p.xs[tb]), a);
      }
      if (L.kquant && br.sub == kSuperBlocks - 1) {
        if (L.has_m) {  // - dmin * sum_s min_s * xsum_s, as super_block_min_sum_avx512 (Q2_K: per half)
          __m256i mins = _mm256_setzero_si256();
          for (int s = 0; s < kSuperBlocks; ++s) {
            const int64_t sb_tb = tb - (kSuperBlocks - 1 - s);
            if (L.split) {
              for (int part = 0; part < 2; ++part) {
                const __m128i sm = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(header_scales(br.fields, QT, s, part) + h * 8));
                const __m256i m = _mm256_srli_epi32(_mm256_cvtepu8_epi32(sm), 4);
                mins = _mm256_add_epi32(mins, _mm256_mullo_epi32(m, _mm256_set1_epi32(p.xsh[2 * sb_tb + part])));
              }
              continue;
            }
            const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(header_mins(br.fields, s) + h * 8)));
            mins = _mm256_add_epi32(mins, _mm256_mullo_epi32(m, _mm256_set1_epi32(p.xsum[sb_tb])));
          }
          sb[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), half8(br.fields + kFieldM + h * 16), sb[t]);
        }
        acc[t] = _mm256_fmadd_ps(sb[t], _mm256_set1_ps(p.xd[tb]), acc[t]);
        sb[t] = _mm256_setzero_ps();
      }
    }
  }
  const int valid = static_cast<int>(std::min<int64_t>(8, p.n - g * kGroupRows - h * 8));
  if (valid > 0)
    for (int t = 0; t < MT; ++t) store8(p, t0 + t, g * kGroupRows + h * 8, valid, acc[t]);
}

template <int QT, int DIGITS>
QL_TARGET void group_rows(const Problem& p, int64_t g) {
  constexpr int kTile = 2;  // 16 ymm registers: 8 weight vectors + scales + 2 rows of accumulators
  const int passes = (p.m + kTile - 1) / kTile;
  for (int h = 0; h < 2; ++h) {
    int t = 0, pass = 0;
    for (; t + kTile <= p.m; t += kTile, ++pass) group_half<QT, kTile, DIGITS>(p, g, t, h, pass, passes);
    if (t < p.m) group_half<QT, 1, DIGITS>(p, g, t, h, pass, passes);
  }
}

template <int QT>
QL_TARGET void group_digits(const Problem& p, int64_t g) {
  p.digits == 2 ? group_rows<QT, 2>(p, g) : group_rows<QT, 1>(p, g);
}

QL_TARGET void group_dispatch(const Problem& p, int64_t g) {
  dispatch_qtype(p.qtype, [&](auto qt) { group_digits<decltype(qt)::value>(p, g); });
}

}  // namespace QL_NS
}  // namespace qlinear
