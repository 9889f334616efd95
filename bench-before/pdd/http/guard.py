"""HTTP connection guard: a connection limit and timeouts aiohttp does not have.

aiohttp waits forever for the first request of a connection, for headers
that trickle in (slowloris) and for a client to take what it is sent, so each
connection is wrapped in a protocol that sits between the transport and
aiohttp's own. It keeps one timer for the connection's state:

    idle     no request in progress and no byte of the next one: closed quietly
    headers  bytes of a request arrived but its handler has not started:
             answered 408 (OpenAI error shape) and closed

and one for sending, whatever a handler is doing (a handler blocked writing
to a client that does not read would otherwise hold its connection for good):

    send     the transport's buffer stayed full — the client took no byte — for
             router.http_send_timeout_s, or a close of the guard's own did not
             get its bytes out in that time: the connection is cut (abort: a
             close waits for the buffer to drain). That cancels its handler,
             whose `finally` aborts the request on the worker.

The app's middleware says when a request's handler starts and ends (the
headers are complete once it starts). The body has its own timeout, in the
handler that reads it (pdd.http.app), where a 408 can still be answered
normally. Past the connection limit a new connection gets a 503 and is closed
before aiohttp sees it. The listen queue is as deep as the connection limit:
a burst of connections that arrive while the loop is busy waits there to be
accepted (asyncio's default, 100, overflows and the kernel drops or resets
them), up to the kernel's cap, net.core.somaxconn (warned at start when lower). aiohttp's own answers to requests it cannot parse
(400) are OpenAI-shaped too (ShapedErrors).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from pdd import security
from pdd.http.request_log import SERVER_NAME
from pdd.http.responses import json_response
from pdd.http.validate import APIError

log = logging.getLogger(__name__)

SOMAXCONN = Path("/proc/sys/net/core/somaxconn")   # the kernel's cap on a listen queue (Linux)


def raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response, for when aiohttp is not (or no longer) in charge."""
    body = orjson.dumps(APIError(status, message, code=code).body())
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class Guards:
    """The live connections of one server, found by their transport."""

    def __init__(self, max_connections: int, header_timeout_s: float, idle_timeout_s: float,
                 send_timeout_s: float):
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.send_timeout_s = send_timeout_s
        self.live: dict[asyncio.BaseTransport, "Guard"] = {}

    def factory(self, inner_factory):
        return lambda: Guard(inner_factory(), self)

    def get(self, transport) -> "Guard | None":
        return self.live.get(transport)

    def buffered_bytes(self) -> int:
        """What the live connections hold that the kernel has not taken yet."""
        return sum(transport.get_write_buffer_size() for transport in self.live)


class Guard(asyncio.Protocol):
    """Wraps aiohttp's protocol for one connection (every call passed through)."""

    def __init__(self, inner: asyncio.Protocol, guards: Guards):
        self.inner = inner
        self.guards = guards
        self.transport: asyncio.Transport | None = None
        self.forwarded = False
        self.busy = False            # a handler is running
        self.receiving = False       # bytes of a request whose handler has not started
        self._timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None   # armed while the client takes nothing

    # -- transport -> aiohttp ------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        if len(self.guards.live) >= self.guards.max_connections:
            security.count("http.connection_limit")
            transport.write(raw_error(503, "Service Unavailable", "too many connections; retry later",
                                      "too_many_connections"))
            self._close()
            return
        self.guards.live[transport] = self
        self.forwarded = True
        self._arm(self.guards.idle_timeout_s, self._idle_expired)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.forwarded:
            return
        if not self.busy and not self.receiving:
            self.receiving = True
            self._arm(self.guards.header_timeout_s, self._headers_expired)
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.forwarded else None

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._disarm_send()
        if self.forwarded:
            self.guards.live.pop(self.transport, None)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        # The transport's buffer is full: the client is not taking what it is sent.
        self._arm_send()
        if self.forwarded:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.transport.is_closing():   # a close keeps its deadline (_close)
            self._disarm_send()
        if self.forwarded:
            self.inner.resume_writing()

    # -- from the app's middleware --------------------------------------------

    def request_started(self) -> None:
        self.busy, self.receiving = True, False
        self._disarm()

    def request_finished(self) -> None:
        self.busy = False
        self._arm(self.guards.idle_timeout_s, self._idle_expired)

    # -- timers --------------------------------------------------------------

    def _arm(self, delay: float, fn) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(delay, fn)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm_send(self) -> None:
        if self._send_timer is None:
            self._send_timer = asyncio.get_running_loop().call_later(self.guards.send_timeout_s,
                                                                     self._send_expired)

    def _disarm_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _close(self) -> None:
        """Close once what is buffered is sent; cut if that takes longer than the send timeout."""
        self.transport.close()
        self._arm_send()

    def _idle_expired(self) -> None:
        if not self.busy and not self.receiving and self.transport is not None:
            security.count("http.idle_timeout")
            self._close()

    def _headers_expired(self) -> None:
        if not self.busy and self.transport is not None:
            security.count("http.header_timeout")
            self.transport.write(raw_error(408, "Request Timeout", f"the request headers did not arrive "
                                           f"within {self.guards.header_timeout_s:g}s", "request_timeout"))
            self._close()

    def _send_expired(self) -> None:
        self._send_timer = None
        security.count("http.send_timeout")
        log.info("an HTTP client took no byte for %gs: connection cut", self.guards.send_timeout_s)
        self.transport.abort()


class ShapedErrors(RequestHandler):
    """aiohttp's protocol, with its own error answers in OpenAI's shape: a
    request it cannot parse (400), or an error no middleware caught (500).
    Those are written before any middleware runs."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:   # anyone can send garbage: not worth more than a count
            security.count("http.malformed_request")
            log.debug("malformed HTTP request from %s: %s", request.remote, message)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already started; the connection is broken")
        if status >= 500:
            error = APIError(status, "internal server error", type="server_error")
        else:
            detail = (message or "").split("\n", 1)[0].strip().rstrip(":")   # its first line names the fault
            error = APIError(status, f"malformed HTTP request: {detail or 'cannot parse it'}",
                             code="malformed_request")
        resp = json_response(error.body(), status)
        resp.headers["Server"] = SERVER_NAME
        resp.force_close()
        return resp


def shaped_errors(server: web.Server):
    """A protocol factory like `server` (aiohttp's), whose protocols answer errors in OpenAI's shape."""
    def make() -> RequestHandler:
        handler = server()
        # Same slots, one method more: aiohttp builds its protocol with settings
        # only it knows (the runner's), so the instance is re-classed, not rebuilt.
        handler.__class__ = ShapedErrors
        return handler
    return make


class GuardedServer:
    """aiohttp's runner behind guarded connections; cleanup() stops both."""

    def __init__(self, runner: web.AppRunner, servers: list[asyncio.AbstractServer]):
        self.runner = runner
        self.servers = servers

    @property
    def port(self) -> int:
        return self.servers[0].sockets[0].getsockname()[1]

    async def cleanup(self) -> None:
        for server in self.servers:
            server.close()   # no new connections; aiohttp's shutdown drains the rest
        await self.runner.cleanup()


def somaxconn() -> int | None:
    """The kernel's cap on a listen queue, or None where it cannot be read (not Linux)."""
    try:
        return int(SOMAXCONN.read_text())
    except (OSError, ValueError):
        return None


def check_backlog(backlog: int) -> None:
    """Warn when the kernel caps the listen queue below `backlog` (the connection limit)."""
    cap = somaxconn()
    if cap is not None and cap < backlog:
        log.warning("the kernel caps listen queues at %d (sysctl net.core.somaxconn) below "
                    "security.http_max_connections = %d: connections arriving in a burst beyond %d are "
                    "dropped or reset; raise it (sysctl -w net.core.somaxconn=%d)", cap, backlog, cap, backlog)


async def serve_guarded(runner: web.AppRunner, guards: Guards, host: str, port: int,
                        reuse_port: bool = False, own_port: int | None = None) -> GuardedServer:
    """Listen on host:port with every connection wrapped (runner already set up).
    reuse_port: other routers of the cluster listen on the port too, and the
    kernel spreads new connections over them (SO_REUSEPORT); own_port: this
    router's alone, as well (one connection limit over both)."""
    loop = asyncio.get_running_loop()
    check_backlog(guards.max_connections)
    servers = []
    for p, shared in ((port, reuse_port), *(((own_port, False),) if own_port else ())):
        servers.append(await loop.create_server(guards.factory(shaped_errors(runner.server)), host, p,
                                                backlog=guards.max_connections, reuse_port=shared or None))
    return GuardedServer(runner, servers)
