"""Receiver-side checking and writing of a pages message, shared by every backend.

Order of checks: the header decodes, the sender's KV layout equals ours, the
pages' dtype/shape/size fit our pool, and finally, under the lease table's
lock, the lease allows exactly these blocks. Only then are the pages written.
"""
from __future__ import annotations

import logging

import torch

from pdd import faults, ops
from pdd.kv.layout import KVLayout
from pdd.transfer.base import ReceiverStats
from pdd.transfer.leases import LeaseTable
from pdd.transfer.wire import WireError, bytes_to_tensor, decode_header, dtype_name

log = logging.getLogger(__name__)

_MAX_REJECTIONS_KEPT = 100


def pool_mismatch(pool: torch.Tensor, layout: KVLayout, what: str = "KV pool") -> str | None:
    """Why a pool ([layers, 2, blocks, block_size, kv_heads, head_dim], or one
    layer of it) does not match `layout`, or None."""
    want = [2, None, layout.block_size, layout.num_kv_heads, layout.head_dim]
    if pool.dim() == 6:
        want = [layout.num_layers] + want
    got = list(pool.shape)
    if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
        return f"{what} has shape {got}, layout wants {['*' if w is None else w for w in want]}"
    if dtype_name(pool.dtype) != layout.dtype:
        return f"{what} has dtype {dtype_name(pool.dtype)}, layout wants {layout.dtype}"
    return None


class PageWriter:
    """Checks pages messages against one local pool and writes them under their lease.

    `stats.messages`/`stats.bytes` count what was written; `stats.rejected`
    what was refused (with the last reasons in `stats.rejections`).
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable):
        err = pool_mismatch(kv_cache, layout)
        if err:
            raise ValueError(err)
        self.kv_cache = kv_cache
        self.layout = layout
        self._layout_dict = layout.to_dict()
        self.leases = leases
        self.stats = ReceiverStats()
        self._page_shape = list(kv_cache.shape[3:])  # block_size, kv_heads, head_dim

    def accept(self, raw_header: bytes | memoryview, payload: memoryview | bytes | torch.Tensor,
               ) -> tuple[dict | None, str | None]:
        """(header or None if it did not decode, error or None if written)."""
        try:
            header = decode_header(raw_header)
        except WireError as e:
            return None, self.reject(f"malformed header: {e}")
        err = self._check(header, payload)
        if err is None and faults.get("transfer.reject"):
            err = "refused by fault injection (PDD_FAULTS transfer.reject)"
        if err is None:
            err = self._write(header, payload)
        if err is not None:
            return header, self.reject(err)
        self.stats.messages += 1
        self.stats.bytes += _nbytes(payload)
        return header, None

    def _check(self, h: dict, payload) -> str | None:
        if h["layout"] != self._layout_dict:  # the common case costs one dict compare
            err = self._layout_error(h["layout"])
            if err:
                return err
        if h["layer"] >= self.kv_cache.shape[0]:
            return f"layer {h['layer']} out of range (pool has {self.kv_cache.shape[0]})"
        if h["dtype"] != dtype_name(self.kv_cache.dtype):
            return f"dtype mismatch: pages are {h['dtype']}, pool is {dtype_name(self.kv_cache.dtype)}"
        dst = h["dst_block_ids"]
        want = [2, len(dst)] + self._page_shape
        if h["shape"] != want:
            return f"shape mismatch: pages are {h['shape']}, expected {want}"
        return _check_blocks(dst, self.kv_cache.shape[2]) or self._check_payload(want, payload)

    def _layout_error(self, d: dict) -> str | None:
        try:
            theirs = KVLayout.from_dict(d)
        except (TypeError, ValueError) as e:
            return f"malformed header: bad layout: {e}"
        return theirs.mismatch(self.layout)

    def _check_payload(self, shape: list[int], payload) -> str | None:
        expected = self.kv_cache.element_size()
        for s in shape:
            expected *= s
        if isinstance(payload, torch.Tensor):
            if payload.dtype != self.kv_cache.dtype or list(payload.shape) != shape:
                return (f"payload tensor is {dtype_name(payload.dtype)} {list(payload.shape)}, "
                        f"header says {dtype_name(self.kv_cache.dtype)} {shape}")
        elif memoryview(payload).nbytes != expected:
            return f"payload is {memoryview(payload).nbytes} bytes, header implies {expected}"
        return None

    def _write(self, h: dict, payload) -> str | None:
        dst = h["dst_block_ids"]
        pages = payload if isinstance(payload, torch.Tensor) else \
            bytes_to_tensor(payload, self.kv_cache.dtype, h["shape"])
        kv_layer = self.kv_cache[h["layer"]]
        # Staged outside the lock: the host->device copy can be slow.
        pages = pages.to(kv_layer.device)
        ids = torch.tensor(dst, dtype=torch.long, device=kv_layer.device)
        with self.leases.writing(h["lease_id"], h["request_id"], dst) as err:
            if err is not None:
                return _LeaseRefusal(err)
            if dst:
                ops.scatter_blocks(kv_layer, ids, pages)
                if kv_layer.is_cuda:
                    # The write must be done, not merely queued, before the lock is
                    # released: a close() that returns hands the blocks to another
                    # request, whose writes may run on another stream.
                    torch.cuda.current_stream(kv_layer.device).synchronize()
        return None

    def reject(self, err: str) -> str:
        s, msg = self.stats, str(err)
        s.rejected += 1
        s.last_error = msg
        s.rejections.append(msg)
        del s.rejections[:-_MAX_REJECTIONS_KEPT]
        # A revoked lease is routine (the request was aborted while pages were
        # in flight); anything else means two workers disagree.
        log.log(logging.DEBUG if isinstance(err, _LeaseRefusal) else logging.WARNING, "kv receive refused: %s", err)
        return msg


class _LeaseRefusal(str):
    """A refusal by the lease table (logged quietly)."""


def _check_blocks(dst: list[int], num_blocks: int) -> str | None:
    if len(set(dst)) != len(dst):
        return "duplicate destination block ids"
    for b in dst:
        if b >= num_blocks:
            return f"block {b} out of range (pool has {num_blocks})"
    return None


def _nbytes(payload) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return memoryview(payload).nbytes
