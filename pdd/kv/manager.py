"""Per-request view of the block pool: which blocks a request holds, what of its
prefix is already cached, and when its full blocks become cache entries.

The scheduler talks only to this class (never to `BlockPool`):
    get_computed_blocks(req) -> (blocks, num_tokens)   prefix-cache lookup
    count_lookup(req, num_tokens)                      ... counted once its request is admitted
    allocate_slots(req, n, computed) -> blocks | None  room for n more tokens
    cache_blocks(req, num_computed)                    publish full blocks
    free(req)
and, with a second tier (pdd.kv.tier) behind the pool:
    advance_copies()                                   between steps: offload, finish copies
    start_load(req, computed) -> bool                  the tier holds more of the prefix: load it
    loading(req) / take_loaded(req) -> tokens          ... the scheduler admits it once loaded

Offload is eager: a block is stored in the tier when it becomes full and
published, not when the pool evicts it. The copy is then off every hot path
(allocation never waits for one), a step's new blocks go out as one batch, and
a block is in the tier before the pool may reuse it, whenever that is; the cost
is PCIe bandwidth for blocks never evicted (a prefill's ~3 GB/s of KV against a
link of 50). A block being copied, either way, holds a reference until its copy
is done (`_Copy`), so the pool cannot hand it out while the copy reads or
writes it; a loaded block is published in the GPU cache only then.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdd.kv.block_pool import BlockPool
from pdd.kv.hashing import ROOT_HASH, block_hashes
from pdd.kv.tier import KVTier, TierCopy


@dataclass
class _Copy:
    """A tier copy in flight and the GPU blocks it holds."""
    copy: TierCopy
    blocks: list[int]
    request_id: str | None = None   # a load's request (None once it ended: the blocks just get cached)
    start: int = 0                  # a load: the request's block index of blocks[0]
    reserved: bool = False          # a load into a reservation: its tokens are counted computed already


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: KVTier | None = None):
        self.pool = BlockPool(num_blocks)
        self.tier = tier
        self._offload: list[tuple[int, int]] = []   # (block, hash) published since the last advance_copies()
        self._copies: list[_Copy] = []
        self._loading: dict[str, _Copy] = {}        # request id -> its load in flight
        self._loaded: dict[str, int] = {}           # request id -> tokens loaded, not yet taken by the scheduler
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
        if self.tier is not None:
            self._offload.extend(zip(blocks[done:num_full], hashes[done:num_full]))
            self.pool.touch(blocks[done:num_full])   # the store's reference (advance_copies)
        self._num_cached_blocks[req.request_id] = num_full

    # ------------------------------------------------------------ second tier

    def advance_copies(self) -> None:
        """Between steps: store the blocks published since the last call (one
        batch), then finish the copies that are done."""
        if self.tier is None:
            return
        if self._offload:
            blocks, hashes = [b for b, _ in self._offload], [h for _, h in self._offload]
            self._offload = []
            copy = self.tier.store(blocks, hashes)
            if copy is None:
                self.pool.free(blocks)   # all there already (or the tier is pinned full)
            else:
                self._copies.append(_Copy(copy, blocks))
        self._finish_copies()

    def _finish_copies(self) -> None:
        left = []
        for c in self._copies:
            if not c.copy.done.done():
                left.append(c)
                continue
            self.tier.finish(c.copy)
            if c.copy.kind == "load":
                self._land(c)
            self.pool.free(c.blocks)
        self._copies = left

    def _land(self, c: _Copy) -> None:
        """A load is done: its blocks hold the hashed KV; publish them."""
        for b, h in zip(c.blocks, c.copy.hashes):
            self.pool.cache_block(b, h)
            self._recent_hashes.append(h)
        rid = c.request_id
        if rid is None:
            return
        self._loading.pop(rid, None)
        self._num_cached_blocks[rid] = c.start + len(c.blocks)
        if not c.reserved:
            self._loaded[rid] = (c.start + len(c.blocks)) * self.block_size

    def _host_hits(self, req, start: int) -> int:
        """Blocks of req's prefix after its first `start` the tier holds (the
        last token is always computed)."""
        if self.tier is None or not self.enable_prefix_caching:
            return 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.tier.lookup(req.block_hashes[start:max_blocks]) if start < max_blocks else 0

    def start_load(self, req, computed: list[int]) -> bool:
        """After a GPU lookup (get_computed_blocks) that found `computed`: if the
        tier holds more of the prefix, take the GPU cache's hits and blocks for
        the tier's, and load them. The request is `loading` until that is done,
        then `take_loaded` says how many tokens it has. False (nothing changed)
        if the tier adds nothing or the blocks are short."""
        start = len(computed)
        n = self._host_hits(req, start)
        if n == 0 or n > self._available(computed):
            return False
        self.pool.touch(computed)
        new = self.pool.allocate(n)
        self.req_blocks[req.request_id] = list(computed) + new
        self._num_cached_blocks[req.request_id] = start
        self._begin_load(req, start, new, reserved=False)
        return True

    def load_into_reservation(self, req, num_cached_blocks: int) -> int:
        """A reservation (decode role) holding its blocks, the first
        `num_cached_blocks` from the GPU cache: load what the tier holds of the
        blocks after them. Returns how many blocks it loads (their tokens are
        the reservation's to count as cached; kv_ready waits for them)."""
        n = self._host_hits(req, num_cached_blocks)
        if n:
            blocks = self.req_blocks[req.request_id][num_cached_blocks:num_cached_blocks + n]
            self._begin_load(req, num_cached_blocks, blocks, reserved=True)
        return n

    def _begin_load(self, req, start: int, blocks: list[int], reserved: bool) -> None:
        copy = self.tier.load(req.block_hashes[start:start + len(blocks)], blocks)
        self.pool.touch(blocks)   # the load's reference: a request that ends meanwhile frees only its own
        c = _Copy(copy, blocks, req.request_id, start, reserved)
        self._copies.append(c)
        self._loading[req.request_id] = c

    @property
    def copies_pending(self) -> bool:
        """Tier copies to issue or finish: the engine steps on until there are none
        (their blocks are referenced until then)."""
        return bool(self._offload or self._copies)

    def loading(self, req) -> bool:
        return req.request_id in self._loading

    def wait_for_load(self, req) -> None:
        """Block until req's load (if any) is done and landed: a reservation
        whose remote KV arrived before its own tier's part."""
        c = self._loading.get(req.request_id)
        if c is not None:
            c.copy.done.wait()
            self._finish_copies()

    def take_loaded(self, req) -> int:
        """Tokens of req's prefix its finished load brought (0: none, or taken)."""
        return self._loaded.pop(req.request_id, 0)

    def close(self) -> None:
        """Wait for the copies in flight and free the tier's memory."""
        if self.tier is not None:
            for c in self._copies:
                c.copy.done.wait()
            self._finish_copies()
            self.tier.close()

    def free(self, req) -> None:
        c = self._loading.pop(req.request_id, None)
        if c is not None:
            c.request_id = None   # its load goes on holding its blocks; they are cached when it lands
        self._loaded.pop(req.request_id, None)
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
        if self.tier is not None:
            self.tier.clear()
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
