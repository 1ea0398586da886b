"""Portable pure-torch attention kernels: the reference every native kernel is tested against.

Also the fallback on CPUs or configurations no native kernel covers, so it must
be correct for every case the backend accepts: fp8 caches, GQA, mixed batches of
decodes and prompt chunks that start after cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _store(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (x.float() / scale).to(cache_dtype)
    return x.to(cache_dtype)


def _load(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """kv_cache[block, :, offset, :D] = key; [..., D:] = value, for every token with slot >= 0."""
    block_size = kv_cache.shape[2]
    head_size = key.shape[-1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv_cache[blocks, :, offsets, :head_size] = _store(key, kv_cache.dtype, k_scale)
    kv_cache[blocks, :, offsets, head_size:] = _store(value, kv_cache.dtype, v_scale)


def _gather_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype, k_scale: float, v_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first ``seq_len`` positions: [num_kv_heads, seq_len, head_size] each."""
    head_size = kv_cache.shape[-1] // 2
    num_blocks = -(-seq_len // kv_cache.shape[2])
    ctx = kv_cache[block_ids[:num_blocks]]  # [nb, Hkv, B, 2D]
    ctx = ctx.permute(1, 0, 2, 3).reshape(kv_cache.shape[1], -1, 2 * head_size)[:, :seq_len]
    return _load(ctx[..., :head_size], dtype, k_scale), _load(ctx[..., head_size:], dtype, v_scale)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    output: torch.Tensor,
    causal: bool = True,
) -> None:
    """Causal attention of each request's queries over its cached context, one request at a time.

    Query row ``j`` of a request with ``q`` queries and ``L`` context positions sits at
    position ``L - q + j`` and sees positions ``<= L - q + j``.
    """
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[1]
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k, v = _gather_context(kv_cache, block_table[i], seq_len, query.dtype, k_scale, v_scale)
        q = query[start:end].transpose(0, 1)  # [H, q, D]
        mask = None
        if causal and q_len > 1:
            pos_q = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            mask = torch.arange(seq_len).unsqueeze(0) <= pos_q  # [q, L]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        output[start:end] = out.transpose(0, 1)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: list[int],
    scale: float,
    output: torch.Tensor,
    causal: bool,
) -> None:
    """Attention over the step's own keys/values (no cache): encoder-only layers."""
    enable_gqa = query.shape[1] != key.shape[1]
    for i in range(len(query_start_loc) - 1):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        out = F.scaled_dot_product_attention(
            query[s:e].transpose(0, 1),
            key[s:e].transpose(0, 1),
            value[s:e].transpose(0, 1),
            is_causal=causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        output[s:e] = out.transpose(0, 1)
