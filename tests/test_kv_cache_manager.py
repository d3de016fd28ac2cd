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
    return [b.block_id for b in kv.pool.free_queue]


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
    # Never-used blocks first, then a's blocks tail first: the prefix head is evicted last.
    assert free_ids(kv) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
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
    assert free_ids(kv) == [2, 3, 1, 0]
    b = seq("b", list(range(16)) + [99, 98])
    admit(kv, b)
    assert b.block_ids == [0, 2]  # block 0 reused (hit), block 2 is the queue head
    assert free_ids(kv) == [3, 1]
    assert kv.usage.num_cached_free == 0  # block 1 held a partial block: never hashed
    assert kv.pool.blocks[1].block_hash is None


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
    # a held [0, 1], b held [2, 3]; freed tail first: queue = 1, 0, 3, 2.
    assert free_ids(kv) == [1, 0, 3, 2]
    c = seq("c", list(range(500, 520)))
    kv.allocate_slots(c, 20)
    assert c.block_ids == [1, 0]
    assert kv.pool.blocks[0].block_hash is None  # a's prefix was evicted ...
    assert kv.get_computed_blocks(seq("b2", list(range(100, 116)) + [5]))[1] == 16  # ... b's survives
    assert kv.get_computed_blocks(seq("a2", list(range(0, 16)) + [5]))[1] == 0


def test_failed_allocation_changes_nothing(full_pool: KVCacheManager) -> None:
    kv = full_pool
    s = seq("big", list(range(100, 116)) + list(range(70)))  # hits block 2, needs 5 more blocks
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
