"""CPU attention backend: paged KV cache writes and attention over it.

The backend declares ``forward_includes_kv_cache_update = False``: the attention
layer (``engine/attention/layer.py``) calls ``do_kv_cache_update`` and then
``forward`` on every layer.  Each Impl picks its kernel once, at construction
(``_get_attn_isa`` -> ``attention/dispatch.py``), from the model dtype, block size,
head size and KV-cache dtype; the per-step metadata (``attention/metadata.py``)
carries nothing kernel-specific beyond the plans dispatch caches in it.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.attention import dispatch
from engine.attention.kernels import ref
from engine.attention.metadata import CPUAttentionMetadata
from engine.kv_cache.layout import kv_cache_shape


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
        """``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (``kv_cache/layout.py``)."""
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)


def _get_attn_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> str:
    """The attention kernel for this configuration on this CPU (``dispatch.select_isa``):
    ``amx``, ``vec512``, ``vec256``, or the portable ``ref``."""
    return dispatch.select_isa(dtype, block_size, head_size, kv_cache_dtype)


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
        return dispatch.describe(self.isa, self.model_dtype, self.kv_cache_dtype)

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
        dispatch.reshape_and_cache(
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
            ref.varlen_attention(query, key, value, attn_metadata.query_start_locs(), self.scale, output, causal=False)
            return output
        dispatch.paged_attention(
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
