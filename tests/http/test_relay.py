"""The relay's pieces: chunk bytes from the per-request template are those of
the dicts serialized whole, and DirectWriter writes a prepared aiohttp stream
with the aiohttp installed (else every stream would silently take the slow path)."""
from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from pdd.http import responses as r
from pdd.http.relay import COALESCE_FROM, FULL_LOAD, DirectWriter, Relay


@pytest.mark.parametrize("kind,include_usage", list(itertools.product(["completion", "chat"], [False, True])))
def test_chunk_template_bytes_are_those_of_the_whole_dict(kind, include_usage):
    req = SimpleNamespace(kind=kind, include_usage=include_usage, request_id='cmpl-"q\u00e9', created=123,
                          model="m/\u2028odel")
    chunks, build = r.StreamChunks(req), (r.completion_chunk if kind == "completion" else r.chat_chunk)
    contents = ["a\"b\n\u00e9", ""] if kind == "completion" else [{"content": "x"}, {}]
    for content, reason, lp, usage, index, stop in itertools.product(
            contents, (None, "stop"), (None, {"tokens": ["a"], "token_logprobs": [-0.5]}),
            (None, {"prompt_tokens": 1}) if include_usage else (None,), (0, 3), (None, "###", 7)):
        stop = stop if reason else None   # a stop reason comes with a finish reason only
        assert chunks.chunk(index, content, reason, lp, usage, stop) == \
            r.sse(build(req, content, reason, lp, usage, index, stop))


def test_direct_writes_reach_the_client_between_awaited_ones_in_order():
    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        direct = DirectWriter(resp)
        assert direct.usable and direct.can_write()
        await resp.write(b"one ")
        direct.write(b"two ")
        ran = asyncio.Event()
        relay = Relay()
        relay.listener(lambda: (direct.write(b"three "), ran.set()))(None)   # as an event posted would
        await ran.wait()
        await resp.write(b"four")
        await resp.write_eof()
        return resp

    async def main():
        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as resp:
                assert resp.headers.get("Transfer-Encoding") == "chunked"
                return await resp.read()
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == b"one two three four"


def test_a_busy_relay_writes_the_tokens_of_several_turns_at_once():
    """A loaded router (its loop's busy share at FULL_LOAD): events that come in
    several loop turns within router.stream_interval_ms are flushed together,
    once the interval since the last flush is over."""
    async def run():
        loop = asyncio.get_running_loop()
        relay = Relay(max_interval_s=1.0, load=lambda: FULL_LOAD)
        taken, flushed = [], asyncio.Queue()
        pending = []

        def flush():
            taken.append(list(pending))
            pending.clear()
            flushed.put_nowait(loop.time())

        post = relay.listener(flush)
        pending.append(1)
        post(None)
        first = await flushed.get()
        for token in (2, 3):   # two events, in two loop turns
            pending.append(token)
            post(None)
            await asyncio.sleep(0)
        second = await flushed.get()
        assert taken == [[1], [2, 3]]
        assert second >= first + relay.max_interval_s

    asyncio.run(run())


def test_the_flushes_are_spaced_by_the_load_only():
    load = [0.0]
    relay = Relay(max_interval_s=0.02, load=lambda: load[0])
    spacing = []
    for share in (0.0, COALESCE_FROM, (COALESCE_FROM + FULL_LOAD) / 2, FULL_LOAD, 1.0):
        load[0] = share
        spacing.append(relay.interval_s)
    assert spacing == [0.0, 0.0, pytest.approx(0.01), 0.02, 0.02]
    assert Relay(max_interval_s=0.0, load=lambda: 1.0).interval_s == 0.0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_plain_chunk_is_the_chunk_of_its_text(kind):
    req = SimpleNamespace(kind=kind, request_id="cmpl-1", created=1, model="m", include_usage=True)
    chunks, text = r.StreamChunks(req), 'h\u00e9llo "x"\n'
    assert chunks.plain(2, text) == chunks.chunk(2, text if kind == "completion" else {"content": text})
