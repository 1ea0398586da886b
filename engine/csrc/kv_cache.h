// The KV cache as the C++ kernels see it (engine/kv_cache/layout.py allocates it): one tensor per
// layer, [num_blocks, num_kv_heads, block_size, 2 * head_size], each row one token's K then V for
// one kv head, in the model's dtype or an 8-bit format (KvKind).  kv_cache.cpp writes it
// (reshape_and_cache); attention.cpp reads it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "vec.h"

namespace cpuserve_attn {

// A cache's element format: the model's dtype, or an 8-bit one that vec.h widens (same values as Elem8).
enum class KvKind : int {
  kSame = 0,
  kE4M3 = static_cast<int>(cpuserve::Elem8::kE4M3),
  kE5M2 = static_cast<int>(cpuserve::Elem8::kE5M2),
  kI8 = static_cast<int>(cpuserve::Elem8::kInt8),
};
inline cpuserve::Elem8 elem8(KvKind k) { return static_cast<cpuserve::Elem8>(k); }  // an 8-bit KvKind

// An int8 cache row holds a token's K and V for one kv head as D int8 values each, then their
// two fp32 scales: [K | V | k_scale | v_scale], x ~= value * scale (so its row stride is at least
// 2D + 8 bytes; the tensor the engine holds is the [..., :2D] view of those rows).
constexpr int kInt8ScaleBytes = 8;

// TORCH_CHECKs that kv_cache is a cache for head size D: [blocks, kv_heads, block, 2D] with dense
// rows, in any block / head / row strides; an int8 cache's rows must leave room for their scales.
void check_kv_cache(const at::Tensor& kv_cache, int64_t D);

// The cache's element format for a model of dtype `model` (TORCH_CHECKs that a cache in neither an
// 8-bit format nor the model's dtype is not used).
KvKind kv_kind_of(const at::Tensor& kv_cache, at::ScalarType model);

}  // namespace cpuserve_attn
