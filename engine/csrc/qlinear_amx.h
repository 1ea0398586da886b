// AMX int8 kernel of qlinear.cpp, for the row-scaled int8 weights (layout in qlinear.h).
//
// Two consecutive row-int8 group-blocks (16 output rows x 64 k) are 16 chunks of 64 bytes, chunk c
// holding each row's bytes [4c, 4c + 4): AMX's B tile for K = 64, N = 16 (16 rows of 16 4-byte
// words), as stored.  The activations come rounded to 15 bits per whole row (two int8 digit
// planes, one scale per row: Problem::act_rows16, layout rows16_q), so a row's products need no
// per-block scale: two `tdpbsud` per 64-k chunk (high and low digits) add into int32 C tiles over
// the whole of K, and the float work happens once per output, in the epilogue (per-32-block
// activations would need every block's sums stored and converted, which costs more than the tile
// products).  The 15-bit rows also round less than the 8-bit blocks (benchmarks.quality measures
// the path end to end).
//
// Tiles, configured once per thread and call (rows R = min(m, 16)): tmm0/tmm1 the A tiles (high
// and low digits of R rows x 64 k), tmm2/tmm3 two groups' B tiles, tmm4-7 their C tiles (high and
// low sums of each group).  A last tile of h < R activation rows still loads R rows: the rows16
// scratch pads the last tile to 16 rows, and their sums are never used.
//
// Included by qlinear.cpp only, after its helpers (Problem, rows16_q, store16_avx512).
#if CPUSERVE_HAVE_AMX
CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AMX_INT8)

namespace qlinear {
namespace amx {

// tileloadd's asm statement declares no memory input: fence the compiler so that the activation
// stores feeding a tile are emitted before it (tilestored clobbers memory).
#define QL_TILE_LOAD(t, ptr, stride)   \
  do {                                 \
    __asm__ volatile("" ::: "memory"); \
    _tile_loadd(t, ptr, stride);       \
  } while (0)

constexpr int kChunkBytes = kGroupRows * kChunk;  // one B tile: a group's 64-k chunk

// The tile configuration for one thread's share of a call (run_groups' per-thread scope); the
// tiles are released after it, as the attention kernels release theirs.
struct Tiles {
  explicit Tiles(const Problem& p) {
    cpuserve_amx::TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    const auto rows = static_cast<uint8_t>(std::min(p.m, kAmxRows));
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = t == 2 || t == 3 ? kChunk / 4 : rows;  // B: 16 x 16 words; A, C: rows x 64 bytes
      cfg.colsb[t] = 64;
    }
    __asm__ volatile("" ::: "memory");  // ldtilecfg's asm declares only 8 bytes of input
    _tile_loadconfig(&cfg);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// The first pass over a group pulls its weights from memory: each B tile into L1 this many chunks
// ahead.  Standalone, one thread, gate_up's shape at 32 rows with the weights in DRAM: 1.10-1.15x
// the speed without; prefetching the next groups into L2 on every pass's turn instead, as the
// AVX-512 kernel does, 0.95-0.97x.
constexpr int kPrefetchChunks = 2;

template <int NG>
inline void prefetch_chunk(const uint8_t* w, int64_t gstride) {
  for (int i = 0; i < NG; ++i)
    for (int off = 0; off < kChunkBytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + i * gstride + off), _MM_HINT_T0);
}

// NG (1 or 2) groups from g against the h activation rows of the tile from row t0.
template <int NG>
void rows16_tile(const Problem& p, int64_t g, int t0, int h, bool first_pass) {
  const int64_t chunks = p.k / kChunk;
  const int64_t gstride = static_cast<int64_t>(p.nb) * kRowsBlockBytes;
  const uint8_t* w0 = p.w + g * gstride;
  const uint8_t* w1 = w0 + gstride;
  const int8_t* xt = p.xq + rows16_q(p.k, t0);
  _tile_zero(4);
  _tile_zero(5);
  if (NG == 2) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    if (first_pass) prefetch_chunk<NG>(w0 + (c + kPrefetchChunks) * kChunkBytes, gstride);
    QL_TILE_LOAD(0, xt + rows16_chunk(c, 0), 64);
    QL_TILE_LOAD(1, xt + rows16_chunk(c, 1), 64);
    QL_TILE_LOAD(2, w0 + c * kChunkBytes, 64);
    _tile_dpbsud(4, 0, 2);
    _tile_dpbsud(5, 1, 2);
    if (NG == 2) {
      QL_TILE_LOAD(3, w1 + c * kChunkBytes, 64);
      _tile_dpbsud(6, 0, 3);
      _tile_dpbsud(7, 1, 3);
    }
  }
  alignas(64) int32_t sums[2 * NG][kAmxRows * 16];
  _tile_stored(4, sums[0], 64);
  _tile_stored(5, sums[1], 64);
  if (NG == 2) {
    _tile_stored(6, sums[2], 64);
    _tile_stored(7, sums[3], 64);
  }
  // Per output: the weights' +128 offset taken off each digit's sum (exact int32), then
  // (128 hi + lo) * (row scale * weight row scale), as rows16_group_scalar does.
  for (int i = 0; i < NG; ++i) {
    const int64_t col = (g + i) * kGroupRows;
    const int valid = static_cast<int>(std::min<int64_t>(kGroupRows, p.n - col));
    const __m512 ws = _mm512_loadu_ps(p.wscale + col);
    for (int t = 0; t < h; ++t) {
      const int32_t* xs = p.xsum + 2 * (t0 + t);
      const __m512i hi = _mm512_sub_epi32(_mm512_load_si512(sums[2 * i] + 16 * t), _mm512_set1_epi32(128 * xs[0]));
      const __m512i lo = _mm512_sub_epi32(_mm512_load_si512(sums[2 * i + 1] + 16 * t), _mm512_set1_epi32(128 * xs[1]));
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(128.f), _mm512_cvtepi32_ps(lo));
      store16_avx512(p, t0 + t, col, valid, _mm512_mul_ps(v, _mm512_mul_ps(_mm512_set1_ps(p.xd[t0 + t]), ws)));
    }
  }
}

// Groups [g0, g1) in pairs (a lone last group on its own), each pair against every 16-row
// activation tile in turn (the pair's weights stay in L1/L2 across the tiles).
void rows16_range(const Problem& p, int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + 2 <= g1; g += 2)
    for (int t = 0; t < p.m; t += kAmxRows) rows16_tile<2>(p, g, t, std::min(kAmxRows, p.m - t), t == 0);
  if (g < g1)
    for (int t = 0; t < p.m; t += kAmxRows) rows16_tile<1>(p, g, t, std::min(kAmxRows, p.m - t), t == 0);
}

#undef QL_TILE_LOAD

}  // namespace amx
}  // namespace qlinear

CPUSERVE_TARGET_END
#endif  // CPUSERVE_HAVE_AMX
