"""Typed asyncio wrappers around the ZeroMQ control sockets.

The router binds one ROUTER socket; each worker connects a DEALER whose
identity is its own per process (worker id and incarnation: see
pdd.router.connections for why). No other module touches zmq control sockets
directly. Malformed frames are logged and dropped here: handlers only ever
see well-formed `Message`s.

With a `security` (pdd.security.control_security) both ends run CURVE: the
router lets in only authorized worker keys, a worker only talks to the holder
of the router's key. A peer that fails the handshake never reaches recv();
its failures are counted and logged (pdd.security.zap.HandshakeWatch).
"""
from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from pdd.protocol.codec import ProtocolError, decode, encode
from pdd.protocol.messages import Message
from pdd.security import Curve
from pdd.security.zap import HandshakeWatch

log = logging.getLogger(__name__)

_HWM = 100_000  # messages queued per peer before zmq blocks/drops


def _configure(sock: zmq.asyncio.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)


class RouterChannel:
    """Bound side: many peers, addressed by identity."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, security: Curve | None = None):
        self.sock = ctx.socket(zmq.ROUTER)
        _configure(self.sock)
        # Sending to a peer that is gone raises instead of vanishing silently.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer reconnecting under its identity while its old connection still
        # looks open (a partition, a half-open TCP connection) takes the identity
        # over; without this the router drops the new connection and the peer
        # waits in silence. (Two processes never share an identity: each worker
        # process has its own, so a handover never orphans another process.)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.security = security
        self.watch = None
        if security is not None:
            security.serve(self.sock)  # before bind: no plaintext peer may slip in
            self.watch = HandshakeWatch.for_socket(self.sock, security.domain, client=False)
        try:
            self.sock.bind(addr)
        except zmq.ZMQError:
            self.close()
            raise
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dropped = 0

    async def recv(self) -> tuple[str, Message]:
        while True:
            frames = await self.sock.recv_multipart(copy=True)
            if len(frames) != 2:
                self.dropped += 1
                log.warning("control: dropped a message with %d frames (expected 2)", len(frames))
                continue
            peer = frames[0].decode("utf-8", "replace")
            try:
                return peer, decode(frames[1])
            except ProtocolError as e:
                self.dropped += 1
                log.warning("control: dropped a malformed message from %s: %s", peer, e)

    def waiting(self) -> bool:
        """Whether a message can be received at once."""
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    async def send(self, peer: str, msg: Message) -> bool:
        """False if the peer is not connected (the message is not delivered)."""
        try:
            await self.sock.send_multipart([peer.encode(), encode(msg)])
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def close(self) -> None:
        _close(self.sock, self.watch, self.security, served=True)


class DealerChannel:
    """Connecting side: one peer (the router)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, identity: str, security: Curve | None = None,
                 on_disconnect=None):
        """on_disconnect: called (on the loop) when the connection to the router closes."""
        self.sock = ctx.socket(zmq.DEALER)
        _configure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.security = security
        self.watch = None
        if security is not None:
            security.dial(self.sock)
        if security is not None or on_disconnect is not None:
            # A worker whose key the router refuses would otherwise retry in silence.
            self.watch = HandshakeWatch.for_socket(self.sock, security.domain if security else "control",
                                                   client=True, on_disconnect=on_disconnect)
        self.sock.connect(addr)
        self.dropped = 0   # malformed messages from the router
        self.unsent = 0    # messages to the router that could not be queued

    async def recv(self) -> Message:
        while True:
            frames = await self.sock.recv_multipart(copy=True)
            if len(frames) != 1:
                self.dropped += 1
                log.warning("control: dropped a message with %d frames (expected 1)", len(frames))
                continue
            try:
                return decode(frames[0])
            except ProtocolError as e:
                self.dropped += 1
                log.warning("control: dropped a malformed message from the router: %s", e)

    async def send(self, msg: Message) -> None:
        """Queue `msg` for the router; dropped (counted in `unsent`) when the
        socket has nowhere to queue it: a refused handshake leaves the DEALER
        without a connection for good, and a blocking send would hang the caller."""
        try:
            await self.sock.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.unsent += 1
            if self.unsent in (1, 10, 100) or self.unsent % 1000 == 0:
                log.warning("control: %d message(s) to the router dropped: no connection can take them "
                            "(refused handshake, or %d messages already queued)", self.unsent, _HWM)

    def close(self) -> None:
        _close(self.sock, self.watch, self.security, served=False)


def _close(sock, watch: HandshakeWatch | None, security: Curve | None, served: bool) -> None:
    if sock.closed:
        return
    if watch is not None:
        watch.close()
    sock.close(0)
    if served and security is not None:
        security.release(sock)  # the context cannot terminate while its ZAP handler runs
