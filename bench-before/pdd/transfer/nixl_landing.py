"""The nixl decode side's landing region: registered memory beside the KV pool
that a request's pages are written into contiguously, then copied into its
blocks here.

NIXL/UCX pays per descriptor, and a pool that has served for a while hands a
request blocks that are almost never neighbours: written straight into its
blocks, a 16k-token request of the Llama-3-8B shape names ~65k descriptors.
Written into a range of this arena laid out as a pool of the request's own
([layers, 2, n, page], each of the request's blocks at a place of the range
the writer chose: the next free one when it first wrote it), each layer's k
and v are one run each: two descriptors per layer, whatever the pool's fragmentation. The copy
into the blocks is a local device copy (pdd.ops.copy_blocks), done once the
request's writes all landed and were checked (pdd.transfer.nixl_control).

A range is handed out at a writer's begin and taken back only once its writer
surely stopped: the same moment its lease's blocks come back (the writer
ended, or its lease's deadline plus WRITER_GRACE_S passed), so a late write
can never land in a range that another request holds.

The region is taken only where a nixl writer can come (landing_size): on a
worker that takes KV over nixl, unless it is "auto" with its data socket on
loopback. No other host can open that socket, and on this host "auto" pairs
take cuda_ipc (GPU) or tcp: nixl is the pair's backend there only when the
prefill worker offers nothing else, and such a writer, granted no range,
writes straight into the blocks. worker.nixl_landing_bytes, when set, wins.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from pdd import ops
from pdd.config import WorkerConfig
from pdd.transfer.nixl_agent import PoolRegion, device_id, mem_type
from pdd.transfer.receiver import loopback_only

_ALIGN = 256   # range starts: the copy kernel moves 16 bytes per access; a cache line is ample
# worker.nixl_landing_bytes's default is one longest request, at most this
# (a 16k-token request of the Llama-3-8B shape: 2 GiB).
_DEFAULT_CAP = 2 << 30


def landing_bytes(setting: int | None, bytes_per_token: int, max_tokens: int) -> int:
    """The landing region's size for worker.nixl_landing_bytes = `setting`
    (None: one request of `max_tokens` tokens, up to _DEFAULT_CAP)."""
    if setting is not None:
        return setting
    return min(_DEFAULT_CAP, bytes_per_token * max_tokens)


class Landing(NamedTuple):
    nbytes: int   # 0: no region
    why: str      # "": nixl never brings KV to this worker (nothing to say at its start)


def landing_size(wc: WorkerConfig, nixl_installed: bool, bytes_per_token: int, max_tokens: int) -> Landing:
    """The landing region a worker of `wc` reserves beside its KV pool, and
    why (its start log line). Only where KV comes in over nixl: a decode
    worker, or a colocated one that prefills for others (the workers the
    router ships KV to), offering nixl. There worker.nixl_landing_bytes
    wins; unset, "auto" with its data socket on loopback takes none (the
    module's docstring says why) and otherwise one request of `max_tokens`."""
    sent_kv = wc.role == "decode" or (wc.role == "colocated" and wc.prefill_for_others)
    if not sent_kv or wc.transfer_backend not in ("auto", "nixl") or not nixl_installed:
        return Landing(0, "")
    if wc.nixl_landing_bytes is not None:
        return Landing(wc.nixl_landing_bytes, f"worker.nixl_landing_bytes = {wc.nixl_landing_bytes}")
    if wc.transfer_backend == "auto" and loopback_only(wc.data_addr):
        return Landing(0, f"transfer_backend auto, data socket on loopback ({wc.data_addr}): no other host "
                          "reaches it and on this one auto takes cuda_ipc or tcp; a nixl-only prefill worker "
                          "writes straight into the blocks; worker.nixl_landing_bytes sets one")
    nbytes = landing_bytes(None, bytes_per_token, max_tokens)
    capped = f", capped at {_DEFAULT_CAP >> 30} GiB" if nbytes < bytes_per_token * max_tokens else ""
    return Landing(nbytes, f"one request of {max_tokens} tokens{capped}; transfer_backend {wc.transfer_backend}, "
                           f"data socket {wc.data_addr}")


class LandingArena:
    """`nbytes` of memory on the KV pool's device, handed out as ranges."""

    def __init__(self, nbytes: int, kv_cache: torch.Tensor):
        if nbytes <= 0:
            raise ValueError(f"a landing arena of {nbytes} bytes")
        # Zeroed: a range is copied into the pool only where its pages were
        # written, but the warm-up copies through one before any was.
        self.buf = torch.zeros(nbytes, dtype=torch.uint8, device=kv_cache.device)
        self.nbytes = nbytes
        self._kv = kv_cache
        self._page_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self._free: list[list[int]] = [[0, nbytes]]   # [start, size], sorted and merged
        self.held = 0   # ranges out
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None

    def region(self) -> dict:
        """Where the arena is, as a writer addresses it (a range by its offset)."""
        return {"addr": self.buf.data_ptr(), "nbytes": self.nbytes, "device": device_id(self.buf),
                "mem": mem_type(self.buf)}

    def range_bytes(self, num_blocks: int) -> int:
        """Bytes of a range for a request of `num_blocks` blocks: every layer's k and v pages."""
        return self._kv.shape[0] * 2 * num_blocks * self._page_bytes

    def _held_bytes(self, num_blocks: int) -> int:
        return -(-self.range_bytes(num_blocks) // _ALIGN) * _ALIGN

    def take(self, num_blocks: int) -> int | None:
        """The offset of a range for `num_blocks` blocks, or None if none is free (first fit)."""
        size = self._held_bytes(num_blocks)
        for hole in self._free:
            if hole[1] >= size:
                start = hole[0]
                hole[0] += size
                hole[1] -= size
                if not hole[1]:
                    self._free.remove(hole)
                self.held += 1
                return start
        return None

    def give_back(self, offset: int, num_blocks: int) -> None:
        self._free.append([offset, self._held_bytes(num_blocks)])
        self._free.sort()
        merged: list[list[int]] = []
        for start, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1][1] += n
            else:
                merged.append([start, n])
        self._free = merged
        self.held -= 1

    def pages(self, offset: int, num_blocks: int) -> torch.Tensor:
        """A range as the pool it stands for: [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        kv = self._kv
        raw = self.buf[offset:offset + self.range_bytes(num_blocks)]
        return raw.view(kv.dtype).view(kv.shape[0], 2, num_blocks, *kv.shape[3:])

    def copy_out(self, offset: int, num_blocks: int, places: dict[int, int], written: dict[int, set[int]]) -> None:
        """Copy a range of `num_blocks` places into the pool: for each layer,
        the pages of the blocks `written` lists for it, from their `places`.
        Done, not merely queued, when it returns: the engine may read the
        blocks from then on."""
        pages = self.pages(offset, num_blocks)
        dev = self._kv.device
        ids: dict[tuple[int, ...], tuple[torch.Tensor | None, torch.Tensor]] = {}   # the same for most layers
        with self._on_stream():
            for layer, written_blocks in sorted(written.items()):
                key = tuple(sorted(written_blocks, key=places.__getitem__))
                if key not in ids:
                    src = [places[b] for b in key]
                    # Places 0..n-1 (a request written whole): the range's head is the
                    # pages in order, one pass copies it into the blocks.
                    ids[key] = (None if src == list(range(len(src))) else
                                torch.tensor(src, dtype=torch.long, device=dev),
                                torch.tensor(key, dtype=torch.long, device=dev))
                src_ids, dst_ids = ids[key]
                if src_ids is None:
                    ops.scatter_blocks(self._kv[layer], dst_ids, pages[layer, :, :len(key)])
                else:
                    ops.copy_blocks(pages[layer], self._kv[layer], src_ids, dst_ids)
        if self._stream is not None:
            self._stream.synchronize()

    def _on_stream(self) -> contextlib.AbstractContextManager:
        """The copies' own stream on the pool's device (whatever this thread's
        current device): they wait for nothing the engine queued."""
        if self._stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self._kv.device))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    def warm_up(self) -> None:
        """The copies copy_out makes (on its stream), of the null block's own
        pages through the arena and back: their kernels compiled before the
        first request lands (KVReceiver.warm_up)."""
        zero = torch.zeros(1, dtype=torch.long, device=self._kv.device)
        pages = self.pages(0, 1)
        with self._on_stream():
            ops.copy_blocks(self._kv[0], pages[0], zero, zero)
            ops.copy_blocks(pages[0], self._kv[0], zero, zero)
            ops.scatter_blocks(self._kv[0], zero, pages[0])
        if self._stream is not None:
            self._stream.synchronize()


def landing_region(arena: dict, offset: int, nbytes: int, num_blocks: int) -> PoolRegion:
    """A peer's landing range (its arena as region() describes it), as a pool
    region of `num_blocks` blocks a write's descriptors address; ValueError if
    it does not lie inside the arena."""
    if not (isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset and nbytes > 0
            and offset + nbytes <= arena["nbytes"]):
        raise ValueError(f"landing range {offset}+{nbytes} outside the arena of {arena['nbytes']} bytes")
    return PoolRegion(arena["addr"] + offset, nbytes, arena["device"], arena["mem"], num_blocks)
