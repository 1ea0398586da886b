"""GGUF blocks -> float32, bit-identical to ``gguf.quants.dequantize``.

The common types (F32/F16/BF16/Q8_0/Q4_0/Q4_1) with a few torch ops that repeat ``gguf.quants``'s
float32 arithmetic exactly (faster than its numpy code), the rest (K-quants, Q5_*) with
``gguf.quants.dequantize`` itself.  The GGUF loader dequantizes whole tensors with it, a quantized
token embedding (engine/layers/embedding.py) the rows a step gathers, and the packed layout
(engine/quant/blocks.py) its blocks once unpacked.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] values: low nibbles are elements 0..15, high ones 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _dequant_torch(raw: torch.Tensor, qtype: str) -> Optional[torch.Tensor]:
    """float32 dequantization of the common block types with torch: faster than the numpy reference,
    and bit-identical to it (the same float32 operations in the same order; tests check equality).
    Returns None for types left to ``gguf.quants.dequantize``."""
    rows = raw.shape[0]
    if qtype == "F32":
        return raw.view(torch.float32)
    if qtype == "F16":
        return raw.view(torch.float16).float()
    if qtype == "BF16":
        return raw.view(torch.bfloat16).float()
    if qtype == "Q8_0":
        b = raw.reshape(-1, 34)
        d = b[:, :2].contiguous().view(torch.float16).float()
        return (b[:, 2:].contiguous().view(torch.int8).float() * d).reshape(rows, -1)
    if qtype == "Q4_0":
        b = raw.reshape(-1, 18)
        d = b[:, :2].contiguous().view(torch.float16).float()
        q = _unpack_nibbles(b[:, 2:]).to(torch.int8) - 8
        return (d * q.float()).reshape(rows, -1)
    if qtype == "Q4_1":
        b = raw.reshape(-1, 20)
        d = b[:, :2].contiguous().view(torch.float16).float()
        m = b[:, 2:4].contiguous().view(torch.float16).float()
        return ((d * _unpack_nibbles(b[:, 4:]).float()) + m).reshape(rows, -1)
    return None


def dequantize_rows(raw: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    """float32 [rows, cols] from raw GGUF rows uint8 [rows, bytes_per_row] of any supported type.

    Bit-identical to ``gguf.quants.dequantize`` (the common types with torch ops, the rest with
    gguf's numpy code).
    """
    dense = _dequant_torch(raw, qtype)
    if dense is None:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        dense = torch.from_numpy(np.ascontiguousarray(dequantize(raw.numpy(), GGMLQuantizationType[qtype])))
    return dense.reshape(raw.shape[0], cols)
