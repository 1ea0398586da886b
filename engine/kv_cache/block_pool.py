"""The block pool: every KV-cache block, its free list, and the prefix-cache hash index.

Blocks hold ``block_size`` tokens of every layer's K and V.  A full block whose
tokens are all computed gets a hash that chains over everything before it, so a
later request with the same prefix reuses it.  Freed blocks keep their hash and
sit in the free list in LRU order; they are evicted (forget their hash) only
when a new block is needed.  Nothing here touches tensors: it hands out block ids.

The cache tensors are allocated untouched (their pages become resident as blocks
fill) and a block's first use costs page faults, so the pool recycles freed blocks
instead of growing into untouched ones once ``reserve`` freed blocks are waiting:
under steady load the resident cache stops growing at the peak of live blocks plus
that reserve of cached prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

BlockHash = int


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None


class BlockPool:
    """Owns every block.  ``free`` holds released blocks oldest-first (the front is evicted first);
    blocks from ``next_fresh`` on have never been handed out, so their memory is still untouched.

    ``reserve``: how many released blocks may wait (holding cached prefixes) before ``take``
    recycles them rather than using a fresh block; None keeps all of them until the pool is full.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, reserve: Optional[int] = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.next_fresh = 0
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.enable_caching = enable_caching
        self.reserve = num_blocks if reserve is None else (reserve if enable_caching else 0)

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.blocks) - self.next_fresh

    @property
    def num_touched(self) -> int:
        """Blocks handed out at least once: the part of the cache that has become resident."""
        return self.next_fresh

    def take(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` free blocks (caller checked there are enough), evicting any cached content."""
        out = []
        for _ in range(n):
            if self.next_fresh < len(self.blocks) and len(self.free) <= self.reserve:
                block = self.blocks[self.next_fresh]
                self.next_fresh += 1
            else:
                _, block = self.free.popitem(last=False)
                if block.block_hash is not None:
                    if self.cached.get(block.block_hash) is block:
                        del self.cached[block.block_hash]
                    block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block pulls it out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop a reference; blocks that reach zero go to the back of the free list, or to its
        front when they hold no cached prefix (nothing to keep them for).

        Callers pass a request's blocks last-first, so a request's tail (least
        likely to be shared) is evicted before its head.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = block
                if block.block_hash is None:
                    self.free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash)

    def register(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block


def hash_block(parent: Optional[BlockHash], token_ids: tuple[int, ...]) -> BlockHash:
    """Chain hash: equal only when every token of this block and all before it match (up to 64-bit collisions)."""
    return hash((parent, token_ids))
