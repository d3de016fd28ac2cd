"""The scheduler's narrow view of the KV cache: find cached prefix blocks, allocate, free.

Prefix caching hashes each *full* block of a sequence's tokens as a chain,
``h_i = sha256(h_{i-1} || token ids of block i)``, so equal hashes mean equal whole prefixes. The
hashes are computed incrementally and kept on the sequence. A hit is confirmed against the stored
token ids, and a hit never covers the last token: its logits must be computed to sample from.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from llmd.daemon.engine.block_pool import Block, BlockPool
from llmd.daemon.engine.sequence import Sequence

ROOT_HASH = hashlib.sha256(b"llmd prefix cache v1").digest()


@dataclass(slots=True, frozen=True)
class KVCacheUsage:
    num_blocks: int
    num_used: int  # held by at least one sequence
    num_cached_free: int  # free, but holding a reusable prefix
    num_free: int  # includes the cached-free ones
    num_touched: int = 0  # handed out at least once since the cache's memory was made (resident, on the CPU)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks


def _num_reclaimed(computed_blocks: list[Block]) -> int:
    """The free cached blocks among a prefix hit's: touching one takes it out of the free queue too."""
    return sum(1 for b in computed_blocks if b.ref_cnt == 0)


def hash_block(parent: bytes, token_ids: tuple[int, ...] | list[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class KVCacheManager:
    """Owns the :class:`BlockPool`; sequences own lists of block ids (their block tables).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        prefix_cache: reuse computed blocks across requests.
        resident_target: blocks the prefix cache may grow the pool's resident memory to (default:
            all; :class:`BlockPool`).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True,
                 resident_target: int | None = None) -> None:
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.pool = BlockPool(num_blocks, enable_caching=prefix_cache, resident_target=resident_target)
        self._num_cached_blocks: dict[str, int] = {}  # request id -> blocks already indexed

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> KVCacheUsage:
        free = self.pool.num_free_blocks
        return KVCacheUsage(self.pool.num_blocks, self.pool.num_blocks - free, self.pool.num_cached_free, free,
                            self.pool.num_touched)

    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to cover every full block of its tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), seq.num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, seq.token_ids[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[Block], int]:
        """The longest cached prefix of ``seq`` as ``(blocks, num_tokens)``; takes no references.
        None for a request that wants its prompt's log-probabilities: those need every prompt
        token computed (its own blocks are still cached for later requests)."""
        if not self.prefix_cache or seq.params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(seq)
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs  # leave the last token to compute
        hits: list[Block] = []
        for i, block_hash in enumerate(seq.block_hashes[:max_blocks]):
            block = self.pool.get_cached_block(block_hash)
            if block is None or block.token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block)
        return hits, len(hits) * bs

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[Block] | None = None) -> list[Block] | None:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` after its computed ones.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, at admission) are appended to the
        block table first. Atomic: on failure nothing changes and None is returned, which tells
        the scheduler to preempt something and retry.

        Returns:
            The newly allocated blocks (possibly empty), or None if the pool cannot provide them.
        """
        computed_blocks = computed_blocks or []
        num_new_blocks = self._num_new_blocks(seq, num_new_tokens, computed_blocks)
        if num_new_blocks + _num_reclaimed(computed_blocks) > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        seq.block_ids.extend(b.block_id for b in computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        seq.block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[Block] | None = None) -> int:
        """The free blocks :meth:`allocate_slots` would take for the same arguments: new ones, and
        the free cached blocks among ``computed_blocks``."""
        computed_blocks = computed_blocks or []
        return self._num_new_blocks(seq, num_new_tokens, computed_blocks) + _num_reclaimed(computed_blocks)

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[Block]) -> int:
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        return max(0, num_required - len(seq.block_ids) - len(computed_blocks))

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Index the blocks that are full and computed (call after each step that computed them)."""
        if not self.prefix_cache:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(seq.request_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(seq)
        bs = self.block_size
        for i in range(start, num_full):
            block = self.pool.blocks[seq.block_ids[i]]
            self.pool.cache_block(block, seq.block_hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]))
        self._num_cached_blocks[seq.request_id] = num_full

    def trim(self, seq: Sequence) -> None:
        """After rejected draft tokens left ``seq``: free the blocks past its tokens (tail first)
        and forget the hashes of blocks that are no longer full of them."""
        keep = -(-seq.num_tokens // self.block_size)
        if len(seq.block_ids) > keep:
            self.pool.free_blocks(self.pool.blocks[i] for i in reversed(seq.block_ids[keep:]))
            del seq.block_ids[keep:]
        del seq.block_hashes[seq.num_tokens // self.block_size:]

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first, so a shared prefix outlives its suffixes."""
        self.pool.free_blocks(self.pool.blocks[i] for i in reversed(seq.block_ids))
        seq.block_ids = []
        self._num_cached_blocks.pop(seq.request_id, None)
