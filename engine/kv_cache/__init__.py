"""The paged KV cache: its memory layout (``layout``), the block pool and prefix-cache index
(``block_pool``), per-request block tables (``manager``) and how many blocks a run gets (``sizing``).

Below the attention code and the scheduler; imports nothing from either.
"""

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache.manager import KVCacheManager, PrefixCacheStats

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager", "PrefixCacheStats"]
