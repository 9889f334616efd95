"""`pdd admin breaker open|close|auto` as /metrics shows it: the state is the
new one as soon as the admin command has answered, and the forced change is a
transition of cause "admin". A real router with its admin socket and HTTP
server on loopback; the workers are stand-ins on real DEALER sockets
(tests.router.test_reset_prefix_cache)."""
from __future__ import annotations

import asyncio

import aiohttp

from pdd.admin.client import call
from pdd.admin.server import AdminServer
from pdd.http.app import build_app, serve_http
from tests.router.test_metrics import samples
from tests.router.test_reset_prefix_cache import TOKEN, NoTokenizer, router_with, run, stop

PATH = {"prefill": "*", "decode": "*"}
PAIR = {"prefill": "a", "decode": "b"}


def test_a_forced_breaker_is_on_metrics_when_the_admin_command_answers():
    async def main():
        router, stand_ins = await router_with(("a", 0), ("b", 0))
        admin = AdminServer(router, "tcp://127.0.0.1:0", TOKEN)
        await admin.start(router.ctx)
        server = await serve_http(build_app(router, NoTokenizer(), "m"), "127.0.0.1", 0)
        async with aiohttp.ClientSession() as s:
            async def breaker(*args: str) -> str:
                """The scrape right after the admin command's answer."""
                await asyncio.to_thread(call, admin.addr, TOKEN, "breaker", *args)
                async with s.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                    return await r.text()

            def moved(text: str, to: str, cause: str, **pair: str) -> list[float]:
                return samples(text, "pdd_breaker_transitions_total", to=to, cause=cause, **pair)

            text = await breaker("open", "a", "b")
            assert samples(text, "pdd_breaker_state", **PAIR) == [1]
            assert moved(text, "open", "admin", **PAIR) == [1] and moved(text, "open", "auto", **PAIR) == [0]
            assert samples(text, "pdd_breaker_state", **PATH) == [0] and moved(text, "open", "admin", **PATH) == [0]
            text = await breaker("open", "all")    # the pair is open already: only the path moves
            assert samples(text, "pdd_breaker_state", **PATH) == [1] and moved(text, "open", "admin", **PATH) == [1]
            assert moved(text, "open", "admin", **PAIR) == [1]
            text = await breaker("auto", "all")    # back to their own counts: closed, never failed
            for labels in (PAIR, PATH):
                assert samples(text, "pdd_breaker_state", **labels) == [0]
                assert moved(text, "closed", "admin", **labels) == [1]
        await server.cleanup()
        await admin.stop()
        await stop(router, stand_ins)

    run(main())
