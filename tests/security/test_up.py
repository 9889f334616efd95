"""`pdd up` as shipped: a throw-away key set in a private run directory, an API
key on HTTP, and a cluster whose registry and answers strangers cannot change."""
from __future__ import annotations

import asyncio
import os
import stat

import pytest
import zmq
import zmq.asyncio

from pdd.protocol import messages as m
from pdd.security import control_security
from tests.e2e.cluster import UpCluster
from tests.e2e.http_util import get, post
from tests.security.conftest import failed_handshake, offer, secure_config, stranger

API_KEY = "sk-up-0123456789abcdef"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    with UpCluster(tmp_path_factory.mktemp("up-secure"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "1", "--api-key", API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model):
    from pdd import LLM
    return LLM(str(tiny_model))


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_secrets_are_private(cluster):
    keys = cluster.run_dir / "keys"
    assert cluster.cfg.security.keys_dir == str(keys)
    assert mode(cluster.run_dir) == 0o700 and mode(keys) == 0o700
    assert mode(cluster.run_dir / "cluster.toml") == 0o600
    assert all(mode(p) == 0o600 for p in keys.glob("*.key_secret"))
    assert len(cluster.cfg.router.admin_token) >= 32
    logs = cluster.logs()
    assert cluster.cfg.router.admin_token not in logs and API_KEY not in logs


def complete(cluster) -> str:
    r = post(cluster.url + "/v1/completions", {"model": cluster.model_name, "prompt": "The keys of the cluster",
                                                "max_tokens": 8, "temperature": 0}, api_key=API_KEY)
    assert r.status == 200, r.body
    return r.json()["choices"][0]["text"]


def test_strangers_change_neither_the_registry_nor_the_answers(cluster, offline, stranger_keys):
    from pdd import SamplingParams

    assert get(cluster.url + "/v1/models").status == 401
    first = complete(cluster)
    assert first == offline.generate(["The keys of the cluster"], SamplingParams(max_tokens=8, temperature=0))[0].text
    workers = sorted(cluster.workers())
    theirs = control_security(secure_config(stranger_keys), "decode")
    router_key = control_security(cluster.cfg, "decode").server_key

    async def attack():
        ctx = zmq.asyncio.Context()
        evils = [stranger(ctx, None, None, b"decode-0"),   # even under a real worker's id
                 stranger(ctx, (theirs.public, theirs.secret), router_key, b"prefill-0")]
        watches = [asyncio.ensure_future(failed_handshake(e)) for e in evils]
        await asyncio.sleep(0)
        bogus = m.Register(worker_id="x", role="decode", host="evil", pid=1, device="cpu",
                           layout={"model_id": "bogus"}, num_blocks=10**6, max_num_seqs=1, max_model_len=2)
        for e in evils:
            e.connect(cluster.cfg.router.control_addr)
            ident = e.getsockopt(zmq.IDENTITY).decode()
            await offer(e, m.Register(**{**vars(bogus), "worker_id": ident}))
            await offer(e, m.Goodbye(ident))
        await asyncio.wait_for(asyncio.gather(*watches), 30)
        for e in evils:
            e.close(0)
        ctx.term()

    asyncio.run(attack())
    assert sorted(cluster.workers()) == workers
    assert complete(cluster) == first
    assert cluster.admin("security").get("control.denied", 0) >= 1
    # The pages crossed the decode worker's (CURVE) data socket: no transfer failed, none fell back.
    metrics = get(cluster.url + "/metrics").body.decode()
    assert metric(metrics, "pdd_kv_transfer_bytes_total") > 0
    assert metric(metrics, "pdd_kv_transfer_failures_total") == 0


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))
