"""Per-request view of the block pool: which blocks a request holds, what of its
prefix is already cached, and when its full blocks become cache entries.

The scheduler talks only to this class (never to `BlockPool`):
    get_computed_blocks(req) -> (blocks, num_tokens)   prefix-cache lookup
    count_lookup(req, num_tokens)                      ... counted once its request is admitted
    allocate_slots(req, n, computed) -> blocks | None  room for n more tokens
    cache_blocks(req, num_computed)                    publish full blocks
    free(req)
"""
from __future__ import annotations

from collections import deque

from pdd.kv.block_pool import BlockPool
from pdd.kv.hashing import ROOT_HASH, block_hashes


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[int]] = {}
        # How many of a request's leading blocks are published in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache hit statistics (queried tokens vs tokens found).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # Hashes published since the last take_recent_hashes(): the router's
        # picture of what each worker caches (prefix-affinity routing). Bounded
        # for an engine nobody takes them from (the offline API).
        self._recent_hashes: deque[int] = deque(maxlen=4096)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, req) -> list[int]:
        """Extend req.block_hashes to cover every full block of its tokens."""
        hashes = req.block_hashes
        start = len(hashes) * self.block_size
        if req.num_tokens - start >= self.block_size:
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.extend(block_hashes(req.all_token_ids, self.block_size, parent, start))
        return hashes

    def get_computed_blocks(self, req) -> tuple[list[int], int]:
        """Longest cached prefix of `req`, in whole blocks. At least one token is
        always left to compute: its logits are what the step samples from."""
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self.update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def count_lookup(self, req, num_hit_tokens: int) -> None:
        """The hit statistics of the lookup a request was admitted with: a
        request looked up on every step it waits (out of blocks, or held back
        behind long prompts) counts once."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += req.num_tokens
            self.num_hit_tokens += num_hit_tokens

    def allocate_slots(self, req, num_new_tokens: int, computed_blocks: list[int] = ()) -> list[int] | None:
        """Make room for `num_new_tokens` beyond req.num_computed_tokens (plus the
        computed prefix blocks when the request starts). None if out of blocks;
        then nothing changed."""
        new = self._num_new_blocks(req, num_new_tokens, computed_blocks)
        if new > self._available(computed_blocks):
            return None
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self._num_cached_blocks[req.request_id] = len(computed_blocks)
        if new > 0:
            blocks.extend(self.pool.allocate(new))
        return blocks

    def _num_new_blocks(self, req, num_new_tokens: int, computed_blocks) -> int:
        held = len(self.req_blocks.get(req.request_id, ())) + len(computed_blocks)
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        return max(0, self.blocks_needed(num_computed + num_new_tokens) - held)

    def _available(self, computed_blocks) -> int:
        # Cached blocks sitting free are about to be taken by touch(): they don't count.
        free_hits = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        return self.pool.num_free_blocks - free_hits

    def cache_blocks(self, req, num_computed_tokens: int) -> None:
        """Publish the request's blocks that are full and whose KV is written."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(req.request_id, 0)
        if num_full <= done:
            return
        hashes = self.update_hashes(req)
        blocks = self.req_blocks[req.request_id]
        for i in range(done, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
            self._recent_hashes.append(hashes[i])
        self._num_cached_blocks[req.request_id] = num_full

    def free(self, req) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self._num_cached_blocks.pop(req.request_id, None)
        self.pool.free(reversed(blocks))

    def hold(self, blocks: list[int]) -> None:
        """An extra reference that keeps blocks out of use after their request
        ends (a one-sided KV writer may still store into them); see release()."""
        self.pool.touch(blocks)

    def release(self, blocks: list[int]) -> None:
        self.pool.free(blocks)

    def block_ids(self, req) -> list[int]:
        return self.req_blocks.get(req.request_id, [])

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (held ones keep working and
        stay findable); returns how many were dropped. The hashes published but
        not yet taken go too: they no longer say what this cache finds."""
        self._recent_hashes.clear()
        return self.pool.reset_prefix_cache()

    def take_recent_hashes(self) -> list[int]:
        """Hashes published since the last call, oldest first. Call it on the
        thread that runs the engine (the worker's engine thread takes them for
        its heartbeat snapshots): from another thread, hashes appended between
        the copy and the clear would be lost."""
        out = list(self._recent_hashes)
        self._recent_hashes.clear()
        return out

    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
