"""A second KV tier behind the GPU prefix cache: blocks kept under their chained
block hashes (pdd.kv.hashing) in memory beside the pool, so a prefix evicted
from the pool is loaded back instead of computed again.

`KVTier` is what the KV manager (pdd.kv.manager) talks to; `HostTier` keeps the
blocks in (pinned) host memory. A further tier (local NVMe files) is another
implementation of the same five calls, or one chained behind this one, with no
change to the manager or the scheduler.

Copies are asynchronous (pdd.kv.copies): `store` and `load` return a
`TierCopy`, and what it moves only counts once it is done: a stored hash is
found by `lookup` only after its copy completed (a load must never read a slot
still being written), and a slot a load reads is pinned until that load is
done (LRU eviction passes it by). The KV manager keeps the GPU blocks of both
kinds of copy referenced until they are done, so the pool never hands out a
block a copy still reads or writes.

FP8 pages travel as their bytes: an FP8 cache's scales are static for the
worker (pdd.kv.scales), so a block in this tier means what it meant on the
GPU; `scales_identity` says under which scales, for a tier that would outlive
the process.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from itertools import takewhile
from dataclasses import dataclass, field

import torch

from pdd.config import ConfigError
from pdd.kv.copies import BlockCopier, CopyDone
from pdd.kv.cache import KVCacheSpec


@dataclass
class TierCopy:
    """A store or load in flight: which hashes, which tier slots, when done."""
    kind: str                     # "store" | "load"
    hashes: list[int]
    slots: list[int]
    done: CopyDone
    started: float = field(default_factory=time.monotonic)


@dataclass
class TierStats:
    """Monotonic totals (the router counts deltas) and the occupancy now."""
    capacity_blocks: int = 0
    used_blocks: int = 0
    bytes_per_block: int = 0
    hit_blocks: int = 0           # blocks loaded back to the GPU
    lookups: int = 0              # lookups that went past the GPU cache's hits
    bytes_in: int = 0             # GPU -> tier
    bytes_out: int = 0            # tier -> GPU
    evicted_blocks: int = 0
    loads: int = 0                # loads finished ...
    load_wait_s: float = 0.0      # ... and their time from the start until finish() (what their requests waited)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class KVTier(ABC):
    """Blocks by chained hash, outside the GPU pool."""

    @abstractmethod
    def lookup(self, hashes: Sequence[int]) -> int:
        """How many leading `hashes` this tier holds, ready to load."""

    @abstractmethod
    def store(self, blocks: Sequence[int], hashes: Sequence[int]) -> TierCopy | None:
        """Copy GPU `blocks` (full, hashed) out under `hashes`; those it already
        holds are skipped (refreshed in LRU order). None if nothing to copy."""

    @abstractmethod
    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> TierCopy:
        """Copy the blocks of `hashes` (all held: lookup said so) into GPU `blocks`."""

    @abstractmethod
    def finish(self, copy: TierCopy) -> None:
        """`copy` is done: a store's hashes become found, a load's slots unpinned."""

    @abstractmethod
    def clear(self) -> int:
        """Forget every block no load reads (a prefix-cache reset); returns how many."""

    @abstractmethod
    def take_stored_hashes(self) -> list[int]:
        """Hashes that became found since the last call (the router's picture of this tier)."""

    @property
    @abstractmethod
    def stats(self) -> TierStats: ...

    @abstractmethod
    def close(self) -> None:
        """Free the tier's memory (worker shutdown); it holds nothing after."""


class HostTier(KVTier):
    """Host memory: one allocation of `capacity_blocks` slots, each a GPU block's
    bytes in the pool's layout ([layer][k|v][slot][kv_head][head_dim]), pinned
    when the pool is on a GPU (DMA at full PCIe speed, and the only memory a
    copy stream copies from without blocking the host). LRU over whole blocks."""

    def __init__(self, spec: KVCacheSpec, capacity_bytes: int, copier: BlockCopier, scales_identity: str = ""):
        self.spec, self.copier, self.scales_identity = spec, copier, scales_identity
        capacity = capacity_bytes // spec.bytes_per_block
        if capacity < 1:
            raise ConfigError(f"engine.host_kv_cache_bytes: {capacity_bytes} bytes hold no KV block of "
                              f"{spec.bytes_per_block} bytes; raise it (or 0 for no host tier)")
        self.storage = _allocate_host(copier.block_shape, capacity, copier.pinned, capacity_bytes)
        self._free_slots = list(range(capacity - 1, -1, -1))
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # found hash -> slot, least recent first
        self._pins: dict[int, int] = {}                        # slot -> loads reading it
        self._writing: set[int] = set()                        # hashes whose store is in flight
        self._stored: list[int] = []
        self._stats = TierStats(capacity_blocks=capacity, bytes_per_block=spec.bytes_per_block)

    @property
    def stats(self) -> TierStats:
        self._stats.used_blocks = len(self._slot_of) + len(self._writing)
        return self._stats

    def lookup(self, hashes: Sequence[int]) -> int:
        self._stats.lookups += 1
        return sum(1 for _ in takewhile(self._slot_of.__contains__, hashes))

    def store(self, blocks: Sequence[int], hashes: Sequence[int]) -> TierCopy | None:
        todo_blocks, todo_hashes, slots = [], [], []
        for b, h in zip(blocks, hashes):
            if h in self._slot_of:
                self._slot_of.move_to_end(h)
                continue
            if h in self._writing or h in todo_hashes:
                continue
            slot = self._take_slot()
            if slot is None:
                break   # every slot is pinned by a load or being written: this tier is full for now
            todo_blocks.append(b)
            todo_hashes.append(h)
            slots.append(slot)
        if not slots:
            return None
        self._writing.update(todo_hashes)
        self._stats.bytes_in += len(slots) * self.spec.bytes_per_block
        return TierCopy("store", todo_hashes, slots, self.copier.to_tier(todo_blocks, self.storage, slots))

    def load(self, hashes: Sequence[int], blocks: Sequence[int]) -> TierCopy:
        slots = []
        for h in hashes:
            slot = self._slot_of[h]   # KeyError: not held (the caller looks up first)
            self._slot_of.move_to_end(h)
            self._pins[slot] = self._pins.get(slot, 0) + 1
            slots.append(slot)
        self._stats.hit_blocks += len(slots)
        self._stats.bytes_out += len(slots) * self.spec.bytes_per_block
        return TierCopy("load", list(hashes), slots, self.copier.to_pool(self.storage, slots, list(blocks)))

    def finish(self, copy: TierCopy) -> None:
        if copy.kind == "store":
            for h, slot in zip(copy.hashes, copy.slots):
                self._writing.discard(h)
                self._slot_of[h] = slot
            self._stored.extend(copy.hashes)
            return
        self._stats.loads += 1
        self._stats.load_wait_s += time.monotonic() - copy.started
        for slot in copy.slots:
            left = self._pins.pop(slot) - 1
            if left:
                self._pins[slot] = left

    def clear(self) -> int:
        dropped = [h for h, s in self._slot_of.items() if s not in self._pins]
        for h in dropped:
            self._free_slots.append(self._slot_of.pop(h))
        self._stored = []
        return len(dropped)

    def take_stored_hashes(self) -> list[int]:
        out, self._stored = self._stored, []
        return out

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used one no load reads."""
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h, s in self._slot_of.items() if s not in self._pins), None)
        if victim is None:
            return None
        self._stats.evicted_blocks += 1
        return self._slot_of.pop(victim)

    def close(self) -> None:
        self.copier.wait_all()
        if self.storage is not None and self.copier.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.storage.data_ptr())
        self.storage = None
        self._slot_of.clear()
        self._free_slots.clear()
        self._pins.clear()
        self._writing.clear()


def host_tier_for(capacity_bytes: int, kv: torch.Tensor, spec: KVCacheSpec,
                  scales_identity: str = "") -> HostTier | None:
    """The tier engine.host_kv_cache_bytes asks for behind pool `kv` (None: 0, off)."""
    if capacity_bytes <= 0:
        return None
    return HostTier(spec, capacity_bytes, BlockCopier(kv), scales_identity)


def _allocate_host(block_shape: tuple[int, ...], capacity: int, pinned: bool, capacity_bytes: int) -> torch.Tensor:
    """Plain host memory, page-locked in place when pinned: torch's pinned
    allocator rounds a request up to a power of two (96 GiB would take 128)."""
    kind = "pinned host" if pinned else "host"
    try:
        storage = torch.empty((capacity, *block_shape), dtype=torch.uint8)
        if pinned:
            err = int(torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.numel(), 0))
            if err:
                raise RuntimeError(f"cudaHostRegister failed with cudaError {err}")
        return storage
    except (RuntimeError, MemoryError) as e:
        raise ConfigError(f"engine.host_kv_cache_bytes: could not allocate {capacity_bytes / 2**30:.2f} GiB of "
                          f"{kind} memory for the host KV tier ({e}); lower it (0: no host tier)") from e
