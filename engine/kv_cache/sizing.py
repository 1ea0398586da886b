"""How many KV-cache blocks a run gets, and how many freed ones it keeps as cached prefixes.

Functions of the configuration and the model's shape, so the engine (and tests) can size
the cache before any tensor exists.
"""

from __future__ import annotations

from engine.config import PREFIX_CACHE_MAX_GB, EngineConfig, ModelConfig, default_kv_cache_gb
from engine.kv_cache.layout import kv_cache_bytes_per_block, kv_cache_torch_dtype


def kv_block_bytes(config: EngineConfig, model: ModelConfig) -> int:
    """Bytes of one KV-cache block over all layers (keys, values, int8 scales).

    ``config.cache.kv_cache_dtype`` should already be resolved (not ``auto``) for int8-capable runs.
    """
    cache_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, config.torch_dtype)
    per_layer = kv_cache_bytes_per_block(config.cache.block_size, model.num_key_value_heads, model.head_dim, cache_dtype)
    return model.num_hidden_layers * per_layer


def num_blocks(config: EngineConfig, model: ModelConfig, max_model_len: int) -> int:
    """Blocks in the pool: ``num_blocks`` if set, else what ``kv_cache_gb`` (default: a quarter of
    available RAM) holds; raises ValueError when that is less than one full context."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    gb = cache.kv_cache_gb if cache.kv_cache_gb is not None else default_kv_cache_gb()
    num = int(gb * 2**30) // kv_block_bytes(config, model)
    min_blocks = -(-max_model_len // cache.block_size)
    if num < min_blocks:
        raise ValueError(
            f"--kv-cache-gb {gb:g} holds {num * cache.block_size} tokens, fewer than one full context "
            f"({max_model_len}); raise it or lower --max-model-len"
        )
    return num


def prefix_cache_blocks(config: EngineConfig, model: ModelConfig, max_model_len: int, num_blocks: int) -> int:
    """Released blocks the pool keeps as cached prefixes before recycling them (see CacheConfig):
    ``prefix_cache_gb`` if set, else 1/32 of the pool, at least one full context, at most PREFIX_CACHE_MAX_GB."""
    cache = config.cache
    block_bytes = kv_block_bytes(config, model)
    if cache.prefix_cache_gb is not None:
        return min(num_blocks, int(cache.prefix_cache_gb * 2**30) // block_bytes)
    one_context = -(-max_model_len // cache.block_size)
    cap = max(1, int(PREFIX_CACHE_MAX_GB * 2**30) // block_bytes)
    return min(num_blocks, max(num_blocks // 32, one_context), cap)
