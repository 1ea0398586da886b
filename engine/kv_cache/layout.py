"""How one layer's KV cache is laid out in memory: shape, storage dtype, bytes per block, allocation.

One tensor per attention layer, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``:
a token's key and value for one kv head are one row ``[K | V]``, so a kernel reads both with
one block/head/row offset.  ``split_kv_cache`` gives the key and value halves as views.

An int8 cache stores each row as int8 with one fp32 scale for K and one for V, max|x| / 127,
kept right after the row: ``[K | V | k_scale | v_scale]``.  Its rows are therefore
``2 * head_size + INT8_SCALE_BYTES`` bytes apart and the cache tensor is the
``[..., :2 * head_size]`` view of them (``int8_row_scales`` views the scales), so it is still
one tensor per layer and the kernels find the scales at a fixed offset after each row.
"""

from __future__ import annotations

import torch

INT8_SCALE_BYTES = 8  # two fp32 scales after each int8 cache row

_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, int, int, int]:
    """The logical shape of one layer's cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches, each ``[num_blocks, num_kv_heads, block_size, head_size]``, as views (no copy)."""
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def int8_row_scales(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, num_kv_heads, block_size, 2] fp32 view of an int8 cache's (k_scale, v_scale) per row."""
    nb, hkv, bs, row = kv_cache.shape
    s0, s1, s2, _ = kv_cache.stride()
    whole = torch.as_strided(kv_cache, (nb, hkv, bs, s2), (s0, s1, s2, 1))
    return whole[..., row : row + INT8_SCALE_BYTES].view(torch.float32)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a ``--kv-cache-dtype`` name stores (``auto``: the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else _TORCH_DTYPES[kv_cache_dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, int8_decodes_in_place: bool) -> str:
    """The storage type ``kv_cache_dtype`` names for this run: ``auto`` is int8 for a bf16 model whose
    decode kernel reads int8 rows in place (``attention.dispatch.int8_decodes_in_place``: half the
    bytes, and no dequantised copy), else the model dtype; any other name stands as given."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if model_dtype == torch.bfloat16 and int8_decodes_in_place:
        return "int8"
    return str(model_dtype).removeprefix("torch.")


def row_bytes(head_size: int, cache_dtype: torch.dtype) -> int:
    """Bytes per cache row (one token, one kv head): K and V, and an int8 cache's two scales."""
    elem = torch.empty(0, dtype=cache_dtype).element_size()
    return 2 * head_size * elem + (INT8_SCALE_BYTES if cache_dtype == torch.int8 else 0)


def kv_cache_bytes_per_block(block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype) -> int:
    """Bytes one block takes in one layer's cache."""
    return num_kv_heads * block_size * row_bytes(head_size, cache_dtype)


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype
) -> torch.Tensor:
    """One layer's cache, shaped ``kv_cache_shape`` (an int8 one with its scales after each row).

    torch.empty, not zeros: pages become resident only as blocks fill, so an idle server's
    resident memory stays at what it has used.
    """
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    if cache_dtype != torch.int8:
        return torch.empty(shape, dtype=cache_dtype)
    rows = torch.empty(*shape[:-1], row_bytes(head_size, cache_dtype), dtype=torch.int8)
    return rows[..., : shape[-1]]
