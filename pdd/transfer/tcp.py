"""The `tcp` backend, prefill side: pages staged in host memory, sent over ZeroMQ.

send_layer() gathers pages into a tensor it owns and hands it to the I/O
thread (pdd.transfer.sender.IoSender): one DEALER per decode worker, messages
[header, payload] sent zero-copy, one ack per message. finish() sends the
request's done message on the same ordered stream, after its pages: it
carries the handoff (the first token), and the receiver
(pdd.transfer.receiver.DataSocket) accepts it only if every pages message
before it was written under the still live lease; the decode worker then
starts the request. The transfer succeeds when the done message is acked.

A request whose messages go unacknowledged for `timeout_s` after its last
progress fails (pdd.transfer.progress.Progress: the clock runs only while a
message awaits its ack, and each ack restarts it, so a slow but moving
transfer goes on). The I/O thread keeps that clock, so it must not block:
an injected send delay (pdd.transfer.injected) holds the message, not the
thread. With
`security`, each DEALER is a CURVE client of the key the decode worker
registered: a handshake that fails (wrong or unauthorized key) fails that
destination's requests at once, with the reason, instead of by a timeout.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer.base import Handoff, TransferTarget
from pdd.transfer.dest import HANDSHAKE_FAILED, Dest, DestKey, Outgoing, handshake_refused
from pdd.transfer.progress import Progress, Tombstones
from pdd.transfer.sender import IoSender, RequestTable
from pdd.transfer.staging import Staged, stage_pages, warm_up_staging
from pdd.transfer.wire import decode_ack, encode_done, encode_pages_header, tensor_bytes

log = logging.getLogger(__name__)


@dataclass
class TcpMessage(Outgoing):
    """One message of a request's stream (a layer's pages, or the done), from
    send_layer()/finish() to its ack."""

    seq: int
    dst: list[int]
    staged: Staged | None   # the pages (None: the done message); referenced until acked: zmq sends from it
    t_enq: float
    landed: bool = False    # its pages are in host memory (waited for once, at the head of its queue)

    def ready(self) -> float | None:
        if self.staged is not None and not self.landed:
            self.staged.wait()  # CUDA: the device->host copy must have landed
            self.landed = True
        return None

    @property
    def nbytes(self) -> int:
        pages = self.staged.pages if self.staged is not None else None
        return pages.numel() * pages.element_size() if pages is not None else 0


@dataclass
class _Req:
    progress: Progress
    target: TransferTarget
    next_seq: int = 0
    outstanding: dict[int, TcpMessage] = field(default_factory=dict)  # seq order = send order
    finished: bool = False
    blocks_skipped: int = 0


class TcpSender(RequestTable, IoSender):
    backend = "tcp"
    thread_name = "kv-tcp-sender"
    decode_answer = staticmethod(decode_ack)
    request_class = _Req
    message_class = TcpMessage   # pdd.transfer.injected's holds pages back once a fault is set

    def __init__(self, layout: KVLayout, timeout_s: float = 30.0, security=None):
        self._reqs: dict[str, _Req] = {}
        self._failed = Tombstones()
        self.monitor_events = HANDSHAKE_FAILED if security is not None else 0
        super().__init__(layout, timeout_s, security)

    # -- engine side ---------------------------------------------------------

    def prepare(self, target: TransferTarget) -> None:
        """Known before its first page: a request whose pages are all skipped
        still sends its done message there."""
        self._put(("prepare", target))

    def send_layer(self, target: TransferTarget, layer: int, src_layer: torch.Tensor,
                   src_block_ids: list[int], block_indices: list[int]) -> None:
        dst = self._dst_blocks_over_tcp(target, src_layer, src_block_ids, block_indices)
        if dst:
            staged = stage_pages(src_layer, src_block_ids, to_host=True)
            self._put(("send", target, layer, dst, staged, time.perf_counter()))

    def warm_up(self, kv_cache: torch.Tensor) -> None:
        warm_up_staging(kv_cache, to_host=True)

    # -- I/O thread ----------------------------------------------------------

    def _command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "prepare":
            self._request(cmd[1])
        elif kind == "send":
            self._enqueue(*cmd[1:])
        elif kind == "finish":
            self._on_finish(*cmd[1:])
        elif kind == "abort":
            self._drop(cmd[1])
            self._failed.discard(cmd[1])

    def _refuse(self, req: _Req, why: str) -> None:
        self._fail(req.target.request_id, why)

    def _enqueue(self, target: TransferTarget, layer: int, dst: list[int], staged: Staged, t_enq: float) -> None:
        req = self._request(target)
        if req is None:
            return
        if req.next_seq == 0:
            req.progress.t_first = t_enq
        rid = target.request_id
        header = encode_pages_header(request_id=rid, lease_id=target.lease_id, layer=layer, dst_block_ids=dst,
                                     dtype=staged.pages.dtype, shape=list(staged.pages.shape),
                                     layout=self.layout_dict, seq=req.next_seq)
        self._send(req, self.message_class(rid, [header, tensor_bytes(staged.pages)], req.next_seq, dst, staged, t_enq))

    def _send(self, req: _Req, msg: TcpMessage) -> None:
        req.next_seq += 1
        req.outstanding[msg.seq] = msg
        req.progress.owe(msg.t_enq)
        self._dest(req.target).pending.append(msg)

    def _after_finish(self, req: _Req, handoff: Handoff | None) -> None:
        rid = req.target.request_id
        # Its seq is the number of pages messages before it: the receiver checks
        # that each of them was written.
        done = encode_done(request_id=rid, lease_id=req.target.lease_id, seq=req.next_seq,
                           handoff=handoff.to_dict() if handoff is not None else None)
        self._send(req, self.message_class(rid, [done], req.next_seq, [], None, time.perf_counter()))

    def _on_answer(self, dest: Dest, ack: dict) -> None:
        req = self._reqs.get(ack["request_id"])
        msg = req.outstanding.pop(ack["seq"], None) if req is not None else None
        if msg is None:  # aborted, already failed, or a duplicate
            return
        if not ack["ok"]:
            self._fail(msg.request_id, ack["error"] or "refused by the decode worker")
            return
        req.progress.delivered(msg.nbytes, msg.dst, time.perf_counter(), still_owed=bool(req.outstanding))
        if req.finished and not req.outstanding:   # the done message was accepted
            del self._reqs[msg.request_id]
            self._emit(req.progress.result(True, blocks_skipped=req.blocks_skipped))

    def _on_monitor(self, key: DestKey, dest: Dest, events: set[int]) -> bool:
        """The decode worker's socket refused our handshake: its requests fail now
        rather than by a timeout, and the socket goes (a later request dials
        afresh: the receiver may have authorized our key meanwhile)."""
        for rid in [rid for rid, req in self._reqs.items() if self._dest_key(req.target) == key]:
            self._fail(rid, handshake_refused(dest.addr))
        self._close_dest(key)
        return False

    def _fail(self, rid: str, error: str) -> None:
        req = self._drop(rid)
        if req is None:
            return
        if not req.finished:
            self._failed.add(rid)  # later pages of it are dropped, finish() is silent
        self._emit(req.progress.result(False, error, req.blocks_skipped))

    def _drop(self, rid: str) -> _Req | None:
        """Forget a request and release its messages not yet handed to zmq."""
        req = self._reqs.pop(rid, None)
        if req is not None and req.outstanding:
            dest = self._dests.get(self._dest_key(req.target))
            if dest is not None:
                dest.drop(rid)
        return req

    def _expire(self, now: float) -> None:
        for rid, req in list(self._reqs.items()):
            due = req.progress.deadline(self.timeout_s)
            if due is not None and now >= due:
                self._fail(rid, f"stalled: no progress for {self.timeout_s:g}s waiting for the decode worker "
                                "(worker.transfer_timeout_s)")

    def _next_deadline(self) -> float | None:
        return min((d for r in self._reqs.values() if (d := r.progress.deadline(self.timeout_s)) is not None),
                   default=None)

    def _crashed(self, error: str) -> None:
        for rid in list(self._reqs):
            self._fail(rid, error)
