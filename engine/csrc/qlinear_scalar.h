// The portable reference path of qlinear.cpp: the activation quantizers (32-blocks, and whole
// rows to 15 bits) and the packed-block and row-int8 products, one output at a time in plain C++.
// Every vector path (qlinear_avx2.h, qlinear_avx512.h, qlinear_amx.h) is tested against these.
//
// Included by qlinear.cpp only, after its helpers (Problem, QuantRow, BlockRef, the layouts); its
// functions join qlinear.cpp's internal namespace.
#pragma once

namespace qlinear {
namespace {

void quantize_row_scalar(const QuantRow& r) {
  const int nb = static_cast<int>(r.k / kBlock);
  auto at = [&](int64_t j) {
    return r.bf16 ? bf16_to_float(static_cast<const uint16_t*>(r.x)[j]) : static_cast<const float*>(r.x)[j];
  };
  for (int b0 = 0; b0 < nb; b0 += r.span) {
    float amax = 0.f;
    for (int64_t j = static_cast<int64_t>(b0) * kBlock; j < static_cast<int64_t>(b0 + r.span) * kBlock; ++j)
      amax = std::max(amax, std::fabs(at(j)));
    const float d = amax / (r.digits == 2 ? kQmax16 : kQmax8);
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int b = b0; b < b0 + r.span; ++b) {
      int32_t sum = 0;
      int8_t* qb = r.q + b * r.q_stride;
      for (int i = 0; i < kBlock; ++i) {
        const int q = static_cast<int>(std::nearbyint(at(static_cast<int64_t>(b) * kBlock + i) * id));
        if (r.digits == 2) {
          const int hi = high_digit(q);
          qb[i] = static_cast<int8_t>(hi);
          qb[kBlock + i] = static_cast<int8_t>(q - 128 * hi);
        } else {
          qb[i] = static_cast<int8_t>(q);
        }
        sum += q;
      }
      r.d[b * r.d_stride] = d;
      r.sum[b * r.d_stride] = sum;
      r.s[b * r.d_stride] = r.s_of(d, sum);
    }
  }
}

// One whole row rounded to 15 bits (qmax 127 * 128, the blocks' two-digit arithmetic above) with
// one scale d, into the rows16 layout at q; sums[0], sums[1] = the high and low digit sums.  k is
// a multiple of kChunk.
void quantize_row16_scalar(const void* x, bool bf16, int64_t k, int8_t* q, float* d, int32_t* sums) {
  auto at = [&](int64_t j) {
    return bf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[j]) : static_cast<const float*>(x)[j];
  };
  float amax = 0.f;
  for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(at(j)));
  const float dd = amax / kQmax16;
  const float id = dd != 0.f ? 1.f / dd : 0.f;
  int32_t hi_sum = 0, lo_sum = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int qv = static_cast<int>(std::nearbyint(at(j) * id));
    const int hi = high_digit(qv);
    int8_t* qj = q + rows16_chunk(j / kChunk, 0) + j % kChunk;
    qj[0] = static_cast<int8_t>(hi);
    qj[kRows16Low] = static_cast<int8_t>(qv - 128 * hi);
    hi_sum += hi;
    lo_sum += qv - 128 * hi;
  }
  *d = dd;
  sums[0] = hi_sum;
  sums[1] = lo_sum;
}

// out[t, col] = v + bias[col], in the output's dtype.
inline void store1_scalar(const Problem& p, int t, int64_t col, float v) {
  if (p.bias)
    v += p.bias_bf16 ? bf16_to_float(static_cast<const uint16_t*>(p.bias)[col]) : static_cast<const float*>(p.bias)[col];
  if (p.amax != nullptr) {
    ArgmaxLanes& a = *p.amax;
    const int64_t i = t * 16 + col % 16;
    if (std::isnan(v)) a.nan = true;
    if (v > a.best[i] || (v == a.best[i] && col < a.col[i])) a.best[i] = v, a.col[i] = static_cast<int32_t>(col);
    return;
  }
  if (p.out_bf16)
    static_cast<uint16_t*>(p.out)[t * p.ldo + col] = float_to_bf16(v);
  else
    static_cast<float*>(p.out)[t * p.ldo + col] = v;
}

// Integer dots of one row's 32 weight quants (unsigned, as row_quants gives them) with 32 int8 x:
// dot[0] over elements 0-15, dot[1] over 16-31.
inline void dot_scalar(const uint8_t* q, const int8_t* xb, int32_t dot[2]) {
  dot[0] = dot[1] = 0;
  for (int i = 0; i < kBlock; ++i) dot[i / 16] += static_cast<int>(q[i]) * xb[i];
}

// The scalar reference of every block type: per row and block the integer dot product of the
// unsigned quants, then the float steps the SIMD kernels take (remove zero * sum(x_q) in
// integers, per half for the split types, then the dot times d * xd; Q4_1 / Q5_1: the dot times
// d * xd plus the offset m times xd * sum(x_q); Q4_K / Q5_K: the mins at the super-block's end,
// -dmin times the integer sum of min * sum(x_q) over its blocks; Q2_K the same over its halves).  K types share xd over a
// super-block (act_span): there the block's terms go without it into a super-block sum, which
// meets xd once, at the super-block's end.  Rows are row after row here (Problem::xtile 1).
void group_scalar(const Problem& p, int64_t g) {
  const int rows_valid = static_cast<int>(std::min<int64_t>(kGroupRows, p.n - g * kGroupRows));
  const uint8_t* wg = p.w + g * p.nb * static_cast<int64_t>(p.gbytes);
  const Layout L = layout(p.qtype);
  for (int t = 0; t < p.m; ++t) {
    const int8_t* xq = p.xq + static_cast<int64_t>(t) * p.ldq;
    float out[kGroupRows] = {0}, sb[kGroupRows] = {0};
    float* acc = L.kquant ? sb : out;
    for (int b = 0; b < p.nb; ++b) {
      const BlockRef br = block_at(wg, p.qtype, b);
      const int8_t* xb = xq + b * kBlock * p.digits;
      const int64_t tb = static_cast<int64_t>(t) * p.nb + b;
      const float xd = L.kquant ? 1.f : p.xd[tb], xs = p.xs[tb];
      for (int r = 0; r < kGroupRows; ++r) {
        uint8_t q[kBlock];
        row_quants(br.q, p.qtype, r, q);
        int32_t dot[2];
        dot_scalar(q, xb, dot);
        if (p.digits == 2) {
          int32_t lo[2];
          dot_scalar(q, xb + kBlock, lo);
          for (int h = 0; h < 2; ++h) dot[h] = 128 * dot[h] + lo[h];
        }
        if (L.split) {
          for (int h = 0; h < 2; ++h)
            acc[r] = std::fma(static_cast<float>(dot[h] - (L.zero ? p.xsh[2 * tb + h] : 0)), row_scale(br, p.qtype, r, h).d * xd, acc[r]);
        } else {
          const RowScale rs = row_scale(br, p.qtype, r, 0);
          acc[r] = std::fma(static_cast<float>(dot[0] + dot[1] - (L.has_m ? 0 : L.zero * p.xsum[tb])), rs.d * xd, acc[r]);
          if (L.has_m && !L.kquant) acc[r] = std::fma(rs.m, xs, acc[r]);
        }
        if (L.kquant && br.sub == kSuperBlocks - 1) {
          if (L.has_m) {  // - dmin * sum_s min_s * xsum_s, as super_block_min_sum_avx512 (Q2_K: per half)
            int32_t mins = 0;
            for (int s = 0; s < kSuperBlocks; ++s) {
              const int64_t sb_tb = tb - (kSuperBlocks - 1 - s);
              if (L.split)
                for (int hh = 0; hh < 2; ++hh) mins += (header_scales(br.fields, p.qtype, s, hh)[r] >> 4) * p.xsh[2 * sb_tb + hh];
              else
                mins += header_mins(br.fields, s)[r] * p.xsum[sb_tb];
            }
            sb[r] = std::fma(-group_block_half(br.fields, kFieldM, r), static_cast<float>(mins), sb[r]);
          }
          out[r] = std::fma(sb[r], p.xd[tb], out[r]);
          sb[r] = 0.f;
        }
      }
    }
    for (int r = 0; r < rows_valid; ++r) store1_scalar(p, t, g * kGroupRows + r, out[r]);
  }
}

// Row-scaled int8 weights (see qlinear.h), scalar reference: the same integer sums and float
// operations as the AVX-512 path, one output at a time.
void rows_group_scalar(const Problem& p, int64_t g) {
  const int rows_valid = static_cast<int>(std::min<int64_t>(kGroupRows, p.n - g * kGroupRows));
  const uint8_t* wg = p.w + g * p.nb * static_cast<int64_t>(kRowsBlockBytes);
  for (int t = 0; t < p.m; ++t) {
    const ActTiles tiles{kRowsTile, p.k, 1};
    const int h = tiles.height(p.m, t);
    const int8_t* xq = p.xq + tiles.q(t);
    const float* xd = p.xd + tiles.d(t);
    for (int r = 0; r < rows_valid; ++r) {
      float acc = 0.f;
      for (int b = 0; b < p.nb; ++b) {
        const uint8_t* gb = wg + static_cast<int64_t>(b) * kRowsBlockBytes;
        const int8_t* xb = xq + static_cast<int64_t>(b) * h * kBlock;
        int32_t dot = 0;
        for (int c = 0; c < 8; ++c)
          for (int j = 0; j < 4; ++j) dot += static_cast<int>(gb[c * 64 + r * 4 + j]) * xb[c * 4 + j];
        acc = std::fma(static_cast<float>(dot), xd[b * h], acc);
      }
      const int64_t col = g * kGroupRows + r;
      store1_scalar(p, t, col, (acc - p.xcorr[t]) * p.wscale[col]);
    }
  }
}

// Row-scaled int8 weights with per-row 15-bit activations (act_rows16), scalar reference of the
// AMX kernel: each digit plane's integer dot product with the signed weights, the two combined and
// scaled in the same float operations.
void rows16_group_scalar(const Problem& p, int64_t g) {
  const int rows_valid = static_cast<int>(std::min<int64_t>(kGroupRows, p.n - g * kGroupRows));
  const uint8_t* wg = p.w + g * p.nb * static_cast<int64_t>(kRowsBlockBytes);
  for (int t = 0; t < p.m; ++t) {
    const int8_t* xq = p.xq + rows16_q(p.k, t);
    for (int r = 0; r < rows_valid; ++r) {
      int32_t hi = 0, lo = 0;
      for (int64_t j = 0; j < p.k; ++j) {
        const int w = static_cast<int>(wg[j / kBlock * kRowsBlockBytes + j % kBlock / 4 * 64 + r * 4 + j % 4]) - 128;
        const int8_t* xj = xq + rows16_chunk(j / kChunk, 0) + j % kChunk;
        hi += w * xj[0];
        lo += w * xj[kRows16Low];
      }
      const int64_t col = g * kGroupRows + r;
      const float v = static_cast<float>(hi) * 128.f + static_cast<float>(lo);
      store1_scalar(p, t, col, v * (p.xd[t] * p.wscale[col]));
    }
  }
}

}  // namespace
}  // namespace qlinear
