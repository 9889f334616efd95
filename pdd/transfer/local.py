"""The `local` backend: prefill and decode engines in one process (tests only:
worker processes never offer it, see pdd.transfer.offered_backends).

Same checks and the same lease-guarded write as tcp
(pdd.transfer.receiver.PageWriter), without the network: the sender copies
synchronously inside send_layer, finish() hands the receiver the done
message at once, and the result is there on the next poll().
"""
from __future__ import annotations

import threading
import uuid

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer.base import Handoff, KVReceiver, TransferTarget
from pdd.transfer.leases import LeaseTable
from pdd.transfer.progress import Progress, Tombstones
from pdd.transfer.receiver import PageWriter
from pdd.transfer.sender import SenderBase
from pdd.transfer.staging import dst_blocks_for, stage_pages, warm_up_staging
from pdd.transfer.wire import encode_done, encode_pages_header

_PREFIX = "local://"
_registry: dict[str, "LocalReceiver"] = {}
_registry_lock = threading.Lock()


def _lookup(addr: str) -> "LocalReceiver | None":
    with _registry_lock:
        return _registry.get(addr)


class LocalReceiver(KVReceiver):
    """Decode side of the local backend: registered under `local://<name>`
    (a fresh unique name when `addr` is just "local://")."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable, addr: str = _PREFIX):
        if not addr.startswith(_PREFIX):
            raise ValueError(f"local receiver address must start with {_PREFIX!r}, got {addr!r}")
        self.address = addr if addr != _PREFIX else _PREFIX + uuid.uuid4().hex[:12]
        self.writer = PageWriter(kv_cache, layout, leases)
        self.stats = self.writer.stats

    def start(self) -> None:
        with _registry_lock:
            other = _registry.get(self.address)
            if other is not None and other is not self:
                raise ValueError(f"{self.address} is already taken by another local receiver")
            _registry[self.address] = self

    def warm_up(self) -> None:
        self.writer.warm_up()

    def close(self) -> None:
        with _registry_lock:
            if _registry.get(self.address) is self:
                del _registry[self.address]

    def deliver(self, header: bytes, pages: torch.Tensor | None) -> str | None:
        """Check and write one pages message (`pages` None: the done message);
        None if accepted, else the refusal."""
        try:
            return (self.writer.complete(header) if pages is None else self.writer.accept(header, pages))[1]
        except Exception as e:  # a bug here must fail the transfer, not the sender's caller
            return f"receiver error: {type(e).__name__}: {e}"


class LocalSender(SenderBase):
    """Prefill side of the local backend; `timeout_s` is accepted for parity with tcp."""

    def __init__(self, layout: KVLayout, timeout_s: float = 30.0):
        super().__init__(layout)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # finish/abort may come from another thread than send_layer
        self._progress: dict[str, Progress] = {}
        self._targets: dict[str, TransferTarget] = {}
        self._seq: dict[str, int] = {}
        self._failed = Tombstones()
        self._closed = False

    def prepare(self, target: TransferTarget) -> None:
        with self._lock:
            self._targets.setdefault(target.request_id, target)

    def send_layer(self, target: TransferTarget, layer: int, src_layer: torch.Tensor,
                   src_block_ids: list[int], block_indices: list[int]) -> None:
        if self._closed:
            raise RuntimeError("sender is closed")
        dst = dst_blocks_for(self.layout, target, src_layer, src_block_ids, block_indices)
        rid = target.request_id
        with self._lock:
            if rid in self._failed or not dst:
                return
            self._targets.setdefault(rid, target)
            prog = self._progress.setdefault(rid, Progress(rid))
            seq = self._seq.get(rid, 0)
            self._seq[rid] = seq + 1
            pages = stage_pages(src_layer, src_block_ids, to_host=False).pages
            header = encode_pages_header(request_id=rid, lease_id=target.lease_id, layer=layer,
                                         dst_block_ids=dst, dtype=pages.dtype, shape=list(pages.shape),
                                         layout=self.layout_dict, seq=seq)
            err = self._deliver(target, header, pages)
            if err is None:
                prog.delivered(pages.numel() * pages.element_size(), dst)
                return
            result = self._end(rid).result(False, err)
            self._failed.add(rid)
        self._emit(result)  # outside the lock: the wake-up callback may call back in

    @staticmethod
    def _deliver(target: TransferTarget, header: bytes, pages: torch.Tensor | None) -> str | None:
        receiver = _lookup(target.dst_addr)
        return f"no local receiver at {target.dst_addr}" if receiver is None else receiver.deliver(header, pages)

    def _end(self, rid: str) -> Progress:
        self._targets.pop(rid, None)
        self._seq.pop(rid, None)
        return self._progress.pop(rid, None) or Progress(rid)

    def warm_up(self, kv_cache: torch.Tensor) -> None:
        warm_up_staging(kv_cache, to_host=False)

    def finish(self, request_id: str, blocks_skipped: int = 0, handoff: Handoff | None = None) -> None:
        with self._lock:
            if self._failed.discard(request_id):
                return
            target, seq = self._targets.get(request_id), self._seq.get(request_id, 0)
            err = None
            if target is not None:   # (never prepared, no page: no receiver to tell)
                done = encode_done(request_id=request_id, lease_id=target.lease_id, seq=seq,
                                   handoff=handoff.to_dict() if handoff is not None else None)
                err = self._deliver(target, done, None)
            result = self._end(request_id).result(err is None, err or "", blocks_skipped)
        self._emit(result)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._end(request_id)
            self._failed.discard(request_id)

    def close(self) -> None:
        self._closed = True
