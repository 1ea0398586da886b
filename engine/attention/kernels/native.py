"""Native attention kernels (C++ torch extension). Placeholder until the extension lands: none available."""

from __future__ import annotations

import torch


def available_isas() -> frozenset[str]:
    return frozenset()


def supports(isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> bool:
    return False
