"""Several routers for one cluster (`pdd up --routers 2`), with real processes:
each router serves the texts one router gives, admin commands reach every
router, a router killed with -9 loses only its own requests (the other's
streams finish, every worker frees what the dead one's held) and rejoins when
`pdd up` restarts it; admission counts what the other routers queued; a
stored response is found through either router."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import aiohttp
import pytest

from pdd import SamplingParams
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.streams import stream_text
from tests.engine.helpers import random_prompts

START_S = 180.0


def at(c: UpCluster, i: int):
    """Router i as the stream helpers take a cluster: its own address."""
    return SimpleNamespace(url=c.router_url(i), model_name=c.model_name)


LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


def reference(offline, prompts, max_tokens):
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * len(prompts)
    return [(o.text, "length", []) for o in offline.generate(prompts, params)], params


async def _streams(targets, prompts, params, started=None):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(stream_text(session, t, p, sp, started) for t, p, sp in
                                      zip(targets, prompts, params)), return_exceptions=True)


def pages_free(c: UpCluster, router: int) -> bool:
    """No request in flight at `router`, and every worker's last heartbeat
    shows all its blocks free and nothing running or waiting."""
    return not c.admin("requests", router=router) and all(
        w["running"] == 0 and w["waiting"] == 0 and w["free_blocks"] == w["num_blocks"]
        for w in c.admin("workers", router=router))


@pytest.fixture(scope="module")
def two_routers(tmp_path_factory, tiny_model):
    c = UpCluster(tmp_path_factory.mktemp("routers") / "run", tiny_model, "--mode", "disagg", "--routers", "2")
    c.start()
    yield c
    assert c.stop() == 0, c.logs()


def test_each_router_serves_the_texts_one_router_gives_and_admin_reaches_both(two_routers, offline):
    c = two_routers
    assert [len(c.admin("workers", router=i)) for i in (0, 1)] == [2, 2]
    prompts = random_prompts([9 + 5 * i for i in range(8)], seed=41)
    expected, params = reference(offline, prompts, 12)
    got = asyncio.run(_streams([at(c, i % 2) for i in range(8)], prompts, params))
    assert [tuple(g) for g in got] == expected
    # Through the shared port too: the kernel picks a router per connection.
    shared = SimpleNamespace(url=c.url, model_name=c.model_name)
    assert [tuple(g) for g in asyncio.run(_streams([shared] * 8, prompts, params))] == expected

    # `pdd admin --config` speaks to every router: a change reaches both, a read shows both.
    def admin(*args):
        r = subprocess.run([sys.executable, "-m", "pdd.cli", "admin", "--config", str(c.run_dir / "cluster.toml"),
                            "--json", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)["routers"]
    try:
        answers = admin("log-level", "debug")
        assert [a["router"] for a in answers] == ["router-0", "router-1"]
        assert [c.admin("log-level", router=i)["router"] for i in (0, 1)] == ["debug", "debug"]
    finally:
        admin("log-level", "info")
    status = admin("status")
    assert [s["result"]["router"] for s in status] == ["router-0", "router-1"]
    assert all(s["result"]["routers_in_cluster"] == 2 for s in status)


def test_a_stored_response_is_found_through_any_router(two_routers):
    """Its id names router 0, which made it: router 1 forwards a GET, DELETE or
    cancel of it there; previous_response_id at router 1 says where it lives."""
    c = two_routers

    async def main():
        async with aiohttp.ClientSession() as s:
            async def call(method, url, **body):
                async with s.request(method, url, json=body or None) as r:
                    return r.status, await r.json()
            _, made = await call("POST", c.router_url(0) + "/v1/responses", model=c.model_name, input="Hi",
                                 max_output_tokens=4, temperature=0)
            rid = made["id"]
            return rid, made, [await call("GET", c.router_url(1) + f"/v1/responses/{rid}"),
                               await call("GET", c.url + f"/v1/responses/{rid}"),
                               await call("POST", c.router_url(1) + f"/v1/responses/{rid}/cancel"),
                               await call("POST", c.router_url(1) + "/v1/responses", model=c.model_name,
                                          input="And?", previous_response_id=rid),
                               await call("DELETE", c.router_url(1) + f"/v1/responses/{rid}"),
                               await call("GET", c.router_url(0) + f"/v1/responses/{rid}")]

    rid, made, (got, shared, cancel, previous, deleted, gone) = asyncio.run(main())
    assert rid.startswith("resp_r0_")
    assert got == (200, made) and shared == (200, made)
    assert cancel[0] == 400 and "cannot be cancelled" in cancel[1]["error"]["message"]
    assert previous[0] == 400 and "made by router 0" in previous[1]["error"]["message"]
    assert deleted == (200, {"id": rid, "object": "response", "deleted": True})
    assert gone[0] == 404 and rid in gone[1]["error"]["message"]


def test_a_router_killed_loses_only_its_own_requests_and_rejoins(two_routers, offline):
    c = two_routers
    prompts = random_prompts([11 + 3 * i for i in range(8)], seed=43)
    expected, params = reference(offline, prompts, 48)
    doomed_pid = c.child_pid("router", router=1)

    async def main():
        flowing = asyncio.Event()
        survivors = asyncio.create_task(_streams([at(c, 0)] * 4, prompts[:4], params[:4]))
        # Long enough that none can end before the kill, however late the test runs it.
        doomed = asyncio.create_task(_streams([at(c, 1)] * 4, prompts[4:], [LONG] * 4, flowing))
        await flowing.wait()
        os.kill(doomed_pid, signal.SIGKILL)
        return await survivors, await doomed

    survived, lost = asyncio.run(main())
    assert [tuple(s) for s in survived] == expected[:4]
    assert all(isinstance(x, Exception) or x[1] != "length" for x in lost)   # cut, every one
    # What router-1's requests held on the prefill and the decode worker is freed
    # without it (the workers saw its connection close).
    _wait_for(lambda: pages_free(c, 0), 60, "every page freed")
    for worker in ("prefill-0", "decode-0"):
        said = (c.run_dir / f"{worker}.log").read_text()
        assert "the connection to the router-1 at" in said and "closed; dropping what it placed here" in said
    # `pdd up` restarts it; it registers both workers again and serves.
    c.wait_line("router-1 exited")
    _wait_for(lambda: c.restarted("router", doomed_pid, router=1), START_S, "router-1 restarted")
    _wait_for(lambda: _registered(c, 1) == 2, START_S, "router-1 registered both workers again")
    again = asyncio.run(_streams([at(c, 1)] * 4, prompts[4:], params[4:]))
    assert [tuple(x) for x in again] == expected[4:]


def _registered(c: UpCluster, router: int) -> int:
    try:
        return len(c.admin("workers", router=router))
    except Exception:   # not listening yet
        return 0


def test_admission_with_two_routers_counts_what_the_other_queued(tmp_path, tiny_model):
    """One worker that runs one request at a time, router.max_queued_requests 3:
    three requests wait at the worker, queued through router-0; router-1, which
    queued none, refuses the next with 429 once the worker's heartbeat says so."""
    env = {"PDD_ENGINE__MAX_NUM_SEQS": "1", "PDD_ROUTER__MAX_QUEUED_REQUESTS": "3"}
    with UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--routers", "2", env=env) as c:
        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                body = {"model": c.model_name, "prompt": "hello", "max_tokens": 2000, "ignore_eos": True,
                        "stream": True}
                running = await session.post(c.router_url(0) + "/v1/completions", json=body)
                assert running.status == 200
                await running.content.readline()   # its first token: it runs, the next ones wait
                waiting = [asyncio.create_task(session.post(c.router_url(0) + "/v1/completions", json=body))
                           for _ in range(3)]
                await asyncio.to_thread(_wait_for, lambda: c.workers(1)["colocated-0"]["waiting"] == 3,
                                        START_S, "router-1 hears of three waiting requests")
                async with session.post(c.router_url(1) + "/v1/completions", json=body) as refused:
                    status, retry_after = refused.status, refused.headers.get("Retry-After")
                running.close()
                for w in waiting:
                    w.cancel()
                return status, retry_after
        status, retry_after = asyncio.run(main())
        assert status == 429 and retry_after is not None
