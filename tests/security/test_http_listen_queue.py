"""The HTTP listen queue is as deep as the connection limit: a burst of
connection-per-request clients that arrive while the server's loop is busy
wait in the kernel's queue and are all served, none dropped or reset. A real
server on a loopback port; the router core is a stand-in (tests.security.conftest)."""
from __future__ import annotations

import asyncio
import logging
import resource
import socket
import struct
import sys

import pytest

from pdd.http import guard
from tests.security.conftest import secure_config
from tests.security.test_http import read_all, run, start

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads the listen queue through Linux's TCP_INFO")

CLIENTS = 1024   # security.http_max_connections' default


def listen_queue(sock) -> tuple[int, int]:
    """(its length now, its bound) of a listening socket: Linux's TCP_INFO gives
    them there as tcpi_unacked and tcpi_sacked (what `ss -ltn` shows as Recv-Q, Send-Q)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    fields = struct.unpack_from("8B6I", info)   # 8 one-byte fields, then rto ato snd_mss rcv_mss unacked sacked
    return fields[12], fields[13]


def test_the_listen_queue_is_as_deep_as_the_connection_limit(keys):
    async def main():
        for limit in (1024, 300):
            server, _ = await start(secure_config(keys, security={"http_max_connections": limit}))
            cap = guard.somaxconn()
            want = min(limit, cap)
            assert listen_queue(server.servers[0].sockets[0]) == (0, want), \
                f"listen queue bound: want http_max_connections = {limit}, capped by net.core.somaxconn = {cap}"
            await server.cleanup()

    run(main())


def test_a_somaxconn_below_the_limit_is_warned_about(keys, tmp_path, monkeypatch, caplog):
    # Forced: this host's real net.core.somaxconn is replaced by a file that reads lower.
    low = tmp_path / "somaxconn"
    low.write_text("128\n")
    monkeypatch.setattr(guard, "SOMAXCONN", low)

    async def main():
        server, _ = await start(secure_config(keys))
        await server.cleanup()

    with caplog.at_level(logging.WARNING, logger="pdd.http.guard"):
        run(main())
    warned = [r.getMessage() for r in caplog.records if "net.core.somaxconn" in r.getMessage()]
    assert len(warned) == 1 and "128" in warned[0] and "http_max_connections = 1024" in warned[0], warned


def connect_all(port: int) -> list[socket.socket]:
    """CLIENTS connections, opened one after another while the caller holds the
    event loop: the server accepts none meanwhile, so each must wait in the
    listen queue. A connection the queue has no room for is not refused: its
    SYN is dropped and connect() waits for a retransmission the server's loop
    never gets to answer, so it times out here."""
    socks = []
    try:
        for i in range(CLIENTS):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.settimeout(20)
            try:
                s.connect(("127.0.0.1", port))
            except socket.timeout:
                raise AssertionError(f"connection {i + 1} of {CLIENTS} found no room in the listen queue") from None
            s.setblocking(False)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


async def one_request(sock: socket.socket) -> bytes:
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return await read_all(reader)
    finally:
        writer.close()


def test_a_burst_of_connection_per_request_clients_at_the_limit_is_served_without_a_reset(keys):
    cap = guard.somaxconn()
    if cap is not None and cap < CLIENTS:
        pytest.skip(f"net.core.somaxconn = {cap} caps the listen queue below {CLIENTS}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * CLIENTS + 256:   # both ends of every connection live in this process
        if hard != resource.RLIM_INFINITY and hard < 2 * CLIENTS + 256:
            pytest.skip(f"needs {2 * CLIENTS + 256} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2 * CLIENTS + 256, hard))

    async def main():
        server, _ = await start(secure_config(keys))   # http_max_connections = 1024
        socks = connect_all(server.port)   # blocks the loop: the server is busy, as under load
        assert listen_queue(server.servers[0].sockets[0])[0] == CLIENTS
        answers = await asyncio.gather(*map(one_request, socks), return_exceptions=True)
        failed = [a for a in answers if not isinstance(a, bytes) or not a.startswith(b"HTTP/1.1 200")]
        assert not failed, f"{len(failed)} of {CLIENTS} clients not served, e.g. {failed[0]!r:.200}"
        await server.cleanup()

    try:
        run(main())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
