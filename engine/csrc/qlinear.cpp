// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W kept in packed GGUF blocks (see qlinear.h).
//
// llama.cpp's recipe: each 32-block of an activation row is quantized to int8 with one float scale
// (and its block sum, for Q4_1's offset and Q8_0's unsigned shift), then weight and activation
// quants meet in integer dot products (VNNI `vpdpbusd`, or AVX2 `vpmaddubsw`).  Decode is
// memory-bound, so the point is reading 4.5-8.5 bits per weight instead of 16; the int8 activation
// costs a small, measured accuracy loss (the README's quality tables).  The row-scaled int8 copies
// on AMX round each whole activation row to 15 bits instead (qlinear_amx.h says why).
//
// One build runs anywhere: every path carries a GCC `target` attribute and the best one is picked
// at run time.  The portable reference is in qlinear_scalar.h, the AVX-512 VNNI kernels in
// qlinear_avx512.h, the AVX2 ones in qlinear_avx2.h, the AMX row-int8 tiles in qlinear_amx.h;
// this file holds what they share (the problem, the activation layouts), the dispatch and the
// entry points.  Work splits over groups of 16 output rows across OpenMP threads (torch's own
// libgomp, so one thread pool), and the activation quantization happens inside the same parallel
// region.
#include "amx_tiles.h"
#include "ops.h"
#include "qlinear.h"
#include "vec.h"
#include "work_spans.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace qlinear {
namespace {

// ---------------------------------------------------------------- shared helpers

using cpuserve::bf16_to_float;
using cpuserve::float_to_bf16;

struct Problem {
  const uint8_t* w;
  int qtype;
  int64_t n, k;
  int nb;       // blocks per row = k / 32
  int64_t groups;
  int gbytes;   // bytes of one group-block
  int m;        // activation rows
  // Quantized activations, per row `ldq` bytes: each 32-block is `digits` planes of 32 int8
  // (1: q; 2: the high and low base-128 digits a, b of a 15-bit q = 128 a + b).  Per block:
  // xd scale (x ~ xd * q), xs = xd * sum(q) (Q4_1 / Q5_1's offsets), xsum = sum(q) (the zero
  // offsets, the K types' mins).  The AVX-512 kernels take them in tiles of `xtile` rows (ActTiles
  // below; 1: row after row).
  int digits;
  int64_t ldq;
  int xtile = 1;
  const int8_t* xq;
  const float* xd;
  const float* xs;
  const int32_t* xsum;
  // Split types only (Layout::split, Q6_K, Q3_K and Q2_K, K types): per row and block, the zero
  // offset times the digit sums of elements 0-15 and of 16-31, laid out as xd but two apiece: taken
  // off the halves' integer sums, as Q8_0's 128 * xsum is, so that q - zero costs no float work.
  // Q2_K has no zero offset: the sums as they are, which its per-half mins meet at the super-block's end.
  const int32_t* xsh = nullptr;
  // output [m, n] with row stride ldo; bias [n] or null
  void* out;
  int64_t ldo;
  bool out_bf16;
  const void* bias;
  bool bias_bf16;
  // Row-scaled int8 weights only: per output row scale [groups * 16]; per activation row
  // 128 * sum_b xs (what the weights' +128 offset adds to each dot product, in output units).
  const float* wscale = nullptr;
  const float* xcorr = nullptr;
  // Row-scaled int8 weights on the AMX kernel (act_bits 16 of qlinear_rows_forward): each
  // activation row is rounded to 15 bits with one scale for the whole row, so that the tiles sum
  // a whole row's products in int32 (no per-block float work).  xq in the layout of rows16_q below;
  // xd[r] the row's scale; xsum[2r], xsum[2r + 1] the row's high and low digit sums.
  bool act_rows16 = false;
  // Set for qlinear_argmax / qlinear_rows_argmax: the epilogue keeps each row's maxima here instead of storing.
  struct ArgmaxLanes* amax = nullptr;
};

// Greedy decoding's argmax, fused into the logits' epilogue (qlinear_argmax, qlinear_rows_argmax): per activation
// row, 16 lanes (column modulo 16) of the largest value seen and its column, one set per thread;
// nothing is stored, so the logits are never written and read back.  Ties keep the smaller column, since threads may take groups out of order, so the
// answer is torch.argmax's first maximum; a NaN is only flagged (the caller then takes the logits).
struct ArgmaxLanes {
  float* best;  // [m][16], 64-byte aligned
  int32_t* col;  // [m][16]
  bool nan = false;
};

// The merge of every thread's lanes: row r's first maximum.
inline int64_t argmax_merge(const std::vector<ArgmaxLanes>& lanes, int r) {
  float best = -std::numeric_limits<float>::infinity();
  int32_t col = std::numeric_limits<int32_t>::max();
  for (const ArgmaxLanes& a : lanes)
    for (int l = 0; l < 16; ++l) {
      const float v = a.best[r * 16 + l];
      const int32_t c = a.col[r * 16 + l];
      if (v > best || (v == best && c < col)) best = v, col = c;
    }
  return col;
}

// Which blocks of a weight group this pass over it prefetches ahead: the kernels pass over a group
// once per tile of activation rows, and pass p of `passes` takes blocks p, p + passes, ...  Issued
// again on every pass, the same prefetches cost issue slots and bunched into the first pass, whose
// loads then waited behind them.
class PrefetchTurn {
 public:
  PrefetchTurn(int pass, int passes) : phase_(pass), passes_(passes) {}
  // Call once per block, in order: true where this pass prefetches.  A negative pass never does.
  bool next() {
    if (phase_ == 0) {
      phase_ = passes_ - 1;
      return true;
    }
    --phase_;
    return false;
  }

 private:
  int phase_, passes_;
};

// Activation row quantization, identical arithmetic on every path: d = amax / qmax,
// q = nearbyint(x * (1 / d)) (ties to even, the SIMD conversion's rounding).  One digit: qmax = 127,
// q is the int8.  Two digits: qmax = 127 * 128, q = 128 a + b with a = nearbyint(q / 128) in
// [-127, 127] and b in [-64, 64], both int8 planes; error 1/32512 of the block's amax (vs 1/254).
constexpr float kQmax8 = 127.f, kQmax16 = 127.f * 128.f;

// The high base-128 digit of a 15-bit q (the low one is q - 128 * high), every two-digit
// quantizer's rule.
inline int high_digit(int q) { return static_cast<int>(std::nearbyint(static_cast<float>(q) * (1.f / 128.f))); }

// Where one row's blocks go: block b's digits at q + b * q_stride; its scale d and digit sums s
// and sum at [b * d_stride] (ActTiles below).  `span` blocks in a run share one scale, that of
// their joint amax: 1, or kSuperBlocks for K-quant weights (llama.cpp's Q8_K), whose kernels then
// apply it once per super-block instead of once per block (act_span).  s is d * sum (what the
// Q4_1 / Q5_1 offsets multiply).
struct QuantRow {
  const void* x;
  bool bf16;
  int64_t k;
  int digits;
  int8_t* q;
  float* d;  // d, s and sum of block b at [b * d_stride]
  float* s;
  int32_t* sum;
  int64_t q_stride;
  int d_stride;
  int span = 1;
  // s for a block of scale d and digit sum `sum`.
  float s_of(float d, int32_t sum) const { return d * static_cast<float>(sum); }
};

// Blocks per activation scale for weights of `qtype`.
constexpr int act_span(int qtype) { return layout(qtype).kquant ? kSuperBlocks : 1; }

// Quantized activation rows in tiles of `rows` rows: tile T holds rows rows * T onwards, h of
// them (rows, or fewer in the last tile), block by block, each block the h rows' digit planes back
// to back; the per-block scales and sums likewise [T][block][h].  Row r's block b is at
// q(r) + b * h * block_bytes() and its scale at d(r) + b * h.  The AVX-512 kernels take the rows of
// a tile (or of a part of one) behind one pointer with constant offsets: with a row stride, the row
// pointers and their per-block address arithmetic spilled general registers in their block loops.
// rows = 1 is plain row after row, as the scalar and AVX2 paths take them.
struct ActTiles {
  int rows;
  int64_t k;
  int digits;
  int nb() const { return static_cast<int>(k / kBlock); }
  int block_bytes() const { return kBlock * digits; }
  int height(int m, int r) const { return std::min(rows, m - r / rows * rows); }
  int64_t q(int r) const { return static_cast<int64_t>(r / rows) * rows * k * digits + r % rows * block_bytes(); }
  int64_t d(int r) const { return static_cast<int64_t>(r / rows) * rows * nb() + r % rows; }
};

// The tile heights: the row-scaled kernel's (8-bit activations) and the block kernel's by digits.
constexpr int kRowsTile = 6;
constexpr int block_tile_rows(int digits) { return digits == 1 ? 8 : 4; }

// Per-row 15-bit activations (Problem::act_rows16), for AMX's A tiles: tiles of 16 rows (the last
// one padded to 16 in the scratch), each a run of 64-k chunks, each chunk the 16 rows' high digits
// (16 x 64 bytes, one A tile) then their low digits.  Row r's chunk c, digit plane d (0 high, 1
// low) is at rows16_q(k, r) + rows16_chunk(c, d).
constexpr int kAmxRows = 16;
constexpr int kChunk = 64;
inline int64_t rows16_q(int64_t k, int r) { return static_cast<int64_t>(r / kAmxRows) * kAmxRows * k * 2 + r % kAmxRows * kChunk; }
constexpr int64_t kRows16Low = kAmxRows * kChunk;  // a chunk's low digits, after its high ones
inline int64_t rows16_chunk(int64_t c, int d) { return (2 * c + d) * kRows16Low; }
inline int64_t rows16_q_bytes(int64_t m, int64_t k) { return (m + kAmxRows - 1) / kAmxRows * kAmxRows * k * 2; }

// Calls f(std::integral_constant<int, QT>{}) for a runtime qtype: the one switch from a qtype to
// the kernels' template instantiations.
template <typename F>
inline void dispatch_qtype(int qtype, const F& f) {
  switch (qtype) {
    case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); break;
    case kQ5_0: f(std::integral_constant<int, kQ5_0>{}); break;
    case kQ5_1: f(std::integral_constant<int, kQ5_1>{}); break;
    case kQ2_K: f(std::integral_constant<int, kQ2_K>{}); break;
    case kQ3_K: f(std::integral_constant<int, kQ3_K>{}); break;
    case kQ4_K: f(std::integral_constant<int, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int, kQ5_K>{}); break;
    case kQ6_K: f(std::integral_constant<int, kQ6_K>{}); break;
    case kIQ4_NL: f(std::integral_constant<int, kIQ4_NL>{}); break;
    case kIQ3_S: f(std::integral_constant<int, kIQ3_S>{}); break;
    case kIQ3_XXS: f(std::integral_constant<int, kIQ3_XXS>{}); break;
    case kIQ4_XS: f(std::integral_constant<int, kIQ4_XS>{}); break;
    default: f(std::integral_constant<int, kQ8_0>{}); break;
  }
}

}  // namespace
}  // namespace qlinear

#include "qlinear_scalar.h"

namespace qlinear {
namespace {

// ---------------------------------------------------------------- AVX2 paths (with and without AVX-VNNI)
//
// Same layout, 256-bit halves: rows 0-7 of a group are the low 32 bytes of each chunk, rows 8-15
// the high 32.  Without VNNI, Q4 products go through `vpmaddubsw` (8 of them summed in int16 cannot
// overflow: 8 * 2 * 15 * 127 < 32768) and Q8_0 through the sign trick on signed weights.

CPUSERVE_TARGET(CPUSERVE_ISA_AVX2) inline __m256 load_x8_avx2(const void* x, bool bf16, int64_t i) {
  if (bf16) return cpuserve::Vec256::load_bf16_ps(static_cast<const uint16_t*>(x) + i);
  return _mm256_loadu_ps(static_cast<const float*>(x) + i);
}

// int32 -> int8 of 32 values keeping order (packs interleave 128-bit lanes; a permute fixes that)
CPUSERVE_TARGET(CPUSERVE_ISA_AVX2) inline void store_q32_avx2(int8_t* dst, const __m256i* q) {
  const __m256i w01 = _mm256_packs_epi32(q[0], q[1]);
  const __m256i w23 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bytes);
}

CPUSERVE_TARGET(CPUSERVE_ISA_AVX2) void quantize_row_avx2(const QuantRow& r) {
  const int nb = static_cast<int>(r.k / kBlock);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const float qmax = r.digits == 2 ? kQmax16 : kQmax8;
  float d = 0.f, id = 0.f;
  for (int b = 0; b < nb; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load_x8_avx2(r.x, r.bf16, static_cast<int64_t>(b) * kBlock + 8 * i);
    if (b % r.span == 0) {  // the scale of blocks [b, b + span)
      __m256 mx = _mm256_setzero_ps();
      for (int64_t j = static_cast<int64_t>(b) * kBlock; j < static_cast<int64_t>(b + r.span) * kBlock; j += 8)
        mx = _mm256_max_ps(mx, _mm256_and_ps(load_x8_avx2(r.x, r.bf16, j), absmask));
      d = cpuserve::Vec256::hmax(mx) / qmax;
      id = d != 0.f ? 1.f / d : 0.f;
    }
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
      sum = _mm256_add_epi32(sum, q[i]);
    }
    int8_t* qb = r.q + b * r.q_stride;
    if (r.digits == 2) {
      __m256i hi[4], lo[4];
      for (int i = 0; i < 4; ++i) {
        hi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), _mm256_set1_ps(1.f / 128.f)));
        lo[i] = _mm256_sub_epi32(q[i], _mm256_slli_epi32(hi[i], 7));
      }
      store_q32_avx2(qb, hi);
      store_q32_avx2(qb + kBlock, lo);
    } else {
      store_q32_avx2(qb, q);
    }
    const int32_t s = cpuserve::Vec256::hsum_i32(sum);
    r.d[b * r.d_stride] = d;
    r.sum[b * r.d_stride] = s;
    r.s[b * r.d_stride] = r.s_of(d, s);
  }
}

CPUSERVE_TARGET(CPUSERVE_ISA_AVX2) inline void store8(const Problem& p, int t, int64_t col, int valid, __m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int i = 0; i < valid; ++i) store1_scalar(p, t, col + i, tmp[i]);
}

}  // namespace
}  // namespace qlinear

#include "qlinear_avx512.h"

#define QL_NS avx2_plain
#define QL_TARGET CPUSERVE_TARGET(CPUSERVE_ISA_AVX2)
#define QL_VNNI 0
#include "qlinear_avx2.h"
#undef QL_NS
#undef QL_TARGET
#undef QL_VNNI

#define QL_NS avx2_vnni
#define QL_TARGET CPUSERVE_TARGET(CPUSERVE_ISA_AVX_VNNI)
#define QL_VNNI 1
#include "qlinear_avx2.h"
#undef QL_NS
#undef QL_TARGET
#undef QL_VNNI

#include "qlinear_amx.h"

namespace qlinear {
namespace {

// ---------------------------------------------------------------- dispatch

// The paths of this file (isa.h values kScalar..kAmxInt8) that this CPU runs.
bool isa_supported(int isa) { return isa >= kScalar && isa <= kAmxInt8 && cpuserve::cpu_supports(isa); }

// The block kernels' best path (kAmxInt8 runs the row-int8 weights only).
int best_isa() {
  static const int best = [] {
    for (int isa = kAvx512Vnni; isa > kScalar; --isa)
      if (isa_supported(isa)) return isa;
    return static_cast<int>(kScalar);
  }();
  return best;
}

// Activation elements from which the threads of the product's region quantize their share of the
// rows (then meet at a barrier) instead of the calling thread quantizing them all first.
constexpr int64_t kParallelQuantElems = 16 * 1024;
// Threads share a product's weight groups in units of about 1/kUnitsPerThread of a thread's share
// (see work_spans.h), an even number of groups: the row-int8 kernel walks groups in pairs.
constexpr int64_t kUnitsPerThread = 64;

struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, s, corr;
  std::vector<int32_t> sum, sh;
};

}  // namespace
}  // namespace qlinear

using namespace qlinear;

std::vector<int64_t> qlinear_isas() {
  std::vector<int64_t> out;
  for (int isa = kScalar; isa <= kAvx512Vnni; ++isa)
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

std::vector<int64_t> qlinear_rows_isas() {
  std::vector<int64_t> out;
  for (int isa : {kScalar, kAvx512Vnni, kAmxInt8})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

int64_t qlinear_best_isa() { return best_isa(); }

namespace {

// What a thread holds while it runs its share of a call's groups: nothing, or (AMX) its tiles.
struct NoScope {
  explicit NoScope(const Problem&) {}
};

// Shared by both entry points: quantize x's rows (digits int8 planes per 32-block, into the
// calling thread's scratch; with row-scaled weights, p.wscale set, also each row's xcorr), then
// run `range(problem, g0, g1)` over the weight's 16-row groups, split across threads in stealable
// spans, each thread inside a `Scope` made from the problem.  `weight_bytes` sizes the thread count.
// With `argmax` the result is each row's first maximum (int64 [M]; empty if a NaN came up) instead
// of the product, each thread's problem pointing at its own ArgmaxLanes.
template <typename Scope = NoScope, typename RangeFn>
torch::Tensor run_groups(const torch::Tensor& x, int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias,
                         int isa, int digits, int64_t weight_bytes, bool out_float32, Problem& p, const RangeFn& range,
                         bool argmax = false) {
  const bool row_corrections = p.wscale != nullptr && !p.act_rows16;
  TORCH_CHECK(k % kBlock == 0, "qlinear: in_features must be a multiple of 32");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "qlinear: x must be [M, ", k, "]");
  TORCH_CHECK(x.device().is_cpu(), "qlinear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qlinear: x must be float32 or bfloat16");
  TORCH_CHECK(isa_supported(isa), "qlinear: instruction set path ", isa, " not supported here");
  TORCH_CHECK(!argmax || n < std::numeric_limits<int32_t>::max(), "qlinear: argmax columns must fit int32");
  const int64_t groups = (n + kGroupRows - 1) / kGroupRows;
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t m = xc.size(0);
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  torch::Tensor out = argmax ? torch::empty({m}, xc.options().dtype(at::kLong))
                             : torch::empty({m, n}, xc.options().dtype(out_float32 ? at::kFloat : xc.scalar_type()));
  if (m == 0) return out;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && (b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16),
                "qlinear: bias must be float32 or bfloat16 with ", n, " elements");
  }

  const int nb = static_cast<int>(k / kBlock);
  static thread_local Scratch tls_scratch;
  Scratch& scratch = tls_scratch;  // the caller's buffers, also inside the parallel region
  const size_t q_bytes = static_cast<size_t>(p.act_rows16 ? rows16_q_bytes(m, k) : m * k * digits);
  if (scratch.q.size() < q_bytes) scratch.q.resize(q_bytes);
  if (scratch.d.size() < static_cast<size_t>(m * nb)) {
    scratch.d.resize(m * nb);
    scratch.s.resize(m * nb);
    scratch.sum.resize(m * nb);
  }
  if (row_corrections && scratch.corr.size() < static_cast<size_t>(m)) scratch.corr.resize(m);
  const bool half_sums = !row_corrections && !p.act_rows16 && layout(p.qtype).split;
  if (half_sums && scratch.sh.size() < static_cast<size_t>(2 * m * nb)) scratch.sh.resize(2 * m * nb);

  p.n = n;
  p.k = k;
  p.nb = nb;
  p.groups = groups;
  p.m = static_cast<int>(m);
  p.digits = digits;
  p.ldq = k * digits;
  // The activations' layout: the row-scaled kernels' tiles, the AVX-512 block kernel's, or rows.
  p.xtile = row_corrections ? kRowsTile : (!p.act_rows16 && isa == kAvx512Vnni) ? block_tile_rows(digits) : 1;
  const ActTiles tiles{p.xtile, k, digits};
  p.xq = scratch.q.data();
  p.xd = scratch.d.data();
  p.xs = scratch.s.data();
  p.xsum = scratch.sum.data();
  p.xcorr = row_corrections ? scratch.corr.data() : nullptr;
  p.xsh = half_sums ? scratch.sh.data() : nullptr;
  p.out = argmax ? nullptr : out.data_ptr();
  p.ldo = n;
  p.out_bf16 = out.scalar_type() == at::kBFloat16;
  p.bias = b.defined() ? b.data_ptr() : nullptr;
  p.bias_bf16 = b.defined() && b.scalar_type() == at::kBFloat16;

  const char* xbase = static_cast<const char*>(xc.data_ptr());
  const int64_t xrow_bytes = xc.stride(0) * xc.element_size();
  auto quant_row = [&](int64_t r) {
    if (p.act_rows16) {
      int8_t* q = scratch.q.data() + rows16_q(k, static_cast<int>(r));
      if (isa >= kAvx512Vnni)
        quantize_row16_avx512(xbase + r * xrow_bytes, bf16, k, q, scratch.d.data() + r, scratch.sum.data() + 2 * r);
      else
        quantize_row16_scalar(xbase + r * xrow_bytes, bf16, k, q, scratch.d.data() + r, scratch.sum.data() + 2 * r);
      return;
    }
    const int row = static_cast<int>(r), h = tiles.height(static_cast<int>(m), row);
    const int64_t at = tiles.d(row);
    const QuantRow qr{xbase + r * xrow_bytes, bf16, k, digits, scratch.q.data() + tiles.q(row), scratch.d.data() + at,
                      scratch.s.data() + at, scratch.sum.data() + at, static_cast<int64_t>(h) * tiles.block_bytes(), h,
                      act_span(p.qtype)};
    if (isa >= kAvx512Vnni)
      quantize_row_avx512(qr);
    else if (isa >= kAvx2)
      quantize_row_avx2(qr);
    else
      quantize_row_scalar(qr);
    if (half_sums)  // the digit sums of each block's two halves (split types' offsets, Q2_K's mins)
      for (int b = 0, f = layout(p.qtype).zero ? layout(p.qtype).zero : 1; b < nb; ++b) {
        const int8_t* qb = qr.q + b * qr.q_stride;
        int32_t first = 0;
        for (int i = 0; i < 16; ++i) first += digits == 2 ? 128 * qb[i] + qb[kBlock + i] : qb[i];
        scratch.sh[2 * (at + b * h)] = f * first;
        scratch.sh[2 * (at + b * h) + 1] = f * (qr.sum[b * h] - first);
      }
    if (row_corrections) {
      float c = 0.f;
      for (int i = 0; i < nb; ++i) c += qr.s[i * h];
      scratch.corr[r] = 128.f * c;
    }
  };

  const int threads = cpuserve_par::product_threads(groups, weight_bytes * m);
  const bool parallel = threads > 1 && !omp_in_parallel();
  // Small activations are quantized up front by the calling thread (a few microseconds at most), so
  // the region has no barrier inside.  From 16K elements the region's threads split the rows, so
  // that the others do not wait while one thread quantizes them all.
  const bool quant_inside = parallel && m * k >= kParallelQuantElems;
  if (!quant_inside)
    for (int64_t r = 0; r < m; ++r) quant_row(r);
  const int teams = parallel ? threads : 1;
  std::vector<ArgmaxLanes> lanes;
  torch::Tensor lane_data;
  if (argmax) {
    // Each thread's values, then its columns: m * 64 bytes apiece, so no two threads share a line.
    lane_data = torch::empty({teams * 2 * m * 16}, xc.options().dtype(at::kFloat));
    for (int i = 0; i < teams; ++i) {
      float* best = lane_data.data_ptr<float>() + 2 * i * m * 16;
      int32_t* col = reinterpret_cast<int32_t*>(best + m * 16);
      std::fill_n(best, m * 16, -std::numeric_limits<float>::infinity());
      std::fill_n(col, m * 16, std::numeric_limits<int32_t>::max());
      lanes.push_back({best, col});
    }
  }
  auto finish = [&]() {
    if (!argmax) return out;
    int64_t* ids = out.data_ptr<int64_t>();
    for (const ArgmaxLanes& a : lanes)
      if (a.nan) return torch::empty({0}, out.options());
    for (int64_t r = 0; r < m; ++r) ids[r] = argmax_merge(lanes, static_cast<int>(r));
    return out;
  };
  if (!parallel) {
    Scope scope(p);
    if (argmax) p.amax = &lanes[0];
    range(p, int64_t{0}, groups);
    p.amax = nullptr;
    return finish();
  }
  const int64_t unit = std::max<int64_t>(2, (groups / (threads * kUnitsPerThread) + 1) & ~int64_t{1});
  cpuserve_par::WorkSpans spans((groups + unit - 1) / unit, threads);
#pragma omp parallel  // the whole team, the work on its first `threads` (work_spans.h: Team size)
  {
    const int me = omp_get_thread_num(), nt = std::min(threads, omp_get_num_threads());
    if (quant_inside) {
      if (me < nt)
        for (int64_t r = m * me / nt; r < m * (me + 1) / nt; ++r) quant_row(r);
#pragma omp barrier
    }
    if (me < nt) {
      Problem mine = p;
      if (argmax) mine.amax = &lanes[me];
      Scope scope(mine);
      spans.run(me, [&](int64_t u) { range(mine, u * unit, std::min(groups, (u + 1) * unit)); });
    }
  }
  return finish();
}

int resolve_isa(int64_t isa) { return static_cast<int>(isa < 0 ? best_isa() : isa); }

}  // namespace

namespace {

// qlinear_forward, or with `argmax` qlinear_argmax.
torch::Tensor packed_product(const torch::Tensor& x, const torch::Tensor& packed, int64_t qtype, int64_t n, int64_t k,
                             const c10::optional<torch::Tensor>& bias, int64_t isa, int64_t act_bits, bool out_float32,
                             bool argmax) {
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "qlinear: act_bits must be 8 or 16");
  TORCH_CHECK(qtype_known(static_cast<int>(qtype)), "qlinear: unsupported qtype ", qtype);
  TORCH_CHECK(!layout(static_cast<int>(qtype)).kquant || k % (kSuperBlocks * kBlock) == 0,
              "qlinear: K-quant weights need in_features divisible by 256");
  const int64_t groups = (n + kGroupRows - 1) / kGroupRows;
  const int gbytes = group_block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == groups * (k / kBlock) * gbytes,
              "qlinear: packed weight does not match its shape and qtype");
  const int path = resolve_isa(isa);
  TORCH_CHECK(path <= kAvx512Vnni, "qlinear: amx-int8 runs row-int8 weights only (qlinear_rows_forward)");
  Problem p;
  p.w = packed.data_ptr<uint8_t>();
  p.qtype = static_cast<int>(qtype);
  p.gbytes = gbytes;
  return run_groups(x, n, k, bias, path, act_bits == 16 ? 2 : 1, packed.numel(), out_float32, p,
                    [&](const Problem& q, int64_t g0, int64_t g1) {
                      if (path == kAvx512Vnni) {
                        group_range_avx512(q, g0, g1);
                        return;
                      }
                      for (int64_t g = g0; g < g1; ++g) {
                        switch (path) {
                          case kAvxVnni: avx2_vnni::group_dispatch(q, g); break;
                          case kAvx2: avx2_plain::group_dispatch(q, g); break;
                          default: group_scalar(q, g); break;
                        }
                      }
                    }, argmax);
}

}  // namespace

torch::Tensor qlinear_forward(const torch::Tensor& x, const torch::Tensor& packed, int64_t qtype, int64_t n,
                              int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                              int64_t act_bits, bool out_float32) {
  return packed_product(x, packed, qtype, n, k, bias, isa, act_bits, out_float32, false);
}

torch::Tensor qlinear_argmax(const torch::Tensor& x, const torch::Tensor& packed, int64_t qtype, int64_t n, int64_t k,
                             const c10::optional<torch::Tensor>& bias, int64_t isa, int64_t act_bits) {
  return packed_product(x, packed, qtype, n, k, bias, isa, act_bits, true, true);
}

namespace {

// qlinear_rows_forward, or with `argmax` qlinear_rows_argmax.
torch::Tensor rows_product(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, int64_t n,
                           int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa, bool out_float32,
                           int64_t act_bits, bool argmax) {
  const int64_t groups = (n + kGroupRows - 1) / kGroupRows;
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == groups * (k / kBlock) * kRowsBlockBytes,
              "qlinear_rows: packed weight does not match its shape");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == groups * kGroupRows,
              "qlinear_rows: scales must be float32 [", groups * kGroupRows, "]");
  static const int best = static_cast<int>(qlinear_rows_isas().back());
  int path = isa >= 0 ? static_cast<int>(isa) : best;
  // AMX multiplies 64-k chunks and sums a row's digit products in int32: |127 * 255 * k| < 2^31
  constexpr int64_t kRows16MaxK = 65536;
  if (isa < 0 && path == kAmxInt8 && (k % kChunk != 0 || k > kRows16MaxK)) path = kAvx512Vnni;
  TORCH_CHECK(path == kScalar || path == kAvx512Vnni || path == kAmxInt8,
              "qlinear_rows: paths are scalar, avx512-vnni and amx-int8");
  const int bits = act_bits != 0 ? static_cast<int>(act_bits) : path == kAmxInt8 ? 16 : 8;
  TORCH_CHECK(bits == 8 || bits == 16, "qlinear_rows: act_bits must be 0 (the path's own), 8 or 16");
  TORCH_CHECK(path == kScalar || (path == kAmxInt8) == (bits == 16),
              "qlinear_rows: amx-int8 takes 16-bit row activations, avx512-vnni 8-bit block ones");
  TORCH_CHECK(bits == 8 || (k % kChunk == 0 && k <= kRows16MaxK),
              "qlinear_rows: 16-bit row activations need in_features divisible by 64 and at most ", kRows16MaxK);
  Problem p;
  p.w = packed.data_ptr<uint8_t>();
  p.qtype = 0;
  p.gbytes = kRowsBlockBytes;
  p.wscale = scales.data_ptr<float>();
  p.act_rows16 = bits == 16;
#if CPUSERVE_HAVE_AMX
  if (path == kAmxInt8)
    return run_groups<amx::Tiles>(x, n, k, bias, path, 2, packed.numel(), out_float32, p,
                                  [&](const Problem& q, int64_t g0, int64_t g1) { amx::rows16_range(q, g0, g1); }, argmax);
#endif
  return run_groups(x, n, k, bias, path, p.act_rows16 ? 2 : 1, packed.numel(), out_float32, p,
                    [&](const Problem& q, int64_t g0, int64_t g1) {
                      if (path == kAvx512Vnni) {
                        rows_range_avx512(q, g0, g1);
                      } else {
                        for (int64_t g = g0; g < g1; ++g)
                          q.act_rows16 ? rows16_group_scalar(q, g) : rows_group_scalar(q, g);
                      }
                    }, argmax);
}

}  // namespace

torch::Tensor qlinear_rows_forward(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                   int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                                   bool out_float32, int64_t act_bits) {
  return rows_product(x, packed, scales, n, k, bias, isa, out_float32, act_bits, false);
}

torch::Tensor qlinear_rows_argmax(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                  int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                                  int64_t act_bits) {
  return rows_product(x, packed, scales, n, k, bias, isa, true, act_bits, true);
}
