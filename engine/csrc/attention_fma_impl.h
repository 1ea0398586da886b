// Paged attention in fp32 FMAs, written once over a vector type and stamped out per instruction
// set: attention_vec256.h and attention_vec512.h include this file inside their namespace and
// target region, after defining
//   V               the vector struct (vec.h: Vec256 or Vec512);
//   fp32_softmax    the online softmax of fp32 scores into fp32 probabilities (Vec512 has one that
//                   reduces 16 rows at once; Vec256 goes row by row).
// The tile loop that calls these operations is run_unit (attention_common.h).
//
// Everything is fp32: bf16 queries and cache rows are widened (a 16-bit shift), 8-bit cache rows
// widened times their row scale (and rounded to bf16 for a bf16 model, as the reference rounds
// the dequantised cache to the model dtype).  F32Ops copies a tile's K rows transposed to
// kt[D][KT], so a broadcast query element times one row of kt adds to W keys' scores per FMA; V
// rows stay in natural order and a broadcast probability times a V row adds to W outputs.
// pv_direct does the same P . V reading the V rows in place from the cache (decode units, where
// too few query rows reuse a copy to pay for it).

constexpr int W = V::kWidth;

// Accumulators a row of a P . V product keeps in registers: RB rows of NC vectors each, plus the NC
// value vectors they share, within the register file with two to spare.
constexpr int pv_cols(int RB) {
  return RB * 4 + 4 <= V::kRegisters - 2 ? 4 : RB * 2 + 2 <= V::kRegisters - 2 ? 2 : 1;
}
// Query rows per K . q product: two accumulators a row, the key panel's two vectors and a broadcast.
constexpr int kQkRows = (V::kRegisters - 3) / 2 < 8 ? (V::kRegisters - 3) / 2 : 8;
constexpr int kPvRows = 6;  // probability rows per P . V product (pv_cols(6): 4 vectors on AVX-512, 2 on AVX2)

// One row of D values -> Dp fp32 values (zero past D): the model dtype (bf16 when src_bf16, else
// fp32), or an 8-bit cache `kind` times `scale`, rounded to bf16 when round_bf16.
static inline void row_to_f32(const uint8_t* src, bool src_bf16, KvKind kind, float scale, bool round_bf16, int D, int Dp,
                              float* dst) {
  int d = 0;
  if (kind != KvKind::kSame) {
    const V sc = V::set1(scale);
    for (; d < D; d += W) {
      V f = V::mul(V::load8(src + d, elem8(kind)), sc);
      if (round_bf16) f = V::round_bf16(f);
      V::store(dst + d, f);
    }
  } else if (src_bf16) {
    for (; d < D; d += W) V::store(dst + d, V::load_bf16(reinterpret_cast<const uint16_t*>(src) + d));
  } else {
    for (; d < D; d += W) V::store(dst + d, V::load(reinterpret_cast<const float*>(src) + d));
  }
  for (; d < Dp; d += W) V::store(dst + d, V::zero());
}

// C[r][0, NC W) = (alpha ? C[r][0, NC W) * alpha[r] : 0) + sum over i < n of A[r][i] * B[i][0, NC W)
// for RB rows (A's rows lda floats apart, C's ldc; load_b(i, c) gives B row i's c-th vector).
// K . q (A the query rows, B the transposed keys, from zero) and P . V (A the probabilities, B the
// value rows, the running output rescaled by alpha) are both this product.
template <int RB, int NC, class LoadB>
static inline void rows_x_panel(const float* A, int lda, int n, float* C, int ldc, const float* alpha, LoadB load_b) {
  V acc[RB][NC];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const V a = alpha ? V::set1(alpha[r]) : V::zero();
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[r][c] = alpha ? V::mul(V::load(C + r * ldc + W * c), a) : V::zero();
  }
  for (int i = 0; i < n; ++i) {
    V b[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) b[c] = load_b(i, c);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const V ab = V::set1(A[r * lda + i]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[r][c] = V::fmadd(ab, b[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) V::store(C + r * ldc + W * c, acc[r][c]);
}

// P . V over tiles of up to kPvRows query rows and NC W output columns: tile(r0, rows, d0,
// std::integral_constant<int, NC>) multiplies one, NC from pv_cols(kPvRows) down to 1 at the
// row's end.  (F32Ops here and vec512's dpbf16 Bf16Ops differ only in the tile's kernel.)
template <class Tile>
static inline void pv_tiles(int R, int D, const Tile& tile) {
  constexpr int NC = pv_cols(kPvRows);
  for (int r0 = 0; r0 < R; r0 += kPvRows) {
    const int rb = std::min(kPvRows, R - r0);
    int d0 = 0;
    for (; d0 + NC * W <= D; d0 += NC * W) tile(r0, rb, d0, std::integral_constant<int, NC>{});
    if constexpr (NC > 2) {
      if (d0 + 2 * W <= D) {
        tile(r0, rb, d0, std::integral_constant<int, 2>{});
        d0 += 2 * W;
      }
    }
    for (; d0 < D; d0 += W) tile(r0, rb, d0, std::integral_constant<int, 1>{});
  }
}

// O[r][0, D) = O * alpha + P V for RB rows of fp32 probabilities (KT apart), the V rows read in
// place from the cache: bf16, or (I8) int8 with each key's V scale already folded into P.
template <int RB, bool I8>
static inline void pv_direct(const float* P, const void* const* vrows, int D, int Dp, int n, float* O, const float* alpha) {
  const auto pass = [&](int d0, auto cols) {
    rows_x_panel<RB, decltype(cols)::value>(P, KT, n, O + d0, Dp, alpha, [&](int j, int c) {
      if constexpr (I8) return V::load8(static_cast<const uint8_t*>(vrows[j]) + d0 + W * c, cpuserve::Elem8::kInt8);
      else return V::load_bf16(static_cast<const uint16_t*>(vrows[j]) + d0 + W * c);
    });
  };
  constexpr int NC = pv_cols(RB);
  int d0 = 0;
  for (; d0 + NC * W <= D; d0 += NC * W) pass(d0, std::integral_constant<int, NC>{});
  for (; d0 < D; d0 += W) pass(d0, std::integral_constant<int, 1>{});
}

// The tile operations (attention_common.h's contract) for any model dtype and cache kind.
struct F32Ops {
  static void begin(const AttnParams&, Scratch&, int) {}
  static void end() {}

  // Query rows widened to fp32 in natural order, Dp apart.
  __attribute__((noinline)) static void load_q(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    (void)ntok;
    float* q = static_cast<float*>(s.q);
    const int64_t esz = p.model_bf16 ? 2 : 4;
    const uint8_t* src = static_cast<const uint8_t*>(p.q);
    for (int r = 0; r < R; ++r)
      row_to_f32(src + q_offset(p, tok, kvh, r) * esz, p.model_bf16, KvKind::kSame, 1.f, false, p.D, p.Dp,
                 q + static_cast<int64_t>(r) * p.Dp);
  }

  // V rows widened to fp32 (s.v, [KT][Dp]); K rows widened (fp32 caches: read in place) and
  // transposed to s.kt, [D][KT].  Keys past n are zero.
  __attribute__((noinline)) static void prep_kv(const AttnParams& p, Scratch& s, const int32_t* bt_row, int kvh, int k0, int n) {
    const uint8_t* rows[KT];
    gather_rows(p, bt_row, kvh, k0, n, rows);
    const int D = p.D, Dp = p.Dp;
    const bool cache_bf16 = p.kv_kind == KvKind::kSame && p.model_bf16;
    const bool k_in_place = p.kv_kind == KvKind::kSame && !p.model_bf16;
    const float* krows[KT];
    float* v = static_cast<float*>(s.v);
    float* krow = static_cast<float*>(s.krow);
    for (int i = 0; i < KT; ++i) {
      float* vd = v + i * Dp;
      if (i >= n) {
        krows[i] = nullptr;
        for (int d = 0; d < Dp; d += W) V::store(vd + d, V::zero());
        continue;
      }
      const uint8_t* base = rows[i];
      if (k_in_place) {
        krows[i] = reinterpret_cast<const float*>(base);
      } else {
        row_to_f32(base, cache_bf16, p.kv_kind, row_k_scale(p, base), p.model_bf16, D, Dp, krow + i * Dp);
        krows[i] = krow + i * Dp;
      }
      row_to_f32(base + D * p.kv_elt, cache_bf16, p.kv_kind, row_v_scale(p, base), p.model_bf16, D, Dp, vd);
    }
    float* kt = static_cast<float*>(s.kt);
    for (int h = 0; h < KT / W; ++h) {
      if (h * W >= n) {
        for (int d = 0; d < D; ++d) V::store(kt + d * KT + h * W, V::zero());
        continue;
      }
      for (int c = 0; c < D / W; ++c) {
        V r[W];
        for (int i = 0; i < W; ++i) {
          const float* row = krows[h * W + i];
          r[i] = row ? V::load(row + c * W) : V::zero();
        }
        V::transpose(r);
        for (int j = 0; j < W; ++j) V::store(kt + (c * W + j) * KT + h * W, r[j]);
      }
    }
  }

  // s.S = Q K^T, panels of 2 W keys (panels past n: zero, their scores are masked).
  __attribute__((noinline)) static void qk(const AttnParams& p, Scratch& s, int R, int n) {
    const float* q = static_cast<const float*>(s.q);
    const float* kt = static_cast<const float*>(s.kt);
    const int qs = p.Dp, D = p.D;
    for (int k = 0; k < KT; k += 2 * W) {
      float* S = s.S + k;
      if (k >= n) {
        for (int r = 0; r < R; ++r) V::store(S + r * KT, V::zero()), V::store(S + r * KT + W, V::zero());
        continue;
      }
      const auto load_k = [&](int d, int c) { return V::load(kt + d * KT + k + W * c); };
      int r0 = 0;
      for (; r0 + kQkRows <= R; r0 += kQkRows) rows_x_panel<kQkRows, 2>(q + r0 * qs, qs, D, S + r0 * KT, KT, nullptr, load_k);
      if (r0 < R)
        with_rows_upto<kQkRows - 1>(R - r0, [&](auto rows) {
          rows_x_panel<decltype(rows)::value, 2>(q + r0 * qs, qs, D, S + r0 * KT, KT, nullptr, load_k);
        });
    }
  }

  __attribute__((noinline)) static void softmax(const AttnParams& p, Scratch& s, int R, int k0, int n, bool masked) {
    fp32_softmax(p, s, R, k0, n, masked);
  }

  __attribute__((noinline)) static void pv(const AttnParams& p, Scratch& s, int R, int n) {
    const int Dp = p.Dp;
    const float* P = static_cast<const float*>(s.P);
    const float* v = static_cast<const float*>(s.v);
    pv_tiles(R, p.D, [&](int r0, int rb, int d0, auto cols) {
      with_rows_upto<kPvRows>(rb, [&](auto rows) {
        rows_x_panel<decltype(rows)::value, decltype(cols)::value>(
            P + r0 * KT, KT, n, s.O + static_cast<int64_t>(r0) * Dp + d0, Dp, s.alpha + r0,
            [&](int j, int c) { return V::load(v + j * Dp + d0 + W * c); });
      });
    });
  }

  // Output rows O / l in the model dtype.
  __attribute__((noinline)) static void store(const AttnParams& p, Scratch& s, int tok, int ntok, int kvh, int R) {
    (void)ntok;
    for (int r = 0; r < R; ++r) {
      const int64_t off = o_offset(p, tok, kvh, r);
      const V inv = V::set1(1.0f / s.l[r]);
      const float* o = s.O + static_cast<int64_t>(r) * p.Dp;
      if (p.model_bf16) {
        uint16_t* dst = static_cast<uint16_t*>(p.out) + off;
        for (int d = 0; d < p.D; d += W) V::store_bf16(dst + d, V::mul(V::load(o + d), inv));
      } else {
        float* dst = static_cast<float*>(p.out) + off;
        for (int d = 0; d < p.D; d += W) V::store(dst + d, V::mul(V::load(o + d), inv));
      }
    }
  }
};
