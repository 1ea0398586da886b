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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16_model_routes_small_batches_to_the_kernel_and_generates_as_f_linear(tmp_path, arch):
    """A bf16 model from a Hugging Face directory (Llama: its own LM head; Qwen2: q/k/v biases and
    the LM head tied to the embedding): every projection and the LM head take the
    kernel for batches of up to DENSE_BF16_MAX_ROWS rows, and greedy decoding gives F.linear's tokens."""
    from tests.tiny_models import make_tiny_hf_model

    from engine.config import CacheConfig, EngineConfig
    from engine.engine import LLMEngine
    from engine.layers.linear import Linear
    from engine.quant.routing import DENSE_BF16_MAX_ROWS
    from engine.request import SamplingParams

    path = str(make_tiny_hf_model(tmp_path, arch))
    engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", cache=CacheConfig(num_blocks=64)))
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.dense_max_rows == DENSE_BF16_MAX_ROWS for m in linears)
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
    for m in linears:
        m.dense_max_rows = 0
    assert generate() == native_tokens
    x = torch.randn(3, linears[0].in_features).to(torch.bfloat16)
    torch.testing.assert_close(linears[0].dense_op(x, linears[0].weight, linears[0].bias, True),
                               F.linear(x.float(), linears[0].weight.float(),
                                        None if linears[0].bias is None else linears[0].bias.float()),
                               rtol=1e-5, atol=1e-3)
