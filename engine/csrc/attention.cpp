// Paged attention for the CPU backend (engine/attention/dispatch.py); the KV-cache writes are in
// kv_cache.cpp.
//
// ISAs (chosen per call by the Python dispatch, checked here against the CPU):
//   vec256   AVX2 + FMA + F16C, fp32 arithmetic (bf16 / fp8 / int8 widened on load)
//   vec512   AVX-512 F/BW/VL + BF16: bf16 dot products with _mm512_dpbf16_ps, or fp32 FMAs;
//            over an int8 cache, VNNI int8 products (decode: Q K^T and P V; prompts: Q K^T)
//   amx      AMX-BF16 tiles for Q K^T and P V (units of >= amx_min_rows() query rows:
//            prefill tiles and decode GQA groups); smaller units take vec512
//   amx_emu  the amx path on a software model of the tiles (tests on non-AMX hosts)
// The tile loop is in attention_common.h; the fp32-FMA tile operations are written once over a
// vector type in attention_fma_impl.h, stamped out for AVX2 and AVX-512 in attention_vec256.h and
// attention_vec512.h beside each ISA's own specialisations (dpbf16 products, in-place decode
// reads); the int8 cache's VNNI products in attention_vnni.h; the AMX tiles in attention_amx.h.
// Every ISA function carries its own GCC target, so this file builds without -march flags and
// runs on any x86-64 CPU.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "amx_emu.h"
#include "amx_tiles.h"
#include "isa.h"
#include "vec.h"
#include "attention_common.h"
#include "attention_vec256.h"
#include "attention_vec512.h"
#include "attention_vnni.h"
#include "ops.h"

// ------------------------------------------------------------------ AMX, real tiles

#if CPUSERVE_HAVE_AMX
CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AMX_BF16)
namespace cpuserve_attn {
namespace amx {
// tileloadd's asm statement declares no memory input: fence the compiler so the
// scratch stores feeding a tile are emitted before it (tilestored clobbers memory).
#define AMX_CFG(c)                       \
  do {                                   \
    __asm__ volatile("" ::: "memory");   \
    _tile_loadconfig(c);                 \
  } while (0)
#define AMX_LOAD(t, ptr, stride)         \
  do {                                   \
    __asm__ volatile("" ::: "memory");   \
    _tile_loadd(t, ptr, stride);         \
  } while (0)
#define AMX_STORE(t, ptr, stride) _tile_stored(t, ptr, stride)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMX_RELEASE() _tile_release()
#include "attention_amx.h"
#undef AMX_CFG
#undef AMX_LOAD
#undef AMX_STORE
#undef AMX_ZERO
#undef AMX_DP
#undef AMX_RELEASE
}  // namespace amx
}  // namespace cpuserve_attn
CPUSERVE_TARGET_END
#endif  // CPUSERVE_HAVE_AMX

// ------------------------------------------------------------------ AMX, emulated tiles (amx_emu.h)

CPUSERVE_TARGET_BEGIN(CPUSERVE_ISA_AVX512_BF16)
namespace cpuserve_attn {
namespace amx_emu {
#define AMX_CFG(c) cpuserve_amx::emu::cfg(c)
#define AMX_LOAD(t, ptr, stride) cpuserve_amx::emu::load(t, ptr, stride)
#define AMX_STORE(t, ptr, stride) cpuserve_amx::emu::store(t, ptr, stride)
#define AMX_ZERO(t) cpuserve_amx::emu::zero(t)
#define AMX_DP(c, a, b) cpuserve_amx::emu::dp(c, a, b)
#define AMX_RELEASE() ((void)0)
#include "attention_amx.h"
#undef AMX_CFG
#undef AMX_LOAD
#undef AMX_STORE
#undef AMX_ZERO
#undef AMX_DP
#undef AMX_RELEASE
}  // namespace amx_emu
}  // namespace cpuserve_attn
CPUSERVE_TARGET_END

// ------------------------------------------------------------------ dispatch and planning
namespace cpuserve_attn {
namespace {

using cpuserve::cpu_supports;
using cpuserve::Isa;

using UnitFn = void (*)(const AttnParams&, const WorkUnit&, float*, const WorkUnit*, bool);

bool cpu_has_vec512() { return cpu_supports(Isa::kAvx512Bf16); }
// The int8 cache's decode path multiplies int8 keys and queries with vpdpbusd (AVX512-VNNI).
bool cpu_has_vnni() { return cpu_supports(Isa::kAvx512Vnni); }

// The names paged_attention's `isa` takes, and the path (isa.h) each one runs.
struct IsaName {
  const char* name;
  Isa isa;
};
constexpr IsaName kIsaNames[] = {
    {"vec256", Isa::kAvx2}, {"vec512", Isa::kAvx512Bf16}, {"amx", Isa::kAmxBf16}, {"amx_emu", Isa::kAmxBf16Emu}};

Isa parse_isa(const std::string& name) {
  for (const IsaName& n : kIsaNames) {
    if (name != n.name) continue;
    TORCH_CHECK(cpu_supports(n.isa), "attention isa ", name, " needs ", cpuserve::isa_name(n.isa),
                " (AMX: with Linux's permission and a compiler with AMX intrinsics)");
    return n.isa;
  }
  TORCH_CHECK(false, "unknown attention isa: ", name);
}

// Query rows (tokens x GQA group) from which a unit is worth AMX tiles; below, vec512.  Not yet
// tuned on hardware: attention_set_amx_min_rows (engine/native.py, CPUSERVE_ATTN_AMX_MIN_ROWS) sets it.
int g_amx_min_rows = 4;

int amx_min_rows() { return g_amx_min_rows; }

// vec512 with a bf16 model: dpbf16 (Bf16DecodeOps, Bf16Ops) or FMAs on bf16 widened to fp32
// (Bf16FmaDecodeOps; F32Ops's tiles for larger units over a bf16 cache).  Two FMAs do a dpbf16's
// 32 multiply-adds, so FMAs win where a dpbf16 costs more than ~2 FMAs.  Chosen by timing both
// once (v512::dpbf16_fma_time_ratio) unless attention_set_bf16_dot pins one (engine/native.py from
// CPUSERVE_ATTN_BF16_DOT, and tests).  -1: time both; 0: dpbf16; 1: fma.
int g_forced_bf16_dot = -1;

bool bf16_with_fma() {
  if (g_forced_bf16_dot >= 0) return g_forced_bf16_dot == 1;
  static const bool fma = v512::dpbf16_fma_time_ratio() > 2.0;
  return fma;
}

UnitFn unit_fn(Isa isa, const AttnParams& p, int R) {
  const bool bf16 = p.model_bf16;
  // Decode units over an int8 cache: vec512's VNNI path reads the rows as they are, where AMX tiles
  // would first dequantise every 32-key tile to bf16 for a handful of query rows.
  const bool int8_vnni = p.kv_kind == KvKind::kI8 && cpu_has_vnni();
  const bool int8_decode = int8_vnni && R <= v512::Int8DecodeOps::kMaxRows;
  switch (isa) {
    case Isa::kAmxBf16:
#if CPUSERVE_HAVE_AMX
      if (bf16 && R >= amx_min_rows() && !int8_decode) return &run_unit<amx::Ops>;
#endif
      break;
    case Isa::kAmxBf16Emu:
      if (bf16) return &run_unit<amx_emu::Ops>;
      break;
    case Isa::kAvx2:
      if (bf16 && p.kv_kind == KvKind::kSame && R <= v256::DecodeOps::kMaxRows) return &run_unit<v256::DecodeOps>;
      if (p.kv_kind == KvKind::kI8 && R <= v256::Int8DecodeOps::kMaxRows) return &run_unit<v256::Int8DecodeOps>;
      return &run_unit<v256::F32Ops>;
    case Isa::kAvx512Bf16:
      break;
  }
  if (int8_decode) return &run_unit<v512::Int8DecodeOps>;
  // Prompt units over an int8 cache: K . q on VNNI, P . V in fp32 FMAs, or in dpbf16 for a bf16 model
  // where a dpbf16 costs about one FMA (bf16_with_fma false).
  if (int8_vnni && R <= RMAX)
    return bf16 && !bf16_with_fma() ? &run_unit<v512::Int8PrefillOps<true>> : &run_unit<v512::Int8PrefillOps<false>>;
  if (!bf16) return &run_unit<v512::F32Ops>;
  const bool fma = bf16_with_fma();
  if (R <= v512::Bf16DecodeOps::kMaxRows) return fma ? &run_unit<v512::Bf16FmaDecodeOps> : &run_unit<v512::Bf16DecodeOps>;
  return fma && (p.kv_kind == KvKind::kSame || p.kv_kind == KvKind::kI8) ? &run_unit<v512::F32Ops> : &run_unit<v512::Bf16Ops>;
}

// Parts to split a unit's `extent` keys into, when `ngroups` such units share `nt` threads: the
// count that minimises the busiest thread's tiles, a split costing SPLIT_COST_TILES more (all
// units taken as alike).  On many cores long contexts split into about as many parts as there
// are threads per unit.
int split_count(int64_t ngroups, int nt, int extent) {
  if (nt <= 1) return 1;
  const int64_t tiles = (extent + KT - 1) / KT;
  int best = 1;
  int64_t best_cost = (ngroups + nt - 1) / nt * tiles;
  for (int s = 2; s <= tiles && s <= 4 * nt; ++s) {
    const int64_t cost = (ngroups * s + nt - 1) / nt * ((tiles + s - 1) / s) + SPLIT_COST_TILES;
    if (cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

struct Merge {
  int req, kvh, t0, t1, nsplit;
  int64_t part_off;
};

// Combine a long context's splits: O = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s.
void merge_splits(const AttnParams& p, const Merge& mg, const float* partials) {
  const int G = p.G, D = p.D, R = (mg.t1 - mg.t0) * G;
  const int64_t row_stride = D + 2, split_stride = static_cast<int64_t>(R) * row_stride;
  const int tok = p.qsl[mg.req] + mg.t0;
  float acc[256];
  for (int r = 0; r < R; ++r) {
    const float* base = partials + mg.part_off + r * row_stride;
    float M = -std::numeric_limits<float>::infinity();
    for (int s = 0; s < mg.nsplit; ++s) M = std::max(M, base[s * split_stride + D]);
    float L = 0.f;
    std::fill(acc, acc + D, 0.f);
    for (int s = 0; s < mg.nsplit; ++s) {
      const float* part = base + s * split_stride;
      if (part[D] == -std::numeric_limits<float>::infinity()) continue;
      const float w = std::exp(part[D] - M);
      L += w * part[D + 1];
      for (int d = 0; d < D; ++d) acc[d] += w * part[d];
    }
    const float inv = 1.f / L;
    const int64_t off = o_offset(p, tok, mg.kvh, r);
    if (p.model_bf16) {
      c10::BFloat16* dst = static_cast<c10::BFloat16*>(p.out) + off;
      for (int d = 0; d < D; ++d) dst[d] = c10::BFloat16(acc[d] * inv);
    } else {
      float* dst = static_cast<float*>(p.out) + off;
      for (int d = 0; d < D; ++d) dst[d] = acc[d] * inv;
    }
  }
}

}  // namespace
}  // namespace cpuserve_attn

namespace cpuserve_attn {
namespace {

// What paged attention derives from a step's batch alone: the validated metadata cut into work
// units.  Every layer of a model has the same heads, head size and cache shape, so one plan per
// step serves all of them (attention_plan, then paged_attention_planned on each layer).
struct PlanHeader {
  int64_t magic;
  int64_t isa;
  int64_t H, Hkv, D, B, NB, T, nreq;
  const void* qsl;  // the metadata tensors the plan was built from (checked on each use)
  const void* sl;
  const void* bt;
  int64_t bt_s;
  int64_t nt;  // threads the units were split for
  int64_t nu, nm, part_size;
};
constexpr int64_t kPlanMagic = 0x6e616c7061747461;  // "attnplan"

struct BatchPlan {
  PlanHeader h{};
  std::vector<WorkUnit> units;
  std::vector<Merge> merges;
};

void check_metadata(const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table) {
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu(), "metadata tensors must be int32 on CPU");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() && block_table.dim() == 2 &&
                  block_table.stride(1) == 1,
              "metadata tensors must be contiguous");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_table.size(0) >= seq_lens.size(0),
              "metadata sizes disagree");
}

// Validates the batch against the cache's shape and splits it into work units for `isa`.
void plan_batch(Isa isa, int64_t H, int64_t T, const at::Tensor& kv_cache, const at::Tensor& query_start_loc,
                const at::Tensor& seq_lens, const at::Tensor& block_table, BatchPlan& plan) {
  TORCH_CHECK(kv_cache.dim() == 4, "kv cache must be [blocks, kv_heads, block, 2 * head_size]");
  const int D = kv_cache.size(3) / 2;
  check_kv_cache(kv_cache, D);
  const int Hkv = kv_cache.size(1), B = kv_cache.size(2);
  const int64_t NB = kv_cache.size(0);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(D % 16 == 0 && D <= 256, "native attention needs head_size % 16 == 0 and <= 256, got ", D);
  check_metadata(query_start_loc, seq_lens, block_table);
  const int nreq = seq_lens.size(0);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_s = block_table.stride(0);
  const bool amx = isa == Isa::kAmxBf16 || isa == Isa::kAmxBf16Emu;
  const int G = H / Hkv;
  // AMX prompt units take AMX_UNIT_ROWS query rows: every unit converts its keys' K and V tiles for
  // all of its rows, so larger units convert each key fewer times.  The vec512 prompt paths keep
  // UNIT_ROWS: their fp32 O and S rows outgrow L1 beyond it.
  const int unit_rows = amx ? AMX_UNIT_ROWS : UNIT_ROWS;
  const int mtok = std::max(1, unit_rows / G);

  const int64_t maxb = block_table.size(1);
  int64_t ngroups = 0;
  for (int i = 0; i < nreq; ++i) {
    const int q0 = qsl[i], q1 = qsl[i + 1], seq = sl[i];
    TORCH_CHECK(0 <= q0 && q0 <= q1 && q1 <= T, "query_start_loc out of range at request ", i);
    const int qlen = q1 - q0;
    if (qlen == 0) continue;
    TORCH_CHECK(seq >= qlen, "seq_len ", seq, " shorter than query length ", qlen, " at request ", i);
    const int nblk = (seq + B - 1) / B;
    TORCH_CHECK(nblk <= maxb, "block table too short for request ", i);
    const int32_t* row = bt + i * bt_s;
    for (int b = 0; b < nblk; ++b) TORCH_CHECK(row[b] >= 0 && row[b] < NB, "block id out of range at request ", i);
    ngroups += static_cast<int64_t>((qlen + mtok - 1) / mtok) * Hkv;
  }
  const int nt = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
  plan.h = PlanHeader{kPlanMagic, static_cast<int64_t>(isa), H, Hkv, D, B, NB, T, nreq, qsl, sl, bt, bt_s, nt, 0, 0, 0};
  if (ngroups == 0) return;

  // Work units: (request, kv head, <= unit_rows query rows); contexts split across threads
  // (flash decoding) when that shortens the busiest thread's share (split_count).
  std::vector<WorkUnit>& units = plan.units;
  std::vector<Merge>& merges = plan.merges;
  units.reserve(ngroups);
  int64_t part_size = 0;
  for (int i = 0; i < nreq; ++i) {
    const int qlen = qsl[i + 1] - qsl[i];
    const int ctx_off = sl[i] - qlen;
    for (int t0 = 0; t0 < qlen; t0 += mtok) {
      const int t1 = std::min(qlen, t0 + mtok);
      const int R = (t1 - t0) * G;
      const int extent = ctx_off + t1;  // keys visible to the last row
      const int want = split_count(ngroups, nt, extent);
      int split_len = extent, nsplit = 1;
      if (want > 1) {
        split_len = (extent + want - 1) / want;
        split_len = (split_len + KT - 1) / KT * KT;
        nsplit = (extent + split_len - 1) / split_len;  // >= 2: split_count keeps want <= tiles
      }
      for (int h = 0; h < Hkv; ++h) {
        if (nsplit == 1) {
          units.push_back({i, h, t0, t1, 0, extent, -1, static_cast<int64_t>(extent + KT) * (R + 4)});
          continue;
        }
        merges.push_back({i, h, t0, t1, nsplit, part_size});
        for (int s = 0; s < nsplit; ++s) {
          const int kb = s * split_len, ke = std::min(extent, kb + split_len);
          units.push_back({i, h, t0, t1, kb, ke, part_size, static_cast<int64_t>(ke - kb + KT) * (R + 4)});
          part_size += static_cast<int64_t>(R) * (D + 2);
        }
      }
    }
  }
  if (nt > 1)
    std::stable_sort(units.begin(), units.end(), [](const WorkUnit& a, const WorkUnit& b) { return a.cost > b.cost; });
  plan.h.nu = units.size();
  plan.h.nm = merges.size();
  plan.h.part_size = part_size;
}

// Runs a plan's units on one layer: its query, cache and output (shapes checked against the plan).
void run_plan(const PlanHeader& h, const WorkUnit* units, const Merge* merges, const at::Tensor& query,
              const at::Tensor& kv_cache, double scale, double k_scale, double v_scale, at::Tensor& output) {
  const Isa isa = static_cast<Isa>(h.isa);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_size], last dim contiguous");
  TORCH_CHECK(output.sizes() == query.sizes() && output.stride(2) == 1 && output.scalar_type() == query.scalar_type(),
              "output must match query");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "query dtype must be bf16 or fp32");
  TORCH_CHECK(query.size(0) == h.T && query.size(1) == h.H && query.size(2) == h.D,
              "query shape does not match the attention plan");
  check_kv_cache(kv_cache, h.D);
  TORCH_CHECK(kv_cache.size(0) == h.NB && kv_cache.size(1) == h.Hkv && kv_cache.size(2) == h.B,
              "kv cache shape does not match the attention plan");
  const bool bf16 = dtype == at::kBFloat16;
  const bool amx = isa == Isa::kAmxBf16 || isa == Isa::kAmxBf16Emu;
  TORCH_CHECK(bf16 || !amx, "amx attention needs bf16");
  if (h.nu == 0) return;

  AttnParams p;
  p.q = query.data_ptr();
  p.q_st = query.stride(0);
  p.q_sh = query.stride(1);
  p.out = output.data_ptr();
  p.o_st = output.stride(0);
  p.o_sh = output.stride(1);
  p.kv = static_cast<const uint8_t*>(kv_cache.data_ptr());
  p.kv_elt = kv_cache.element_size();
  p.kv_so = kv_cache.stride(2);
  p.kv_sh = kv_cache.stride(1);
  p.kv_sb = kv_cache.stride(0);
  p.bt = static_cast<const int32_t*>(h.bt);
  p.bt_s = h.bt_s;
  p.qsl = static_cast<const int32_t*>(h.qsl);
  p.sl = static_cast<const int32_t*>(h.sl);
  p.H = h.H;
  p.Hkv = h.Hkv;
  p.G = h.H / h.Hkv;
  p.D = h.D;
  p.Dp = (h.D + 31) / 32 * 32;
  p.B = h.B;
  p.scale = static_cast<float>(scale);
  p.k_scale = static_cast<float>(k_scale);
  p.v_scale = static_cast<float>(v_scale);
  p.kv_kind = kv_kind_of(kv_cache, dtype);
  p.model_bf16 = bf16;
  const int G = p.G;
  const int unit_rows = amx ? AMX_UNIT_ROWS : UNIT_ROWS;
  p.rows_cap = (std::max(unit_rows, G) + 15) / 16 * 16;

  static thread_local std::vector<float> partials;
  if (static_cast<int64_t>(partials.size()) < h.part_size) partials.resize(h.part_size);
  float* part = partials.data();
  const int64_t nu = h.nu, nm = h.nm;
  const int nt = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
  const int errors_before = cpuserve_amx::emu::g_errors.load();
  if (nt == 1 || nu == 1) {
    for (int64_t u = 0; u < nu; ++u) {
      const WorkUnit& w = units[u];
      unit_fn(isa, p, (w.t1 - w.t0) * G)(p, w, part, u + 1 < nu ? &units[u + 1] : nullptr, u > 0);
    }
    for (int64_t m = 0; m < nm; ++m) merge_splits(p, merges[m], part);
  } else {
    // Dynamic scheduling, with each thread claiming its next units before it runs the last of the
    // current ones, so that it can prefetch that unit's cache lines meanwhile.  Units are claimed
    // Hkv at a time when there are enough of them (at least 4 claims a thread): a request's kv
    // heads are consecutive units whose rows lie side by side in every block, so one thread then
    // reads each block's rows in one sweep.
    std::atomic<int64_t> claimed{0};
    const int64_t chunk = nu >= 4 * nt * p.Hkv ? p.Hkv : 1;
#pragma omp parallel  // the whole team: nt threads (work_spans.h: Team size)
    {
      int64_t c0 = claimed.fetch_add(chunk, std::memory_order_relaxed);
      bool prefetched = false;
      while (c0 < nu) {
        const int64_t c1 = std::min(nu, c0 + chunk);
        int64_t n0 = nu;
        for (int64_t u = c0; u < c1; ++u) {
          int64_t next = u + 1;
          if (next == c1) next = n0 = claimed.fetch_add(chunk, std::memory_order_relaxed);
          const WorkUnit& w = units[u];
          unit_fn(isa, p, (w.t1 - w.t0) * G)(p, w, part, next < nu ? &units[next] : nullptr, prefetched);
          prefetched = true;
        }
        c0 = n0;
      }
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t m = 0; m < nm; ++m) merge_splits(p, merges[m], part);
    }
  }
  if (isa == Isa::kAmxBf16Emu) TORCH_CHECK(cpuserve_amx::emu::g_errors.load() == errors_before, "emulated AMX tile shape error");
}

}  // namespace
}  // namespace cpuserve_attn

void paged_attention(const std::string& isa_name, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                     int64_t num_decodes, int64_t max_query_len, int64_t max_seq_len, double scale, double k_scale,
                     double v_scale, at::Tensor output) {
  using namespace cpuserve_attn;
  (void)num_decodes;
  (void)max_query_len;
  (void)max_seq_len;
  const Isa isa = parse_isa(isa_name);
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, head_size], last dim contiguous");
  BatchPlan plan;
  plan_batch(isa, query.size(1), query.size(0), kv_cache, query_start_loc, seq_lens, block_table, plan);
  run_plan(plan.h, plan.units.data(), plan.merges.data(), query, kv_cache, scale, k_scale, v_scale, output);
}

at::Tensor attention_plan(const std::string& isa_name, int64_t num_heads, int64_t num_tokens, const at::Tensor& kv_cache,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table) {
  using namespace cpuserve_attn;
  BatchPlan plan;
  plan_batch(parse_isa(isa_name), num_heads, num_tokens, kv_cache, query_start_loc, seq_lens, block_table, plan);
  const int64_t ub = plan.h.nu * sizeof(WorkUnit), mb = plan.h.nm * sizeof(Merge);
  at::Tensor out = at::empty({static_cast<int64_t>(sizeof(PlanHeader)) + ub + mb}, at::kByte);
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::memcpy(dst, &plan.h, sizeof(PlanHeader));
  if (ub) std::memcpy(dst + sizeof(PlanHeader), plan.units.data(), ub);
  if (mb) std::memcpy(dst + sizeof(PlanHeader) + ub, plan.merges.data(), mb);
  return out;
}

void paged_attention_planned(const at::Tensor& plan, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             const at::Tensor& block_table, double scale, double k_scale, double v_scale,
                             at::Tensor output) {
  using namespace cpuserve_attn;
  TORCH_CHECK(plan.scalar_type() == at::kByte && plan.is_contiguous() &&
                  plan.numel() >= static_cast<int64_t>(sizeof(PlanHeader)),
              "not an attention plan");
  const uint8_t* src = plan.data_ptr<uint8_t>();
  PlanHeader h;
  std::memcpy(&h, src, sizeof(PlanHeader));
  TORCH_CHECK(h.magic == kPlanMagic &&
                  plan.numel() == static_cast<int64_t>(sizeof(PlanHeader) + h.nu * sizeof(WorkUnit) + h.nm * sizeof(Merge)),
              "not an attention plan");
  TORCH_CHECK(query_start_loc.data_ptr() == h.qsl && seq_lens.data_ptr() == h.sl && block_table.data_ptr() == h.bt,
              "the attention plan was built from other metadata tensors");
  // Aligned: torch allocates at 64 bytes, and the header's size is a multiple of 8.
  const WorkUnit* units = reinterpret_cast<const WorkUnit*>(src + sizeof(PlanHeader));
  const Merge* merges = reinterpret_cast<const Merge*>(src + sizeof(PlanHeader) + h.nu * sizeof(WorkUnit));
  run_plan(h, units, merges, query, kv_cache, scale, k_scale, v_scale, output);
}

std::vector<std::string> attention_isas() {
  using namespace cpuserve_attn;
  std::vector<std::string> out;
  for (const IsaName& n : kIsaNames)
    if (cpu_supports(n.isa)) out.push_back(n.name);
  return out;
}

std::string attention_bf16_dot() {
  using namespace cpuserve_attn;
  if (!cpu_has_vec512()) return "none";
  return bf16_with_fma() ? "fma" : "dpbf16";
}

int64_t attention_amx_min_rows() { return cpuserve_attn::amx_min_rows(); }

void attention_set_amx_min_rows(int64_t rows) {
  using namespace cpuserve_attn;
  g_amx_min_rows = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, 1 << 20)));
}

void attention_set_bf16_dot(const std::string& mode) {
  using namespace cpuserve_attn;
  TORCH_CHECK(mode == "auto" || mode == "dpbf16" || mode == "fma", "bf16 dot mode must be auto, dpbf16 or fma");
  g_forced_bf16_dot = mode == "auto" ? -1 : mode == "fma" ? 1 : 0;
}
