"""The decode end of the transfer benchmarks (benchmarks.transfer,
benchmarks.ipc): a KV pool, its lease table and a receiver, in a process of its own as a
decode worker runs it, or in this process (the local backend; a thread for the
others).

Pools are filled from a seeded generator, so both ends can make the same one;
pages are compared by digest, layer by layer, so neither end holds a second
copy of a pool of gigabytes.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer import make_receiver
from pdd.transfer.leases import LeaseTable


def make_pool(layout: KVLayout, blocks: int, device: str, seed: int) -> torch.Tensor:
    """[layers, 2, blocks, block_size, kv_heads, head_dim], random and never zero."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    pool = torch.empty(shape, dtype=getattr(torch, layout.kv_cache_dtype), device=device)
    for layer in pool:   # a layer at a time: a float32 draw of the whole pool would be twice its size
        layer.copy_(torch.rand(shape[1:], generator=g) + 1)
    return pool


def pages_digest(pool: torch.Tensor, block_ids: list[int]) -> str:
    """A digest of the pages of `block_ids` (in that order), every layer and k|v."""
    h = hashlib.blake2b(digest_size=16)
    idx = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    for layer in pool:
        pages = layer.index_select(1, idx).contiguous().cpu()
        h.update(pages.view(torch.uint8).numpy())
    return h.hexdigest()


class LocalDecode:
    """The decode side in this process: a receiver of `backend` (its data
    socket's thread, or the local backend's in-process page writer)."""

    def __init__(self, layout: KVLayout, blocks: int, device: str, backend: str = "tcp", landing_bytes: int = 0):
        """landing_bytes: nixl's landing region beside the pool (0: none)."""
        self.dst = make_pool(layout, blocks, device, 2)
        self.leases = LeaseTable()
        self.receiver = make_receiver(backend, self.dst, layout, self.leases, nixl_landing_bytes=landing_bytes)
        self.receiver.start()
        self.address = self.receiver.address

    def grant(self, rid: str, dst_ids: list[int]) -> str:
        return self.leases.grant(rid, dst_ids, 600)

    def digest(self, dst_ids: list[int]) -> str:
        return pages_digest(self.dst, dst_ids)

    def clear(self) -> None:
        """Zero the pool: pages a later run checks must be its own."""
        self.dst.zero_()

    def intact(self, src: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> bool:
        return pages_digest(src, src_ids) == self.digest(dst_ids)

    def close(self) -> None:
        self.receiver.close()


def _serve(conn, layout: dict, blocks: int, device: str, backend: str, landing_bytes: int) -> None:
    side = LocalDecode(KVLayout.from_dict(layout), blocks, device, backend, landing_bytes)
    conn.send(side.address)
    while True:
        cmd, *rest = conn.recv()
        if cmd == "grant":
            conn.send(side.grant(*rest))
        elif cmd == "digest":
            conn.send(side.digest(*rest))
        elif cmd == "clear":
            side.clear()
            conn.send(True)
        else:
            side.close()
            conn.send(True)
            return


class RemoteDecode(LocalDecode):
    """The decode side in its own process, as deployed: no GIL shared with the
    sender. Its data socket serves tcp and cuda_ipc senders, and nixl ones when
    `backend` is nixl (its pool registered with a NIXL agent there)."""

    def __init__(self, layout: KVLayout, blocks: int, device: str, backend: str = "tcp", landing_bytes: int = 0):
        if backend == "local":
            raise ValueError("the local backend joins two ends of one process: use LocalDecode")
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, layout.to_dict(), blocks, device, backend, landing_bytes),
                                daemon=True)
        self.proc.start()
        child.close()   # so that its death reads as EOF here
        if not self.conn.poll(600):
            self.proc.kill()
            raise RuntimeError("the decode process did not start in 600 s")
        self.address = self.conn.recv()

    def _call(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def grant(self, rid: str, dst_ids: list[int]) -> str:
        return self._call("grant", rid, dst_ids)

    def digest(self, dst_ids: list[int]) -> str:
        return self._call("digest", dst_ids)

    def clear(self) -> None:
        self._call("clear")

    def close(self) -> None:
        try:
            self._call("close")
        except (EOFError, OSError):   # it died: nothing left to stop
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
