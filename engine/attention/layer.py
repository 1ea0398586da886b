"""The attention layer: the one place that decides whether to write the KV cache, then attends.

Backends declare ``forward_includes_kv_cache_update``.  When it is False this
layer calls ``impl.do_kv_cache_update`` and then ``impl.forward``, and it holds
the guards, once, for every backend: a layer that reads another layer's cache
(KV sharing), a call without new key/value, and encoder-only attention never
write the cache.
"""

from __future__ import annotations

import enum
import time
from typing import Optional

import torch
from torch import nn

from engine.attention.backends.cpu import CPUAttentionBackend
from engine.forward_context import get_forward_context


class AttentionType(str, enum.Enum):
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


class Attention(nn.Module):
    """One attention layer: its backend Impl (kernel chosen at construction), its KV-cache tensor
    (bound by the model runner) and fp8 scales.  Reads the step's metadata from the forward context."""

    backend = CPUAttentionBackend

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        layer_name: str,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        model_dtype: torch.dtype = torch.bfloat16,
        kv_sharing_target_layer_name: Optional[str] = None,
        attn_type: AttentionType = AttentionType.DECODER,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.layer_name = layer_name
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.impl = self.backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, kv_cache_dtype, block_size, model_dtype, attn_type.value
        )
        # The guards that do not change per call: a backend that writes in forward, a layer that
        # reads another layer's cache, and encoder-only attention never write it here.
        self.writes_kv_cache = (
            not self.backend.forward_includes_kv_cache_update
            and kv_sharing_target_layer_name is None
            and attn_type != AttentionType.ENCODER_ONLY
        )
        # Bound by the model runner (bind_kv_cache); shared layers get the target's tensor.
        self.kv_cache: torch.Tensor = torch.empty(0)
        # fp8 cache scales: cache holds x / scale.
        self.k_scale: float = 1.0
        self.v_scale: float = 1.0

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        output: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """query [T, H*D], key/value [T, Hkv*D] (or None) -> output [T, H*D].

        Callers that already hold per-head views (query [T, H, D], key/value [T, Hkv, D]) and an
        output buffer shaped like the query pass them as they are, and get the buffer back: the
        native decoder layer makes the split, the views and the buffer in C++, since each torch op
        issued from Python costs microseconds on every layer of every step.
        """
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        flat = query.dim() == 2
        if flat:
            num_tokens = query.shape[0]
            query = query.view(num_tokens, self.num_heads, self.head_size)
            if key is not None:
                key = key.view(num_tokens, self.num_kv_heads, self.head_size)
            if value is not None:
                value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if output is None:
            output = torch.empty_like(query)

        t0 = time.perf_counter()
        if self.writes_kv_cache and key is not None and value is not None:
            self.impl.do_kv_cache_update(self, key, value, self.kv_cache, meta.slot_mapping)
        t1 = time.perf_counter()
        self.impl.forward(self, query, key, value, self.kv_cache, meta, output)
        t2 = time.perf_counter()
        ctx.kv_update_s += t1 - t0
        ctx.attention_s += t2 - t1
        return output.view(output.shape[0], self.num_heads * self.head_size) if flat else output
