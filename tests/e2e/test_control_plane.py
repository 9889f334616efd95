"""The control plane under faults, with real processes (`pdd up` on loopback):
a decode worker frozen then killed while Reserves wait on it, a worker
restarted under its own id, a storm of clients leaving before their first
byte. Every stream must end with the text a fault-free run gives, or not at
all for the clients that left; every count ends at zero."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from pdd import SamplingParams
from tests.e2e.cluster import UpCluster
from tests.e2e.test_disagg import metric
from tests.e2e.streams import stream_all, stream_text
from tests.e2e.test_disagg_faults import _wait_for, assert_all_free
from tests.engine.helpers import random_prompts


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory, tiny_model):
    """Colocated, one worker; at most 4 requests wait for a first token (the
    overload test's bound); faults at run time."""
    with UpCluster(tmp_path_factory.mktemp("one"), tiny_model, "--mode", "colocated", "--workers", "1",
                   env={"PDD_ROUTER__MAX_QUEUED_REQUESTS": "4", "PDD_ROUTER__ALLOW_FAULT_INJECTION": "1"}) as c:
        yield c


@pytest.fixture(scope="module")
def p1d2(tmp_path_factory, tiny_model):
    """1 prefill + 2 decode workers, the default settings."""
    with UpCluster(tmp_path_factory.mktemp("p1d2"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "2") as c:
        yield c


def test_decode_worker_frozen_then_killed_while_reserves_wait(tmp_path, tiny_model, offline):
    """SIGSTOP a decode worker, send requests (some Reserves go to it and wait),
    let it be declared lost (its requests move), SIGKILL it (pdd up restarts it):
    every stream ends with its fault-free text, none placed twice."""
    # 5 s of missed heartbeats before the frozen worker is lost: long enough for the
    # requests to be placed on it on a busy machine (1.5 s, the default, once was
    # not). The expected texts are computed before the freeze, outside that window.
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "disagg", "--prefill", "1", "--decode", "2",
                  env={"PDD_ROUTER__RESERVE_TIMEOUT_S": "30", "PDD_ROUTER__HEARTBEAT_MISSES": "10"}).start()
    try:
        prompts = random_prompts([5, 17, 40, 3, 33, 70, 12, 9], seed=21)
        params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * len(prompts)
        expected = [e.text for e in offline.generate(prompts, params)]
        frozen = c.workers()["decode-0"]
        os.kill(frozen["pid"], signal.SIGSTOP)

        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                tasks = [asyncio.create_task(stream_text(session, c, p, sp)) for p, sp in zip(prompts, params)]
                loop = asyncio.get_running_loop()
                # Reserves are waiting on the frozen worker...
                await loop.run_in_executor(None, _wait_for, lambda: any(
                    r["worker_id"] == "decode-0" and r["phase"] == "reserving" for r in c.admin("requests")),
                    60.0, "a Reserve waiting on the frozen decode worker")
                # ...until it misses its heartbeats and its requests move.
                await loop.run_in_executor(None, _wait_for, lambda: "decode-0" not in c.workers(), 60.0,
                                           "the frozen worker declared lost")
                os.kill(frozen["pid"], signal.SIGKILL)
                return await asyncio.gather(*tasks)
        results = asyncio.run(main())
        assert [(t, r, e) for t, r, e in results] == [(t, "length", []) for t in expected]
        assert metric(c, "pdd_request_migrations_total") >= 1
        _wait_for(lambda: c.workers().get("decode-0", {}).get("pid") not in (None, frozen["pid"]), 120.0,
                  "decode-0 restarted")
        assert_all_free(c)
    finally:
        assert c.stop() == 0, c.logs()


def test_worker_restarted_under_its_id_takes_its_old_requests(tmp_path, tiny_model, offline):
    """kill -9 a colocated worker; `pdd up` restarts it under the same id long
    before its old entry would expire (heartbeat timeout 60 s here): the new
    process registering is the old one's loss, and its requests move onto it."""
    # Steps of 10 ms at least: 300 tokens take 3 s, so all three still run when the
    # kill comes, however late a busy box lets the test send it.
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1",
                  env={"PDD_ROUTER__HEARTBEAT_MISSES": "120", "PDD_FAULTS": "colocated.step_delay_s=0.01"}).start()
    try:
        old_pid = c.workers()["colocated-0"]["pid"]
        prompts = random_prompts([4, 30, 11], seed=5)
        params = [SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)] * len(prompts)
        expected = [e.text for e in offline.generate(prompts, params)]
        results = stream_all(c, prompts, params, while_running=lambda: os.kill(old_pid, signal.SIGKILL))
        assert [(t, r, e) for t, r, e in results] == [(t, "length", []) for t in expected]
        assert c.workers()["colocated-0"]["pid"] != old_pid
        assert metric(c, "pdd_request_migrations_total") == len(prompts)
        assert_all_free(c)
    finally:
        assert c.stop() == 0, c.logs()


def test_a_worker_started_under_a_live_connections_id_takes_it_over(tmp_path, tiny_model, offline):
    """colocated-0 frozen (its connection still open), a new process started
    as colocated-0: it registers (the router hands the id over) and serves."""
    import subprocess
    import sys
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1",
                  env={"PDD_ROUTER__HEARTBEAT_MISSES": "1000"}).start()   # the frozen one is never timed out
    new = None
    try:
        old = c.workers()["colocated-0"]["pid"]
        os.kill(old, signal.SIGSTOP)
        new = subprocess.Popen([sys.executable, "-m", "pdd.cli", "serve", "--role", "colocated",
                                "--worker-id", "colocated-0", "--config", str(tmp_path / "run" / "cluster.toml")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for(lambda: c.workers().get("colocated-0", {}).get("pid") == new.pid, 120.0,
                  "the new colocated-0 registered")
        prompts = random_prompts([7, 19], seed=13)
        params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * len(prompts)
        expected = [e.text for e in offline.generate(prompts, params)]
        assert [(t, r, e) for t, r, e in stream_all(c, prompts, params)] == [(t, "length", []) for t in expected]
        os.kill(old, signal.SIGKILL)
    finally:
        if new is not None:
            new.terminate()
            new.wait(60)
        assert c.stop() == 0, c.logs()


def test_a_stalled_router_loses_no_worker(one_worker, offline):
    """The router and its worker stopped together for longer than the heartbeat
    timeout (a host paused: a suspended VM, say), the router continued first:
    its loop finds itself late and moves liveness on by the stall before it
    looks for lost workers, so the worker, which could not beat meanwhile, is
    not declared lost before its next heartbeat. One worker: had it been
    declared lost, every stream would have failed."""
    c = one_worker
    router, worker = c.child_pid("router"), c.child_pid("colocated")
    router_log = c.run_dir / "router.log"
    prompts = random_prompts([6, 25, 14], seed=12)
    params = [SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)] * len(prompts)
    expected = [e.text for e in offline.generate(prompts, params)]
    migrations = metric(c, "pdd_request_migrations_total")
    stalls = router_log.read_text().count("its loop stalled")

    def stall():
        os.kill(worker, signal.SIGSTOP)
        os.kill(router, signal.SIGSTOP)
        try:
            time.sleep(4 * c.cfg.router.heartbeat_interval_s * c.cfg.router.heartbeat_misses)
            os.kill(router, signal.SIGCONT)
            # The worker stays stopped until the router has looked at its liveness.
            _wait_for(lambda: router_log.read_text().count("its loop stalled") > stalls, 60.0,
                      "the router saw its own stall")
        finally:
            os.kill(router, signal.SIGCONT)
            os.kill(worker, signal.SIGCONT)
    results = stream_all(c, prompts, params, while_running=stall)
    assert [(t, r, e) for t, r, e in results] == [(t, "length", []) for t in expected]
    assert metric(c, "pdd_request_migrations_total") == migrations
    assert c.workers()["colocated-0"]["heartbeats"] > 0
    assert_all_free(c)


def test_clients_leaving_before_the_first_byte_leave_nothing_behind(p1d2):
    """200 streams whose clients hang up right after sending: each request is
    retired exactly once, every worker's inflight count is back to zero, every
    block free (the router once leaked an inflight count per early reset)."""
    c = p1d2
    prompt_tokens = metric(c, "pdd_prompt_tokens_total")
    prompts = random_prompts([40] * 200, seed=9)

    async def one(prompt):
        body = json.dumps({"model": c.model_name, "prompt": prompt, "max_tokens": 50, "stream": True,
                           "ignore_eos": True}).encode()
        host, port = c.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.transport.abort()   # reset: gone before any answer

    async def main():
        await asyncio.gather(*(one(p) for p in prompts))
    asyncio.run(main())
    # Not vacuous: requests did reach the router before their clients vanished.
    _wait_for(lambda: metric(c, "pdd_prompt_tokens_total") > prompt_tokens, 60.0, "requests admitted")
    # A leaked count never returns to zero: this would time out.
    _wait_for(lambda: c.admin("requests") == [] and all(w["inflight"] == 0 for w in c.workers().values()),
              120.0, "no request in flight and every inflight count at zero")
    assert_all_free(c)


def test_overload_answers_429_with_retry_after_and_serves_the_rest(one_worker, offline):
    """300 at once: beyond router.max_queued_requests waiting for a first token, new
    requests get 429 + Retry-After in OpenAI's shape; no 5xx; those admitted
    complete exactly; it serves after."""
    c = one_worker
    c.admin("faults", "set", "colocated.step_delay_s=0.05", "colocated-0")
    try:
        _wait_for(lambda: c.admin("faults")["workers"].get("colocated-0") == {"colocated.step_delay_s": 0.05},
                  30.0, "the steps slowed")
        prompts = random_prompts([30] * 300, seed=13)
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        expected = [e.text for e in offline.generate(prompts, [sp] * len(prompts))]
        rejected = metric(c, "pdd_requests_rejected_total", '{reason="overloaded"}')

        async def one(session, prompt):
            body = {"model": c.model_name, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            async with session.post(c.url + "/v1/completions", json=body) as resp:
                return resp.status, resp.headers.get("Retry-After"), await resp.json()

        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                return await asyncio.gather(*(one(session, p) for p in prompts))
        results = asyncio.run(main())
        statuses = [r[0] for r in results]
        assert set(statuses) <= {200, 429} and statuses.count(429) > 0 and statuses.count(200) >= 4, statuses
        for (status, retry_after, body), text in zip(results, expected):
            if status == 429:
                assert int(retry_after) >= 1 and body["error"]["type"] == "rate_limit_error", body
            else:
                assert body["choices"][0]["text"] == text
        assert metric(c, "pdd_requests_rejected_total", '{reason="overloaded"}') - rejected == statuses.count(429)
        (text, reason, errors), = stream_all(c, prompts[:1], [sp])
        assert (text, reason, errors) == (expected[0], "length", [])
        assert_all_free(c)
    finally:
        c.admin("faults", "clear")


def test_operator_forces_the_breaker_open_and_requests_go_colocated(p1d2, offline):
    c = p1d2
    prompts = random_prompts([20, 33, 7], seed=17)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [(e.text, "length", []) for e in offline.generate(prompts, [sp] * 3)]
    fallbacks = metric(c, "pdd_disagg_fallbacks_total", '{reason="breaker_open"}')

    def served(mode: str) -> float:
        return metric(c, "pdd_requests_total", f'{{finish_reason="length",mode="{mode}"}}')
    disagg, colocated = served("disagg"), served("colocated")

    assert stream_all(c, prompts[:1], [sp]) == expected[:1] and served("disagg") == disagg + 1
    forced = c.admin("breaker", "open", "all")
    assert forced and all(b["state"] == "open" and b["forced"] == "open" for b in forced), forced
    assert stream_all(c, prompts[1:2], [sp]) == expected[1:2] and served("colocated") == colocated + 1
    assert metric(c, "pdd_disagg_fallbacks_total", '{reason="breaker_open"}') == fallbacks + 1
    assert all(b["forced"] == "auto" for b in c.admin("breaker", "auto", "all"))
    assert stream_all(c, prompts[2:], [sp]) == expected[2:] and served("disagg") == disagg + 2
    assert_all_free(c)
