"""The pool of fixed-size KV blocks, with the prefix-cache index and the LRU free queue.

A block is *free* when no sequence holds it (``ref_cnt == 0``). A free block may still carry a
hash: its K/V are valid and a later request with the same prefix can take it back (a cache hit).
Free blocks wait in an O(1) doubly linked queue; allocation takes from the head, so the block freed
longest ago is reused (evicted) first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full, computed and cached
    token_ids: tuple[int, ...] | None = None  # what the hash covers, to confirm a hit
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks through ``prev_free``/``next_free``; every operation O(1)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels: no None checks in the hot paths
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> Block:
        if self._len == 0:
            raise IndexError("no free blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    """All blocks of the KV cache, the free queue and the hash -> block index.

    Args:
        num_blocks: blocks in the pool.
        enable_caching: keep hashes of freed blocks so they can be hit again.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.num_cached_free = 0  # free blocks that still hold a reusable prefix

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num: int) -> list[Block]:
        """Take ``num`` blocks from the head of the free queue, evicting their cached prefixes."""
        if num > len(self.free_queue):
            raise ValueError(f"asked for {num} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(num):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        self.num_cached_free -= 1
        block.block_hash = None
        block.token_ids = None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on each block (a cache hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop a reference on each block, in the given order; those reaching 0 join the queue tail."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free += 1

    def forget_cached(self) -> None:
        """Drop every cached prefix: their K/V are gone (the KV cache was freed). Free blocks keep
        their place in the queue; blocks in use are not allowed here."""
        if self.num_free_blocks != self.num_blocks:
            raise RuntimeError("cannot forget the prefix cache while blocks are in use")
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        self.num_cached_free = 0

    def cache_block(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Index a full, computed block. A duplicate of an already indexed prefix stays unindexed."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
