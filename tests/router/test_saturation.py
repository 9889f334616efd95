"""A saturated router refuses new requests (429 with Retry-After, in OpenAI's
shape) while the streams it holds go on to their end: its loop late at every
probe (forced: the test holds the loop at each of its turns), or its HTTP
connections holding more unsent bytes than router.max_buffered_bytes (a client
that never reads). A real router with its HTTP server on loopback; the worker
is a stand-in on a real DEALER socket that streams the tokens the test gives it."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pdd.http.app import build_app, serve_http
from pdd.model.tokenizer import Tokenizer
from pdd.protocol import messages as m
from tests.router.test_metrics import samples
from tests.router.test_reset_prefix_cache import StandIn, router_with, run, stop
from tests.security.test_http import never_reading_client

TOKEN_ID = 100


class StreamingStandIn(StandIn):
    """A worker that takes Admits and streams what the test says, one token at a time."""

    def __init__(self, router, worker_id: str):
        super().__init__(router, worker_id, None)
        self.admitted: asyncio.Queue[m.Admit] = asyncio.Queue()

    async def _serve(self) -> None:
        while True:
            msg = await self.chan.recv()
            if isinstance(msg, m.Admit):
                self.admitted.put_nowait(msg)

    async def token(self, admit: m.Admit, position: int, finished: bool = False) -> None:
        await self.chan.send(m.TokenBatch(self.worker_id, [m.TokenItem(
            admit.request_id, admit.epoch, position, [TOKEN_ID], finished, "length" if finished else None)]))


class LoopStall:
    """The forced fault: the loop held `seconds` (time.sleep) at each of its turns,
    as a router busy past its core is; between the holds it serves as ever."""

    def __init__(self, seconds: float):
        self.seconds, self.on = seconds, True
        asyncio.get_running_loop().call_soon(self._hold)

    def _hold(self) -> None:
        if self.on:
            time.sleep(self.seconds)
            asyncio.get_running_loop().call_soon(self._hold)

    def stop(self) -> None:
        self.on = False


async def until(condition) -> None:
    """Until `condition()` holds (the test's own timeout bounds it)."""
    while not condition():
        await asyncio.sleep(0.01)


def completion(stream: bool) -> dict:
    return {"model": "m", "prompt": "hello", "max_tokens": 3, "ignore_eos": True, "stream": stream}


async def refused(s: aiohttp.ClientSession, url: str, setting: str) -> None:
    async with s.post(url + "/v1/completions", json=completion(False)) as r:
        body = await r.json()
        assert r.status == 429 and r.headers["Retry-After"] == "1", body
        assert 500 <= int(r.headers["retry-after-ms"]) < 1500, r.headers
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["code"] == "rate_limit_exceeded" and setting in body["error"]["message"], body


async def rejected(s: aiohttp.ClientSession, url: str, reason: str) -> float:
    async with s.get(url + "/metrics") as r:
        (value,) = samples(await r.text(), "pdd_requests_rejected_total", reason=reason)
        return value


def test_a_router_whose_loop_is_late_at_every_probe_refuses_new_requests_and_its_streams_go_on(tiny_model):
    async def main():
        router, _ = await router_with(max_loop_lag_s=0.05)
        worker = await StreamingStandIn(router, "c").start()
        server = await serve_http(build_app(router, Tokenizer(tiny_model), "m"), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            assert await rejected(s, url, "loop_lag") == 0
            stream = await s.post(url + "/v1/completions", json=completion(True))
            assert stream.status == 200
            admit = await worker.admitted.get()
            await worker.token(admit, 0)
            assert (await stream.content.readline()).startswith(b"data: ")
            stall = LoopStall(0.1)   # a probe waits at least one hold: late by more than the limit
            await until(lambda: router.saturation.reason == "loop_lag")
            await refused(s, url, "router.max_loop_lag_s")
            assert worker.admitted.empty()   # refused before anything reached a worker
            await worker.token(admit, 1)      # the stream held meanwhile goes on to its end
            await worker.token(admit, 2, finished=True)
            events = [line for line in (await stream.read()).split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]" and b'"finish_reason":"length"' in events[-2], events
            stall.stop()
            await until(lambda: router.saturation.reason is None)
            assert await rejected(s, url, "loop_lag") == 1
            answer = asyncio.ensure_future(s.post(url + "/v1/completions", json=completion(False)))
            admit = await worker.admitted.get()    # admitted again
            for position in range(3):
                await worker.token(admit, position, finished=position == 2)
            async with await answer as r:
                assert r.status == 200, await r.text()
        await server.cleanup()
        await stop(router, [worker])

    run(main())


def test_a_saturated_router_refuses_before_it_reads_the_body(tiny_model):
    """While saturated, a generation request is answered 429 before its body is
    read: one that is not even JSON gets the 429, not the 400 a parse would
    give, on each endpoint; and the connection stays usable for the next."""
    async def main():
        router, _ = await router_with(max_loop_lag_s=0.05)
        server = await serve_http(build_app(router, Tokenizer(tiny_model), "m"), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession(headers={"Content-Type": "application/json"}) as s:
            async with s.post(url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400, await r.text()   # parsed while not saturated
            stall = LoopStall(0.1)
            await until(lambda: router.saturation.reason == "loop_lag")
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
                async with s.post(url + path, data=b"{not json") as r:
                    body = await r.json()
                    assert r.status == 429 and body["error"]["code"] == "rate_limit_exceeded", (path, body)
            stall.stop()
            await until(lambda: router.saturation.reason is None)
            async with s.post(url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400, await r.text()
            assert await rejected(s, url, "loop_lag") == 3
        await server.cleanup()
        await stop(router, [])

    run(main())


def test_a_router_holding_too_many_unsent_bytes_refuses_new_requests(tiny_model):
    async def main():
        router, _ = await router_with(max_buffered_bytes=16384)
        server = await serve_http(build_app(router, Tokenizer(tiny_model), "m"), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        writer = await never_reading_client(server.port)
        await until(lambda: router.saturation.reason == "buffered_bytes")
        async with aiohttp.ClientSession() as s:
            await refused(s, url, "router.max_buffered_bytes")
            writer.close()                 # its bytes go with it
            await until(lambda: router.saturation.reason is None)
            assert await rejected(s, url, "buffered_bytes") == 1
        await server.cleanup()
        await stop(router, [])

    run(main())


def test_a_loop_on_its_cpu_all_the_time_is_saturated_and_one_that_idles_is_not():
    """The loop's thread on a CPU for more than router.max_loop_busy of the last
    probes' span: refused (a request more would slow every stream), though no
    probe ran late; back to admitting once it idles again."""
    from pdd.router.inflight import Overloaded
    from pdd.router.saturation import LOOP_BUSY, PROBE_INTERVAL_S, PROBES
    sat, _ = _saturation(max_loop_busy=0.95)
    wall = cpu = 0.0
    for _ in range(PROBES + 1):          # every interval spent on the CPU, each probe on time
        wall, cpu = wall + PROBE_INTERVAL_S, cpu + PROBE_INTERVAL_S
        sat.probe(0.001, wall, cpu)
    assert sat.reason == LOOP_BUSY
    with pytest.raises(Overloaded, match=r"router\.max_loop_busy"):   # refused, and says why
        sat.check()
    for _ in range(PROBES):              # then half of each interval
        wall, cpu = wall + PROBE_INTERVAL_S, cpu + PROBE_INTERVAL_S / 2
        sat.probe(0.001, wall, cpu)
    assert sat.reason is None
    sat.check()


def test_workers_messages_waiting_without_a_break_saturate_and_a_caught_up_router_admits_again():
    """The receive loop found a message waiting after each one for longer than
    router.max_inbound_lag_s: refused (every stream's tokens and every first
    token wait in that queue); an empty socket ends it at once."""
    from pdd.router.inflight import Overloaded
    from pdd.router.saturation import INBOUND_LAG
    sat, rejected = _saturation(max_inbound_lag_s=0.5)
    sat.behind(10.0)
    sat.behind(10.3)            # still behind: the wait counts from the first
    sat.probe(0.001, 10.4, 0.0)
    assert sat.reason is None and sat.inbound_lag == pytest.approx(0.4)
    sat.probe(0.001, 10.6, 0.0)
    assert sat.reason == INBOUND_LAG
    with pytest.raises(Overloaded, match=r"router\.max_inbound_lag_s"):   # refused, and says why
        sat.check()
    assert rejected.labels(INBOUND_LAG)._value.get() == 1
    sat.caught_up()
    sat.probe(0.001, 10.7, 0.0)
    assert sat.reason is None and sat.inbound_lag == 0.0
    sat.check()


def test_a_refusal_spreads_its_retry_after_ms_over_the_second_it_names():
    """Every refusal says Retry-After 1 (whole seconds); retry-after-ms is drawn
    in [500, 1500) ms, so clients refused together do not all come back in one instant."""
    from pdd.router.inflight import Overloaded
    from pdd.router.saturation import INBOUND_LAG
    draws = iter([0.0, 0.5, 0.999])
    sat, _ = _saturation(max_inbound_lag_s=0.5, jitter=lambda: next(draws))
    sat.behind(0.0)
    sat.probe(0.001, 1.0, 0.0)
    assert sat.reason == INBOUND_LAG
    waits = []
    for _ in range(3):
        with pytest.raises(Overloaded) as refused:
            sat.check()
        waits.append((refused.value.retry_after_s, refused.value.retry_after_ms))
    assert waits == [(1, 500), (1, 1000), (1, 1499)]


def test_while_saturated_a_request_is_admitted_only_in_the_place_of_one_that_ended():
    """The requests held when the verdict tripped are the level kept while it
    holds: an arrival is refused while as many are held, admitted once as many
    as its choices have ended, never past that level; the level is forgotten
    when the verdict clears."""
    from pdd.router.inflight import Overloaded
    from pdd.router.saturation import INBOUND_LAG
    held = [40]
    sat, rejected = _saturation(max_inbound_lag_s=0.5, in_flight=lambda: held[0])
    sat.behind(0.0)
    sat.probe(0.001, 1.0, 0.0)
    assert sat.reason == INBOUND_LAG and sat.pinned == 40
    with pytest.raises(Overloaded):
        sat.check()
    held[0] = 39                  # one ended: its place is taken
    sat.check()
    held[0] = 40
    with pytest.raises(Overloaded):
        sat.check()
    held[0] = 38                  # two ended: a request of three choices (n = 3) would pass the level
    with pytest.raises(Overloaded):
        sat.check(3)
    sat.check(2)                  # ... one of two takes both places
    held[0] = 45                  # more held than at the trip (an n > 1 request): still refused
    sat.probe(0.001, 1.1, 0.0)    # still saturated: the level stays the trip's
    assert sat.pinned == 40
    with pytest.raises(Overloaded):
        sat.check()
    assert rejected.labels(INBOUND_LAG)._value.get() == 4
    sat.caught_up()
    sat.probe(0.001, 1.2, 0.0)
    assert sat.reason is None and sat.pinned is None
    sat.check()
    held[0] = 10                  # a new trip pins the level of its own moment
    sat.behind(2.0)
    sat.probe(0.001, 3.0, 0.0)
    assert sat.pinned == 10


def test_the_wait_a_refusal_asks_for_follows_the_rate_of_refusals_against_the_rate_requests_end():
    """Refusals faster than REFUSALS_PER_END times the rate requests end (at least
    MIN_REFUSALS_PER_S) lengthen the wait in proportion, up to MAX_RETRY_AFTER_S;
    under 0.7 of that rate it shrinks in proportion, at most halved a step, never
    below RETRY_AFTER_S; Retry-After names its whole seconds."""
    from pdd.router.inflight import Overloaded
    from pdd.router.saturation import MAX_RETRY_AFTER_S, MIN_REFUSALS_PER_S, REFUSALS_PER_END, RETRY_AFTER_S
    assert REFUSALS_PER_END == 1.5   # the figures below are for it
    ended = [0]
    sat, _ = _saturation(max_inbound_lag_s=0.5, ended=lambda: ended[0], jitter=lambda: 0.5)
    sat.behind(0.0)

    def second(t: float, refusals: int, ends: int) -> None:
        for _ in range(refusals):
            with pytest.raises(Overloaded):
                sat.check()
        ended[0] += ends
        sat.probe(0.001, t, 0.0)

    sat.probe(0.001, 1.0, 0.0)            # tripped; the first steer's reading
    assert sat.reason is not None and sat.retry_after_s == RETRY_AFTER_S
    second(2.0, 300, 100)                 # 300 refusals a second against 1.5 x 100 ended
    assert sat.retry_after_s == pytest.approx(2 * RETRY_AFTER_S)
    with pytest.raises(Overloaded) as refused:
        sat.check()
    assert (refused.value.retry_after_s, refused.value.retry_after_ms) == (2, 2000)
    second(3.0, 110, 100)                 # within [0.7 target, target]: the wait holds
    assert sat.retry_after_s == pytest.approx(2 * RETRY_AFTER_S)
    second(3.5, 0, 0)                     # (steered once a STEER_INTERVAL_S: not yet)
    second(4.0, 90, 100)                  # 90 a second against 150: shrunk in proportion
    assert sat.retry_after_s == pytest.approx(0.6 * 2 * RETRY_AFTER_S)
    second(4.5, 0, 0)
    second(5.0, 10 * MIN_REFUSALS_PER_S, 0)   # few end: the floor of the refusals' rate is the target
    assert sat.retry_after_s == pytest.approx(12 * RETRY_AFTER_S)
    second(5.5, 0, 0)
    second(6.0, 10 * MIN_REFUSALS_PER_S, 0)
    assert sat.retry_after_s == MAX_RETRY_AFTER_S
    for t in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0):   # the clients wait as asked: it halves back to the floor
        second(t, 0, 100)
    assert sat.retry_after_s == RETRY_AFTER_S


def test_without_a_count_of_requests_held_a_saturated_router_refuses_every_arrival():
    from pdd.router.inflight import Overloaded
    sat, _ = _saturation(max_inbound_lag_s=0.5)
    sat.behind(0.0)
    sat.probe(0.001, 1.0, 0.0)
    assert sat.pinned is None
    with pytest.raises(Overloaded):
        sat.check()


def test_the_bench_client_waits_what_retry_after_ms_says_before_retry_after():
    from pdd.bench.frontdoor import _retry_after
    assert _retry_after({"Retry-After": "1", "retry-after-ms": "730"}) == pytest.approx(0.73)
    assert _retry_after({"Retry-After": "2"}) == 2.0
    assert _retry_after({}) == 1.0


def _saturation(**limits):
    """A Saturation with max_loop_lag_s 0.5 and `limits`, and its rejection counter."""
    from prometheus_client import CollectorRegistry, Counter

    from pdd.router.saturation import Saturation
    rejected = Counter("r", "r", ["reason"], registry=CollectorRegistry())
    return Saturation(0.5, 0, rejected, **limits), rejected
