// The row-scaled int8 copy of a packed GGUF-block weight (both layouts in qlinear.h), built at load.
//
// engine/quant/weights.py (quantize_rows_int8) defines the conversion in torch ops (dequantize the
// blocks to float32, round each row to int8 against its largest magnitude), which at load costs
// seconds and full-size float32 temporaries.  This does the same arithmetic one row at a time, rows
// of a group in cache, groups split across threads, and must stay bit-identical to the torch
// definition (tests/engine/quant/test_qlinear.py compares them): the same float32 operations in the same order,
// separate multiplies and adds (no FMA: neither the baseline x86-64 target nor the AVX2 clone below
// enables one to contract them into), round half to even for torch.round.
#include "ops.h"
#include "qlinear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace qlinear;

// Row r of packed group `wg` (nb group-blocks of `qtype`) dequantized into row[k], as
// quant.py's dequantize_blocks (gguf.quants) computes it: d * (q - zero), plus m where the type
// has an offset (row_scale in qlinear.h).
inline __attribute__((always_inline)) void dequantize_row(const uint8_t* wg, int qtype, int nb, int r, float* row) {
  const Layout L = layout(qtype);
  uint8_t q[kBlock];
  for (int b = 0; b < nb; ++b) {
    const BlockRef br = block_at(wg, qtype, b);
    row_quants(br.q, qtype, r, q);
    float* out = row + b * kBlock;
    for (int h = 0; h < 2; ++h) {
      const RowScale rs = row_scale(br, qtype, r, h);
      for (int i = 16 * h; i < 16 * h + 16; ++i) {
        const float v = rs.d * static_cast<float>(static_cast<int>(q[i]) - L.zero);
        out[i] = L.has_m ? v + rs.m : v;
      }
    }
  }
}

// Largest |x| of row[0, k) (k a multiple of 32), in eight running maxima that vectorize.
inline __attribute__((always_inline)) float row_amax(const float* row, int64_t k) {
  float m[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < k; i += 8)
    for (int l = 0; l < 8; ++l) m[l] = std::max(m[l], std::fabs(row[i + l]));
  return *std::max_element(m, m + 8);
}

// x rounded to the nearest integer, ties to even, for |x| < 2^22: the float addition rounds in the
// current mode (nearest-even), and this vectorizes where a libm nearbyint call does not.
inline float round_even(float x) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  return (x + kMagic) - kMagic;
}

// Group g's 16 rows (those past n as padding) into the row-int8 layout; `row` holds k floats.
inline __attribute__((always_inline)) void convert_group(const uint8_t* w, int qtype, int64_t n, int64_t k, int64_t g,
                                                         float* row, uint8_t* out, float* sc) {
  const int64_t nb = k / kBlock;
  const int gbytes = group_block_bytes(qtype);
  uint8_t* og = out + g * nb * kRowsBlockBytes;
  for (int r = 0; r < kGroupRows; ++r) {
    const int64_t global = g * kGroupRows + r;
    if (global >= n) {  // padding rows: q = 0 (stored + 128), scale 0
      for (int64_t b = 0; b < nb; ++b)
        for (int c = 0; c < 8; ++c) std::fill_n(og + b * kRowsBlockBytes + c * 64 + r * 4, 4, uint8_t{128});
      continue;
    }
    dequantize_row(w + g * nb * gbytes, qtype, static_cast<int>(nb), r, row);
    const float d = row_amax(row, k) / 127.f;
    const float inv = d == 0.f ? 0.f : 1.f / d;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = row + b * kBlock;
      uint8_t q[kBlock];
      for (int i = 0; i < kBlock; ++i)
        q[i] = static_cast<uint8_t>(static_cast<int>(std::min(127.f, std::max(-127.f, round_even(xb[i] * inv)))) + 128);
      for (int c = 0; c < 8; ++c) std::memcpy(og + b * kRowsBlockBytes + c * 64 + r * 4, q + 4 * c, 4);
    }
    sc[global] = d;
  }
}

// The same code compiled for AVX2 vectorizes its loops (~2x faster); without FMA, so that its
// results stay bit-identical to the torch definition.
CPUSERVE_TARGET(CPUSERVE_ISA_AVX2_NO_FMA) void convert_group_avx2(const uint8_t* w, int qtype, int64_t n, int64_t k, int64_t g,
                                                         float* row, uint8_t* out, float* sc) {
  convert_group(w, qtype, n, k, g, row, out, sc);
}

}  // namespace

std::vector<torch::Tensor> qlinear_rows_from_packed(const torch::Tensor& packed, int64_t qtype, int64_t n, int64_t k) {
  TORCH_CHECK(qtype_known(static_cast<int>(qtype)), "qlinear_rows_from_packed: unsupported qtype ", qtype);
  TORCH_CHECK(n > 0 && k > 0 && k % (layout(static_cast<int>(qtype)).kquant ? kSuperBlocks * kBlock : kBlock) == 0,
              "qlinear_rows_from_packed: bad shape");
  const int64_t groups = (n + kGroupRows - 1) / kGroupRows, nb = k / kBlock;
  const int gbytes = group_block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == groups * nb * gbytes,
              "qlinear_rows_from_packed: packed weight does not match its shape");
  torch::Tensor data = torch::empty({groups * nb * kRowsBlockBytes}, packed.options());
  torch::Tensor scales = torch::zeros({groups * kGroupRows}, packed.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  uint8_t* out = data.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  static const bool avx2 = cpuserve::cpu_supports(cpuserve::kAvx2);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> row(k);
    for (int64_t g = g0; g < g1; ++g) {
      if (avx2)
        convert_group_avx2(w, static_cast<int>(qtype), n, k, g, row.data(), out, sc);
      else
        convert_group(w, static_cast<int>(qtype), n, k, g, row.data(), out, sc);
    }
  });
  return {data, scales};
}
