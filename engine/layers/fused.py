"""Element-wise building blocks of a Llama layer, each one fused into a single pass where a kernel exists.

Every function has a torch implementation (the reference, and the path when the
native extension is unavailable); native versions must match it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to x's dtype (as Hugging Face's LlamaRMSNorm does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm residual stream in one call."""
    if residual is not None:
        x = x + residual
    return rms_norm(x, weight, eps), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, for gate_up = [gate | up] along the last dim."""
    d = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :d]) * gate_up[..., d:]


def apply_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, GPT-NeoX layout (rotate halves), as Hugging Face Llama/Qwen2 use.

    q: [T, Hq*D], k: [T, Hkv*D]; cos_sin: float32 [max_pos, D] = [cos | sin] of half width.
    """
    cs = cos_sin.index_select(0, positions)
    half = head_size // 2
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, head_size).float()
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.reshape(t, -1)

    return rot(q).to(q.dtype), rot(k).to(k.dtype)
