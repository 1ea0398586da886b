// AVX2 kernels of qlinear.cpp, stamped out twice by including this file with different macros:
//   QL_NS      namespace of this copy
//   QL_TARGET  GCC target attribute of its functions
//   QL_VNNI    1: AVX-VNNI `vpdpbusd`; 0: `vpmaddubsw` + `vpmaddwd`
// (GCC cannot give one template instantiation a different target than another, hence the copies.)
//
// Same packed layout as the AVX-512 path, in 256-bit halves: rows 0-7 of a group are the low 32
// bytes of each 64-byte chunk, rows 8-15 the high 32.  Without VNNI the 8 Q4 nibble products of a
// block are summed in int16, which cannot overflow (8 * 2 * 15 * 127 < 32768), and Q8_0 goes
// through the sign trick on the signed weights (|w| <= 128, so one `vpmaddubsw` pair fits int16).
// Both hold for either activation digit (|a| <= 127, |b| <= 64).
//
// Included by qlinear.cpp only, after its helpers (Problem, store8).

namespace qlinear {
namespace QL_NS {

// Integer dots of 8 rows (lanes) with one 32-byte int8 x block, from preloaded weight vectors:
// Q8_0: w[0..7] the chunks (unsigned q + 128 with VNNI, signed q without); Q4: w[0..3] low nibbles
// (x 0..15), w[4..7] high nibbles (x 16..31).
template <int QT>
QL_TARGET inline __m256i dot8(const __m256i* w, const int8_t* xb) {
  const int32_t* xw = reinterpret_cast<const int32_t*>(xb);
#if QL_VNNI
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  if (QT == kQ8_0) {
    for (int c = 0; c < 8; c += 2) {
      s0 = _mm256_dpbusd_avx_epi32(s0, w[c], _mm256_set1_epi32(xw[c]));
      s1 = _mm256_dpbusd_avx_epi32(s1, w[c + 1], _mm256_set1_epi32(xw[c + 1]));
    }
  } else {
    for (int c = 0; c < 4; ++c) {
      s0 = _mm256_dpbusd_avx_epi32(s0, w[c], _mm256_set1_epi32(xw[c]));
      s1 = _mm256_dpbusd_avx_epi32(s1, w[4 + c], _mm256_set1_epi32(xw[4 + c]));
    }
  }
  return _mm256_add_epi32(s0, s1);
#else
  const __m256i ones16 = _mm256_set1_epi16(1);
  if (QT == kQ8_0) {
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xw[c]), w[c]);
      s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[c]), xs), ones16));
    }
    return s;
  }
  __m256i s16 = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(xw[c])));
  return _mm256_madd_epi16(s16, ones16);
#endif
}

template <int QT, int MT, int DIGITS>
QL_TARGET void group_half(const Problem& p, int64_t g, int t0, int h, int pass, int passes) {
  const uint8_t* wg = p.w + g * p.nb * static_cast<int64_t>(p.gbytes);
  const int nb = p.nb;
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  PrefetchTurn turn(h == 0 ? pass : -1, passes);  // the second half re-reads the group from cache
  for (int b = 0; b < nb; ++b) {
    const uint8_t* gb = wg + static_cast<int64_t>(b) * p.gbytes;
    if (turn.next() && kPrefetchBytes > 0)
      for (int off = 0; off < p.gbytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(gb + kPrefetchBytes + off), QL_PREFETCH_HINT);
    __m256i w[8];
    __m256 dv, mv = _mm256_setzero_ps();
    if (QT == kQ8_0) {
      for (int c = 0; c < 8; ++c) w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + c * 64 + h * 32));
#if !QL_VNNI
      for (int c = 0; c < 8; ++c) w[c] = _mm256_xor_si256(w[c], _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
      dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + group_block_d_at(kQ8_0) + h * 16)));
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + c * 64 + h * 32));
        w[c] = _mm256_and_si256(v, low4);
        w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
      dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + group_block_d_at(QT) + h * 16)));
      mv = QT == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + group_block_m_at(QT) + h * 16)))
                       : _mm256_mul_ps(dv, _mm256_set1_ps(-8.f));
    }
    for (int t = 0; t < MT; ++t) {
      const int64_t row = t0 + t;
      const int8_t* xb = p.xq + row * p.ldq + b * kBlock * DIGITS;
      __m256i s = dot8<QT>(w, xb);
      if (DIGITS == 2) s = _mm256_add_epi32(_mm256_slli_epi32(s, 7), dot8<QT>(w, xb + kBlock));
#if QL_VNNI
      if (QT == kQ8_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * p.xsum[row * nb + b]));
#endif
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dv, _mm256_set1_ps(p.xd[row * nb + b])), acc[t]);
      if (QT != kQ8_0) acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(p.xs[row * nb + b]), acc[t]);
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

template <int DIGITS>
QL_TARGET void group_qtype(const Problem& p, int64_t g) {
  switch (p.qtype) {
    case kQ4_0: group_rows<kQ4_0, DIGITS>(p, g); break;
    case kQ4_1: group_rows<kQ4_1, DIGITS>(p, g); break;
    default: group_rows<kQ8_0, DIGITS>(p, g); break;
  }
}

QL_TARGET void group_dispatch(const Problem& p, int64_t g) {
  if (p.digits == 2)
    group_qtype<2>(p, g);
  else
    group_qtype<1>(p, g);
}

}  // namespace QL_NS
}  // namespace qlinear
