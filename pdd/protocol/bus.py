"""Typed asyncio wrappers around the ZeroMQ control sockets.

The router binds one ROUTER socket; each worker connects a DEALER whose
identity is its worker id. No other module touches zmq control sockets
directly. Malformed frames are logged and dropped here: handlers only ever
see well-formed `Message`s.
"""
from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from pdd.protocol.codec import ProtocolError, decode, encode
from pdd.protocol.messages import Message

log = logging.getLogger(__name__)

_HWM = 100_000  # messages queued per peer before zmq blocks/drops


def _configure(sock: zmq.asyncio.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)


class RouterChannel:
    """Bound side: many peers, addressed by identity."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str):
        self.sock = ctx.socket(zmq.ROUTER)
        _configure(self.sock)
        # Sending to a peer that is gone raises instead of vanishing silently.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(addr)
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
        self.sock.close(0)


class DealerChannel:
    """Connecting side: one peer (the router)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, identity: str):
        self.sock = ctx.socket(zmq.DEALER)
        _configure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.connect(addr)
        self.dropped = 0

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
        await self.sock.send(encode(msg))

    def close(self) -> None:
        self.sock.close(0)
