// Packed low-bit weights for small-batch (decode) matmuls: layout shared by every ISA path.
//
// A weight [N, K] in a GGUF block format (Q4_0, Q4_1, Q8_0: blocks of 32 along K) is stored
// as groups of 16 output rows; a group holds its K/32 blocks back to back ("group-blocks"), so
// one group is one sequential stream.  Inside a group-block the quants of the 16 rows are
// interleaved in 4-byte words: chunk c (64 bytes) = for row r = 0..15 the bytes [4c, 4c+4) of
// that row's quants.  A 512-bit vector of a chunk thus holds 4 quant bytes per row in lane r,
// and one `vpdpbusd` against 4 activation bytes broadcast to every lane adds 4 products into
// each row's lane: 16 rows advance at once, and the per-block scales are per-lane vectors.
//
//   Q4_0: 4 chunks of nibbles (GGUF byte i: low nibble q[i], high nibble q[i+16]), then 16 fp16 d
//         value = d * (q - 8)                                               -> 288 bytes
//   Q4_1: 4 chunks of nibbles, 16 fp16 d, 16 fp16 m; value = d * q + m      -> 320 bytes
//   Q8_0: 8 chunks of (q XOR 0x80), i.e. q + 128 as unsigned; 16 fp16 d; value = d * q -> 544 bytes
//
// The last group is padded with zero rows.  engine/layers/quant.py builds this layout.
//
// Row-scaled int8 (large batches, built from any of the above by engine/layers/quant.py): the
// same groups of 16 rows and 32-blocks, 8 chunks of (q + 128) per group-block as in Q8_0, but one
// float scale per output row (value = scale[row] * q), kept in a separate float32 tensor.  With
// no per-block weight scale, a block's integer dot product needs one convert and one FMA (by the
// activation block's scale), instead of four float operations, and no nibble unpacking.
#pragma once
#include <c10/util/Half.h>

#include <cstdint>

namespace qlinear {

constexpr int kGroupRows = 16;
constexpr int kBlock = 32;
constexpr int kRowsBlockBytes = kGroupRows * kBlock;  // a row-scaled int8 group-block

// GGML type ids, the qtype argument of the ops.
enum QType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

// Where a group-block's fp16 fields start: its 16 scales d right after the quants, then (Q4_1) its
// 16 offsets m.
constexpr int group_block_d_at(int qtype) { return qtype == kQ8_0 ? 16 * 32 : 16 * 16; }
constexpr int group_block_m_at(int qtype) { return group_block_d_at(qtype) + 16 * 2; }

inline int group_block_bytes(int qtype) {
  switch (qtype) {
    case kQ4_0: return group_block_d_at(kQ4_0) + 16 * 2;
    case kQ4_1: return group_block_m_at(kQ4_1) + 16 * 2;
    case kQ8_0: return group_block_d_at(kQ8_0) + 16 * 2;
    default: return 0;
  }
}

// Row r's fp16 field (a scale d or an offset m, 16 values per group-block) at byte `at` of group-block gb.
inline float group_block_half(const uint8_t* gb, int at, int r) {
  return static_cast<float>(c10::Half(reinterpret_cast<const uint16_t*>(gb + at)[r], c10::Half::from_bits()));
}

// Instruction-set paths, best last.  `isa` arguments take these values, or -1 for the best available.
// kAmxInt8 (AMX int8 tiles) runs the row-scaled int8 weights only: two of their group-blocks in a
// row are already AMX's B-tile layout for 64 k (16 rows of 4-byte words for 16 columns); the GGUF
// group-blocks, with nibbles and per-block scales, are not.
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAmxInt8 = 4 };

}  // namespace qlinear
