"""Block pool and KV cache manager on tiny pools: exact block ids, ref counts, hashes, eviction."""

from __future__ import annotations

import pytest

from llmd.daemon.engine.block_pool import BlockPool
from llmd.daemon.engine.kv_cache_manager import ROOT_HASH, KVCacheManager, hash_block
from llmd.daemon.engine.sampling_params import SamplingParams
from llmd.daemon.engine.sequence import Sequence

BS = 16


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=8))


def admit(kv: KVCacheManager, s: Sequence) -> None:
    """What the scheduler does on admission: cache lookup, allocate the rest, compute all."""
    blocks, num_cached = kv.get_computed_blocks(s)
    assert kv.allocate_slots(s, s.num_tokens - num_cached, blocks) is not None
    s.num_cached_tokens = num_cached
    s.num_computed_tokens = s.num_tokens
    kv.cache_computed_blocks(s)


def ref_cnts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def free_ids(kv: KVCacheManager) -> list[int]:
    """The free blocks in the order the pool would hand them out."""
    return kv.pool.free_block_ids()


def test_allocation_takes_blocks_in_order_and_free_returns_tail_first() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = seq("a", list(range(40)))  # 2 full blocks + 8 tokens
    admit(kv, a)
    assert a.block_ids == [0, 1, 2]
    assert ref_cnts(kv)[:4] == [1, 1, 1, 0]
    # Only the two full blocks are hashed and cached; the partial third is not.
    assert [kv.pool.blocks[i].block_hash is not None for i in (0, 1, 2)] == [True, True, False]
    assert len(a.block_hashes) == 2
    kv.free(a)
    assert a.block_ids == []
    assert ref_cnts(kv) == [0] * 10
    # a's partial block first (written before, it holds nothing), then never-used blocks, then a's
    # cached blocks tail first: the prefix head is evicted last.
    assert free_ids(kv) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    assert kv.usage.num_cached_free == 2


def test_prefix_hit_shares_blocks_and_caps_at_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prefix = list(range(100, 132))  # exactly 2 blocks
    a = seq("a", prefix + [1, 2, 3])
    admit(kv, a)
    b = seq("b", prefix + [7, 8])
    blocks, n = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0, 1] and n == 32
    admit(kv, b)
    assert b.block_ids == [0, 1, 3] and b.num_cached_tokens == 32
    assert ref_cnts(kv)[:4] == [2, 2, 1, 1]
    # A prompt equal to the cached blocks may reuse only the first: the last token is recomputed.
    c = seq("c", list(prefix))
    blocks, n = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in blocks] == [0] and n == 16


def test_hit_on_a_freed_block_takes_it_back_from_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = seq("a", list(range(20)))
    admit(kv, a)
    kv.free(a)
    assert free_ids(kv) == [1, 2, 3, 0]
    b = seq("b", list(range(16)) + [99, 98])
    admit(kv, b)
    assert b.block_ids == [0, 1]  # block 0 reused (hit), block 1 (a's partial one, empty now) next
    assert free_ids(kv) == [2, 3]
    assert kv.usage.num_cached_free == 0
    assert kv.pool.blocks[1].block_hash is None  # b's partial block: not hashed
    assert kv.usage.num_touched == 2  # blocks 2 and 3 were never handed out


@pytest.fixture
def full_pool() -> KVCacheManager:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    for rid, base in (("a", 0), ("b", 100)):
        s = seq(rid, list(range(base, base + 16)) + [1])
        admit(kv, s)
        kv.free(s)
    return kv


def test_eviction_takes_the_least_recently_freed_cached_block(full_pool: KVCacheManager) -> None:
    kv = full_pool
    # a held [0, 1] (its prefix in 0); b took the empty 1 back and the fresh 2 (its prefix in 1);
    # freed tail first: the empty 2, the fresh 3, then the cached 0 and 1, least recently freed first.
    assert free_ids(kv) == [2, 3, 0, 1]
    c = seq("c", list(range(500, 540)))
    kv.allocate_slots(c, 40)
    assert c.block_ids == [2, 3, 0]
    assert kv.pool.blocks[0].block_hash is None  # a's prefix was evicted ...
    assert kv.get_computed_blocks(seq("b2", list(range(100, 116)) + [5]))[1] == 16  # ... b's survives
    assert kv.get_computed_blocks(seq("a2", list(range(0, 16)) + [5]))[1] == 0


def test_failed_allocation_changes_nothing(full_pool: KVCacheManager) -> None:
    kv = full_pool
    s = seq("big", list(range(100, 116)) + list(range(70)))  # hits block 1, needs 5 more blocks
    blocks, n = kv.get_computed_blocks(s)
    before = (ref_cnts(kv), free_ids(kv), dict(kv.pool.cached), kv.usage)
    assert kv.allocate_slots(s, s.num_tokens - n, blocks) is None
    assert (ref_cnts(kv), free_ids(kv), dict(kv.pool.cached), kv.usage) == before
    assert s.block_ids == []


def test_growing_sequence_allocates_a_block_every_block_size_tokens() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    s = seq("s", list(range(15)))
    admit(kv, s)
    assert s.block_ids == [0]
    s.token_ids.append(15)  # 16 tokens now: still one block
    assert kv.allocate_slots(s, 1) == []
    assert kv.pool.blocks[0].block_hash is None  # not full before the 16th token is computed
    s.num_computed_tokens += 1
    kv.cache_computed_blocks(s)
    assert kv.pool.blocks[0].block_hash == s.block_hashes[0] == hash_block(ROOT_HASH, list(range(16)))
    s.token_ids.append(16)
    assert [b.block_id for b in kv.allocate_slots(s, 1)] == [1]


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    x = seq("x", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    y = seq("y", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.update_block_hashes(x)
    kv.update_block_hashes(y)
    assert len(x.block_hashes) == 2
    assert x.block_hashes[1] != y.block_hashes[1]  # same second block, different parent


def test_hit_is_confirmed_against_tokens() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = seq("a", list(range(17)))
    admit(kv, a)
    block = kv.pool.blocks[0]
    block.token_ids = tuple(range(1, 17))  # simulate a hash collision with different tokens
    assert kv.get_computed_blocks(seq("b", list(range(17))))[1] == 0


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, prefix_cache=False)
    a = seq("a", list(range(17)))
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(seq("b", list(range(17)))) == ([], 0)
    assert kv.usage.num_cached_free == 0


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])


def test_requests_one_after_another_reuse_the_same_blocks() -> None:
    # No prefix to keep (caching off, as a draft model's pool): each request takes the blocks the last
    # one wrote, so the pool's resident memory stays one request's. A FIFO over the free blocks walked
    # the whole pool (20 requests x 3 blocks: all 50 touched).
    kv = KVCacheManager(num_blocks=50, block_size=BS, prefix_cache=False)
    for i in range(20):
        s = seq(f"r{i}", list(range(1000 * i, 1000 * i + 40)))
        admit(kv, s)
        kv.free(s)
    assert kv.usage.num_touched == 3


def test_the_prefix_cache_stays_within_its_resident_target_but_running_sequences_do_not() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BS, resident_target=6)
    # distinct prompts of 2 full blocks + 1 token, one after another: the cache grows to the target,
    # then evicts its oldest prefix instead of writing another block
    for i in range(10):
        s = seq(f"r{i}", list(range(1000 * i, 1000 * i + 33)))
        admit(kv, s)
        kv.free(s)
        # (each request takes the last one's partial block back, then two fresh ones)
        assert kv.usage.num_touched == min(6, 1 + 2 * (i + 1))
    assert kv.usage.num_cached_free == 5  # 6 blocks: 5 of them cached prefixes, 1 empty
    assert kv.get_computed_blocks(seq("last", list(range(9000, 9032)) + [1]))[1] == 32  # r9's, kept
    assert kv.get_computed_blocks(seq("first", list(range(0, 32)) + [1]))[1] == 0  # r0's, evicted
    # sequences running at once are never refused for the target: all 20 blocks serve them
    held = [seq(f"big{i}", list(range(50_000 + 100 * i, 50_000 + 100 * i + 64))) for i in range(5)]
    for s in held:
        admit(kv, s)
    assert kv.usage.num_used == 20 and kv.usage.num_touched == 20


def test_forgetting_the_cache_makes_every_block_fresh_again() -> None:
    # an idle unload frees the cache's memory: the next one is written from its first block again
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    for i in range(3):
        s = seq(f"r{i}", list(range(100 * i, 100 * i + 20)))
        admit(kv, s)
        kv.free(s)
    assert kv.usage.num_touched == 4
    kv.pool.forget_cached()
    assert kv.usage.num_touched == 0 and free_ids(kv) == list(range(8)) and not kv.pool.cached
    s = seq("after", list(range(20)))
    admit(kv, s)
    assert s.block_ids == [0, 1] and kv.usage.num_touched == 2


@pytest.mark.parametrize("target", [0, 9, -1])
def test_a_resident_target_outside_the_pool_is_refused(target: int) -> None:
    with pytest.raises(ValueError, match="resident_target must be in 1..8"):
        BlockPool(8, resident_target=target)
