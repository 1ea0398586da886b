// Shared definitions of the paged-attention kernels (attention.cpp): parameters,
// per-thread scratch, and the tile loop every ISA runs.  Compiled for the baseline
// target: the per-ISA work (attention_fma_impl.h stamped out in attention_vec512.h and
// attention_vec256.h, beside their own specialisations; attention_amx.h)
// sits in functions with their own GCC target, called once per 32-key tile.
//
// Algorithm (flash attention over the paged cache):
//   a work unit = one request, one kv head, up to UNIT_ROWS (AMX: AMX_UNIT_ROWS) query
//   rows (tokens x the G query heads of that kv head, so GQA groups share every K/V
//   load), and a key range [kv_begin, kv_end).  Keys are visited 32 at a time (KT):
//   gathered from their blocks into a transposed K tile and a pair-interleaved V tile
//   (the layouts AVX-512 BF16 dot products and AMX tiles consume), scores S = Q K^T,
//   online softmax (running max m, sum l, rescale alpha), O = O * alpha + P V.
//   Long contexts with few units are split across threads (flash decoding); the
//   splits' (m, l, O) are merged afterwards.
#pragma once

#include <emmintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_cache.h"
#include "vec.h"

namespace cpuserve_attn {

constexpr int KT = 32;          // keys per tile
// Query rows (tokens x heads of one kv group) per prompt work unit: UNIT_ROWS, and AMX_UNIT_ROWS
// on the AMX path (why: where paged_attention picks between them, attention.cpp).
constexpr int UNIT_ROWS = 64;
constexpr int AMX_UNIT_ROWS = 192;
constexpr int RMAX = std::max(UNIT_ROWS, AMX_UNIT_ROWS);  // the per-row scratch arrays' capacity
// A context split across threads (flash decoding) costs a merge, a second barrier and a unit's
// set-up, about this many key tiles of work (split_count in attention.cpp).
constexpr int SPLIT_COST_TILES = 4;
constexpr int TOUCH_TILES = 8;  // tiles whose cache lines are loaded in one pass (64 KiB of bf16 K/V)

struct AttnParams {
  const void* q;  // [T, H, D], model dtype
  int64_t q_st, q_sh;
  void* out;  // [T, H, D], model dtype
  int64_t o_st, o_sh;
  const uint8_t* kv;      // cache base, [NB, Hkv, B, 2D] (rows dense; an int8 cache's scales follow each row)
  int64_t kv_elt;         // bytes per cache element
  int64_t kv_sb, kv_sh, kv_so;  // strides (elements) of block, kv head, offset (row)
  const int32_t* bt;      // block table [R, maxb]
  int64_t bt_s;
  const int32_t* qsl;     // query_start_loc [R + 1]
  const int32_t* sl;      // seq_lens [R]
  int H, Hkv, G, D, Dp, B;
  float scale, k_scale, v_scale;
  KvKind kv_kind;
  bool model_bf16;
  int rows_cap;  // scratch rows (multiple of 16)
};

// Element offsets, in the query and in the output, of a work unit's row r: a unit's rows are its
// tokens' G query heads of kv head kvh, token-major, from token tok.
inline int64_t q_offset(const AttnParams& p, int tok, int kvh, int r) {
  return (tok + r / p.G) * p.q_st + (kvh * p.G + r % p.G) * p.q_sh;
}
inline int64_t o_offset(const AttnParams& p, int tok, int kvh, int r) {
  return (tok + r / p.G) * p.o_st + (kvh * p.G + r % p.G) * p.o_sh;
}

// Dequantisation scales of a cache row's K and V: an int8 cache's own, else the layer's (fp8).
inline float row_k_scale(const AttnParams& p, const uint8_t* row) {
  if (p.kv_kind != KvKind::kI8) return p.k_scale;
  float sc;
  std::memcpy(&sc, row + 2 * p.D, sizeof(float));
  return sc;
}
inline float row_v_scale(const AttnParams& p, const uint8_t* row) {
  if (p.kv_kind != KvKind::kI8) return p.v_scale;
  float sc;
  std::memcpy(&sc, row + 2 * p.D + sizeof(float), sizeof(float));
  return sc;
}

// Per-thread scratch, carved from one 64-byte aligned buffer.
struct Scratch {
  void* q;      // [rows_cap][Dp] compute dtype (bf16 or fp32), zero padded
  void* kt;     // K tile transposed: bf16 pairs [Dp/2][KT] int32, or fp32 [Dp][KT]
  void* v;      // V tile: bf16 pairs [KT/2][Dp] int32, or fp32 [KT][Dp]
  void* krow;   // dequantised/converted K rows [KT][Dp] (fp8 caches, vec256)
  void* vrow;   // same for V
  float* S;     // scores [rows_cap][KT]
  void* P;      // probabilities [rows_cap][KT], compute dtype
  float* O;     // running output [rows_cap][Dp]
  float* m;     // running max [rows_cap]
  float* l;     // running sum [rows_cap]
  float* alpha; // rescale of this tile [rows_cap]
  int* pos;     // position of each query row [rows_cap]
  const void* krows[KT];  // this tile's K / V rows (cache or dequantised), direct decode paths
  const void* vrows[KT];
  alignas(64) float ksc[KT];  // int8 decode path: this tile's K and V row scales (0 past n)
  alignas(64) float vsc[KT];
  float qsc[RMAX];            // int8 paths: query rows' int8 scales and sums of their int8 values
  int32_t qsum[RMAX];
  float psc[8];               // decode path: the scales of its probabilities rounded to u8
};

inline Scratch& thread_scratch(const AttnParams& p) {
  static thread_local std::vector<uint8_t> buf;
  static thread_local Scratch s;
  const size_t rows = p.rows_cap, Dp = p.Dp;
  const size_t sizes[] = {
      rows * Dp * 4,  // q
      Dp * KT * 4,    // kt
      KT * Dp * 4,    // v
      KT * Dp * 4,    // krow
      KT * Dp * 4,    // vrow
      rows * KT * 4,  // S
      rows * KT * 4,  // P
      rows * Dp * 4,  // O
      rows * 4, rows * 4, rows * 4, rows * 4,
  };
  size_t total = 64;
  for (size_t z : sizes) total += (z + 63) / 64 * 64;
  if (buf.size() < total) buf.assign(total, 0);
  uint8_t* base = buf.data();
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  void* ptrs[12];
  for (int i = 0; i < 12; ++i) {
    ptrs[i] = base;
    base += (sizes[i] + 63) / 64 * 64;
  }
  s.q = ptrs[0];
  s.kt = ptrs[1];
  s.v = ptrs[2];
  s.krow = ptrs[3];
  s.vrow = ptrs[4];
  s.S = static_cast<float*>(ptrs[5]);
  s.P = ptrs[6];
  s.O = static_cast<float*>(ptrs[7]);
  s.m = static_cast<float*>(ptrs[8]);
  s.l = static_cast<float*>(ptrs[9]);
  s.alpha = static_cast<float*>(ptrs[10]);
  s.pos = static_cast<int*>(ptrs[11]);
  return s;
}

// One work unit: query tokens [t0, t1) of request `req` (token offsets inside the
// request), kv head `kvh`, keys [kv_begin, kv_end).  part_off >= 0: write the
// unnormalised (O, m, l) of its rows there instead of the output (a split).
struct WorkUnit {
  int req, kvh, t0, t1;
  int kv_begin, kv_end;
  int64_t part_off;
  int64_t cost;
};

// The runs of key positions [k0, k1) that sit back to back in one block of kv head kvh:
// fn(first_row, i, m) for rows k0 + i .. k0 + i + m - 1, m <= B, rows kv_so elements apart.
// One division per call, then the block table in order (entries past k1's block unread).
template <class F>
inline void for_each_block_run(const AttnParams& p, const int32_t* bt_row, int kvh, int k0, int k1, F&& fn) {
  const uint8_t* head = p.kv + (static_cast<int64_t>(kvh) * p.kv_sh) * p.kv_elt;
  int b = k0 / p.B, off = k0 - b * p.B;
  for (int k = k0; k < k1;) {
    const int m = std::min(k1 - k, p.B - off);
    fn(head + (bt_row[b] * p.kv_sb + off * p.kv_so) * p.kv_elt, k - k0, m);
    k += m;
    off = 0;
    ++b;
  }
}

// Row pointers (K at [0, D), V at [D, 2D)) of key positions [k0, k0 + n).
inline void gather_rows(const AttnParams& p, const int32_t* bt_row, int kvh, int k0, int n, const uint8_t** rows) {
  const int64_t row_bytes = p.kv_so * p.kv_elt;
  for_each_block_run(p, bt_row, kvh, k0, k0 + n, [&](const uint8_t* first, int i, int m) {
    for (int j = 0; j < m; ++j) rows[i + j] = first + j * row_bytes;
  });
}

// Load every cache line of key positions [k0, k1) once, with plain independent loads,
// before the tiles that use them.  Decode reads each block's 4 KiB once and computes
// little on it, so the tile loop's dependent reads (and software prefetches, each of
// which holds one of the core's few L1 miss slots) kept few misses in flight and read at
// a fraction of the memory's bandwidth; this pass keeps many in flight and the tile loop then
// reads L1/L2.
// The blocks' lines are visited round-robin, kTouchStreams blocks at a time: several
// sequential streams keep the L2 streamers of more pages busy at once than one block
// after the other.
constexpr int kTouchStreams = 4;
inline void touch_rows(const AttnParams& p, const int32_t* bt_row, int kvh, int k0, int k1) {
  const int64_t row_bytes = p.kv_so * p.kv_elt;
  __m128i acc = _mm_setzero_si128();
  const uint8_t* start[kTouchStreams];
  int64_t lines[kTouchStreams];
  int ns = 0;
  auto flush = [&] {
    int64_t most = 0;
    for (int s = 0; s < ns; ++s) most = std::max(most, lines[s]);
    for (int64_t j = 0; j < most; ++j)
      for (int s = 0; s < ns; ++s)
        if (j < lines[s]) acc = _mm_or_si128(acc, _mm_loadu_si128(reinterpret_cast<const __m128i*>(start[s] + 64 * j)));
    ns = 0;
  };
  for_each_block_run(p, bt_row, kvh, k0, k1, [&](const uint8_t* first, int, int m) {
    start[ns] = first;
    lines[ns] = (m * row_bytes + 63) / 64;
    if (++ns == kTouchStreams) flush();
  });
  flush();
  static thread_local volatile int sink;  // keeps the loads
  sink = _mm_cvtsi128_si32(acc);
}

// The cache lines of the next unit a thread will run, prefetched into L2 a share per key tile of
// the unit it runs now, so that the next unit's reads overlap this one's arithmetic instead of
// following it (the touch pass above then runs only for a thread's first unit).
//
// Each tile's share goes out in kPrefetchSlices parts, one before each of the tile's four
// operations: a prefetch that finds every L1 miss slot busy stalls the core, so one burst of a
// tile's ~60 lines (32 int8 keys of ~196-key decodes) held the arithmetic until most had arrived,
// while ~15 lines drain during the operation that follows.
constexpr int kPrefetchSlices = 4;

class UnitLinePrefetch {
 public:
  // Plan `next`'s lines (none if null) over `tiles` key tiles: kPrefetchSlices calls of step() each.
  void plan(const AttnParams& p, const WorkUnit* next, int tiles) {
    p_ = &p;
    k_ = k1_ = 0;
    if (next == nullptr || tiles <= 0) return;
    head_ = p.kv + (static_cast<int64_t>(next->kvh) * p.kv_sh) * p.kv_elt;
    bt_row_ = p.bt + next->req * p.bt_s;
    k_ = next->kv_begin;
    k1_ = next->kv_end;
    int64_t total = 0;
    for_each_block_run(p, bt_row_, next->kvh, k_, k1_, [&](const uint8_t*, int, int m) { total += lines(m); });
    const int64_t steps = static_cast<int64_t>(tiles) * kPrefetchSlices;
    per_step_ = (total + steps - 1) / steps;
    if (k_ < k1_) open_run();
  }
  // Prefetch the next slice of lines.
  void step() {
    for (int64_t i = 0; i < per_step_ && k_ < k1_; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(run_ + 64 * line_), _MM_HINT_T1);
      if (++line_ == run_lines_) {
        k_ += run_rows_;
        if (k_ < k1_) open_run();
      }
    }
  }

 private:
  // Cache lines spanned by `rows` consecutive rows from a block's row.
  int64_t lines(int rows) const { return (rows * p_->kv_so * p_->kv_elt + 63) / 64; }
  // The rows from k_ to the end of its block (or k1_) sit back to back: one run of lines.
  void open_run() {
    const int b = k_ / p_->B, off = k_ - b * p_->B;
    run_rows_ = std::min(k1_ - k_, p_->B - off);
    run_ = head_ + (bt_row_[b] * p_->kv_sb + off * p_->kv_so) * p_->kv_elt;
    run_lines_ = lines(run_rows_);
    line_ = 0;
  }
  const AttnParams* p_ = nullptr;
  const uint8_t* head_ = nullptr;
  const uint8_t* run_ = nullptr;
  const int32_t* bt_row_ = nullptr;
  int64_t per_step_ = 0, run_lines_ = 0, line_ = 0;
  int k_ = 0, k1_ = 0, run_rows_ = 0;
};

// f(std::integral_constant<int, R>{}) for R = 1..MAX (larger R as MAX; MAX <= 8): kernels that take
// their row count as a template argument, so their accumulators live in registers, are called
// through this one switch.
template <int MAX, class F>
inline void with_rows_upto(int R, F&& f) {
  static_assert(MAX >= 1 && MAX <= 8, "row blocks of 1 to 8 rows");
  auto call = [&](auto rows) {
    if constexpr (decltype(rows)::value <= MAX) f(rows);
  };
  switch (R < MAX ? R : MAX) {
    case 1: return call(std::integral_constant<int, 1>{});
    case 2: return call(std::integral_constant<int, 2>{});
    case 3: return call(std::integral_constant<int, 3>{});
    case 4: return call(std::integral_constant<int, 4>{});
    case 5: return call(std::integral_constant<int, 5>{});
    case 6: return call(std::integral_constant<int, 6>{});
    case 7: return call(std::integral_constant<int, 7>{});
    default: return call(std::integral_constant<int, MAX>{});
  }
}

// Per-ISA operations the tile loop calls (static members of an Ops struct):
//   begin(p, s, R)                      once per unit (AMX: tile configuration)
//   load_q(p, s, tok, ntok, kvh, R)     query rows into s.q (zero padded)
//   prep_kv(p, s, bt_row, kvh, k0, n)   K/V tile of keys [k0, k0 + n), zero beyond n
//   qk(p, s, R, n)                      s.S = Q K^T (unscaled)
//   softmax(p, s, R, k0, n, masked)     online softmax: s.P, s.alpha, s.m, s.l
//   pv(p, s, R, n)                      s.O = s.O * alpha + P V
//   store(p, s, tok, ntok, kvh, R)      normalised output rows
//   end()                               once per unit
// `next`: the unit this thread runs after this one (prefetched during it; null if none);
// `prefetched`: this unit's lines were prefetched by the one before it, so it skips the touch pass.
template <class Ops>
void run_unit(const AttnParams& p, const WorkUnit& u, float* partials, const WorkUnit* next, bool prefetched) {
  Scratch& s = thread_scratch(p);
  const int G = p.G, Dp = p.Dp;
  const int ntok = u.t1 - u.t0;
  const int R = ntok * G;
  const int q_len = p.qsl[u.req + 1] - p.qsl[u.req];
  const int ctx_off = p.sl[u.req] - q_len;
  const int tok = p.qsl[u.req] + u.t0;
  const int32_t* bt_row = p.bt + u.req * p.bt_s;
  const int rows_pad = (R + 15) / 16 * 16;
  for (int r = 0; r < R; ++r) {
    s.pos[r] = ctx_off + u.t0 + r / G;
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.f;
  }
  std::memset(s.O, 0, sizeof(float) * rows_pad * Dp);
  const int min_pos = ctx_off + u.t0;
  Ops::begin(p, s, R);
  Ops::load_q(p, s, tok, ntok, u.kvh, R);
  UnitLinePrefetch ahead;
  ahead.plan(p, next, (u.kv_end - u.kv_begin + KT - 1) / KT);
  for (int k0 = u.kv_begin; k0 < u.kv_end; k0 += KT) {
    const int n = std::min(KT, u.kv_end - k0);
    if (!prefetched && (k0 - u.kv_begin) % (TOUCH_TILES * KT) == 0)
      touch_rows(p, bt_row, u.kvh, k0, std::min(u.kv_end, k0 + TOUCH_TILES * KT));
    ahead.step();
    Ops::prep_kv(p, s, bt_row, u.kvh, k0, n);
    ahead.step();
    Ops::qk(p, s, R, n);
    ahead.step();
    const bool masked = n < KT || k0 + KT - 1 > min_pos;
    Ops::softmax(p, s, R, k0, n, masked);
    ahead.step();
    Ops::pv(p, s, R, n);
  }
  Ops::end();
  if (u.part_off < 0) {
    Ops::store(p, s, tok, ntok, u.kvh, R);
  } else {
    // Split of a long context: unnormalised rows [O (D) | m | l], merged later.
    float* dst = partials + u.part_off;
    for (int r = 0; r < R; ++r) {
      std::memcpy(dst, s.O + static_cast<int64_t>(r) * Dp, sizeof(float) * p.D);
      dst[p.D] = s.m[r];
      dst[p.D + 1] = s.l[r];
      dst += p.D + 2;
    }
  }
}

}  // namespace cpuserve_attn
