"""The decode side of the data socket: one thread, one bound ROUTER socket.

Each pages message [header, payload] (tcp backend) is checked and written by
pdd.transfer.accept.PageWriter and answered with one ack (ok, or the reason it
was refused). One-frame control messages (cuda_ipc: pool export, one-sided
write bookkeeping) go to pdd.transfer.ipc_receiver.IpcControl. Nothing a peer
sends can stop the thread.

With `security` (pdd.security.data_security) the socket is a CURVE server that
lets in only authorized worker keys: a peer without one never gets a message
through, so it can neither write pages nor ask for the pool.
"""
from __future__ import annotations

import logging
import socket
import threading

import torch
import zmq

from pdd.kv.layout import KVLayout
from pdd.transfer.accept import PageWriter
from pdd.transfer.base import KVReceiver
from pdd.transfer.ipc_receiver import IpcControl
from pdd.transfer.leases import LeaseTable
from pdd.transfer.wire import encode_ack, peek_ids

log = logging.getLogger(__name__)

_POLL_MS = 50  # how often the thread looks at its stop flag: bounds close()'s wait


class TcpReceiver(KVReceiver):
    """Decode side of the tcp backend: a ROUTER bound at `addr` (port 0 picks
    a free port; `address` is the one to give senders)."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                 addr: str = "tcp://127.0.0.1:0", security=None):
        self._bind_addr = addr
        self.security = security
        self._writer = PageWriter(kv_cache, layout, leases)
        self.ipc = IpcControl(kv_cache, layout, leases)
        self.stats = self._writer.stats
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_error: BaseException | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="kv-tcp-receiver", daemon=True)
        self._thread.start()
        ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise ValueError(f"kv receiver cannot bind {self._bind_addr}: {self._start_error}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, ready: threading.Event) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        served = False
        try:
            if self.security is not None:
                self.security.serve(sock)   # before bind: no plaintext peer may slip in
                served = True
            sock.bind(self._bind_addr)
            self.address = _public_endpoint(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except (zmq.ZMQError, RuntimeError) as e:
            self._start_error = e
        ready.set()
        try:
            while self._start_error is None and not self._stop.is_set():
                if sock.poll(_POLL_MS, zmq.POLLIN):
                    self._drain(sock)
        finally:
            sock.close(linger=0)
            if served:
                self.security.release(sock)
            ctx.term()

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(64):  # bounded, so a flood cannot starve the stop flag
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle(sock, frames)
            except Exception:  # a bad message must never take the receiver down
                log.exception("kv receiver: error handling a message")

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        ident, body = frames[0], frames[1:]
        if len(body) == 1:
            self._reply(sock, ident, self.ipc.handle(body[0].buffer))
            return
        if len(body) != 2:
            err = self._writer.reject(f"malformed message: {len(body)} frames, expected 2 (pages) or 1 (control)")
            rid, seq = peek_ids(body[0].buffer) if body else ("", -1)
        else:
            try:
                header, err = self._writer.accept(body[0].buffer, body[1].buffer)
            except Exception as e:  # e.g. a scatter failing: refuse, keep serving
                log.exception("kv receiver: write failed")
                header, err = None, self._writer.reject(f"receiver error: {type(e).__name__}: {e}")
            rid, seq = (header["request_id"], header["seq"]) if header else peek_ids(body[0].buffer)
        self._reply(sock, ident, encode_ack(rid, seq, err is None, err or ""))

    @staticmethod
    def _reply(sock: zmq.Socket, ident, frame: bytes) -> None:
        try:
            sock.send_multipart([ident, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the sender is gone or not reading: it will time out
            log.debug("kv receiver: reply not sent: %s", e)


def _public_endpoint(endpoint: str) -> str:
    """LAST_ENDPOINT as a peer must dial it: a wildcard bind becomes this host's address."""
    for wildcard in ("0.0.0.0", "[::]"):
        if f"//{wildcard}:" in endpoint:
            return endpoint.replace(wildcard, _host_address(), 1)
    return endpoint


def _host_address() -> str:
    # The source address of a route to a public address (no packet is sent);
    # falls back to the hostname's address.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
