// One Llama decoder layer's packed path as two native calls around its attention.
//
// At batch 1 most of a layer's time outside its kernels was Python (module frames, the Linear ->
// PackedWeight wrappers, pybind11 conversions, the qkv split): this file does that work in C++.
// When all four projections of a layer hold packed weights, engine/models/llama.py runs the layer as
//   pre_attention:  [residual +] RMSNorm -> qkv projection -> RoPE on q and k (in place); q, k, v
//                   as per-head views and the attention's output buffer (each a torch op of a few
//                   microseconds from Python)
//   attention:      the attention layer, from Python (do_kv_cache_update, then forward)
//   post_attention: o projection -> residual + RMSNorm -> gate_up projection -> SiLU * up -> down
// The kernels, their order and their arguments are those of the modular path (the reference,
// and the path for every other layer), so both give the same bits.
#include "ops.h"

namespace {

const char* const kDeclined = "decoder layer: a fused op declined its inputs";

}  // namespace

torch::Tensor PackedProjection::operator()(const torch::Tensor& x) const {
  // Linear.forward's routing: up to max_rows rows at the weight's own activation precision,
  // larger batches on the row-scaled int8 copy from rows_min_rows rows, else at large_act_bits
  // (PackedDecoderLayer is only used where that is set or the batch is small enough).
  const int64_t m = x.size(0);
  if (m <= max_rows) return blocks(x, 0);
  if (rows_data.has_value() && m >= rows_min_rows)
    return qlinear_rows_forward(x, *rows_data, *rows_scales, n, k, bias, rows_isa);
  return blocks(x, large_act_bits);
}

torch::Tensor PackedProjection::blocks(const torch::Tensor& x, int64_t bits) const {
  if (parts.empty()) return qlinear_forward(x, data, qtype, n, k, bias, isa, bits ? bits : act_bits);
  std::vector<torch::Tensor> outs;
  outs.reserve(parts.size());
  for (const PackedProjection& p : parts) outs.push_back(p.blocks(x, bits));
  return at::cat(outs, 1);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> PackedDecoderLayer::pre_attention(
    torch::Tensor x, c10::optional<torch::Tensor> residual, const torch::Tensor& positions,
    const torch::Tensor& cos_sin) const {
  torch::Tensor normed, res;
  if (residual.has_value()) {  // residual += x; x = norm(residual)
    res = *residual;
    TORCH_CHECK(fused_add_rms_norm_(x, res, input_norm, eps), kDeclined);
    normed = x;
  } else {  // first layer: x is the residual stream
    auto n = fused_rms_norm(x, input_norm, eps);
    TORCH_CHECK(n.has_value(), kDeclined);
    normed = *n;
    res = x;
  }
  torch::Tensor qkv = qkv_proj(normed);
  // q, k, v as views of qkv's columns, each made by one as_strided: narrow + view go through
  // three dispatcher calls per view (narrow -> slice -> as_strided, then view).
  const int64_t t = qkv.size(0), s0 = qkv.stride(0), off = qkv.storage_offset();
  const int64_t heads = q_size / head_size, kv_heads = kv_size / head_size;
  torch::Tensor q = qkv.as_strided({t, q_size}, {s0, 1}, off), k = qkv.as_strided({t, kv_size}, {s0, 1}, off + q_size);
  TORCH_CHECK(fused_rope(positions, q, k, cos_sin, head_size, true).has_value(), kDeclined);
  return {qkv.as_strided({t, heads, head_size}, {s0, head_size, 1}, off),
          qkv.as_strided({t, kv_heads, head_size}, {s0, head_size, 1}, off + q_size),
          qkv.as_strided({t, kv_heads, head_size}, {s0, head_size, 1}, off + q_size + kv_size),
          at::empty({t, heads, head_size}, qkv.options()), res};
}

torch::Tensor PackedDecoderLayer::post_attention(const torch::Tensor& attn_out, torch::Tensor residual) const {
  // [T, H, D] -> [T, H * D]: one view for the contiguous buffer pre_attention made (flatten is three calls).
  const bool heads = attn_out.dim() == 3;
  torch::Tensor h = o_proj(!heads ? attn_out
                           : attn_out.is_contiguous() ? attn_out.view({attn_out.size(0), attn_out.size(1) * attn_out.size(2)})
                                                      : attn_out.flatten(1));
  TORCH_CHECK(fused_add_rms_norm_(h, residual, post_norm, eps), kDeclined);
  auto act = fused_silu_and_mul(gate_up_proj(h));
  TORCH_CHECK(act.has_value(), kDeclined);
  return down_proj(*act);
}
