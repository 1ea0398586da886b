"""Block pool, block tables and prefix caching, without a model."""

from engine.kv_cache import KVCacheManager
from engine.request import Request, SamplingParams


def req(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, SamplingParams(**kw))


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_ids("a")) == 3
    assert kv.num_free_blocks == 7
    kv.forget(r)
    assert kv.num_free_blocks == 10
    assert kv.usage == 0.0


def test_allocation_refused_when_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 2  # nothing half-taken


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(10)))
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_blocks(a, 10)  # two full blocks registered
    b = req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in hits] == kv.block_ids("a")[:2]
    assert kv.stats.hits == 8 and kv.stats.queries == 11
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.num_free_blocks == 10 - 3 - 1  # a: 3 blocks, b: 2 shared + 1 new


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    b = req("b", list(range(8)))
    _, n = kv.get_computed_blocks(b)
    assert n == 4  # the last block is recomputed so the model produces logits


def test_freed_cached_blocks_survive_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    kv.forget(a)
    assert kv.num_free_blocks == 4
    b = req("b", list(range(8)) + [1])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # A request that needs every block evicts the cached ones.
    c = req("c", [7] * 16)
    assert kv.allocate_slots(c, 16)
    assert kv.pool.cached == {}
    kv.forget(c)
    _, n = kv.get_computed_blocks(req("d", list(range(8)) + [1]))
    assert n == 0


def test_cache_hit_on_free_block_is_not_double_counted_as_free():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    kv.forget(a)
    b = req("b", list(range(8)) + list(range(100, 108)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # needs 4 blocks in total, 2 hit (both sitting in the free list) -> 2 new, 1 free after the hits: refuse
    assert not kv.allocate_slots(b, 8, hits)
    assert kv.num_free_blocks == 3
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_prefix_caching_disabled_and_prompt_logprobs_skip_lookup():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0
    kv2 = KVCacheManager(num_blocks=10, block_size=4)
    a2 = req("a", list(range(8)))
    kv2.allocate_slots(a2, 8)
    kv2.cache_blocks(a2, 8)
    assert kv2.get_computed_blocks(req("b", list(range(9)), prompt_logprobs=1))[1] == 0
