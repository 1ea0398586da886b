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


def _ops() -> Optional[Any]:
    """The native extension when it has the fused ops (built on first use), else None."""
    global _native
    if _native is _UNSET:
        from engine import native

        _native = native.module_with("fused_rms_norm")
    return _native


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
#
# The native ops check their inputs themselves (dtype, dims, device, shapes) and answer None (or
# False) for anything they do not handle, so the hot path here is one call; the torch reference
# runs for the rest (float16, 3-D inputs, ...).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to x's dtype (as Hugging Face's LlamaRMSNorm does)."""
    ops = _native if _native is not _UNSET else _ops()
    if ops is not None:
        out = ops.fused_rms_norm(x, weight, eps)
        if out is not None:
            return out
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm residual stream in one call."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    ops = _native if _native is not _UNSET else _ops()
    if ops is not None:
        out = ops.fused_add_rms_norm(x, residual, weight, eps)
        if out is not None:
            return out
    return add_rms_norm_ref(x, residual, weight, eps)


def add_rms_norm_(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`add_rms_norm`: ``residual`` becomes x + residual and ``x`` its norm;
    returns ``(x, residual)``.  Without a residual (first layer) x itself becomes the residual and
    the norm is a new tensor: ``(rms_norm(x), x)``.  x's old values are lost."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    ops = _native if _native is not _UNSET else _ops()
    if ops is None or not ops.fused_add_rms_norm_(x, residual, weight, eps):
        residual.add_(x)
        x.copy_(rms_norm_ref(residual, weight, eps))
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, for gate_up = [gate | up] along the last dim."""
    ops = _native if _native is not _UNSET else _ops()
    if ops is not None:
        out = ops.fused_silu_and_mul(gate_up)
        if out is not None:
            return out
    return silu_and_mul_ref(gate_up)


def apply_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, GPT-NeoX layout (rotate halves), as Hugging Face Llama/Qwen2 use.

    q: [T, Hq*D], k: [T, Hkv*D]; cos_sin: float32 [max_pos, D] = [cos | sin] of half width.
    Returns new tensors.
    """
    ops = _native if _native is not _UNSET else _ops()
    if ops is not None:
        out = ops.fused_rope(positions, q, k, cos_sin, head_size, False)
        if out is not None:
            return out
    return apply_rope_ref(positions, q, k, cos_sin, head_size)


def apply_rope_(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place :func:`apply_rope`: rotates q and k where they are (e.g. column slices of the qkv
    projection's output, which stay row-strided views) and returns them."""
    ops = _native if _native is not _UNSET else _ops()
    if ops is not None:
        out = ops.fused_rope(positions, q, k, cos_sin, head_size, True)
        if out is not None:
            return out
    q_rot, k_rot = apply_rope_ref(positions, q, k, cos_sin, head_size)
    q.copy_(q_rot)
    k.copy_(k_rot)
    return q, k
