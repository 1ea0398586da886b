"""The native dense bf16 kernel (engine/csrc/dense_bf16.cpp) that serves small batches of a model
loaded from a Hugging Face directory: its products against float32 ones, and the routing that sends
a bf16 model's decode steps to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import native

mod = native.module_with("dense_bf16_forward")
pytestmark = pytest.mark.skipif(mod is None or not mod.dense_bf16_supported(), reason="needs AVX512-BF16")


@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (2, 37, 96), (3, 100, 50), (4, 256, 2048), (7, 17, 33), (5, 1, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_float32_within_bf16_rounding(m, n, k, bias):
    """Every row count, output count and K (tails of the 4-row tiles, of the 16-row units and of the
    32-element steps): the float32 output equals the float32 product of the bf16 values to float32
    accumulation error, and the bf16 output is that value rounded."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    ref = x.float() @ w.float().t() + (b.float() if bias else 0)
    got = mod.dense_bf16_forward(x, w, b, True)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * k**0.5)
    got16 = mod.dense_bf16_forward(x, w, b)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)


def test_strided_rows_and_columns_are_read_as_their_values():
    x = torch.randn(6, 128).to(torch.bfloat16)
    w = torch.randn(48, 64).to(torch.bfloat16)
    for view in (x[::2, :64], x[:, ::2]):  # a row stride, then a column stride (copied first)
        torch.testing.assert_close(mod.dense_bf16_forward(view, w, None, True), view.float() @ w.float().t(),
                                   rtol=1e-5, atol=1e-3)


def test_bad_inputs_are_refused():
    w = torch.randn(8, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="K"):
        mod.dense_bf16_forward(torch.randn(1, 16).to(torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="bf16"):
        mod.dense_bf16_forward(torch.randn(1, 32), w)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """dense_bf16_pack's inverse: [N/16, K/2, 16, 2] -> [N, K]."""
    groups, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(groups * 16, pairs * 2)[:n]


@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (2, 37, 96), (5, 100, 50), (6, 16, 2), (7, 17, 34), (13, 1, 2048), (64, 80, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_match_float32_within_bf16_rounding(m, n, k, bias):
    """The repacked weight's kernel, across the tails of its 6-row tiles, 4-group units and 16-row
    groups: float32 output equals the float32 product to accumulation error, bf16 output is it
    rounded; the packing loses nothing (unpacking gives the weight back)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    packed = mod.dense_bf16_pack(w)
    assert torch.equal(unpack(packed, n), w)
    ref = x.float() @ w.float().t() + (b.float() if bias else 0)
    got = mod.dense_bf16_packed_forward(x, packed, n, b, True)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * k**0.5)
    got16 = mod.dense_bf16_packed_forward(x, packed, n, b)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    view = torch.randn(m, k + 3, generator=g).to(torch.bfloat16)[:, 1 : k + 1]  # rows at an odd element offset
    torch.testing.assert_close(mod.dense_bf16_packed_forward(view, packed, n, None, True), view.float() @ w.float().t(),
                               rtol=1e-5, atol=1e-4 * k**0.5)


def test_packed_bad_inputs_are_refused():
    packed = mod.dense_bf16_pack(torch.randn(40, 32).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        mod.dense_bf16_packed_forward(torch.randn(1, 16).to(torch.bfloat16), packed, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        mod.dense_bf16_packed_forward(torch.randn(1, 32).to(torch.bfloat16), packed, 20)
    with pytest.raises(RuntimeError, match="bias"):
        mod.dense_bf16_packed_forward(torch.randn(1, 32).to(torch.bfloat16), packed, 40, torch.randn(40))
    with pytest.raises(RuntimeError, match="K even"):
        mod.dense_bf16_pack(torch.randn(8, 31).to(torch.bfloat16))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16_model_runs_on_the_kernels_and_generates_as_f_linear(tmp_path, arch):
    """A bf16 model from a Hugging Face directory (Llama: its own LM head; Qwen2: q/k/v biases and
    the LM head tied to the embedding): every projection it owns alone is repacked (its plain copy
    freed), a tied LM head takes the as-is kernel for batches of up to DENSE_BF16_MAX_ROWS rows, and
    greedy decoding gives the tokens of F.linear on the same weights."""
    from tests.tiny_models import make_tiny_hf_model

    from engine.config import CacheConfig, EngineConfig
    from engine.engine import LLMEngine
    from engine.layers.linear import Linear
    from engine.quant.routing import DENSE_BF16_MAX_ROWS
    from engine.request import SamplingParams

    path = str(make_tiny_hf_model(tmp_path, arch))
    engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", cache=CacheConfig(num_blocks=64)))
    model = engine.runner.model
    named = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    tied = {name for name, m in named.items() if m.weight is model.embed_tokens.weight}
    assert tied == ({"lm_head"} if arch == "qwen2" else set())
    for name, m in named.items():
        if name in tied:
            assert m.dense_packed is None and m.dense_max_rows == DENSE_BF16_MAX_ROWS
        else:
            assert m.dense_packed is not None and m.weight.numel() == 0, name
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def generate() -> dict:
        out: dict = {}
        for i, p in enumerate(["the hat", "a tent in the"]):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished():
            for d in engine.step()[0]:
                out.setdefault(d.request_id, []).extend(d.new_token_ids)
        return out

    native_tokens = generate()
    for m in named.values():  # back to the plain weights on F.linear
        if m.dense_packed is not None:
            m.weight = torch.nn.Parameter(unpack(m.dense_packed, m.out_features).clone(), requires_grad=False)
        m.dense_packed, m.dense_op, m.dense_max_rows = None, None, 0
    assert generate() == native_tokens
