"""Portable pure-torch attention kernels: the reference every native kernel is tested against.

Also the fallback on CPUs or configurations no native kernel covers, so it must
be correct for every case the backend accepts: fp8 and int8 caches, GQA, mixed
batches of decodes and prompt chunks that start after cached context.  The cache
layout (an int8 cache's scales after each row included) is ``engine/kv_cache/layout.py``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kv_cache.layout import int8_row_scales


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Last dim -> int8 round(x * 127 / max|x|) (half to even) and the scale max|x| / 127 (0 for zeros)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    # A true division (``127.0 / amax`` would multiply by amax's reciprocal), as the native write does.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(x * inv).to(torch.int8), (amax / 127.0).squeeze(-1)


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
    if kv_cache.dtype == torch.int8:
        (kq, ks), (vq, vs) = quantize_int8_rows(key), quantize_int8_rows(value)
        kv_cache[blocks, :, offsets, :head_size] = kq
        kv_cache[blocks, :, offsets, head_size:] = vq
        int8_row_scales(kv_cache)[blocks, :, offsets] = torch.stack([ks, vs], -1)
        return
    kv_cache[blocks, :, offsets, :head_size] = _store(key, kv_cache.dtype, k_scale)
    kv_cache[blocks, :, offsets, head_size:] = _store(value, kv_cache.dtype, v_scale)


def _gather_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype, k_scale: float, v_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first ``seq_len`` positions: [num_kv_heads, seq_len, head_size] each."""
    head_size = kv_cache.shape[-1] // 2
    num_blocks = -(-seq_len // kv_cache.shape[2])

    def rows(t: torch.Tensor) -> torch.Tensor:  # [nb, Hkv, B, X] -> [Hkv, seq_len, X]
        t = t[block_ids[:num_blocks]]
        return t.permute(1, 0, 2, 3).reshape(t.shape[1], -1, t.shape[-1])[:, :seq_len]

    ctx = rows(kv_cache)
    if kv_cache.dtype == torch.int8:
        sc = rows(int8_row_scales(kv_cache))
        k = (ctx[..., :head_size].float() * sc[..., :1]).to(dtype)
        return k, (ctx[..., head_size:].float() * sc[..., 1:]).to(dtype)
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
