"""ZeroMQ's side of authentication: the ZAP handler and handshake monitors.

libzmq asks a ZAP handler (a REP socket at inproc://zeromq.zap.01 on the same
context) about every CURVE handshake on a server socket; ZapHandler answers
from the authorized-key directory of the socket's domain ("control", "data",
"admin") and refuses everything else. HandshakeWatch reads a socket's monitor
so that failed handshakes are counted and logged, not silent. Which keys a
process uses, and from where, is pdd.security's business.

Counters of refusals ("<domain>.<what>") live here, per process, for
`pdd admin security`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter
from typing import Protocol

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("pdd.security")

_counts: Counter = Counter()     # "<domain>.<event>" -> times, for `pdd admin security`
_counts_lock = threading.Lock()


def count(event: str) -> None:
    with _counts_lock:
        _counts[event] += 1


def counts() -> dict[str, int]:
    """What this process refused so far, by socket and reason."""
    with _counts_lock:
        return dict(_counts)


_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class KeySource(Protocol):
    """Who may connect to one domain's sockets (pdd.security.KeyDir)."""

    def lookup(self, public_z85: bytes) -> str | None:
        """The name of an authorized client key, or None."""


class ZapHandler:
    """The ZAP handler of one libzmq context: libzmq asks it about every CURVE
    handshake on that context's server sockets. It runs in its own thread on a
    plain (shadow) context, so it serves asyncio and thread sockets alike and
    never waits on an event loop."""

    _all: dict[int, "ZapHandler"] = {}
    _lock = threading.Lock()

    def __init__(self, ctx: zmq.Context):
        self._ctx = zmq.Context.shadow(ctx.underlying)
        self.domains: dict[str, KeySource] = {}
        self.users = 0
        self._logged: set[tuple[str, str]] = set()
        self._stop_r, self._stop_w = os.pipe()
        self._error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="zap", daemon=True)
        self._thread.start()
        ready.wait()
        if self._error is not None:
            self._close_pipe()
            raise RuntimeError(f"cannot start the ZAP authenticator: {self._error}")

    @classmethod
    def acquire(cls, ctx: zmq.Context, domain: str, keys: KeySource) -> None:
        """Make sure `ctx` has a running handler that knows `domain` (before any bind)."""
        with cls._lock:
            zap = cls._all.get(ctx.underlying)
            # (A handler whose context ended without a release() is gone: a new
            # context may have the same address.)
            if zap is None or not zap._thread.is_alive():
                zap = cls._all[ctx.underlying] = ZapHandler(ctx)
            zap.domains[domain] = keys
            zap.users += 1

    @classmethod
    def release(cls, ctx: zmq.Context) -> None:
        """A server socket of `ctx` is closing; the last one stops the handler
        (which must be gone before the context can terminate)."""
        with cls._lock:
            zap = cls._all.get(ctx.underlying)
            if zap is None:
                return
            zap.users -= 1
            if zap.users > 0:
                return
            del cls._all[ctx.underlying]
        os.write(zap._stop_w, b"x")
        zap._thread.join()
        zap._close_pipe()

    def _close_pipe(self) -> None:
        os.close(self._stop_r)
        os.close(self._stop_w)

    def _run(self, ready: threading.Event) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            sock.close()
            ready.set()
            return
        ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._stop_r in events:
                    return
                if sock in events:
                    sock.send_multipart(self._answer(sock.recv_multipart()))
        except zmq.ZMQError as e:  # ETERM: the context ended without a release()
            if e.errno != zmq.ETERM:
                log.exception("ZAP authenticator stopped")
        finally:
            sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """One ZAP request -> its reply; everything but a known CURVE key is refused."""
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain_b, address_b, _identity, mechanism, *creds = frames
        domain, address = domain_b.decode(errors="replace"), address_b.decode(errors="replace")
        user = None
        try:
            keys = self.domains.get(domain)
            if keys is not None and mechanism == b"CURVE" and len(creds) == 1 and len(creds[0]) == 32:
                user = keys.lookup(z85.encode(creds[0]))
        except Exception:  # a bug here must refuse, not open the door or kill the thread
            log.exception("ZAP: error checking a %s handshake from %s", domain, address)
        if user is not None:
            return [version, request_id, b"200", b"OK", user.encode(), b""]
        count(f"{domain}.denied")
        # Once per (socket, address) at WARNING: a peer retrying every second must not flood the log.
        first = (domain, address) not in self._logged and len(self._logged) < 10_000
        self._logged.add((domain, address))
        log.log(logging.WARNING if first else logging.DEBUG,
                "%s socket: refused a handshake from %s: its key is not in the authorized directory", domain, address)
        return [version, request_id, b"400", b"not authorized", b"", b""]


_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
           "handshake_failed", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_refused"}


class HandshakeWatch:
    """Counts and logs the handshakes an asyncio socket fails, in a task of the
    running loop (`for_socket` gives None outside one). close() before the socket's.
    With `on_disconnect`, also calls it when a connection of the socket closes
    (a socket has one monitor: this is it)."""

    def __init__(self, sock: zmq.Socket, domain: str, client: bool, on_disconnect=None):
        self.sock = sock
        self.on_disconnect = on_disconnect
        events = sum(_FAILED) | (zmq.EVENT_DISCONNECTED if on_disconnect else 0)
        self.monitor = sock.get_monitor_socket(events)
        self.task = asyncio.get_running_loop().create_task(self._run(domain, client))

    @classmethod
    def for_socket(cls, sock: zmq.Socket, domain: str, client: bool, on_disconnect=None) -> "HandshakeWatch | None":
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return None
        return cls(sock, domain, client, on_disconnect)

    async def _run(self, domain: str, client: bool) -> None:
        logged = 0
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and self.on_disconnect is not None:
                self.on_disconnect()
                continue
            what = _FAILED.get(event["event"])
            if what is None:
                continue
            count(f"{domain}.{what}")
            if logged >= 20:  # a peer retrying forever must not flood the log
                continue
            logged += 1
            if client:
                log.error("%s: the CURVE handshake with %s failed (%s): this process's key is not authorized "
                          "there, or it holds the wrong server key", domain,
                          event["endpoint"].decode(errors="replace"), what)
            else:
                log.warning("%s: a peer failed the CURVE handshake (%s)", domain, what)

    def close(self) -> None:
        self.task.cancel()
        self.sock.disable_monitor()
        self.monitor.close(0)
