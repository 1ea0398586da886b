// Declarations of every native op; bindings.cpp exposes them to Python.
#pragma once
#include <torch/extension.h>

// cpu_features.cpp
bool cpu_has_amx();  // also asks the kernel for AMX tile state permission

// ---- qlinear.cpp (packed GGUF-block matmul; layout in qlinear.h) ----
// y = x @ W^T (+ bias): x [M, K] float32/bfloat16 (unit column stride), packed uint8, qtype a GGML id
// (2 Q4_0, 3 Q4_1, 8 Q8_0); y [M, N] in x's dtype.  isa: -1 best, else a value of qlinear_isas().
torch::Tensor qlinear_forward(const torch::Tensor& x, const torch::Tensor& packed, int64_t qtype, int64_t n,
                              int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa);
std::vector<int64_t> qlinear_isas();  // usable paths: 0 scalar, 1 avx2, 2 avx-vnni, 3 avx512-vnni
int64_t qlinear_best_isa();
// ---- end qlinear.cpp ----

// ---- attention.cpp (paged attention + KV-cache writes; see engine/attention/kernels/native.py) ----
// isa: "vec256" | "vec512" | "amx" | "amx_emu" (amx on emulated tiles, for tests).
void paged_attention(const std::string& isa, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                     int64_t num_decodes, int64_t max_query_len, int64_t max_seq_len, double scale, double k_scale,
                     double v_scale, at::Tensor output);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                       const at::Tensor& slot_mapping, double k_scale, double v_scale);
std::vector<std::string> attention_isas();  // attention ISAs compiled in and runnable on this CPU
// ---- end attention.cpp ----
