"""The pool of fixed-size KV blocks, with the prefix-cache index and the LRU free queue.

A block is *free* when no sequence holds it (``ref_cnt == 0``). A free block may still carry a
hash: its K/V are valid and a later request with the same prefix can take it back (a cache hit).
Such blocks wait in an O(1) doubly linked queue, and eviction takes from its head, so the prefix
freed longest ago goes first.

Allocation follows memory, not just recency: on the CPU the pool is reserved, not written
(model_runner.new_kv_cache), so a block costs resident memory from the first time it is handed out.
A request therefore gets, in order: a free block that holds nothing (written before: costs nothing);
a block never handed out, while fewer than ``resident_target`` have been; a cached prefix, evicted;
and only then a block never handed out beyond the target. The prefix cache thus grows the pool's
resident memory up to the target and no further, while the sequences running at once may use every
block. (A FIFO over all free blocks walked through the whole reservation, one request after another,
until all of it was resident.)
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
    """All blocks of the KV cache, the free lists and the hash -> block index.

    Args:
        num_blocks: blocks in the pool.
        enable_caching: keep hashes of freed blocks so they can be hit again.
        resident_target: how many blocks may be handed out before cached prefixes are evicted rather
            than another fresh block taken (default: all of them; see the module docstring).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, resident_target: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        if resident_target is not None and not 1 <= resident_target <= num_blocks:
            raise ValueError(f"resident_target must be in 1..{num_blocks}, got {resident_target}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.resident_target = num_blocks if resident_target is None else resident_target
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(())  # free blocks holding a prefix, least recently freed first
        self._empty: list[Block] = []  # free blocks written before that hold no prefix (a stack)
        self._fresh: list[int] = []  # ids of blocks never handed out, lowest last (popped first)
        self.cached: dict[bytes, Block] = {}
        self._reset()

    def _reset(self) -> None:
        """Every block fresh: the cache's memory is new (at start, after :meth:`forget_cached`)."""
        self.free_queue = FreeBlockQueue(())
        self._empty = []
        self._fresh = list(range(self.num_blocks - 1, -1, -1))

    @property
    def num_touched(self) -> int:
        """Blocks handed out at least once since the cache's memory was made (on the CPU: written)."""
        return self.num_blocks - len(self._fresh)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable prefix: the queue holds exactly those."""
        return len(self.free_queue)

    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._fresh) + len(self.free_queue)

    def free_block_ids(self) -> list[int]:
        """Every free block's id, in the order :meth:`get_new_blocks` would hand them out now."""
        fresh = self._fresh[::-1]
        room = max(0, self.resident_target - self.num_touched)
        return ([b.block_id for b in reversed(self._empty)] + fresh[:room]
                + [b.block_id for b in self.free_queue] + fresh[room:])

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num: int) -> list[Block]:
        """Take ``num`` blocks in the order the module docstring gives, evicting cached prefixes taken."""
        if num > self.num_free_blocks:
            raise ValueError(f"asked for {num} blocks with {self.num_free_blocks} free")
        out = []
        for _ in range(num):
            block = self._take()
            block.ref_cnt = 1
            out.append(block)
        return out

    def _take(self) -> Block:
        if self._empty:
            return self._empty.pop()
        if self._fresh and (self.num_touched < self.resident_target or not self.free_queue):
            return self.blocks[self._fresh.pop()]
        block = self.free_queue.popleft()
        self._evict(block)
        return block

    def _evict(self, block: Block) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on each block (a cache hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_hash is None:  # only a cached block is found to be touched
                    raise RuntimeError(f"block {block.block_id} is free and holds no prefix")
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop a reference on each block, in the given order; those reaching 0 join the queue tail
        (a prefix) or the empty blocks (nothing cached)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    self._empty.append(block)

    def forget_cached(self) -> None:
        """Drop every cached prefix: their K/V are gone (the KV cache was freed), and the next cache's
        memory is new, so every block is fresh again. Blocks in use are not allowed here."""
        if self.num_free_blocks != self.num_blocks:
            raise RuntimeError("cannot forget the prefix cache while blocks are in use")
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        self._reset()

    def cache_block(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Index a full, computed block. A duplicate of an already indexed prefix stays unindexed."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
