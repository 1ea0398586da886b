// The one Python module of the extension: plain pybind11 functions (no dispatcher
// hop), since several of these run on every layer of every step.  The kernels run without
// the GIL (they touch no Python object), as torch's own ops do: the server's HTTP thread
// can then answer requests, /health and /metrics while a step computes.
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  // ---- isa.cpp ----
  py::enum_<cpuserve::Isa>(m, "Isa", "instruction-set paths (isa.h; engine/platform.py mirrors them)")
      .value("SCALAR", cpuserve::kScalar)
      .value("AVX2", cpuserve::kAvx2)
      .value("AVX_VNNI", cpuserve::kAvxVnni)
      .value("AVX512_VNNI", cpuserve::kAvx512Vnni)
      .value("AMX_INT8", cpuserve::kAmxInt8)
      .value("AVX512", cpuserve::kAvx512)
      .value("AVX512_BF16", cpuserve::kAvx512Bf16)
      .value("AMX_BF16", cpuserve::kAmxBf16)
      .value("AMX_BF16_EMU", cpuserve::kAmxBf16Emu);
  m.def("isa_name", &cpuserve::isa_name, "the name of an Isa value (\"\" past the end)", py::arg("isa"));
  m.def("cpu_supports", &cpuserve::cpu_supports, "whether this process can run an Isa's kernels", py::arg("isa"));
  m.def("cpu_features", &cpuserve::cpu_features, "the CPU features the kernels use that this CPU has (/proc/cpuinfo names)");
  m.def("cpu_has_amx", [] { return cpuserve::cpu_supports(cpuserve::kAmxBf16); }, "AMX bf16 tiles usable by this process");
  // ---- end isa.cpp ----
  // ---- qlinear.cpp ----
  m.def("qlinear_forward", &qlinear_forward, "packed GGUF-block matmul", nogil, py::arg("x"), py::arg("packed"),
        py::arg("qtype"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(), py::arg("isa") = -1,
        py::arg("act_bits") = 16, py::arg("out_float32") = false);
  m.def("qlinear_argmax", &qlinear_argmax, "greedy tokens: argmax of a packed matmul's rows", nogil, py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(), py::arg("isa") = -1,
        py::arg("act_bits") = 16);
  m.def("qlinear_rows_forward", &qlinear_rows_forward, "row-scaled int8 matmul (large batches)", nogil, py::arg("x"),
        py::arg("packed"), py::arg("scales"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(),
        py::arg("isa") = -1, py::arg("out_float32") = false, py::arg("act_bits") = 0);
  m.def("qlinear_rows_argmax", &qlinear_rows_argmax, "greedy tokens: argmax of a row-scaled int8 matmul's rows", nogil,
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(),
        py::arg("isa") = -1, py::arg("act_bits") = 0);
  m.def("qlinear_isas", &qlinear_isas, "qlinear instruction-set paths usable on this CPU");
  m.def("qlinear_best_isa", &qlinear_best_isa, "the qlinear path used by default");
  m.def("dense_bf16_supported", &dense_bf16_supported, "whether dense_bf16_forward runs here (AVX512-BF16)");
  m.def("dense_bf16_forward", &dense_bf16_forward, "x @ W^T for a dense bf16 weight, small batches", nogil,
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("out_float32") = false);
  m.def("dense_bf16_pack", &dense_bf16_pack, "a dense bf16 weight in dense_bf16_packed_forward's layout", nogil, py::arg("weight"));
  m.def("dense_bf16_packed_forward", &dense_bf16_packed_forward, "x @ W^T for a packed dense bf16 weight", nogil,
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("out_float32") = false);
  m.def("qlinear_rows_isas", &qlinear_rows_isas, "row-int8 instruction-set paths usable on this CPU, best last");
  // ---- end qlinear.cpp ----
  m.def("qlinear_rows_from_packed", &qlinear_rows_from_packed, "row-scaled int8 copy of a packed weight", nogil,
        py::arg("packed"), py::arg("qtype"), py::arg("n"), py::arg("k"));
  // ---- work_spans.cpp ----
  m.def("work_spans_trace", &work_spans_trace, "test hook: run units over stealable spans, report who ran each",
        nogil, py::arg("units"), py::arg("threads"), py::arg("stalled_thread") = -1, py::arg("stall_us") = 0,
        py::arg("unit_us") = 0);
  // ---- end work_spans.cpp ----
  // ---- attention.cpp ----
  m.def("paged_attention", &paged_attention, "paged attention over the KV cache (writes output)", nogil);
  m.def("attention_plan", &attention_plan, "a step's attention plan, shared by every layer's paged_attention_planned",
        nogil);
  m.def("paged_attention_planned", &paged_attention_planned, "paged attention over a step's plan (writes output)",
        nogil);
  m.def("reshape_and_cache", &reshape_and_cache, "write new keys/values into their KV-cache slots", nogil);
  m.def("attention_isas", &attention_isas, "attention ISAs usable on this CPU");
  m.def("attention_bf16_dot", &attention_bf16_dot, "how vec512 attention multiplies bf16: dpbf16 or fma");
  m.def("attention_set_bf16_dot", &attention_set_bf16_dot, "pin vec512's bf16 attention path (auto, dpbf16, fma)",
        py::arg("mode"));
  m.def("attention_set_amx_min_rows", &attention_set_amx_min_rows, "query rows from which amx units use tiles",
        py::arg("rows"));
  m.def("attention_amx_min_rows", &attention_amx_min_rows, "query rows from which amx units use tiles");
  // ---- end attention.cpp ----
  // ---- fused.cpp ----
  m.def("fused_rms_norm", &fused_rms_norm, "RMSNorm", nogil, py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "(rms_norm(x + residual), x + residual)", nogil, py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("fused_add_rms_norm_", &fused_add_rms_norm_, "in place: residual += x; x = rms_norm(residual)", nogil,
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("fused_silu_and_mul", &fused_silu_and_mul, "SiLU(gate) * up", nogil, py::arg("gate_up"));
  m.def("fused_rope", &fused_rope, "NeoX rotary embedding of q and k", nogil, py::arg("positions"), py::arg("q"),
        py::arg("k"), py::arg("cos_sin"), py::arg("head_size"), py::arg("inplace"));
  m.def("fused_isas", &fused_isas, "fused-op instruction-set paths usable on this CPU");
  m.def("fused_set_isa", &fused_set_isa, "pin the fused-op path (-1: best)", py::arg("isa"));
  // ---- end fused.cpp ----
  // ---- sampling.cpp ----
  m.def("sampling_thresholds", &sampling_thresholds, "per-row top-k / top-p cut-off of unnormalised probabilities", nogil,
        py::arg("e"), py::arg("top_k"), py::arg("top_p"));
  m.def("argmax_rows", &argmax_rows, "per-row index of the first maximum (torch.argmax(x, -1))", nogil, py::arg("x"),
        py::arg("isa") = -1);
  m.def("sample_rows", &sample_rows, "temperature / top-k / top-p / min-p draw per row", nogil, py::arg("logits"),
        py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"));
  m.def("logprobs_rows", &logprobs_rows, "log-probabilities of the chosen tokens and the k best per row", nogil,
        py::arg("logits"), py::arg("chosen"), py::arg("k"));
  m.def("mask_logits_", &mask_logits_, "in place: -inf where a row's grammar bitmask disallows the token", nogil,
        py::arg("logits"), py::arg("bits"), py::arg("rows"), py::arg("vocab_size"), py::arg("isa") = -1);
  m.def("argmax_best_isa", &argmax_best_isa, "the argmax path used by default (an Isa value)");
  m.def("argmax_isas", &argmax_isas, "argmax instruction-set paths usable on this CPU");
  // ---- end sampling.cpp ----
  // ---- decoder_layer.cpp ----
  py::class_<PackedProjection>(m, "PackedProjection")
      .def(py::init([](torch::Tensor data, int64_t qtype, int64_t n, int64_t k, c10::optional<torch::Tensor> bias,
                       int64_t isa, int64_t act_bits, int64_t max_rows, int64_t large_act_bits,
                       c10::optional<torch::Tensor> rows_data, c10::optional<torch::Tensor> rows_scales,
                       int64_t rows_isa, int64_t rows_min_rows) {
             TORCH_CHECK(rows_data.has_value() == rows_scales.has_value(), "rows_data and rows_scales go together");
             return PackedProjection{data, qtype, n, k, bias, isa, act_bits, max_rows, large_act_bits,
                                     rows_data, rows_scales, rows_isa, rows_min_rows};
           }),
           py::arg("data"), py::arg("qtype"), py::arg("n"), py::arg("k"), py::arg("bias"), py::arg("isa"),
           py::arg("act_bits"), py::arg("max_rows"), py::arg("large_act_bits"), py::arg("rows_data") = py::none(),
           py::arg("rows_scales") = py::none(), py::arg("rows_isa") = -1, py::arg("rows_min_rows") = 0)
      .def_static(
          "stacked",
          [](std::vector<PackedProjection> parts, int64_t max_rows, int64_t large_act_bits,
             c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> rows_data,
             c10::optional<torch::Tensor> rows_scales, int64_t rows_isa, int64_t rows_min_rows) {
            TORCH_CHECK(parts.size() >= 2, "a stacked projection needs two parts or more");
            TORCH_CHECK(rows_data.has_value() == rows_scales.has_value(), "rows_data and rows_scales go together");
            int64_t n = 0;
            for (const PackedProjection& p : parts) {
              TORCH_CHECK(p.k == parts[0].k && p.parts.empty(), "parts need one in_features and no parts of their own");
              n += p.n;
            }
            const PackedProjection& first = parts[0];
            return PackedProjection{first.data, first.qtype, n, first.k, bias, first.isa, first.act_bits, max_rows,
                                    large_act_bits, rows_data, rows_scales, rows_isa, rows_min_rows, std::move(parts)};
          },
          "row-stacked parts of different qtypes (each with its own bias slice) as one projection; bias and the "
          "row-int8 copy are the whole stack's",
          py::arg("parts"), py::arg("max_rows"), py::arg("large_act_bits"), py::arg("bias") = py::none(),
          py::arg("rows_data") = py::none(), py::arg("rows_scales") = py::none(), py::arg("rows_isa") = -1,
          py::arg("rows_min_rows") = 0);
  py::class_<PackedDecoderLayer>(m, "PackedDecoderLayer")
      .def(py::init([](torch::Tensor input_norm, torch::Tensor post_norm, double eps, const PackedProjection& qkv,
                       const PackedProjection& o, const PackedProjection& gate_up, const PackedProjection& down,
                       int64_t head_size, int64_t q_size, int64_t kv_size) {
             return PackedDecoderLayer{input_norm, post_norm, eps, qkv, o, gate_up, down, head_size, q_size, kv_size};
           }),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv_proj"), py::arg("o_proj"),
           py::arg("gate_up_proj"), py::arg("down_proj"), py::arg("head_size"), py::arg("q_size"), py::arg("kv_size"))
      .def("pre_attention", &PackedDecoderLayer::pre_attention, nogil, py::arg("x"), py::arg("residual"),
           py::arg("positions"), py::arg("cos_sin"))
      .def("post_attention", &PackedDecoderLayer::post_attention, nogil, py::arg("attn_out"), py::arg("residual"));
  // ---- end decoder_layer.cpp ----
}
