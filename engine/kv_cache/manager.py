"""KV-cache block manager: per-request block tables on the block pool, and prefix-cache lookups.

The scheduler's only view of KV memory: it asks for slots, caches finished blocks and
frees requests; the model runner reads each request's block ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.kv_cache.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block
from engine.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached

    def reset(self) -> "PrefixCacheStats":
        out = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return out


class KVCacheManager:
    """Per-request block tables on top of the pool; the scheduler's only view of KV memory."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, reserve: Optional[int] = None
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks, enable_prefix_caching, reserve)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached: dict[str, int] = {}  # leading blocks already registered in the cache
        self.stats = PrefixCacheStats()
        self.prefaulted_blocks = 0  # the lowest ids, made resident up front (mark_resident)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live requests (0 once all have finished: none leaked)."""
        return self.num_blocks - self.pool.num_free

    @property
    def reserve_blocks(self) -> int:
        """Freed blocks kept for cached prefixes before the pool reuses them (BlockPool.reserve)."""
        return self.pool.reserve

    @property
    def num_resident_blocks(self) -> int:
        """Blocks whose memory is resident: used at least once (the pool grows until ``reserve``
        freed blocks wait), or made resident up front (``prefaulted_blocks``, the lowest ids)."""
        return max(self.pool.num_touched, self.prefaulted_blocks)

    def mark_resident(self, num_blocks: int) -> None:
        """Blocks [0, num_blocks) were made resident outside the pool (LLMEngine.prefault_kv_cache)."""
        self.prefaulted_blocks = max(self.prefaulted_blocks, num_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tuple(tokens[i * bs : (i + 1) * bs])))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks for a request about to start; at least one token stays to compute."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        self.stats.queries += request.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Optional[list[KVCacheBlock]] = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones; False if the pool is short."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens if blocks is not None else len(computed_blocks) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size)
        have = (len(blocks) if blocks is not None else 0) + len(computed_blocks)
        # Cache hits sitting in the free list are not free for this request's new blocks.
        free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if needed - have > self.pool.num_free - free_hits:
            return False
        if blocks is None:
            blocks = self.req_blocks[rid] = []
            self.req_block_ids[rid] = []
            self.req_num_cached[rid] = len(computed_blocks)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self.req_block_ids[rid].extend(b.block_id for b in computed_blocks)
        if needed > len(blocks):
            new = self.pool.take(needed - len(blocks))
            blocks.extend(new)
            self.req_block_ids[rid].extend(b.block_id for b in new)
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's newly completed full blocks so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self.req_num_cached[rid]
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, num_full):
            self.pool.register(blocks[i], hashes[i])
        self.req_num_cached[rid] = num_full

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_block_ids[request_id]

    def free(self, request: Request) -> None:
        """Return every block of the request (preemption, finish or abort). Idempotent."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self.req_block_ids.pop(rid, None)
        self.req_num_cached.pop(rid, None)
        if blocks:
            self.pool.release(list(reversed(blocks)))

    def forget(self, request: Request) -> None:
        """Drop the request's hash list too (it is finished for good)."""
        self.free(request)
        self.req_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        for block in self.pool.free.values():
            block.block_hash = None
        self.pool.cached = {h: b for h, b in self.pool.cached.items() if b.ref_cnt > 0}
