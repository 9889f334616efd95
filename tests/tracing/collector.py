"""A fake OTLP/HTTP collector: an aiohttp server on 127.0.0.1, in a thread of
its own, that keeps every ExportTraceServiceRequest posted to /v1/traces."""
from __future__ import annotations

import asyncio
import socket
import threading

from aiohttp import web


class Collector:
    def __init__(self):
        self.posts: list[tuple[dict[str, str], dict]] = []   # (headers, JSON body) of each export
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-collector", daemon=True)
        self.port = 0

    def start(self) -> "Collector":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.json()
        with self._lock:
            self.posts.append((dict(request.headers), body))
        return web.json_response({})

    def spans(self) -> list[dict]:
        """Every span received, each with its resource's attributes under "resource" (a dict)."""
        with self._lock:
            posts = list(self.posts)
        out = []
        for _, body in posts:
            for rs in body["resourceSpans"]:
                resource = {a["key"]: next(iter(a["value"].values())) for a in rs["resource"]["attributes"]}
                for ss in rs["scopeSpans"]:
                    out += [{**s, "resource": resource} for s in ss["spans"]]
        return out

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


def attrs(span: dict) -> dict:
    """A span's attributes as a dict of their values (intValue stays a string, as on the wire)."""
    return {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}


def closed_port() -> int:
    """A loopback port nothing listens on (a collector that is down: connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
