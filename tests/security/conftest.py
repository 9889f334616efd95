"""Fixtures for the security tests: one cluster key set, configs that use it,
and a stand-in for the router core where only its sockets are under test."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdd import security
from pdd.config import ClusterConfig
from pdd.config_loader import load_cluster_config
from pdd.router.metrics import RouterMetrics
from pdd.router.saturation import Saturation
from pdd.security import generate_keys

HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH}


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> Path:
    """The cluster's keys (router, worker, admin)."""
    return generate_keys(tmp_path_factory.mktemp("cluster") / "keys")


@pytest.fixture(scope="session")
def stranger_keys(tmp_path_factory) -> Path:
    """Another cluster's keys: well-formed, authorized nowhere here."""
    return generate_keys(tmp_path_factory.mktemp("stranger") / "keys")


def secure_config(keys: Path, **tables) -> ClusterConfig:
    over = {"security": {"keys_dir": str(keys)}}
    for name, table in tables.items():
        over.setdefault(name, {}).update(table)
    return load_cluster_config(env={}, overrides=over)


@pytest.fixture
def secure_cfg(keys) -> ClusterConfig:
    return secure_config(keys, router={"admin_token": "a" * 32})


def wait_handshake_failure(monitor: zmq.Socket, timeout_s: float = 10.0) -> int:
    """The first handshake-failure event a (sync) monitor socket reports."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(100):
            event = recv_monitor_message(monitor)
            if event["event"] in HANDSHAKE_FAILED:
                return event["event"]
            assert event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED, "a stranger completed the handshake"
    raise AssertionError("no handshake failure reported")


@dataclass
class StubWorker:
    worker_id: str

    def summary(self) -> dict:
        return {"worker_id": self.worker_id}


@dataclass
class StubRegistry:
    workers: dict = field(default_factory=dict)


class StubRouter:
    """What the admin socket and the HTTP app read of the router core."""

    def __init__(self, cfg: ClusterConfig, max_model_len: int | None = 64):
        self.cfg = cfg
        self.registry = StubRegistry({"w0": StubWorker("w0")})
        self.requests: dict = {}
        self.metrics = RouterMetrics(StubRegistry())   # no worker state to scrape
        self.saturation = Saturation(0, 0, self.metrics.rejected)   # never saturated (no probe runs)
        self.accepting = True
        self.ready = True
        self.overloaded = False
        self.started_at = time.time()
        self._max_model_len = max_model_len

    def max_model_len(self):
        return self._max_model_len

    def check_admission(self, choices: int = 1) -> None:
        """Admits everything: no queue here."""

    def status(self) -> dict:
        return {"model": "m", "ready": True, "accepting": True, "requests_in_flight": 0, "uptime_s": 0.0,
                "workers": self.worker_summaries()}

    def worker_summaries(self) -> list[dict]:
        return [w.summary() for w in self.registry.workers.values()]

    @property
    def operations(self):
        return self

    def set_draining(self, worker_id: str, draining: bool) -> dict:   # as Router.operations would
        raise KeyError(f"no worker {worker_id!r}")


async def failed_handshake(sock: zmq.asyncio.Socket) -> int:
    """Await the first handshake-failure event of a socket (asyncio monitor)."""
    from zmq.utils.monitor import parse_monitor_message

    mon = sock.get_monitor_socket()
    try:
        while True:
            event = parse_monitor_message(await mon.recv_multipart())
            assert event["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED, "a stranger completed the handshake"
            if event["event"] in HANDSHAKE_FAILED:
                return event["event"]
    finally:
        sock.disable_monitor()
        mon.close(0)


async def grows(before: dict, *names: str) -> None:
    """Until one of the security counters `names` is above its value in `before`."""
    while not any(security.counts().get(n, 0) > before.get(n, 0) for n in names):
        await asyncio.sleep(0.01)


def stranger(ctx, curve: tuple[bytes, bytes] | None, server_key: bytes | None,
             identity: bytes = b"evil") -> zmq.asyncio.Socket:
    """A DEALER as a stranger makes it: plaintext, or CURVE with keys of its own
    (`curve`: public, secret) towards `server_key`. Not yet connected."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey = curve
        sock.curve_serverkey = server_key
    return sock


async def offer(sock: zmq.asyncio.Socket, msg) -> bool:
    """A stranger's send: whatever it says is offered, never waited for. A
    refused handshake leaves the socket nowhere to queue, where a plain send
    would wait forever. True if zmq took the message."""
    from pdd.protocol.codec import encode

    try:
        await sock.send(encode(msg), flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
