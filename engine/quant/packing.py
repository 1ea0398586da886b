"""Building packed weights at load time: a GGUF file's tensors (or a dense weight) -> the
:mod:`engine.quant.weights` the kernels multiply, or the reason there is no kernel for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from engine.quant.blocks import GROUP_ROWS, QTYPE_IDS, block_weights, pack_blocks, quantize_blocks
from engine.quant.weights import PackedParts, PackedWeight, native_available

if TYPE_CHECKING:
    from engine.loader.types import GGUFTensor


def packing_refusal(tensors: Sequence["GGUFTensor"]) -> Optional[str]:
    """Why the row-concatenation of these GGUF tensors cannot be packed (None: it can)."""
    if not tensors:
        return "no tensors"
    k = int(tensors[0].shape[1])
    if any(int(t.shape[1]) != k for t in tensors):
        return "in_features differ"
    for t in tensors:
        if t.qtype not in QTYPE_IDS:
            return f"{t.qtype} has no packed kernel"
        if k % block_weights(t.qtype):
            return f"{t.qtype} needs in_features divisible by {block_weights(t.qtype)}, got {k}"
    if len({t.qtype for t in tensors}) > 1 and any(int(t.shape[0]) % GROUP_ROWS for t in tensors[:-1]):
        return "mixed qtypes with a part of rows not divisible by 16"
    if not native_available():
        return "no native extension"
    return None


def packable(tensors: Sequence["GGUFTensor"]) -> bool:
    """Whether :func:`pack_gguf` packs these tensors (:func:`packing_refusal` finds no reason not to)."""
    return packing_refusal(tensors) is None


def pack_gguf(
    tensors: Sequence["GGUFTensor"], isa: Optional[str] = None, act_bits: Optional[int] = None
) -> "Optional[PackedWeight | PackedParts]":
    """Pack the row-concatenation of GGUF tensors (e.g. q, k, v -> qkv_proj), or None when there is
    no kernel for them (:func:`packing_refusal` says why).  Tensors of one qtype become one
    PackedWeight; mixed qtypes a PackedParts of each run of equal ones."""
    if packing_refusal(tensors) is not None:
        return None
    runs: list[list["GGUFTensor"]] = []
    for t in tensors:
        if runs and runs[-1][0].qtype == t.qtype:
            runs[-1].append(t)
        else:
            runs.append([t])
    parts = []
    for run in runs:
        qtype, k = run[0].qtype, int(run[0].shape[1])
        n = sum(int(t.shape[0]) for t in run)
        raw = run[0].data if len(run) == 1 else torch.cat([t.data for t in run], dim=0)
        parts.append(PackedWeight(pack_blocks(raw, qtype, (n, k)), qtype, (n, k), isa, act_bits))
    return parts[0] if len(parts) == 1 else PackedParts(parts)


def quantize_dense(
    w: torch.Tensor, qtype: str, isa: Optional[str] = None, act_bits: Optional[int] = None
) -> PackedWeight:
    """Quantize a dense weight [N, K] to ``qtype`` (one of blocks.QUANTIZE_TYPES; opt-in, lossy:
    Q8_0 ~0.4% relative error per weight, the 4-bit types ~10%) and pack it."""
    n, k = (int(d) for d in w.shape)
    return PackedWeight(pack_blocks(quantize_blocks(w, qtype), qtype, (n, k)), qtype, (n, k), isa, act_bits)
