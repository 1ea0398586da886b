// Declarations of every native op; bindings.cpp exposes them to Python.
#pragma once
#include <torch/extension.h>

// CPU features and instruction-set paths: isa.h (cpuserve::Isa, cpuserve::cpu_supports).
#include "isa.h"

// ---- qlinear.cpp (packed GGUF-block matmul; layout in qlinear.h) ----
// y = x @ W^T (+ bias): x [M, K] float32/bfloat16 (unit column stride), packed uint8, qtype a GGML id
// (2 Q4_0, 3 Q4_1, 8 Q8_0); y [M, N] in x's dtype, or float32 when out_float32 (logits: no bf16
// rounding and no conversion pass after).  isa: -1 best, else a value of qlinear_isas().
// act_bits: 8 (activations rounded to int8 per 32-block, llama.cpp-style) or 16 (15-bit, ~exact).
torch::Tensor qlinear_forward(const torch::Tensor& x, const torch::Tensor& packed, int64_t qtype, int64_t n,
                              int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa, int64_t act_bits,
                              bool out_float32 = false);
// argmax over columns of qlinear_forward(x, ..., out_float32=true) per row (int64 [M], the first
// maximum, as torch.argmax) without writing the product; empty if any value was NaN.
torch::Tensor qlinear_argmax(const torch::Tensor& x, const torch::Tensor& packed, int64_t qtype, int64_t n, int64_t k,
                             const c10::optional<torch::Tensor>& bias, int64_t isa, int64_t act_bits);
// Row-scaled int8 weights (layout in qlinear.h; scales float32 [groups * 16]); isa: -1 best,
// 0 scalar, 3 avx512-vnni, 4 amx-int8; out_float32 as above.  act_bits: 8 = each 32-block of an
// activation row rounded to int8 (avx512-vnni), 16 = each whole row rounded to 15 bits (amx-int8),
// 0 = the path's own; the scalar path runs either.
torch::Tensor qlinear_rows_forward(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                   int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                                   bool out_float32 = false, int64_t act_bits = 0);
// argmax over columns of qlinear_rows_forward(x, ..., out_float32=true) per row (int64 [M], the
// first maximum, as torch.argmax) without writing the product; empty if any value was NaN.
torch::Tensor qlinear_rows_argmax(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                  int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                                  int64_t act_bits = 0);
std::vector<int64_t> qlinear_isas();  // usable paths: 0 scalar, 1 avx2, 2 avx-vnni, 3 avx512-vnni
std::vector<int64_t> qlinear_rows_isas();  // usable row-int8 paths, best last: 0 scalar, 3 avx512-vnni, 4 amx-int8
int64_t qlinear_best_isa();
// ---- end qlinear.cpp ----

// ---- dense_bf16.cpp (small batches of a dense bf16 weight) ----
// y = x @ W^T (+ bias): x bf16 [M, K], weight contiguous bf16 [N, K], bias
// bf16 [N]; y [M, N] bf16, or float32 when out_float32.  AVX512-BF16 only (dense_bf16_supported).
bool dense_bf16_supported();
torch::Tensor dense_bf16_forward(const torch::Tensor& x, const torch::Tensor& weight,
                                 const c10::optional<torch::Tensor>& bias, bool out_float32 = false);
torch::Tensor dense_bf16_pack(const torch::Tensor& weight);
torch::Tensor dense_bf16_packed_forward(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                        const c10::optional<torch::Tensor>& bias, bool out_float32);
// ---- end dense_bf16.cpp ----

// ---- qlinear_rows.cpp ----
// [data, scales]: the row-scaled int8 copy (qlinear.h) of a packed weight [n, k] (any qtype of qlinear.h),
// bit-identical to engine/quant/weights.py's torch definition (quantize_rows_int8 of the dequantized blocks).
std::vector<torch::Tensor> qlinear_rows_from_packed(const torch::Tensor& packed, int64_t qtype, int64_t n, int64_t k);
// ---- end qlinear_rows.cpp ----

// ---- work_spans.cpp (test hook for work_spans.h, the split of qlinear's parallel loops) ----
// [2, units] int64, how many times each unit ran and which thread ran
// it, with `stalled_thread` (-1: none) held back stall_us before it starts; each unit busy unit_us.
torch::Tensor work_spans_trace(int64_t units, int64_t threads, int64_t stalled_thread, int64_t stall_us,
                               int64_t unit_us);
// ---- end work_spans.cpp ----

// ---- attention.cpp (paged attention + KV-cache writes; see engine/attention/dispatch.py) ----
// isa: "vec256" | "vec512" | "amx" | "amx_emu" (amx on emulated tiles, for tests).
void paged_attention(const std::string& isa, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                     int64_t num_decodes, int64_t max_query_len, int64_t max_seq_len, double scale, double k_scale,
                     double v_scale, at::Tensor output);
// The same in two halves: a step's plan (validated metadata cut into work units, a byte tensor),
// built once per step, then each layer's attention over it with that step's metadata tensors.
at::Tensor attention_plan(const std::string& isa, int64_t num_heads, int64_t num_tokens, const at::Tensor& kv_cache,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table);
void paged_attention_planned(const at::Tensor& plan, const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             const at::Tensor& block_table, double scale, double k_scale, double v_scale,
                             at::Tensor output);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                       const at::Tensor& slot_mapping, double k_scale, double v_scale);
std::vector<std::string> attention_isas();  // attention ISAs compiled in and runnable on this CPU
// How vec512 multiplies a bf16 model's attention: "dpbf16" or "fma" (see attention.cpp), "none" without vec512.
std::string attention_bf16_dot();
// "auto" (time both once) | "dpbf16" | "fma": set at load from CPUSERVE_ATTN_BF16_DOT (engine/native.py), and by tests.
void attention_set_bf16_dot(const std::string& mode);
// Query rows from which an amx unit runs on tiles (default 4; values below 1 count as 1): set at load
// from CPUSERVE_ATTN_AMX_MIN_ROWS (engine/native.py).
void attention_set_amx_min_rows(int64_t rows);
int64_t attention_amx_min_rows();
// ---- end attention.cpp ----

// ---- fused.cpp (element-wise ops of a Llama layer; torch reference in engine/layers/fused.py) ----
// bf16 or fp32 CPU tensors, 2-D [T, H], weight [H] in x's dtype.  Each op returns None (false) when
// its inputs are not a case it handles, and the caller runs the torch reference instead.
c10::optional<torch::Tensor> fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
// (rms_norm(x + residual), x + residual), new tensors
c10::optional<std::tuple<torch::Tensor, torch::Tensor>> fused_add_rms_norm(const torch::Tensor& x,
                                                                           const torch::Tensor& residual,
                                                                           const torch::Tensor& weight, double eps);
// in place: residual = x + residual; x = rms_norm(residual) (both with a contiguous last dim)
bool fused_add_rms_norm_(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps);
c10::optional<torch::Tensor> fused_silu_and_mul(const torch::Tensor& gate_up);  // [T, 2d] -> [T, d]
// NeoX RoPE of q [T, Hq*D] and k [T, Hkv*D] (row-strided slices allowed); cos_sin float32 [P, D] = [cos|sin].
// inplace: rotates q and k and returns them; else returns new contiguous tensors.  Throws on a
// position outside cos_sin.
c10::optional<std::tuple<torch::Tensor, torch::Tensor>> fused_rope(const torch::Tensor& positions,
                                                                   const torch::Tensor& q, const torch::Tensor& k,
                                                                   const torch::Tensor& cos_sin, int64_t head_size,
                                                                   bool inplace);
// For other kernels (sampling.cpp): out[i] = exp((x[i] - shift) * scale) over n floats, returns their sum.
float fused_exp_row(const float* x, float shift, float scale, float* out, int64_t n);
std::vector<int64_t> fused_isas();  // kScalar, kAvx2, kAvx512, kAvx512Bf16 (isa.h) this CPU runs
void fused_set_isa(int64_t isa);    // pin a path (tests); -1: best
// ---- end fused.cpp ----

// ---- sampling.cpp (top-k / top-p cut-offs and greedy argmax; torch references in engine/sampler.py) ----
// e: float32 [R, V] unnormalised probabilities (exp(logit - row max)); top_k int64 [R] (<= 0 or
// >= V: none); top_p float32 [R].  Returns float32 [R]: per row, the smallest e that survives
// top-k and then top-p (tokens with e >= it are kept).
torch::Tensor sampling_thresholds(const torch::Tensor& e, const torch::Tensor& top_k, const torch::Tensor& top_p);
// x: float32 [R, V], rows contiguous.  Returns int64 [R]: torch.argmax(x, -1) (first maximum;
// the first NaN where a row has one).
// isa: -1 the best this CPU has, else one of argmax_isas() (isa.h values; tests pin each one).
torch::Tensor argmax_rows(const torch::Tensor& x, int64_t isa);
int64_t argmax_best_isa();
std::vector<int64_t> argmax_isas();  // the argmax paths this CPU runs: kScalar, kAvx2, kAvx512 (isa.h)
// The draw of engine/sampler.py for rows that sample: logits float32 [R, V] (rows contiguous);
// per row temperature (> 0), top_k (<= 0 or >= V: none), top_p, min_p (float32) and a uniform u
// in [0, 1).  Returns (token ids int64 [R], the smallest exp((logit - max) / temperature) each
// row kept, float32 [R]).
std::tuple<torch::Tensor, torch::Tensor> sample_rows(const torch::Tensor& logits, const torch::Tensor& temperature,
                                                     const torch::Tensor& top_k, const torch::Tensor& top_p,
                                                     const torch::Tensor& min_p, const torch::Tensor& u);
// The log-probabilities users ask for, of the raw logits float32 [R, V] (rows contiguous): of each
// row's chosen token int64 [R], and the row's k most likely tokens.  Returns (float32 [R], ids
// int64 [R, k] most likely first, equal logits by index, float32 [R, k]); no [R, V] temporaries.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> logprobs_rows(const torch::Tensor& logits,
                                                                      const torch::Tensor& chosen, int64_t k);
// Grammar masks (engine/structured/masks.py), in place: logits float32 [R, V] (rows contiguous);
// bits int32 [M, W], bit t % 32 of word t // 32 set where token t is allowed; rows int64 [M], the
// logits row of mask m.  Sets row rows[m]'s disallowed logits (and those from token vocab_size on,
// the model's padding) to -inf.  Returns bool [M]: whether row rows[m] still has a logit above -inf.
// isa: -1 the best, else one of argmax_isas() (kAvx512 has its own path; the others run scalar).
torch::Tensor mask_logits_(torch::Tensor& logits, const torch::Tensor& bits, const torch::Tensor& rows,
                           int64_t vocab_size, int64_t isa);
// ---- end sampling.cpp ----

// ---- decoder_layer.cpp (a Llama layer's packed path around its attention; see engine/models/llama.py) ----
// One packed projection with Linear.forward's routing: rows <= max_rows at act_bits; larger
// batches from rows_min_rows rows on the row-scaled int8 copy when there is one, else at large_act_bits.
// With parts (engine.quant.weights.PackedParts: row-stacked weights of different qtypes, e.g. a
// Q4_K_M file's q/k in Q4_K and v in Q6_K) the block kernel runs once per part, each at its own
// act_bits, into its columns of the output; data and qtype are then unused.
struct PackedProjection {
  torch::Tensor data;
  int64_t qtype, n, k;
  c10::optional<torch::Tensor> bias;
  int64_t isa, act_bits, max_rows, large_act_bits;
  c10::optional<torch::Tensor> rows_data, rows_scales;
  int64_t rows_isa, rows_min_rows;
  std::vector<PackedProjection> parts;
  torch::Tensor operator()(const torch::Tensor& x) const;
  // The block kernel at act_bits (0: each part's own).
  torch::Tensor blocks(const torch::Tensor& x, int64_t bits) const;
};
struct PackedDecoderLayer {
  torch::Tensor input_norm, post_norm;
  double eps;
  PackedProjection qkv_proj, o_proj, gate_up_proj, down_proj;
  int64_t head_size, q_size, kv_size;
  // (query [T, H, D], key and value [T, Hkv, D], output [T, H, D], residual): the first three are
  // views of one qkv product with RoPE applied to q and k, the output an empty buffer for the
  // attention to write.  x and residual are updated in place as add_rms_norm_ does (no residual:
  // x becomes it).
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> pre_attention(
      torch::Tensor x, c10::optional<torch::Tensor> residual, const torch::Tensor& positions,
      const torch::Tensor& cos_sin) const;
  // The MLP block's output; residual += o_proj(attn_out) in place.  attn_out: [T, H * D] or [T, H, D].
  torch::Tensor post_attention(const torch::Tensor& attn_out, torch::Tensor residual) const;
};
// ---- end decoder_layer.cpp ----
