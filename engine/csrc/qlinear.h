// Packed low-bit weights for small-batch (decode) matmuls: layout shared by every ISA path.
//
// A weight [N, K] in a GGUF block format is stored as groups of 16 output rows; a group holds its
// K/32 "group-blocks" (32 weights of each of the 16 rows) back to back, so one group is one
// sequential stream.  Inside a group-block the quants of the 16 rows are interleaved in 4-byte
// words: chunk c (64 bytes) = for row r = 0..15 the bytes [4c, 4c+4) of that row's quant bytes.
// A 512-bit vector of a chunk thus holds 4 quant bytes per row in lane r, and one `vpdpbusd`
// against 4 activation bytes broadcast to every lane adds 4 products into each row's lane: 16 rows
// advance at once, and the per-block scales are per-lane vectors.
//
// Quant bytes of a row's 32-block: Q8_0 32 bytes (q XOR 0x80, i.e. q + 128 as unsigned); every
// other type 16 nibble bytes, byte i holding element i (low nibble) and element 16 + i (high), the
// low 4 bits of the unsigned quant q, then (5- and 6-bit types) the high bits in a plane of 1 or 2
// chunks, arranged so that a nibble chunk's high bits come out with one shift and mask:
//   Q5 (1 chunk): byte j of row r's word, bit c = bit 4 of element 4c + j, bit 4 + c = bit 4 of
//                 element 16 + 4c + j (c = 0..3, the nibble chunk)
//   Q6 (2 chunks): chunk 0 byte j bits 2c..2c+1 = bits 4-5 of element 4c + j; chunk 1 the same for
//                 element 16 + 4c + j
//   Q2_K's 2-bit quants have no nibble chunks: the Q6 plane holds them whole (bits 0-1 of each element).
// Per-row fields and the value of element i with the unsigned quant q:
//   Q4_0: 4 nibble chunks, 16 fp16 d                      d * (q - 8)       288 bytes (file 18/32)
//   Q4_1: 4 nibble chunks, 16 fp16 d, 16 fp16 m           d * q + m         320 bytes (file 20/32)
//   Q5_0: 4 nibble chunks, 1 plane chunk, 16 fp16 d       d * (q - 16)      352 bytes (file 22/32)
//   Q5_1: 4 + 1 chunks, 16 fp16 d, 16 fp16 m              d * q + m         384 bytes (file 24/32)
//   Q8_0: 8 chunks of q + 128, 16 fp16 d                  d * (q - 128)     544 bytes (file 34/32)
// The K types keep their 256-weight super-blocks: 8 group-blocks of quants (nibble and plane
// chunks as above, no fields) after a header with the 16 rows' fields of the super-block:
//   Q4_K: 16 fp16 d, 16 fp16 dmin, then per sub-block s = 0..7 the 16 rows' 6-bit scale sc (one
//         byte each), then per sub-block their 6-bit min m; value (d * sc) * q - dmin * m
//                                       header 320 + 8 x 256 = 2368 bytes (file 144 x 16 = 2304)
//   Q5_K: the same header, 8 x (4 + 1 chunks)                  2880 bytes (file 176 x 16 = 2816)
//   Q6_K: 16 fp16 d, then per 16-weight sub-block s = 0..15 the 16 rows' int8 scales;
//         value (d * sc) * (q - 32), sc of element i of group-block b that of sub-block 2b + i / 16
//                                       header 288 + 8 x 384 = 3360 bytes (file 210 x 16 = 3360)
//   Q3_K: Q6_K's header (its int8 scales the file's 6-bit ones - 32), 3-bit quants in nibbles;
//         value (d * sc) * (q - 4)      header 288 + 8 x 256 = 2336 bytes (file 110 x 16 = 1760)
//   Q2_K: 16 fp16 d, 16 fp16 dmin, then per 16-weight sub-block s = 0..15 the 16 rows' byte of the
//         file: 4-bit scale sc (low nibble) and min m (high); quants in the 2-bit plane;
//         value (d * sc) * q - dmin * m, sc and m of element i of group-block b those of sub-block 2b + i / 16
//                                       header 320 + 8 x 128 = 1344 bytes (file 84 x 16 = 1344)
// The non-linear 4-bit types store nibbles q that index kIq4Values (lut): the kernels look each
// nibble up as kIq4Values[q] + 128, an unsigned byte, and from there compute as for Q8_0 (zero 128).
// IQ3_S and IQ3_XXS go the same way through tables of their own (their grid rows and signs as nibbles).
//   IQ4_NL: 4 nibble chunks, 16 fp16 d                    d * kIq4Values[q] 288 bytes (file 18/32)
//   IQ4_XS: super-blocks, header 16 fp16 d, then per sub-block the 16 rows' int8 scale sc (the
//           file's 6-bit scale - 32); value (d * sc) * kIq4Values[q]
//                                       header 160 + 8 x 256 = 2208 bytes (file 136 x 16 = 2176)
//   IQ3_S:  IQ4_XS's header (its int8 scales the file's 4-bit scale s as 1 + 2s), nibbles q through
//           kIq3sBytes; value (d * sc) * (2q - 15)
//                                       header 160 + 8 x 256 = 2208 bytes (file 110 x 16 = 1760)
//   IQ3_XXS: the same through kIq3xxsBytes; value (d * sc) * grid_value(q) / 4
//                                       header 160 + 8 x 256 = 2208 bytes (file 98 x 16 = 1568)
// d * sc is exact in float32 (an 11-bit fp16 significand times a 6- or 8-bit integer), so the
// kernels' per-block scales are the file's own.  group_block_bytes() is the average bytes per
// group-block (super-block / 8 for the K types), so a group is nb * group_block_bytes() bytes.
//
// The last group is padded with zero rows.  engine/quant/blocks.py builds this layout.
//
// Row-scaled int8 (large batches, built from any of the above by engine/quant/weights.py): the
// same groups of 16 rows and 32-blocks, 8 chunks of (q + 128) per group-block as in Q8_0, but one
// float scale per output row (value = scale[row] * q), kept in a separate float32 tensor.  With
// no per-block weight scale, a block's integer dot product needs one convert and one FMA (by the
// activation block's scale), instead of four float operations, and no nibble unpacking.
#pragma once

#include "isa.h"
#include <c10/util/Half.h>

#include <cstdint>

namespace qlinear {

constexpr int kGroupRows = 16;
constexpr int kBlock = 32;
constexpr int kRowsBlockBytes = kGroupRows * kBlock;  // a row-scaled int8 group-block

// GGML type ids, the qtype argument of the ops.
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ3_XXS = 18, kIQ4_NL = 20, kIQ3_S = 21, kIQ4_XS = 23
};

constexpr bool qtype_known(int qt) {
  return qt == kQ4_0 || qt == kQ4_1 || qt == kQ5_0 || qt == kQ5_1 || qt == kQ8_0 || qt == kQ4_K || qt == kQ5_K ||
         qt == kQ6_K || qt == kQ2_K || qt == kQ3_K || qt == kIQ4_NL || qt == kIQ4_XS || qt == kIQ3_S ||
         qt == kIQ3_XXS;
}

// The lut types' nibbles q index 16 values; the kernels multiply them as unsigned bytes, value + 128
// (one table lookup per nibble vector).
struct ByteTable {
  alignas(16) uint8_t b[16];
};
template <typename Value>
constexpr ByteTable byte_table(Value value) {
  ByteTable t{};
  for (int q = 0; q < 16; ++q) t.b[q] = static_cast<uint8_t>(value(q) + 128);
  return t;
}
// IQ4_NL / IQ4_XS: ggml's kvalues_iq4nl.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// IQ3_S and IQ3_XXS: a weight's grid magnitude, the l-th of the type's 8, with its sign is the nibble
// 8 + l, or 7 - l when negative (engine/quant/blocks.py decodes the grid rows and sign bits to it).
// IQ3_S's magnitudes are 1, 3, ..., 15 (so the value is 2q - 15), IQ3_XXS's 4, 12, ..., 52, 62.
constexpr int kIq3sMagnitudes[8] = {1, 3, 5, 7, 9, 11, 13, 15};
constexpr int kIq3xxsMagnitudes[8] = {4, 12, 20, 28, 36, 44, 52, 62};
constexpr int grid_value(const int (&mag)[8], int q) { return q >= 8 ? mag[q - 8] : -mag[7 - q]; }
constexpr ByteTable kIq4Bytes = byte_table([](int q) { return static_cast<int>(kIq4Values[q]); });
constexpr ByteTable kIq3sBytes = byte_table([](int q) { return grid_value(kIq3sMagnitudes, q); });
constexpr ByteTable kIq3xxsBytes = byte_table([](int q) { return grid_value(kIq3xxsMagnitudes, q); });
// The bytes a lut type's nibbles index (Layout::lut).
constexpr const uint8_t* lut_bytes(int qt) {
  return (qt == kIQ3_S ? kIq3sBytes : qt == kIQ3_XXS ? kIq3xxsBytes : kIq4Bytes).b;
}
// What the header's d * sc is multiplied by (IQ3_XXS: its scale is d * (0.5 + s) * 0.5 = d * (1 + 2s) / 4,
// exact in float32 as gguf computes it).
constexpr float scale_factor(int qt) { return qt == kIQ3_XXS ? 0.25f : 1.f; }

// The layout of a qtype's packed blocks (see above), for the kernels' templates and the scalar code.
struct Layout {
  int quant_chunks;  // 64-byte chunks of quant bytes (8: Q8_0 bytes; 4: nibbles; 0: Q2_K, all in the plane)
  int plane_chunks;  // chunks of high bits after the nibbles (0, 1: Q5, 2: Q6 and Q2_K's whole quants)
  int zero;          // the integer subtracted from the unsigned quant (4, 8, 16, 32, 128; 0: an offset field m instead),
                     // taken off in integers, as zero * sum(x_q) (per half for the split types: Problem::xsh)
  bool has_m;        // an additive per-row offset: Q4_1/Q5_1 fp16 m, or K types' -dmin * min (Q2_K: per half)
  bool kquant;       // 256-weight super-blocks with a header of per-row fields
  bool split;        // two scales per 32-block (Q6_K, Q3_K, Q2_K: elements 0-15 and 16-31): their integer sums stay apart
  int header;        // K types: bytes of the super-block header
  bool lut = false;  // nibbles index a value table (IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS), looked up as lut_bytes(qt)[q]
};

constexpr Layout layout(int qt) {
  switch (qt) {
    case kQ4_0: return {4, 0, 8, false, false, false, 0};
    case kQ4_1: return {4, 0, 0, true, false, false, 0};
    case kQ5_0: return {4, 1, 16, false, false, false, 0};
    case kQ5_1: return {4, 1, 0, true, false, false, 0};
    case kQ4_K: return {4, 0, 0, true, true, false, 64 + 256};
    case kQ5_K: return {4, 1, 0, true, true, false, 64 + 256};
    case kQ6_K: return {4, 2, 32, false, true, true, 32 + 256};
    case kQ3_K: return {4, 0, 4, false, true, true, 32 + 256};
    case kQ2_K: return {0, 2, 0, true, true, true, 64 + 256};
    case kIQ4_NL: return {4, 0, 128, false, false, false, 0, true};
    case kIQ4_XS:
    case kIQ3_S:
    case kIQ3_XXS: return {4, 0, 128, false, true, false, 32 + 128, true};
    default: return {8, 0, 128, false, false, false, 0};  // Q8_0
  }
}

constexpr int kSuperBlocks = 8;  // group-blocks per K-type super-block

// Bytes of one group-block's quants (nibble or byte chunks, then the high-bit plane).
constexpr int group_block_quant_bytes(int qt) { return (layout(qt).quant_chunks + layout(qt).plane_chunks) * 64; }

// Where a group-block's plane starts: after its nibble chunks.
constexpr int plane_at(int qt) { return layout(qt).quant_chunks * 64; }

// The kernels' steps over a group-block: step c takes 4 elements of each row, Q8_0's bytes
// [4c, 4c + 4), the other types' elements [4c, 4c + 4) and [16 + 4c, 16 + 4c + 4) (nibble chunk c
// and bits 2c.. of the plane, or Q2_K's bits 2c..2c+1 of it alone).
constexpr int block_steps(int qt) { return layout(qt).quant_chunks == 8 ? 8 : 4; }

// Where a (non-K) group-block's fp16 fields start: its 16 scales d right after the quants, then
// (Q4_1, Q5_1) its 16 offsets m.
constexpr int group_block_d_at(int qt) { return group_block_quant_bytes(qt); }
constexpr int group_block_m_at(int qt) { return group_block_d_at(qt) + 16 * 2; }

// Average bytes per group-block: nb * this is a group's bytes (nb a multiple of 8 for K types).
constexpr int group_block_bytes(int qt) {
  return !qtype_known(qt)       ? 0
         : layout(qt).kquant    ? (layout(qt).header + kSuperBlocks * group_block_quant_bytes(qt)) / kSuperBlocks
         : layout(qt).has_m     ? group_block_m_at(qt) + 16 * 2
                                : group_block_d_at(qt) + 16 * 2;
}

// Group-block b of the group at wg: its quants, and the start of its fields (a K type's header).
struct BlockRef {
  const uint8_t* q;
  const uint8_t* fields;
  int sub;  // the group-block's index in its super-block (0 for non-K types)
};
// (The byte counts as arguments, so that the kernels' block_at<QT> below folds them to constants:
// GCC left a run-time group_block_bytes(12) call in the AVX-512 Q4_K loop, 1.8x its time.)
__attribute__((always_inline)) inline BlockRef block_at_bytes(const uint8_t* wg, int b, bool kquant, int header, int qbytes,
                                                              int gbytes, int fields_at) {
  if (!kquant) {
    const uint8_t* gb = wg + static_cast<int64_t>(b) * gbytes;
    return {gb, gb + fields_at, 0};
  }
  const uint8_t* sb = wg + static_cast<int64_t>(b / kSuperBlocks) * kSuperBlocks * gbytes;
  const int s = b % kSuperBlocks;
  return {sb + header + s * qbytes, sb, s};
}
template <int QT>
__attribute__((always_inline)) inline BlockRef block_at(const uint8_t* wg, int b) {
  constexpr Layout L = layout(QT);
  constexpr int kQbytes = group_block_quant_bytes(QT), kGbytes = group_block_bytes(QT), kDAt = group_block_d_at(QT);
  return block_at_bytes(wg, b, L.kquant, L.header, kQbytes, kGbytes, kDAt);
}
inline BlockRef block_at(const uint8_t* wg, int qt, int b) {
  const Layout L = layout(qt);
  return block_at_bytes(wg, b, L.kquant, L.header, group_block_quant_bytes(qt), group_block_bytes(qt), group_block_d_at(qt));
}

// Row r's fp16 field (a scale d or an offset m, 16 values per group-block) at byte `at` of group-block gb.
inline float group_block_half(const uint8_t* gb, int at, int r) {
  return static_cast<float>(c10::Half(reinterpret_cast<const uint16_t*>(gb + at)[r], c10::Half::from_bits()));
}

// Where BlockRef::fields keeps the 16 rows' fp16 scale d and offset m (a K type's dmin), 16 each:
// in a group-block's fields and in a K type's super-block header alike.
constexpr int kFieldD = 0, kFieldM = 32;
// A K type's header then holds 16 bytes (one a row) per sub-block: from header_scales_at the scales
// (Q6_K, Q3_K, IQ4_XS, IQ3_S: int8; Q4_K, Q5_K: 6-bit; Q2_K: the file's byte of 4-bit scale and min), one
// sub-block a group-block, two (elements 0-15, 16-31) for the split types; then, from kHeaderMinsAt,
// Q4_K's and Q5_K's 6-bit mins, one sub-block a group-block.
constexpr int header_scales_at(int qt) { return layout(qt).has_m ? 64 : 32; }
constexpr int kHeaderMinsAt = 64 + 128;
constexpr int scale_sub(int qt, int sub, int h) { return layout(qt).split ? 2 * sub + h : sub; }
// The 16 rows' scale bytes of the elements [16h, 16h + 16) of group-block `sub` of a K-type
// super-block, and (Q4_K, Q5_K) its mins.
inline const uint8_t* header_scales(const uint8_t* header, int qt, int sub, int h) {
  return header + header_scales_at(qt) + scale_sub(qt, sub, h) * 16;
}
inline const uint8_t* header_mins(const uint8_t* header, int sub) { return header + kHeaderMinsAt + sub * 16; }

// Row r's scale d and offset m of a group-block, for its elements [16h, 16h + 16): element i's
// value is d * (q_i - zero) + m (m only where the layout has_m), in the float32 operations of
// gguf.quants.dequantize (d * sc and dmin * min rounded once, as there).
struct RowScale {
  float d, m;
};
inline RowScale row_scale(const BlockRef& br, int qt, int r, int h) {
  switch (qt) {
    case kQ4_K:
    case kQ5_K: {
      const float d = group_block_half(br.fields, kFieldD, r), dmin = group_block_half(br.fields, kFieldM, r);
      const float sc = header_scales(br.fields, qt, br.sub, h)[r], mn = header_mins(br.fields, br.sub)[r];
      return {d * sc, -(dmin * mn)};
    }
    case kQ2_K: {
      const float d = group_block_half(br.fields, kFieldD, r), dmin = group_block_half(br.fields, kFieldM, r);
      const int sm = header_scales(br.fields, qt, br.sub, h)[r];
      return {d * static_cast<float>(sm & 15), -(dmin * static_cast<float>(sm >> 4))};
    }
    case kQ6_K:
    case kQ3_K:
    case kIQ4_XS:
    case kIQ3_S:
    case kIQ3_XXS: {
      const float sc = static_cast<int8_t>(header_scales(br.fields, qt, br.sub, h)[r]);
      return {group_block_half(br.fields, kFieldD, r) * sc * scale_factor(qt), 0.f};
    }
    default:
      return {group_block_half(br.fields, kFieldD, r), layout(qt).has_m ? group_block_half(br.fields, kFieldM, r) : 0.f};
  }
}

// Row r's 32 unsigned quants of group-block `q` (Q8_0: q + 128; the lut types: lut_bytes(qt)[q]).
inline void row_quants(const uint8_t* q, int qt, int r, uint8_t out[32]) {
  const Layout L = layout(qt);
  if (L.quant_chunks == 8) {
    for (int c = 0; c < 8; ++c)
      for (int j = 0; j < 4; ++j) out[4 * c + j] = q[c * 64 + r * 4 + j];
    return;
  }
  if (L.quant_chunks == 0) {  // Q2_K: the plane alone
    for (int c = 0; c < 4; ++c)
      for (int j = 0; j < 4; ++j) {
        out[4 * c + j] = (q[r * 4 + j] >> (2 * c)) & 3;
        out[16 + 4 * c + j] = (q[64 + r * 4 + j] >> (2 * c)) & 3;
      }
    return;
  }
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < 4; ++j) {
      const uint8_t byte = q[c * 64 + r * 4 + j];
      uint8_t lo = byte & 15, hi = byte >> 4;
      if (L.plane_chunks == 1) {
        const uint8_t pb = q[256 + r * 4 + j];
        lo |= ((pb >> c) & 1) << 4;
        hi |= ((pb >> (4 + c)) & 1) << 4;
      } else if (L.plane_chunks == 2) {
        lo |= ((q[256 + r * 4 + j] >> (2 * c)) & 3) << 4;
        hi |= ((q[320 + r * 4 + j] >> (2 * c)) & 3) << 4;
      }
      out[4 * c + j] = L.lut ? lut_bytes(qt)[lo] : lo;
      out[16 + 4 * c + j] = L.lut ? lut_bytes(qt)[hi] : hi;
    }
}

// Instruction-set paths (isa.h), best last: kScalar, kAvx2, kAvxVnni, kAvx512Vnni for every weight;
// kAmxInt8 (AMX int8 tiles) runs the row-scaled int8 weights only: two of their group-blocks in a
// row are already AMX's B-tile layout for 64 k (16 rows of 4-byte words for 16 columns); the GGUF
// group-blocks, with nibbles and per-block scales, are not.
using cpuserve::kAmxInt8;
using cpuserve::kAvx2;
using cpuserve::kAvx512Vnni;
using cpuserve::kAvxVnni;
using cpuserve::kScalar;

}  // namespace qlinear
