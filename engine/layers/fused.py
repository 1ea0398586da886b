"""Element-wise building blocks of a Llama layer, each one fused into a single pass where a kernel exists.

Every function has a torch implementation (the ``*_ref`` functions: the reference, and the path
when the native extension is unavailable or the inputs are not its case); native versions
(``engine/csrc/fused.cpp``: one pybind11 call each, AVX-512/AVX2/scalar) must match it.  At batch 1
the torch versions cost ~30 tensor ops per layer, a few microseconds each, which is a large share
of a 5 ms token; the native ones cost one call each.

The in-place variants (``add_rms_norm_``, ``apply_rope_``) also save the output allocations; the
model uses them where the inputs are dead afterwards.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

_UNSET: Any = object()
_native: Any = _UNSET
_DTYPES = (torch.bfloat16, torch.float32)


def _ops() -> Optional[Any]:
    """The native extension when it has the fused ops (built on first use), else None."""
    global _native
    if _native is _UNSET:
        from engine import native

        mod = native.load()
        _native = mod if mod is not None and hasattr(mod, "fused_rms_norm") else None
    return _native


def _rows_ok(x: torch.Tensor) -> bool:
    """A tensor the native kernels take: 2-D CPU [T, H] bf16/fp32 with a contiguous last dim."""
    return x.dim() == 2 and x.dtype in _DTYPES and x.stride(1) == 1 and x.device.type == "cpu"


# ---------------------------------------------------------------- torch reference


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to x's dtype (as Hugging Face's LlamaRMSNorm does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    return rms_norm_ref(x, weight, eps), x


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]


def apply_rope_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    cs = cos_sin.index_select(0, positions)
    half = head_size // 2
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.reshape(t, -1, head_size).float()
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.reshape(t, -1)

    return rot(q).to(q.dtype), rot(k).to(k.dtype)


# ---------------------------------------------------------------- public ops (native when possible)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to x's dtype (as Hugging Face's LlamaRMSNorm does)."""
    ops = _ops()
    if ops is not None and _rows_ok(x) and weight.dtype == x.dtype and weight.is_contiguous():
        return ops.fused_rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm residual stream in one call."""
    ops = _ops()
    if ops is not None and _rows_ok(x) and weight.dtype == x.dtype and weight.is_contiguous():
        if residual is None:
            return ops.fused_rms_norm(x, weight, eps), x
        if _rows_ok(residual) and residual.dtype == x.dtype and residual.shape == x.shape:
            return ops.fused_add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def add_rms_norm_(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`add_rms_norm`: ``residual`` becomes x + residual and ``x`` its norm;
    returns ``(x, residual)``.  Without a residual (first layer) x itself becomes the residual and
    the norm is a new tensor: ``(rms_norm(x), x)``.  x's old values are lost."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    ops = _ops()
    if (
        ops is not None
        and _rows_ok(x)
        and _rows_ok(residual)
        and residual.dtype == x.dtype
        and residual.shape == x.shape
        and weight.dtype == x.dtype
        and weight.is_contiguous()
    ):
        ops.fused_add_rms_norm_(x, residual, weight, eps)
        return x, residual
    residual.add_(x)
    x.copy_(rms_norm_ref(residual, weight, eps))
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, for gate_up = [gate | up] along the last dim."""
    ops = _ops()
    if ops is not None and _rows_ok(gate_up) and gate_up.shape[1] % 2 == 0:
        return ops.fused_silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)


def _rope_ok(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    return (
        _rows_ok(q)
        and _rows_ok(k)
        and k.dtype == q.dtype
        and positions.dtype == torch.int64
        and positions.dim() == 1
        and positions.is_contiguous()
        and cos_sin.dtype == torch.float32
        and cos_sin.stride(-1) == 1
    )


def apply_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, GPT-NeoX layout (rotate halves), as Hugging Face Llama/Qwen2 use.

    q: [T, Hq*D], k: [T, Hkv*D]; cos_sin: float32 [max_pos, D] = [cos | sin] of half width.
    Returns new tensors.
    """
    ops = _ops()
    if ops is not None and _rope_ok(positions, q, k, cos_sin):
        return ops.fused_rope(positions, q, k, cos_sin, head_size, False)
    return apply_rope_ref(positions, q, k, cos_sin, head_size)


def apply_rope_(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`apply_rope`: rotates q and k where they are (e.g. column slices of the qkv
    projection's output) and returns them."""
    ops = _ops()
    if ops is not None and _rope_ok(positions, q, k, cos_sin):
        return ops.fused_rope(positions, q, k, cos_sin, head_size, True)
    q_rot, k_rot = apply_rope_ref(positions, q, k, cos_sin, head_size)
    q.copy_(q_rot)
    k.copy_(k_rot)
    return q, k
