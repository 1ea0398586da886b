"""Native fused element-wise ops (engine/csrc/fused.cpp) against their torch references, per ISA path."""

from __future__ import annotations

import pytest
import torch

from engine.layers import fused
from engine.platform import Isa

FUSED_PATHS = [Isa.SCALAR, Isa.AVX2, Isa.AVX512, Isa.AVX512_BF16]  # every path fused.cpp has


def _ops():
    ops = fused._ops()
    if ops is None:
        pytest.skip("native extension unavailable")
    return ops


def _isas() -> list[int]:
    ops = fused._ops()
    return list(ops.fused_isas()) if ops is not None else []


@pytest.fixture(params=FUSED_PATHS, ids=lambda i: i.label)
def isa(request):
    ops = _ops()
    if request.param not in ops.fused_isas():
        pytest.skip(f"{request.param.label} not supported on this CPU")
    ops.fused_set_isa(request.param)
    yield request.param
    ops.fused_set_isa(-1)


DTYPES = [torch.bfloat16, torch.float32]


def _tol(dtype):
    # bf16: results may differ from torch by one rounding step (sum order, exp's last bit)
    return dict(atol=2e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)


def _close_bf16_ulps(a: torch.Tensor, b: torch.Tensor, max_frac: float = 0.02) -> None:
    """bf16 outputs: nearly all elements equal, the rest within 1 ulp-ish."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype == torch.bfloat16:
        diff = (a.float() - b.float()).abs()
        mismatch = (diff > 0).float().mean().item()
        assert mismatch <= max_frac, f"{mismatch:.3%} of elements differ"
    torch.testing.assert_close(a, b, **_tol(a.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 576), (3, 67), (16, 576), (100, 576), (5, 8), (2, 2048)])
def test_rms_norm(isa, dtype, t, h):
    torch.manual_seed(t * 1000 + h)
    x = (torch.randn(t, h) * 3).to(dtype)
    w = (torch.rand(h) + 0.5).to(dtype)
    out = fused.rms_norm(x, w, 1e-5)
    _close_bf16_ulps(out, fused.rms_norm_ref(x, w, 1e-5))


def test_add_rms_norm_nan(isa):
    """A NaN in the residual stream stays NaN in the stored sum and poisons its own row only, in
    every path (the bf16 rounding instruction of avx512-bf16 must not turn it into a number)."""
    torch.manual_seed(1)
    x = torch.randn(2, 64).bfloat16()
    res = torch.randn(2, 64).bfloat16()
    x[0, 5] = float("nan")
    w = torch.rand(64).bfloat16() + 0.5
    ref_out, ref_sum = fused.add_rms_norm_ref(x, res, w, 1e-6)
    out, s = fused.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(s.isnan(), ref_sum.isnan()) and s.isnan().sum() == 1
    assert torch.equal(s[~s.isnan()], ref_sum[~ref_sum.isnan()])
    assert out[0].isnan().all()
    _close_bf16_ulps(out[1:], ref_out[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 576), (3, 67), (100, 576), (7, 1000)])
def test_add_rms_norm(isa, dtype, t, h):
    torch.manual_seed(t + h)
    x = torch.randn(t, h).to(dtype)
    res = (torch.randn(t, h) * 4).to(dtype)
    w = (torch.rand(h) + 0.5).to(dtype)
    ref_out, ref_sum = fused.add_rms_norm_ref(x, res, w, 1e-6)
    out, s = fused.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(s, ref_sum)  # one rounding of the same sum: bit-exact
    _close_bf16_ulps(out, ref_out)

    # in place: residual <- x + residual, x <- norm
    x2, res2 = x.clone(), res.clone()
    a, b = fused.add_rms_norm_(x2, res2, w, 1e-6)
    assert a is x2 and b is res2
    assert torch.equal(res2, ref_sum)
    _close_bf16_ulps(x2, ref_out)


def test_add_rms_norm_without_residual(isa):
    x = torch.randn(4, 576, dtype=torch.bfloat16)
    w = torch.rand(576, dtype=torch.bfloat16)
    for fn in (fused.add_rms_norm, fused.add_rms_norm_):
        out, res = fn(x, None, w, 1e-5)
        assert res is x
        _close_bf16_ulps(out, fused.rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_strided_rows(isa, dtype):
    """Row-strided views (e.g. a slice of a wider buffer) are read and written in place correctly."""
    base = torch.randn(6, 700).to(dtype)
    x = base[:, 50:626]
    w = torch.rand(576).to(dtype)
    _close_bf16_ulps(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5))
    rbase = torch.randn(6, 640).to(dtype)
    res = rbase[:, 64:]
    ref_out, ref_sum = fused.add_rms_norm_ref(x, res, w, 1e-5)
    before = base.clone()
    fused.add_rms_norm_(x, res, w, 1e-5)
    assert torch.equal(res, ref_sum)
    _close_bf16_ulps(x, ref_out)
    assert torch.equal(base[:, :50], before[:, :50]) and torch.equal(base[:, 626:], before[:, 626:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 1536), (3, 37), (64, 1536), (2, 8)])
def test_silu_and_mul(isa, dtype, t, d):
    torch.manual_seed(d)
    gu = (torch.randn(t, 2 * d) * 4).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -87.5])
    out = fused.silu_and_mul(gu)
    _close_bf16_ulps(out, fused.silu_and_mul_ref(gu))


def test_silu_and_mul_strided(isa):
    base = torch.randn(5, 3100, dtype=torch.bfloat16)
    gu = base[:, 10:3082]
    _close_bf16_ulps(fused.silu_and_mul(gu), fused.silu_and_mul_ref(gu))


def _cos_sin(max_pos: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat((f.cos(), f.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (5, 4, 2, 128), (70, 9, 3, 64), (3, 2, 1, 20)])
def test_rope_on_qkv_slices(isa, dtype, t, hq, hkv, d):
    """q and k are column slices of the qkv projection's output, rotated in place; v is untouched."""
    torch.manual_seed(t * hq)
    cs = _cos_sin(4096, d)
    positions = torch.randint(0, 4096, (t,), dtype=torch.int64)
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref_q, ref_k = fused.apply_rope_ref(positions, q, k, cs, d)
    v_before = v.clone()

    new_q, new_k = fused.apply_rope(positions, q, k, cs, d)
    _close_bf16_ulps(new_q, ref_q, max_frac=0.0 if dtype == torch.float32 else 0.01)
    _close_bf16_ulps(new_k, ref_k, max_frac=0.0 if dtype == torch.float32 else 0.01)

    a, b = fused.apply_rope_(positions, q, k, cs, d)
    assert a is q and b is k
    _close_bf16_ulps(q, ref_q, max_frac=0.0 if dtype == torch.float32 else 0.01)
    _close_bf16_ulps(k, ref_k, max_frac=0.0 if dtype == torch.float32 else 0.01)
    assert torch.equal(v, v_before)


def test_rope_rejects_out_of_range_positions():
    ops = _ops()
    cs = _cos_sin(16, 64)
    q = torch.randn(1, 128)
    k = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="outside the cos_sin cache"):
        ops.fused_rope(torch.tensor([16]), q, k, cs, 64, False)


def test_fallbacks_for_unsupported_inputs():
    """float16 and 3-D inputs take the torch path and still give the reference result."""
    x = torch.randn(2, 3, 64, dtype=torch.float16)
    w = torch.rand(64, dtype=torch.float16)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5))
    gu = torch.randn(2, 3, 64)
    torch.testing.assert_close(fused.silu_and_mul(gu), fused.silu_and_mul_ref(gu))
    x2 = torch.randn(4, 64, dtype=torch.float16)
    res = torch.randn(4, 64, dtype=torch.float16)
    ref = fused.add_rms_norm_ref(x2, res, w, 1e-5)
    out = fused.add_rms_norm_(x2.clone(), res.clone(), w, 1e-5)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_strided_inputs(dtype):
    """A non-contiguous last dim (a transposed view): out-of-place ops copy, in-place ones fall
    back to torch; results match the reference either way and the in-place ops still write through."""
    w = torch.rand(64).to(dtype)
    xt = torch.randn(64, 5).to(dtype).t()  # [5, 64], stride (1, 5)
    rt = torch.randn(64, 5).to(dtype).t()
    _close_bf16_ulps(fused.rms_norm(xt, w, 1e-5), fused.rms_norm_ref(xt, w, 1e-5))
    ref_out, ref_sum = fused.add_rms_norm_ref(xt, rt, w, 1e-5)
    out, s = fused.add_rms_norm(xt, rt, w, 1e-5)
    _close_bf16_ulps(out, ref_out)
    assert torch.equal(s, ref_sum)
    x2, r2 = xt.clone().t().contiguous().t(), rt.clone().t().contiguous().t()
    a, b = fused.add_rms_norm_(x2, r2, w, 1e-5)
    assert a is x2 and b is r2 and x2.stride() == (1, 5)
    _close_bf16_ulps(x2, ref_out)
    assert torch.equal(r2, ref_sum)
    gu = torch.randn(128, 3).to(dtype).t()
    _close_bf16_ulps(fused.silu_and_mul(gu), fused.silu_and_mul_ref(gu))
    cs = _cos_sin(64, 16)
    pos = torch.tensor([3, 1, 60])
    q = torch.randn(32, 3).to(dtype).t()
    k = torch.randn(16, 3).to(dtype).t()
    rq, rk = fused.apply_rope_ref(pos, q, k, cs, 16)
    nq, nk = fused.apply_rope(pos, q, k, cs, 16)
    _close_bf16_ulps(nq, rq)
    _close_bf16_ulps(nk, rk)
    fused.apply_rope_(pos, q, k, cs, 16)
    _close_bf16_ulps(q, rq)
    _close_bf16_ulps(k, rk)


def test_mismatched_inputs_fall_back_to_torch():
    """Weight in another dtype than x: torch's promotion rules apply (float32 result)."""
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w32 = torch.rand(64)
    out = fused.rms_norm(x, w32, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, fused.rms_norm_ref(x, w32, 1e-5))


def test_isa_paths_agree():
    """Every ISA path gives the same bf16 result as the best one on identical input (model-sized)."""
    ops = _ops()
    torch.manual_seed(0)
    x = torch.randn(3, 576, dtype=torch.bfloat16)
    w = torch.rand(576, dtype=torch.bfloat16)
    outs = []
    try:
        for i in ops.fused_isas():
            ops.fused_set_isa(i)
            outs.append(fused.rms_norm(x, w, 1e-5))
    finally:
        ops.fused_set_isa(-1)
    for o in outs[1:]:
        _close_bf16_ulps(o, outs[0], max_frac=0.01)
