"""What strangers and broken peers can do at a real cluster's edges: the
router's log takes no line of theirs, and a control message no type could
name is dropped while the router serves on. `pdd up` with an API key file."""
from __future__ import annotations

import urllib.parse

import msgpack
import pytest

from pdd.protocol.messages import PROTOCOL_VERSION
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.http_util import get, post

API_KEY = "sk-edges-0123456789abcdef"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    key_file = tmp_path_factory.mktemp("secrets") / "api-keys"
    key_file.write_text(f"# the team's key\n{API_KEY}\n")
    key_file.chmod(0o600)
    with UpCluster(tmp_path_factory.mktemp("up-edges"), tiny_model, "--mode", "colocated", "--workers", "1",
                   "--api-key-file", str(key_file)) as c:
        yield c


def router_log(cluster) -> list[str]:
    return (cluster.run_dir / "router.log").read_text().splitlines()


def completes(cluster) -> bool:
    r = post(cluster.url + "/v1/completions", {"model": cluster.model_name, "prompt": "still there?",
                                                "max_tokens": 2}, api_key=API_KEY)
    return r.status == 200 and len(r.json()["choices"]) == 1


def test_a_path_cannot_write_a_line_of_its_own_into_the_log(cluster):
    """A decoded path may hold a newline (%0A): logged as it is, anyone without
    a key could append what looks like an audit record to the router's log."""
    forged = "2026-01-01 00:00:00,000 INFO pdd.audit: admin drain colocated-0: ok forged-7f3a"
    assert get(cluster.url + "/x" + urllib.parse.quote("\n" + forged)).status == 401
    line = _wait_for(lambda: next((x for x in router_log(cluster) if "forged-7f3a" in x), None),
                     what="the access line of the forging request")
    assert " INFO pdd.access: GET /x%0A2026-01-01" in line, line
    assert not any(x.startswith(forged[:30]) for x in router_log(cluster))


@pytest.mark.parametrize("kind", [[1], {"a": 1}, "x" * 100_000], ids=["list", "map", "huge"])
def test_a_control_message_no_type_could_name_is_dropped_and_the_router_serves_on(cluster, kind):
    """An authenticated peer's message whose type is a list or a map (not even
    hashable) or a megabyte string: one short log line, and the router's
    receive loop lives on (its worker's heartbeats keep it, requests complete)."""
    sock = cluster.control_socket(b"intruder")
    sock.send(msgpack.packb({"t": kind, "v": PROTOCOL_VERSION}))
    # The router answers an unknown worker's heartbeat with ReRegister: once that
    # arrives, the message before it was handled.
    sock.send(msgpack.packb({"t": "heartbeat", "v": PROTOCOL_VERSION, "worker_id": "intruder", "running": 0,
                             "waiting": 0, "free_blocks": 0, "total_blocks": 0}))
    assert msgpack.unpackb(sock.recv())["t"] == "reregister"
    sock.close()
    dropped = [x for x in router_log(cluster) if "dropped a malformed message from intruder" in x]
    assert dropped and "unknown message type" in dropped[-1] and len(dropped[-1]) < 400, dropped[-1][:400]
    assert completes(cluster)
    assert list(cluster.workers()) == ["colocated-0"]
