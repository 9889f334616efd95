"""The admin socket: whatever arrives gets an error reply and the socket serves
on; a wrong token or key gets nothing done; secrets are never shown."""
from __future__ import annotations

import asyncio
import logging
import threading

import msgpack
import pytest
import zmq
import zmq.asyncio

from pdd import security
from pdd.admin.client import AdminError, call
from pdd.admin.server import MAX_REQUEST_BYTES, AdminServer
from pdd.security import admin_client_security, admin_security
from tests.security.conftest import StubRouter, secure_config

TOKEN = "0123456789abcdef-admin-token"


class AdminThread:
    """An AdminServer on its own loop in a thread, as the router runs it."""

    def __init__(self, cfg, router=None):
        self.cfg = cfg
        self.router = router or StubRouter(cfg)
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self):
        ctx = zmq.asyncio.Context()
        self.server = AdminServer(self.router, "tcp://127.0.0.1:0", TOKEN, admin_security(self.cfg))
        await self.server.start(ctx)
        self.stop = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.ready.set()
        await self.stop.wait()
        await self.server.stop()
        ctx.term()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def admin(keys):
    cfg = secure_config(keys, router={"admin_token": TOKEN}, security={"api_keys": ["k-123456"]})
    with AdminThread(cfg) as a:
        yield a


def raw(admin, payload: bytes, keys_dir) -> dict:
    """Send exactly `payload` (what a hostile admin-key holder could send)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    admin_client_security(keys_dir).dial(sock)
    sock.connect(admin.server.addr)
    try:
        sock.send(payload)
        assert sock.poll(10_000), "no reply"
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close(0)


def request(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize("payload, error", [
    (request(token=123, cmd="status"), "token must be a string"),
    (request(token=["x"], cmd="status"), "token must be a string"),
    (request(cmd="status"), "token must be a string"),
    (request(token="é", cmd="status"), "bad admin token"),
    (request(token="日本語のトークン", cmd="status"), "bad admin token"),
    (request(token=TOKEN, cmd=["status"]), "cmd must be a string"),
    (request(token=TOKEN, cmd={"a": 1}), "cmd must be a string"),
    (request(token=TOKEN, cmd="status", args="x"), "args must be a list"),
    (request(token=TOKEN, cmd="status", args=[{"a": 1}]), "args must be a list"),
    (request(token=TOKEN, cmd="drain", args=[1, 2]), "drain: name one worker"),
    (request(token=TOKEN, cmd="status", args=[1]), "status: bad arguments"),
    (request(token=TOKEN, cmd="nope"), "unknown command 'nope'"),
    (request(token=TOKEN, cmd="status", pad="x" * (MAX_REQUEST_BYTES + 1)), "exceeds the limit"),
    (b"\xc1\xc1", "request is not msgpack"),
    (msgpack.packb([TOKEN, "status"]), "request must be a map"),
])
def test_malformed_requests_get_an_error_and_the_socket_serves_on(admin, keys, payload, error):
    reply = raw(admin, payload, keys)
    assert reply["ok"] is False and error in reply["error"]
    assert call(admin.server.addr, TOKEN, "status", security=admin_client_security(keys))["model"] == "m"


def test_a_command_that_raises_is_an_error_reply(admin, keys):
    def boom():
        raise RuntimeError("bug")

    admin.server.register("boom", boom)
    admin.server.register("unencodable", lambda: object())
    with pytest.raises(AdminError, match="internal error"):
        call(admin.server.addr, TOKEN, "boom", security=admin_client_security(keys))
    with pytest.raises(AdminError, match="cannot be encoded"):
        call(admin.server.addr, TOKEN, "unencodable", security=admin_client_security(keys))
    assert call(admin.server.addr, TOKEN, "workers", security=admin_client_security(keys)) == [{"worker_id": "w0"}]


def test_wrong_token_is_refused_and_not_logged(admin, keys, caplog):
    before = security.counts().get("admin.bad_token", 0)
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(AdminError, match="bad admin token"):
            call(admin.server.addr, "wrong-token-of-some-length", "status", security=admin_client_security(keys))
        cfg = call(admin.server.addr, TOKEN, "config", security=admin_client_security(keys))
    assert security.counts()["admin.bad_token"] == before + 1
    assert cfg["router"]["admin_token"] == "***" and cfg["security"]["api_keys"] == ["***"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert TOKEN not in text and "wrong-token-of-some-length" not in text and "k-123456" not in text


def test_a_client_without_an_admin_key_cannot_connect(admin, keys, stranger_keys):
    """Neither plaintext nor another cluster's admin key completes the
    handshake, even with the right token and the router's public key."""
    with pytest.raises(AdminError, match="CURVE handshake failed"):
        call(admin.server.addr, TOKEN, "status", security=None)
    theirs = admin_client_security(stranger_keys)
    theirs.server_key = admin_client_security(keys).server_key
    before = security.counts().get("admin.denied", 0)
    with pytest.raises(AdminError, match="CURVE handshake failed"):
        call(admin.server.addr, TOKEN, "status", security=theirs)
    assert security.counts()["admin.denied"] == before + 1
    assert call(admin.server.addr, TOKEN, "security", security=admin_client_security(keys))["admin.denied"] >= 1
