"""The `tcp` backend: pages staged in host memory, sent over ZeroMQ.

Sender (here): send_layer() gathers pages into a tensor it owns and hands it
to one I/O thread, which owns every socket (zmq sockets are not thread-safe):
one DEALER per destination, messages [header, payload] sent zero-copy, one ack
per message. Receiver (pdd.transfer.tcp_receiver, re-exported here): one
thread with a bound ROUTER that checks and writes each message
(pdd.transfer.accept) and acks it.

With `security`, each DEALER is a CURVE client of the key the decode worker
registered: a handshake that fails (wrong or unauthorized key) fails that
destination's requests at once, with the reason, instead of by a timeout.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from pdd import faults
from pdd.kv.layout import KVLayout
from pdd.transfer.base import TransferTarget
from pdd.transfer.common import Mailbox, Progress, SenderBase, Staged, Tombstones, dst_blocks_for, stage_pages
from pdd.transfer.tcp_receiver import TcpReceiver
from pdd.transfer.wire import WireError, decode_ack, encode_pages_header, tensor_bytes

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

__all__ = ["TcpReceiver", "TcpSender"]

log = logging.getLogger(__name__)

_MAX_WAIT_MS = 1000  # longest poll when nothing is due


@dataclass
class _Msg:
    """One layer's pages for one request, from send_layer() to its ack."""

    request_id: str
    seq: int
    dst: list[int]
    header: bytes
    staged: Staged       # referenced until acked: zmq sends from its memory
    t_enq: float

    @property
    def nbytes(self) -> int:
        return self.staged.pages.numel() * self.staged.pages.element_size()


@dataclass
class _Req:
    progress: Progress
    dest: tuple[str, str]     # (address, server key): its _Dest
    next_seq: int = 0
    outstanding: dict[int, _Msg] = field(default_factory=dict)  # seq order = send order
    finished: bool = False
    blocks_skipped: int = 0


class _Dest:
    """One DEALER to one receiver, and what it could not take yet."""

    def __init__(self, ctx: zmq.Context, addr: str, security=None, server_key: str = ""):
        self.addr = addr
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # Queue only onto a live connection: with no receiver, sends fail with
        # Again and the pages stay in `pending`, where a timeout can drop them.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)   # bounded by what we hold anyway
        self.monitor = None
        if security is not None:
            security.dial(self.sock, server_key)
            self.monitor = self.sock.get_monitor_socket(_HANDSHAKE_FAILED)
        self.sock.connect(addr)
        self.pending: deque[_Msg] = deque()

    def handshake_failed(self) -> bool:
        """Drain the monitor; True if a handshake failed since the last look."""
        failed = False
        while True:
            try:
                self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return failed
            failed = True

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)


class TcpSender(SenderBase):
    """Prefill side of the tcp backend; a message unacknowledged after
    `timeout_s` fails its request."""

    def __init__(self, layout: KVLayout, timeout_s: float = 30.0, security=None):
        super().__init__(layout)
        self.timeout_s = timeout_s
        self.security = security   # pdd.security.Curve (data), None: plaintext
        self._mail = Mailbox()
        # I/O-thread state from here on.
        self._ctx = zmq.Context()
        self._reqs: dict[str, _Req] = {}
        self._dests: dict[tuple[str, str], _Dest] = {}
        self._failed = Tombstones()
        self._thread = threading.Thread(target=self._run, name="kv-tcp-sender", daemon=True)
        self._thread.start()

    # -- engine side ---------------------------------------------------------

    def send_layer(self, target: TransferTarget, layer: int, src_layer: torch.Tensor,
                   src_block_ids: list[int], block_indices: list[int]) -> None:
        if self._mail.closed or not self._thread.is_alive():
            raise RuntimeError("sender is closed" if self._mail.closed else "kv sender I/O thread died (see log)")
        if not target.dst_addr.startswith("tcp://"):
            raise ValueError(f"tcp sender cannot reach {target.dst_addr!r}")
        dst = dst_blocks_for(self.layout, target, src_layer, src_block_ids, block_indices)
        if dst:
            staged = stage_pages(src_layer, src_block_ids, to_host=True)
            if not self._mail.put(("send", target, layer, dst, staged, time.perf_counter())):
                raise RuntimeError("sender is closed")

    def finish(self, request_id: str, blocks_skipped: int = 0) -> None:
        self._mail.put(("finish", request_id, blocks_skipped))

    def abort(self, request_id: str) -> None:
        self._mail.put(("abort", request_id))

    def close(self) -> None:
        if not self._mail.put(("close",)):
            return  # already closed
        self._thread.join()
        self._mail.close_fds()

    # -- I/O thread ----------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._mail.fd, zmq.POLLIN)
        try:
            while True:
                timeout = 0 if self._mail.going_idle() else self._next_deadline_ms()
                events = dict(poller.poll(timeout))
                self._mail.woken(self._mail.fd in events)
                if not self._run_commands(poller):
                    break
                for key, dest in list(self._dests.items()):
                    if dest.monitor is not None and events.get(dest.monitor, 0) & zmq.POLLIN \
                            and dest.handshake_failed():
                        self._refused(key, dest, poller)
                        continue
                    if events.get(dest.sock, 0) & zmq.POLLIN:
                        self._recv_acks(dest)
                    self._flush(dest, poller)
                self._expire(time.perf_counter())
        except Exception:  # never expected; make it loud, fail what is in flight
            log.exception("kv tcp sender I/O thread crashed")
            for rid in list(self._reqs):
                self._fail(rid, "kv sender I/O thread crashed")
        finally:
            for dest in self._dests.values():
                dest.close()
            self._ctx.term()

    def _run_commands(self, poller: zmq.Poller) -> bool:
        """Apply queued engine calls in order; False once close() was asked."""
        for cmd in self._mail.take():
            kind = cmd[0]
            if kind == "send":
                self._enqueue(poller, *cmd[1:])
            elif kind == "finish":
                self._on_finish(cmd[1], cmd[2])
            elif kind == "abort":
                self._drop(cmd[1])
                self._failed.discard(cmd[1])
            else:
                return False
        return True

    def _enqueue(self, poller: zmq.Poller, target: TransferTarget, layer: int, dst: list[int],
                 staged: Staged, t_enq: float) -> None:
        rid = target.request_id
        if rid in self._failed:
            return
        key = (target.dst_addr, target.dst_public_key if self.security is not None else "")
        req = self._reqs.get(rid)
        if req is None:
            req = self._reqs[rid] = _Req(Progress(rid, t_first=t_enq), key)
            if self.security is not None and not target.dst_public_key:
                self._fail(rid, "the decode worker registered no data-socket key (it runs without keys?)")
                return
        header = encode_pages_header(request_id=rid, lease_id=target.lease_id, layer=layer, dst_block_ids=dst,
                                     dtype=staged.pages.dtype, shape=list(staged.pages.shape),
                                     layout=self.layout_dict, seq=req.next_seq)
        msg = _Msg(rid, req.next_seq, dst, header, staged, t_enq)
        req.next_seq += 1
        req.outstanding[msg.seq] = msg
        dest = self._dests.get(key)
        if dest is None:
            dest = self._dests[key] = _Dest(self._ctx, target.dst_addr, self.security, key[1])
            poller.register(dest.sock, zmq.POLLIN)
            if dest.monitor is not None:
                poller.register(dest.monitor, zmq.POLLIN)
        dest.pending.append(msg)

    def _flush(self, dest: _Dest, poller: zmq.Poller) -> None:
        """Hand pending messages to zmq until it refuses; ask for POLLOUT if it did."""
        while dest.pending:
            msg = dest.pending[0]
            msg.staged.wait()  # CUDA: the device->host copy must have landed
            delay = faults.get("transfer.send_delay_s")
            if delay:
                time.sleep(delay)
            try:
                dest.sock.send_multipart([msg.header, tensor_bytes(msg.staged.pages)],
                                         flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            dest.pending.popleft()
        poller.register(dest.sock, zmq.POLLIN | (zmq.POLLOUT if dest.pending else 0))

    def _recv_acks(self, dest: _Dest) -> None:
        while True:
            try:
                frames = dest.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ack = decode_ack(frames[-1])
            except WireError as e:
                log.warning("kv sender: dropped a malformed ack: %s", e)
                continue
            self._on_ack(ack)

    def _refused(self, key: tuple[str, str], dest: _Dest, poller: zmq.Poller) -> None:
        """The decode worker's socket refused our handshake: its requests fail now
        rather than by a timeout, and the socket goes (a later request dials
        afresh: the receiver may have authorized our key meanwhile)."""
        for rid in [rid for rid, req in self._reqs.items() if req.dest == key]:
            self._fail(rid, f"CURVE handshake with the decode worker at {dest.addr} failed: this worker's key "
                            "is not authorized there, or the key it registered is not the one it serves with")
        poller.unregister(dest.sock)
        poller.unregister(dest.monitor)
        dest.close()
        del self._dests[key]

    def _on_ack(self, ack: dict) -> None:
        req = self._reqs.get(ack["request_id"])
        msg = req.outstanding.pop(ack["seq"], None) if req is not None else None
        if msg is None:  # aborted, already failed, or a duplicate
            return
        if not ack["ok"]:
            self._fail(msg.request_id, ack["error"] or "refused by the decode worker")
            return
        req.progress.delivered(msg.nbytes, msg.dst)
        self._maybe_done(msg.request_id)

    def _on_finish(self, rid: str, blocks_skipped: int) -> None:
        if self._failed.discard(rid):
            return  # its failure was already reported
        req = self._reqs.get(rid)
        if req is None:  # nothing was sent (everything skipped, or no pages)
            self._emit(Progress(rid).result(True, blocks_skipped=blocks_skipped))
            return
        req.finished, req.blocks_skipped = True, blocks_skipped
        self._maybe_done(rid)

    def _maybe_done(self, rid: str) -> None:
        req = self._reqs[rid]
        if req.finished and not req.outstanding:
            del self._reqs[rid]
            self._emit(req.progress.result(True, blocks_skipped=req.blocks_skipped))

    def _fail(self, rid: str, error: str) -> None:
        req = self._drop(rid)
        if req is None:
            return
        if not req.finished:
            self._failed.add(rid)  # later pages of it are dropped, finish() is silent
        self._emit(req.progress.result(False, error, req.blocks_skipped))

    def _drop(self, rid: str) -> _Req | None:
        """Forget a request and release its pages not yet handed to zmq."""
        req = self._reqs.pop(rid, None)
        if req is not None and req.outstanding:
            dest = self._dests.get(req.dest)
            if dest is not None and dest.pending:
                dest.pending = deque(m for m in dest.pending if m.request_id != rid)
        return req

    def _expire(self, now: float) -> None:
        for rid, req in list(self._reqs.items()):
            oldest = next(iter(req.outstanding.values()), None)
            if oldest is not None and now - oldest.t_enq > self.timeout_s:
                self._fail(rid, f"timed out after {self.timeout_s:g}s waiting for the decode worker")

    def _next_deadline_ms(self) -> int:
        oldest = [next(iter(r.outstanding.values())).t_enq for r in self._reqs.values() if r.outstanding]
        if not oldest:
            return _MAX_WAIT_MS
        due = min(oldest) + self.timeout_s - time.perf_counter()
        return max(1, min(_MAX_WAIT_MS, int(due * 1000) + 1))
