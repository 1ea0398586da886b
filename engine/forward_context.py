"""The per-step context every attention layer reads: metadata and the step's timing accumulators.

The model runner sets it around one forward pass, as vLLM does, so model code
stays a plain ``self.attn(q, k, v)`` and the attention metadata is built once
per step, not once per layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

from engine.attention.metadata import CPUAttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: CPUAttentionMetadata
    kv_update_s: float = 0.0  # summed over layers
    attention_s: float = 0.0


_current: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward context (ModelRunner sets one per step)")
    return _current


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev
