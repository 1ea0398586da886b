// AMX int8 kernel of qlinear.cpp, for the row-scaled int8 weights (layout in qlinear.h).
//
// A row-int8 group-block (16 output rows x 32 k) is 8 chunks of 64 bytes, chunk c holding each
// row's bytes [4c, 4c + 4): that is AMX's B tile for K = 32, N = 16 (8 rows of 16 4-byte words),
// as stored.  A block of an activation tile (rows_tiled_q with 16-row tiles: h rows of 32 int8,
// stride 32) is the A tile, and one `tdpbsud` (signed activations x unsigned weights) yields the
// 16 x h int32 dot products for which the AVX-512 kernel issues 8 `vpdpbusd` per (row, group).
// The float work per block is unchanged, each row's sums converted and FMAed by the row's block
// scale in block order, and so is the epilogue: both paths give the same bits (tests/test_qlinear.py).
//
// Tiles, configured once per thread and call (rows R = min(m, 16)): tmm0/tmm1 A, tmm2/tmm3 B,
// tmm4/tmm5 C, for even/odd blocks, so that one block's product runs while earlier blocks' sums
// are stored and accumulated (see QL_AMX_STEP).  A last tile of h < R activation rows still loads
// R rows: rows past h read on into the scratch (run_groups keeps slack for it) and their sums are
// never used.
//
// Included by qlinear.cpp only, after its helpers (Problem, PrefetchTurn, store16_avx512).
#if CPUSERVE_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")

namespace qlinear {
namespace amx {

// tileloadd's asm statement declares no memory input: fence the compiler so that the activation
// stores feeding a tile are emitted before it (tilestored clobbers memory).
#define QL_TILE_LOAD(t, ptr, stride)   \
  do {                                 \
    __asm__ volatile("" ::: "memory"); \
    _tile_loadd(t, ptr, stride);       \
  } while (0)

// The tile configuration for one thread's share of a call (run_groups' per-thread scope); the
// tiles are released after it, as the attention kernels release theirs.
struct Tiles {
  explicit Tiles(const Problem& p) {
    cpuserve_amx::TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    const auto rows = static_cast<uint8_t>(std::min(p.m, kAmxRows));
    for (int i = 0; i < 2; ++i) {
      cfg.rows[i] = rows;  // A: rows x 32 int8
      cfg.colsb[i] = kBlock;
      cfg.rows[2 + i] = kBlock / 4;  // B: 8 x 16 words
      cfg.colsb[2 + i] = 64;
      cfg.rows[4 + i] = rows;  // C: rows x 16 int32
      cfg.colsb[4 + i] = 64;
    }
    __asm__ volatile("" ::: "memory");  // ldtilecfg's asm declares only 8 bytes of input
    _tile_loadconfig(&cfg);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// acc[t] += float(c row t) * d[t] for the tile's H activation rows.
template <int H>
inline void accumulate(__m512* acc, const int32_t* c, const float* d) {
#pragma GCC unroll 16
  for (int t = 0; t < H; ++t)
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * t)), _mm512_set1_ps(d[t]), acc[t]);
}

// The next group's block b into L2 on this pass's turn (see PrefetchTurn and rows_tile_avx512).
inline void prefetch_next_group(PrefetchTurn& turn, const uint8_t* next_group, int b) {
  if (!turn.next()) return;
  for (int off = 0; off < kRowsBlockBytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next_group + static_cast<int64_t>(b) * kRowsBlockBytes + off), _MM_HINT_T1);
}

// The A and B tiles' bytes of a block two ahead into L1 (past the last block harmlessly: prefetches
// never fault).
inline void prefetch_l1(const int8_t* a, const uint8_t* w) {
  for (int off = 0; off < kRowsBlockBytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(a + off), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + off), _MM_HINT_T0);
  }
}

// Block b's product on tile set S (A tile S, B tile BT = 2 + S, C tile CT = 4 + S), after
// accumulating block b - 2's sums from buffer S (stored one step ago: a vector load right after the
// tile store that wrote it waits for that store to reach the cache), and before storing block
// b - 1's C tile (CP, the other set's) into buffer 1 - S.  Tile numbers must be literals, hence a
// macro taking each.
#define QL_AMX_STEP(S, BT, CT, CP, b)                                        \
  do {                                                                       \
    if ((b) >= 2) accumulate<H>(acc, c[S], dt + ((b) - 2) * H);              \
    prefetch_next_group(turn, wg + gstride, b);                              \
    prefetch_l1(xt + ((b) + 2) * H * kBlock,                                \
                wg + static_cast<int64_t>((b) + 2) * kRowsBlockBytes);       \
    QL_TILE_LOAD(S, xt + (b) * H * kBlock, kBlock);                          \
    QL_TILE_LOAD(BT, wg + static_cast<int64_t>(b) * kRowsBlockBytes, 64);    \
    _tile_zero(CT);                                                          \
    _tile_dpbsud(CT, S, BT);                                                 \
    if ((b) >= 1) _tile_stored(CP, c[1 - (S)], 64);                          \
  } while (0)

// One group of 16 output rows against the H activation rows of the tile from row t0.
template <int H>
void rows_tile(const Problem& p, int64_t g, int t0, int pass, int passes) {
  const int nb = p.nb;
  const int64_t gstride = static_cast<int64_t>(nb) * kRowsBlockBytes;
  const uint8_t* wg = p.w + g * gstride;
  const int8_t* xt = p.xq + rows_tiled_q(p.k, t0, kAmxRows);
  const float* dt = p.xd + rows_tiled_d(nb, t0, kAmxRows);
  alignas(64) int32_t c[2][kAmxRows * 16];
  __m512 acc[H];
#pragma GCC unroll 16
  for (int t = 0; t < H; ++t) acc[t] = _mm512_setzero_ps();
  PrefetchTurn turn(pass, passes);
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    QL_AMX_STEP(0, 2, 4, 5, b);
    QL_AMX_STEP(1, 3, 5, 4, b + 1);
  }
  if (b < nb) QL_AMX_STEP(0, 2, 4, 5, b);
  // Left: block nb - 2 in buffer nb % 2 (if nb >= 2), block nb - 1 in C tile 4 + (nb - 1) % 2.
  if (nb >= 2) accumulate<H>(acc, c[nb % 2], dt + (nb - 2) * H);
  if (nb % 2) {
    _tile_stored(4, c[0], 64);
    accumulate<H>(acc, c[0], dt + (nb - 1) * H);
  } else {
    _tile_stored(5, c[1], 64);
    accumulate<H>(acc, c[1], dt + (nb - 1) * H);
  }
  const int64_t col = g * kGroupRows;
  const int valid = static_cast<int>(std::min<int64_t>(kGroupRows, p.n - col));
  const __m512 ws = _mm512_loadu_ps(p.wscale + col);
#pragma GCC unroll 16
  for (int t = 0; t < H; ++t)
    store16_avx512(p, t0 + t, col, valid, _mm512_mul_ps(_mm512_sub_ps(acc[t], _mm512_set1_ps(p.xcorr[t0 + t])), ws));
}

#undef QL_AMX_STEP

// The last tile's h (1..15) rows, by a compile-time H.
template <int... Hs>
void rows_tail(const Problem& p, int64_t g, int t0, int h, int pass, int passes, std::integer_sequence<int, Hs...>) {
  ((h == Hs + 1 ? rows_tile<Hs + 1>(p, g, t0, pass, passes) : void()), ...);
}

// Groups [g0, g1), one at a time, each against every 16-row activation tile in turn (the group's
// weights stay in L1 across the tiles).
void rows_range(const Problem& p, int64_t g0, int64_t g1) {
  const int passes = (p.m + kAmxRows - 1) / kAmxRows;
  for (int64_t g = g0; g < g1; ++g) {
    int t = 0, pass = 0;
    for (; t + kAmxRows <= p.m; t += kAmxRows, ++pass) rows_tile<kAmxRows>(p, g, t, pass, passes);
    if (t < p.m) rows_tail(p, g, t, p.m - t, pass, passes, std::make_integer_sequence<int, kAmxRows - 1>{});
  }
}

#undef QL_TILE_LOAD

}  // namespace amx
}  // namespace qlinear

#pragma GCC pop_options
#endif  // CPUSERVE_HAVE_AMX
