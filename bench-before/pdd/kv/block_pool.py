"""Physical KV blocks: reference counts, an LRU free queue, and the hash map
that makes freed blocks reusable as prefix cache.

A block is in exactly one of three states:
  in use      ref_count > 0, not in the free queue;
  free+cached ref_count == 0, in the free queue, still findable by its hash;
  free        ref_count == 0, in the free queue, no hash.
Allocation takes from the head of the free queue (least recently freed) and
only then forgets the block's hash: a cached block survives until its memory
is actually needed. Block 0 is the null block: never allocated, it pads block
tables and absorbs writes of padding tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (1 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Eviction order: first key = next to be reused. Values unused.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.ref_counts[NULL_BLOCK] = 1
        # The engine's count of launched steps, and its value when each block was
        # last freed: with async scheduling a step launched by then may still be
        # writing the block (see LLMEngine.reserve).
        self.steps_launched = 0
        self.freed_at = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._forget_hash(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on blocks found in the cache (maybe sitting free)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop a reference; blocks reaching zero join the queue's tail in the
        order given (callers pass a request's blocks tail-first, so the end of
        a sequence is evicted before its more shareable beginning)."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
                self.freed_at[b] = self.steps_launched

    def cache_block(self, block: int, block_hash: int) -> None:
        """Make a full, computed block findable by its hash. If another block
        already holds that hash, the first one stays the cached copy."""
        if self.block_hash[block] is not None:
            return
        if block_hash in self.cached:
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    def reset_prefix_cache(self) -> int:
        """Forget every free block's hash; returns how many were dropped."""
        dropped = 0
        for b in self.free_queue:
            if self.block_hash[b] is not None:
                self._forget_hash(b)
                dropped += 1
        return dropped
