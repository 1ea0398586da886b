"""Packed kernels for the K-quant block types (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1, the types a
Q4_K_M / Q5_K_M / Q6_K file holds (llama-quantize falls back to Q5_0 / Q5_1 / Q8_0 for rows whose
length is not a multiple of 256), Q2_K and Q3_K (Q2_K and Q3_K_M files'), the non-linear IQ4_NL / IQ4_XS of
an IQ4_XS file and IQ3_S / IQ3_XXS (IQ3_M / IQ3_XS files').  The reference is gguf.quants' own dequantization: the kernels
must compute with exactly the file's weights, the only rounding being the activations' (as for
Q4_0 / Q8_0, tests/engine/quant/test_qlinear.py), which for the K types share one scale per
256-element super-block, as llama.cpp's Q8_K does.
"""

from __future__ import annotations

import pytest
import torch

from engine.quant import blocks as qblocks, packing as qpacking, weights as qweights
from tests.engine.quant.test_qlinear import FakeGGUFTensor, assert_first_maximum, bits, check_output, gguf_dequantize, isa  # noqa: F401
from tests.tiny_models import make_tiny_gguf

pytestmark = pytest.mark.skipif(not qweights.native_available(), reason="native extension unavailable")

NEW_QTYPES = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS"]


def act_block(qtype: str) -> int:
    """Activation elements that share one scale in the kernel, for weights of `qtype`."""
    return 256 if qtype in qblocks.K_TYPES else 32


def random_blocks(qtype: str, n: int, k: int, seed: int = 0, scale: float = 0.002) -> torch.Tensor:
    """Random GGUF blocks [n, bytes per row]: every quant, scale and min byte value, finite fp16 d
    (and Q5_1's m / the K types' dmin) around `scale`."""
    g = torch.Generator().manual_seed(seed)
    bw, bb = qblocks.GGUF_BLOCKS[qtype]
    raw = torch.randint(0, 256, (n, k // bw, bb), dtype=torch.uint8, generator=g)
    for at in qblocks.FP16_AT[qtype]:
        f = (torch.rand(n, k // bw, 1, generator=g) * scale + scale / 10).half()
        raw[..., at : at + 2] = f.view(torch.uint8)
    return raw.reshape(n, -1)


def packed(raw: torch.Tensor, qtype: str, n: int, k: int, isa_name=None, act_bits=None) -> qweights.PackedWeight:
    return qweights.PackedWeight(qblocks.pack_blocks(raw, qtype, (n, k)), qtype, (n, k), isa_name, act_bits)


@pytest.mark.parametrize("qtype", NEW_QTYPES)
def test_layout_roundtrip_and_dequantize(qtype):
    """unpack(pack(blocks)) gives the file's bytes back; the packed bytes stay the file's size (Q4_K,
    Q5_K: 1/32 more, their 6-bit scales and mins unpacked to a byte; IQ4_XS 1/64; Q3_K a third more,
    its 3-bit quants in nibbles, IQ3_S / IQ3_XXS a quarter / 41% more, their grid codes as nibbles; Q2_K exactly);
    dequantize is gguf's."""
    n, k = 37, 512
    raw = random_blocks(qtype, n, k, seed=1)
    data = qblocks.pack_blocks(raw, qtype, (n, k))
    assert data.numel() == 3 * (k // 32) * qblocks.GROUP_BLOCK_BYTES[qtype]  # 37 rows -> 3 groups of 16
    file_bytes = 48 * raw.shape[1]
    assert file_bytes <= data.numel() <= file_bytes * {"Q3_K": 1.33, "IQ3_S": 1.26, "IQ3_XXS": 1.41}.get(qtype, 1.03)
    if qtype == "Q2_K":
        assert data.numel() == file_bytes
    assert torch.equal(qblocks.unpack_blocks(data, qtype, (n, k)), raw)
    assert torch.equal(packed(raw, qtype, n, k).to_gguf_blocks(), raw)
    assert torch.equal(qblocks.dequantize_blocks(raw, qtype, (n, k)), gguf_dequantize(raw, qtype, (n, k)))


@pytest.mark.parametrize("qtype", NEW_QTYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_random_blocks(isa, bits, qtype, m, dtype):
    n, k = 200, 512  # 13 groups, the last one partial; two K super-blocks
    raw = random_blocks(qtype, n, k, seed=m)
    w = gguf_dequantize(raw, qtype, (n, k))
    pw = packed(raw, qtype, n, k, isa, bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    x[0, :32] = 0  # an all-zero activation block
    check_output(pw(x), x, w, bits=bits, block=act_block(qtype))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    check_output(pw(x, bias), x, w, bias, bits=bits, block=act_block(qtype))


@pytest.mark.parametrize("qtype", NEW_QTYPES)
def test_every_path_agrees_with_the_scalar_reference(qtype):
    n, k = 72, 768
    raw = random_blocks(qtype, n, k, seed=4)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    ref = packed(raw, qtype, n, k, "scalar")(x)
    for name in qweights.available_isas():
        torch.testing.assert_close(packed(raw, qtype, n, k, name)(x), ref, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("qtype", NEW_QTYPES)
def test_a_row_gets_the_same_bits_in_any_batch(isa, bits, qtype):
    n, k = 56, 256
    pw = packed(random_blocks(qtype, n, k, seed=n), qtype, n, k, isa, bits)
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([pw(x[i : i + 1]) for i in range(15)])
    for m in (2, 3, 4, 5, 8, 9, 12, 15):
        assert torch.equal(pw(x[:m]), alone[:m]), m


@pytest.mark.parametrize("qtype", NEW_QTYPES)
@pytest.mark.parametrize("m", [1, 2, 5])
def test_packed_argmax_is_the_products_first_maximum(isa, qtype, m):
    """The LM head's fused argmax (a Q4_K_M file's tied embedding is Q6_K)."""
    n, k = 4099, 256
    raw = random_blocks(qtype, n, k, seed=m)
    raw[3] = raw[n - 2] = random_blocks(qtype, 1, k, seed=1, scale=0.02)[0]  # ten times the others' scale
    pw = packed(raw, qtype, n, k, isa)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    x[0] = 0
    if m > 1:
        w3 = gguf_dequantize(raw[3:4], qtype, (1, k))[0]
        x[1] = (w3 / w3.norm()).to(torch.bfloat16) * 8
    assert_first_maximum(pw, pw.argmax, x, torch.randn(n, generator=g))
    # and the argmax of the float reference product, where its top two are not within rounding
    w = gguf_dequantize(raw, qtype, (n, k))
    xf = torch.randn(m, k, generator=g)
    ref = xf.double() @ w.double().t()
    top = ref.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1]) > 1e-3 * top[:, 0].abs()
    assert torch.equal(pw.argmax(xf)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("qtype", NEW_QTYPES)
def test_rows_int8_copy_is_quantize_rows_int8_of_the_dequantized_blocks(qtype):
    n, k = 37, 512
    raw = random_blocks(qtype, n, k, seed=3)
    raw[5] = 0  # every scale 0: the row dequantizes to zeros
    pw = packed(raw, qtype, n, k)
    fast, ref = qweights.rows_int8_from(pw), qweights.quantize_rows_int8(gguf_dequantize(raw, qtype, (n, k)))
    assert torch.equal(fast.scales, ref.scales) and fast.scales[5] == 0
    assert torch.equal(fast.data, ref.data)


def test_pack_gguf_needs_whole_k_super_blocks_and_says_why_not():
    t = FakeGGUFTensor("Q4_K", random_blocks("Q4_K", 32, 256), (32, 256))
    assert isinstance(qpacking.pack_gguf([t]), qweights.PackedWeight)
    q5 = FakeGGUFTensor("Q5_0", random_blocks("Q5_0", 32, 576), (32, 576))  # a 576-wide fallback tensor
    assert qpacking.pack_gguf([q5]).qtype == "Q5_0"
    odd = FakeGGUFTensor("Q6_K", torch.zeros(16, 3 * 210, dtype=torch.uint8), (16, 640))
    assert qpacking.pack_gguf([odd]) is None and "divisible by 256" in qpacking.packing_refusal([odd])
    f16 = FakeGGUFTensor("F16", torch.zeros(16, 512, dtype=torch.uint8), (16, 256))
    assert qpacking.pack_gguf([f16]) is None and qpacking.packing_refusal([f16]) == "F16 has no packed kernel"


@pytest.mark.parametrize("m", [1, 40])
def test_mixed_qtype_merges_stack_their_parts(m):
    """A Q4_K_M qkv_proj: q and k in Q4_K, v in Q6_K -> one Q4_K part (q and k merged), one Q6_K part;
    the product, its bias and the row-int8 copy are those of the stacked weights."""
    k = 256
    parts = [("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)]
    ts = [FakeGGUFTensor(q, random_blocks(q, rows, k, seed=i), (rows, k)) for i, (q, rows) in enumerate(parts)]
    pw = qpacking.pack_gguf(ts)
    assert isinstance(pw, qweights.PackedParts) and [p.qtype for p in pw.parts] == ["Q4_K", "Q6_K"]
    assert pw.shape == (128, k) and pw.qtype == "Q4_K"
    w = torch.cat([gguf_dequantize(t.data, t.qtype, t.shape) for t in ts])
    assert torch.equal(pw.dequantize(), w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(128)
    check_output(pw(x, bias), x, w, bias, block=256)
    rows = qweights.rows_int8_from(pw)
    ref = qweights.quantize_rows_int8(w)
    assert torch.equal(rows.data, ref.data) and torch.equal(rows.scales, ref.scales)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ3_XXS"])
def test_k_quant_model_runs_packed_and_generates_the_dense_models_tokens(tmp_path, mix, caplog):
    """A tiny model in each K-quant mix loads with every projection packed (q/k/v of mixed types as
    parts) and greedy-generates what the dense float32 model of the same dequantized weights does."""
    import logging

    from engine.config import CacheConfig, EngineConfig
    from engine.engine import LLMEngine
    from engine.request import SamplingParams

    path = str(make_tiny_gguf(tmp_path, "llama", mix))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["the hat", "a tent in the"]

    def generate(weight_quant: str) -> tuple[LLMEngine, dict]:
        cfg = EngineConfig(model=path, dtype="float32", weight_quant=weight_quant, cache=CacheConfig(num_blocks=64))
        engine = LLMEngine(cfg)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        out: dict = {}
        while engine.has_unfinished():
            for d in engine.step()[0]:
                out.setdefault(d.request_id, []).extend(d.new_token_ids)
        return engine, out

    with caplog.at_level(logging.INFO, logger="engine.quant.attach"):
        engine, got = generate("auto")
    from engine.layers.linear import Linear

    linears = {n: m for n, m in engine.runner.model.named_modules() if isinstance(m, Linear)}
    dense = [n for n, m in linears.items() if m.packed is None]
    assert not dense, dense
    assert not any("dense projections" in r.getMessage() for r in caplog.records)
    if mix.endswith("_M"):
        assert isinstance(linears["lm_head"].packed, qweights.PackedWeight) and linears["lm_head"].packed.qtype == "Q6_K"
        assert isinstance(linears["layers.0.self_attn.qkv_proj"].packed, qweights.PackedParts)
    _, want = generate("none")
    assert got == want and all(len(v) == 16 for v in got.values())


def test_dense_projections_are_logged_with_their_reason(tmp_path, caplog):
    """Tensors without a packed kernel (here a file's F16 matrices) stay dense, and the load log says which and why."""
    import logging

    from engine.config import CacheConfig, EngineConfig
    from engine.engine import LLMEngine

    path = str(make_tiny_gguf(tmp_path, "llama", "F16"))
    with caplog.at_level(logging.INFO, logger="engine.quant.attach"):
        LLMEngine(EngineConfig(model=path, dtype="float32", cache=CacheConfig(num_blocks=16)))
    line = next(r.getMessage() for r in caplog.records if "dense projections" in r.getMessage())
    assert "self_attn.qkv_proj in 2 layers (F16 256x256, F16 128x256, F16 128x256: F16 has no packed kernel)" in line
    assert "lm_head (F16" in line


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_qtype_layers_run_the_native_decoder_layer_bit_for_bit(tmp_path, arch):
    """A Q4_K_M model's layers whose q/k/v mix Q4_K and Q6_K (and, in Qwen2, carry q/k/v biases)
    run the native decoder layer with one kernel call a part, and give the modular path's tokens and
    log-probabilities to the bit; bf16, so mid-sized batches take the int8-activation kernel too."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import LLMEngine
    from engine.request import SamplingParams
    from tests.engine.native_layers import native_and_modular

    path = str(make_tiny_gguf(tmp_path, arch, "Q4_K_M"))
    cfg = EngineConfig(model=path, dtype="bfloat16", cache=CacheConfig(num_blocks=64, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    engine = LLMEngine(cfg)
    model = engine.runner.model
    mixed = [i for i, layer in enumerate(model.layers) if isinstance(layer.self_attn.qkv_proj.packed, qweights.PackedParts)]
    assert mixed and all(layer.packed is not None for layer in model.layers)
    prompts = ["the hat", "a tent in the", " ".join(["word"] * 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)

    native, modular = native_and_modular(engine, prompts, params)
    assert native == modular and all(len(v) == 8 for v in native.values())
