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


def run_one(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Allocate, compute, register and finish one request; its block ids."""
    r = req(rid, tokens)
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, len(tokens) - n, hits)
    r.num_computed_tokens = len(tokens)
    kv.cache_blocks(r, len(tokens))
    ids = list(kv.block_ids(rid))
    kv.forget(r)
    return ids


def test_pool_reuses_freed_blocks_instead_of_touching_new_memory():
    # Without a reserve the resident part stays at what the live requests needed at once.
    kv = KVCacheManager(num_blocks=100, block_size=4, reserve=0)
    for i in range(30):
        ids = run_one(kv, f"r{i}", [1000 * i + t for t in range(10)])  # 3 blocks each, one at a time
        assert max(ids) < 3
    assert kv.num_resident_blocks == 3
    # Without a reserve argument every freed block is kept until the pool is full (fresh blocks first).
    kv = KVCacheManager(num_blocks=100, block_size=4)
    for i in range(30):
        run_one(kv, f"r{i}", [1000 * i + t for t in range(10)])
    assert kv.num_resident_blocks == 90


def test_reserve_keeps_recent_prefixes_and_bounds_the_resident_blocks():
    kv = KVCacheManager(num_blocks=1000, block_size=4, reserve=6)
    prompts = [[1000 * i + t for t in range(8)] for i in range(40)]  # two full blocks each
    for i, p in enumerate(prompts):
        run_one(kv, f"r{i}", p)
    assert kv.num_resident_blocks <= 2 + 6 + 1  # one request's blocks plus the reserve
    assert kv.get_computed_blocks(req("new", prompts[-1] + [5]))[1] == 8  # the latest prefixes still hit
    assert kv.get_computed_blocks(req("new2", prompts[-3] + [5]))[1] == 8
    assert kv.get_computed_blocks(req("old", prompts[0] + [5]))[1] == 0  # the oldest were recycled


def test_whole_pool_is_still_used_when_live_requests_need_it():
    kv = KVCacheManager(num_blocks=10, block_size=4, reserve=0)
    run_one(kv, "a", list(range(12)))
    big = req("big", list(range(100, 140)))  # all 10 blocks: 3 recycled, 7 never used before
    assert kv.allocate_slots(big, 40)
    assert sorted(kv.block_ids("big")) == list(range(10))
    assert kv.num_free_blocks == 0 and kv.num_resident_blocks == 10


def test_blocks_without_a_cached_prefix_are_reused_first():
    kv = KVCacheManager(num_blocks=100, block_size=4, reserve=0)
    a_ids = run_one(kv, "a", list(range(10)))  # blocks 0, 1 full and registered, block 2 partial
    b = req("b", list(range(500, 503)))
    assert kv.allocate_slots(b, 3)
    assert kv.block_ids("b") == [a_ids[2]]  # the partial block, not a cached one
    assert kv.get_computed_blocks(req("c", list(range(10))))[1] == 8


def test_reserve_is_zero_without_prefix_caching():
    kv = KVCacheManager(num_blocks=100, block_size=4, enable_prefix_caching=False, reserve=50)
    for i in range(10):
        run_one(kv, f"r{i}", [1000 * i + t for t in range(10)])
    assert kv.num_resident_blocks == 3
