"""Chaos with real processes (`pdd up` on loopback): workers killed (-9), a
decode worker whose engine hangs, KV transfers that fail (all of them, then a
share), clients leaving at random. Every stream that is not abandoned must end
with the text a fault-free run gives (greedy); every block ends free.
Faults are injected through pdd.faults, at run time over the admin socket."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import aiohttp
import pytest

from pdd import SamplingParams
from tests.e2e.cluster import UpCluster
from tests.e2e.streams import stream_all
from tests.e2e.test_disagg import metric
from tests.e2e.test_disagg_faults import _wait_for, assert_all_free
from tests.engine.helpers import random_prompts

RUNTIME_FAULTS = {"PDD_ROUTER__ALLOW_FAULT_INJECTION": "1"}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def fault_free(offline, prompts, sp) -> list[tuple[str, str, list]]:
    return [(e.text, "length", []) for e in offline.generate(prompts, [sp] * len(prompts))]


def faults_reported(c, worker: str, want: dict) -> bool:
    """The worker's heartbeat says these faults are set (it applied the SetFaults)."""
    return c.admin("faults")["workers"].get(worker) == want


@pytest.fixture(scope="module")
def p1d2(tmp_path_factory, tiny_model):
    """1 prefill + 2 decode; a step running 8 s is a hang (a busy 2-core box has seen
    real steps of 2.4 s: lower, a healthy worker is taken for hung); faults at run time."""
    with UpCluster(tmp_path_factory.mktemp("p1d2"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "2", env={**RUNTIME_FAULTS, "PDD_WORKER__STEP_TIMEOUT_S": "8"}) as c:
        yield c


@pytest.fixture(scope="module")
def p1d1(tmp_path_factory, tiny_model):
    """1 prefill + 1 decode; breaker cool-down 1 s, at most 4 (trials come quickly); faults at run time."""
    with UpCluster(tmp_path_factory.mktemp("p1d1"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "1", env={**RUNTIME_FAULTS, "PDD_ROUTER__BREAKER__COOLDOWN_S": "1",
                                         "PDD_ROUTER__BREAKER__MAX_COOLDOWN_S": "4"}) as c:
        yield c


def test_kill_9_the_decode_worker(tmp_path, tiny_model, offline):
    """1P+1D, 24 streams decoding; the decode worker is killed: with no decode
    worker left the prefill worker must carry on (pdd up restarts decode-0 meanwhile)."""
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "disagg", "--prefill", "1", "--decode", "1").start()
    try:
        pid = c.workers()["decode-0"]["pid"]
        prompts = random_prompts([10 + 3 * i for i in range(24)], seed=41)
        sp = greedy(200)
        results = stream_all(c, prompts, [sp] * 24, while_running=lambda: os.kill(pid, signal.SIGKILL))
        assert results == fault_free(offline, prompts, sp)
        assert metric(c, "pdd_request_migrations_total") >= 1
        _wait_for(lambda: c.workers().get("decode-0", {}).get("pid") not in (None, pid), 120.0, "decode-0 back")
        assert_all_free(c)
    finally:
        assert c.stop() == 0, c.logs()


def test_kill_9_the_prefill_worker(tmp_path, tiny_model, offline):
    """1P+1D, 24 streams; the prefill worker is killed while it still has prompts
    to compute (its steps are slowed): those are prefilled by the decode worker."""
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "disagg", "--prefill", "1", "--decode", "1",
                  env={"PDD_FAULTS": "prefill.step_delay_s=0.2", "PDD_ENGINE__MAX_NUM_BATCHED_TOKENS": "128"}).start()
    try:
        pid = c.workers()["prefill-0"]["pid"]
        prompts = random_prompts([60 + i for i in range(24)], seed=42)
        sp = greedy(30)
        results = stream_all(c, prompts, [sp] * 24, while_running=lambda: os.kill(pid, signal.SIGKILL),
                             once_started=1)
        assert results == fault_free(offline, prompts, sp)
        # ~1500 prompt tokens at 128 a step, 0.2 s each: most were still to compute.
        assert metric(c, "pdd_disagg_fallbacks_total", '{reason="prefill_worker_lost"}') >= 1
        _wait_for(lambda: c.workers().get("prefill-0", {}).get("pid") not in (None, pid), 120.0, "prefill-0 back")
        assert_all_free(c)
    finally:
        assert c.stop() == 0, c.logs()


def test_a_hung_decode_worker_loses_its_streams_to_the_other(p1d2, offline):
    c = p1d2
    # From its first step on, decode-0's engine blocks; its heartbeats go on.
    c.admin("faults", "set", "decode.hang_after_steps=1", "decode-0")
    _wait_for(lambda: faults_reported(c, "decode-0", {"decode.hang_after_steps": 1.0}), 30.0, "the fault set")
    assert faults_reported(c, "decode-1", {})
    prompts = random_prompts([12 + 2 * i for i in range(24)], seed=43)
    sp = greedy(40)
    migrations = metric(c, "pdd_request_migrations_total")
    hung_seen = []

    def hung():
        _wait_for(lambda: c.workers()["decode-0"]["hung"], 60.0, "decode-0 declared hung")
        hung_seen.append(c.workers()["decode-0"]["step_running_s"])

    results = stream_all(c, prompts, [sp] * 24, while_running=hung, once_started=1)
    assert results == fault_free(offline, prompts, sp)
    assert hung_seen and hung_seen[0] > 8
    assert metric(c, "pdd_request_migrations_total") > migrations
    c.admin("faults", "clear", "decode-0")   # releases the blocked step: it steps again
    _wait_for(lambda: not c.workers()["decode-0"]["hung"], 60.0, "decode-0 stepping again")
    assert faults_reported(c, "decode-0", {})
    assert_all_free(c)


def test_abort_storm_leaks_no_block(p1d2, offline):
    """100 streams whose clients leave at random points (before the first token,
    mid-stream, or never): those that stay get their text, nothing leaks."""
    c = p1d2
    rng = random.Random(44)
    prompts = random_prompts([rng.randint(5, 80) for _ in range(100)], seed=44)
    leave_after = [rng.choice([0, 1, 2, 5, 10, 20, 40, None]) for _ in prompts]   # chunks read; None: stays
    sp = greedy(40)
    expected = [e.text for e in offline.generate(prompts, [sp] * len(prompts))]

    async def one(session, prompt, chunks):
        body = {"model": c.model_name, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True}
        text = []
        async with session.post(c.url + "/v1/completions", json=body) as resp:
            async for raw in resp.content:
                line = raw.decode().strip()
                if chunks is not None and len(text) >= chunks:
                    return None      # leaves: the connection is closed with the response
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return await asyncio.gather(*(one(session, p, k) for p, k in zip(prompts, leave_after)))
    texts = asyncio.run(main())
    for text, k, want in zip(texts, leave_after, expected):
        if k is None:
            assert text == want
    _wait_for(lambda: c.admin("requests") == [] and all(w["inflight"] == 0 for w in c.workers().values()),
              120.0, "no request in flight and every inflight count at zero")
    assert_all_free(c)


def test_transfers_failing_open_the_breaker_then_it_closes(p1d1, offline):
    c = p1d1
    pair = ("prefill-0", "decode-0")

    def breaker() -> dict:
        return next(b for b in c.admin("breaker") if (b["prefill"], b["decode"]) == pair)

    def failures() -> float:
        return metric(c, "pdd_kv_transfer_failures_total")

    def trials() -> float:
        return metric(c, "pdd_breaker_transitions_total", '{cause="auto",decode="decode-0",prefill="prefill-0",to="half_open"}')

    def served(mode: str) -> float:
        return metric(c, "pdd_requests_total", f'{{finish_reason="length",mode="{mode}"}}')

    prompts = random_prompts([15 + i for i in range(40)], seed=45)
    sp = greedy(6)
    expected = fault_free(offline, prompts, sp)
    c.admin("faults", "set", "transfer.fail_rate=1")
    _wait_for(lambda: faults_reported(c, "prefill-0", {"transfer.fail_rate": 1.0}), 30.0, "the fault set")
    # One request at a time: the breaker's count is exact.
    opened_after = None
    for i in range(12):
        assert stream_all(c, prompts[i:i + 1], [sp]) == expected[i:i + 1]
        if opened_after is None and breaker()["state"] != "closed":
            opened_after = failures()
    assert opened_after is not None and 1 <= opened_after <= 5
    # Open: transfers are tried only as half-open trials (each fails and reopens it).
    assert failures() == opened_after + trials()
    assert metric(c, "pdd_disagg_fallbacks_total", '{reason="breaker_open"}') >= 1
    # Cleared at run time: the next trials succeed, the breaker closes, disaggregation resumes.
    c.admin("faults", "clear")
    _wait_for(lambda: faults_reported(c, "prefill-0", {}), 30.0, "the fault cleared")
    disagg_before = served("disagg")
    # The cool-down (doubled by each failed trial, capped at 4 s here) runs out
    # whatever the requests do; from then on, one request at a time, each is a
    # trial until two succeeded and the breaker closes, then each disaggregates.
    _wait_for(lambda: breaker()["state"] == "half_open", 60.0, "the breaker's cool-down to run out")
    for i in range(12, 20):
        assert stream_all(c, prompts[i:i + 1], [sp]) == expected[i:i + 1]
    assert breaker()["state"] == "closed" and served("disagg") > disagg_before + 2, breaker()


def test_a_share_of_transfers_failing_loses_no_request(p1d1, offline):
    c = p1d1
    prompts = random_prompts([20 + 2 * i for i in range(24)], seed=46)
    sp = greedy(12)
    before = metric(c, "pdd_disagg_fallbacks_total", '{reason="transfer_failed"}')
    c.admin("faults", "set", "transfer.fail_rate=0.3,seed=3")
    _wait_for(lambda: faults_reported(c, "prefill-0", {"transfer.fail_rate": 0.3, "seed": 3.0}), 30.0, "set")
    try:
        assert stream_all(c, prompts, [sp] * 24) == fault_free(offline, prompts, sp)
        assert metric(c, "pdd_disagg_fallbacks_total", '{reason="transfer_failed"}') > before
    finally:
        c.admin("faults", "clear")
    assert_all_free(c)


def test_the_router_killed_and_restarted(tmp_path, tiny_model, offline):
    """kill -9 the router (under systemd it is restarted; here the test restarts
    it on the same addresses): streams in flight end at once, none hangs; the
    workers, told to register again, drop what they held and serve the new
    router. No `pdd up` here: it stops the cluster when its router dies."""
    from pdd.admin.client import call_with_config
    from benchmarks.load import start_cluster
    cluster = start_cluster(tmp_path / "run", [("colocated", "colocated-0", None)], str(tiny_model), "colocated")
    try:
        router = next(c for c in cluster.children if c.name == "router")
        prompts = random_prompts([6, 13, 21, 30], seed=77)

        async def stream(session, prompt, started):
            body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            try:
                async with session.post(cluster.url + "/v1/completions", json=body) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            started.set()
            except aiohttp.ClientError as e:
                return type(e).__name__
            return "ended"

        async def main():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                started = [asyncio.Event() for _ in prompts]
                tasks = [asyncio.create_task(stream(session, p, ev)) for p, ev in zip(prompts, started)]
                await asyncio.gather(*(ev.wait() for ev in started))
                os.kill(router.proc.pid, signal.SIGKILL)
                return await asyncio.gather(*tasks)
        ends = asyncio.run(main())
        assert len(ends) == len(prompts)    # every stream ended: the connection went with the router
        router.proc.wait()
        cluster.restart(router)
        cluster.wait_ready(120)             # the worker registered again with the new router
        workers = _wait_for(lambda: [w for w in call_with_config(cluster.cfg, "workers")
                                     if w["free_blocks"] == w["num_blocks"] and w["running"] == 0], 60.0,
                            "the worker's blocks all free after it registered again")
        assert [w["worker_id"] for w in workers] == ["colocated-0"]
        sp = greedy(12)

        async def again():
            async with aiohttp.ClientSession() as session:
                body = {"model": cluster.model_name, "prompt": prompts[0], "max_tokens": 12, "temperature": 0,
                        "ignore_eos": True}
                async with session.post(cluster.url + "/v1/completions", json=body) as resp:
                    return (await resp.json())["choices"][0]["text"]
        assert asyncio.run(again()) == offline.generate([prompts[0]], sp)[0].text
    finally:
        cluster.stop()
