"""CPU attention backend: paged KV cache writes and attention over it.

The backend declares ``forward_includes_kv_cache_update = False``: the attention
layer (``engine/attention/layer.py``) calls ``do_kv_cache_update`` and then
``forward`` on every layer.  Kernel selection happens here, at run time, from
dtype, block size, head size and KV-cache dtype (``_get_attn_isa``); the chosen
ISA is never part of the metadata, so one metadata object serves any kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.attention.kernels import ops, ref


@dataclass
class CPUAttentionMetadata:
    """Per-step description of a mixed batch, shared by every layer.

    Requests are laid out decodes first, then prefills (whole prompts or prompt
    chunks after already-cached context).  Token ``t`` of request ``i`` sits in
    rows ``query_start_loc[i]:query_start_loc[i+1]`` and attends to cache
    positions ``[0, seq_lens[i])``; its own position is
    ``seq_lens[i] - query_len + (t - query_start_loc[i])``.
    """

    num_actual_tokens: int
    num_decodes: int  # requests with exactly one query token, first in the batch
    num_decode_tokens: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs], context length including this step's tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens], block_id * block_size + offset; negative = padding
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    # Host-side copies, so kernels that loop in Python (the ref kernel) avoid .tolist() per layer.
    query_start_loc_list: Optional[list[int]] = None
    seq_lens_list: Optional[list[int]] = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])


class CPUAttentionBackend:
    """Names the pieces a model runner needs; mirrors vLLM's backend classes."""

    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type["CPUAttentionBackendImpl"]:
        return CPUAttentionBackendImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches as views of the single per-layer tensor (no copy)."""
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return {
        "auto": model_dtype, "bfloat16": torch.bfloat16, "float32": torch.float32,
        "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8,
    }[kv_cache_dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """What ``auto`` stores here: int8 for bf16 models where decode attention reads it in place
    (``ops.int8_decode_path``: the native AVX-512 VNNI and AVX2 paths), else the model dtype.
    Engine alone, 32 streams, bf16 -> int8 alternating: attention 11.8 -> 7.7 ms a step on the VNNI
    path (half the bytes, products without widening), 13.0 -> 10.4 ms on the AVX2 one (forced on
    an AVX-512 host; half the bytes, the same instructions)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if model_dtype == torch.bfloat16 and ops.int8_decode_path(_get_attn_isa(model_dtype, block_size, head_size, "int8")):
        return "int8"
    return str(model_dtype).removeprefix("torch.")


def _row_bytes(head_size: int, cache_dtype: torch.dtype) -> int:
    """Bytes per cache row (one token, one kv head): K and V, and an int8 cache's two scales."""
    elem = torch.empty(0, dtype=cache_dtype).element_size()
    return 2 * head_size * elem + (ref.INT8_SCALE_BYTES if cache_dtype == torch.int8 else 0)


def kv_cache_bytes_per_block(block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype) -> int:
    """Bytes one block takes in one layer's cache."""
    return num_kv_heads * block_size * _row_bytes(head_size, cache_dtype)


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype
) -> torch.Tensor:
    """One layer's cache, shaped ``get_kv_cache_shape``.  An int8 cache is the [..., :2 * head_size]
    view of rows that carry their scales after them (``ref.int8_row_scales``), so it is still one
    tensor per layer.  torch.empty: pages become resident as blocks fill."""
    shape = CPUAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    if cache_dtype != torch.int8:
        return torch.empty(shape, dtype=cache_dtype)
    rows = torch.empty(*shape[:-1], _row_bytes(head_size, cache_dtype), dtype=torch.int8)
    return rows[..., : shape[-1]]


def _get_attn_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> str:
    """Pick the attention kernel for this configuration on this CPU.

    ``amx`` needs bf16 and AMX tiles, ``vec512`` AVX-512, ``vec256`` AVX2; each native
    kernel handles a fixed set of head sizes and block sizes that are multiples of 16
    (AMX tiles) or 8.  Anything else runs the portable torch ``ref`` kernel.
    """
    return ops.select_isa(dtype, block_size, head_size, kv_cache_dtype)


class CPUAttentionBackendImpl:
    """One instance per attention layer; stateless apart from its configuration."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        model_dtype: torch.dtype = torch.bfloat16,
        attn_type: str = "decoder",
    ) -> None:
        self.num_heads = num_heads
        self.attn_type = attn_type
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.block_size = block_size
        self.model_dtype = model_dtype
        self.isa = _get_attn_isa(model_dtype, block_size, head_size, kv_cache_dtype)

    def describe(self) -> str:
        """The kernel path, for the start-up log (``ref``, ``vec512 (bf16 products: fma)``, ...)."""
        return ops.describe(self.isa, self.model_dtype, self.kv_cache_dtype)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write each new token's K and V into its slot; padding slots (< 0) are skipped.

        ``key``/``value``: [num_tokens, num_kv_heads, head_size] in the model dtype.
        fp8 caches store ``x / scale`` with the layer's ``k_scale`` / ``v_scale``; int8 caches
        store each row with its own scale (``ref.quantize_int8_rows``).
        """
        ops.reshape_and_cache(
            self.isa, key, value, kv_cache, slot_mapping, self.kv_cache_dtype, layer.k_scale, layer.v_scale
        )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Attend each query over its request's paged context; writes into and returns ``output``.

        ``query``: [num_tokens, num_heads, head_size]; ``output``: same shape.  The new
        tokens' K/V were already written by ``do_kv_cache_update``, so every kernel reads
        keys and values from the cache only.  Encoder-only layers never touch the cache:
        they attend, non-causally, over the key/value they are given.
        """
        if self.attn_type == "encoder_only":
            assert key is not None and value is not None, "encoder-only attention needs key and value"
            qsl = attn_metadata.query_start_loc_list or attn_metadata.query_start_loc.tolist()
            ref.varlen_attention(query, key, value, qsl, self.scale, output, causal=False)
            return output
        ops.paged_attention(
            self.isa,
            query,
            kv_cache,
            attn_metadata,
            self.scale,
            self.kv_cache_dtype,
            layer.k_scale,
            layer.v_scale,
            output,
        )
        return output
