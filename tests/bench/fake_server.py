"""A fake OpenAI-compatible streaming server for the benchmark client's tests,
on a loopback port in a thread of the test process (its own event loop, so a
test may call asyncio.run or `pdd bench serve` against it).

Completions and chat stream one chunk per token ("w0 ", "w1 ", ...), a
finish-only chunk, the usage chunk when asked, then [DONE]. The model name
picks a failure: "http-500" answers 500; "error-mid" sends two tokens then an
error event; "cut" ends the stream without [DONE]; "no-usage" never sends usage.
"""
from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

MODEL = "fake-model"


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class FakeServer:
    def __init__(self, gate_at: int = 0, fail_request: int = 0):
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.gate_at = gate_at            # > 0: the first requests wait until this many are in flight
        self.fail_request = fail_request  # > 0: that request (1-based) answers HTTP 500
        self.loop = asyncio.new_event_loop()

    def __enter__(self) -> "FakeServer":
        started = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._start())
            started.set()
            self.loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        assert started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _start(self) -> None:
        self.gate = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        model = body["model"]
        if model == "http-500" or len(self.bodies) == self.fail_request:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate_at and not self.gate.is_set():
                if self.in_flight >= self.gate_at:
                    self.gate.set()
                else:
                    await self.gate.wait()
            return await self._stream(request, body, model)
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, body: dict, model: str) -> web.StreamResponse:
        chat = request.path.endswith("chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body.get("max_completion_tokens") if chat else body.get("max_tokens")

        def chunk(text: str, reason=None) -> bytes:
            if chat:
                return _sse({"choices": [{"index": 0, "delta": {"content": text} if text else {},
                                          "finish_reason": reason}]})
            return _sse({"choices": [{"index": 0, "text": text, "finish_reason": reason}]})

        if chat:
            await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        for i in range(n):
            if model == "error-mid" and i == 2:
                await resp.write(_sse({"error": {"message": "worker lost", "type": "server_error"}}))
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if i == 1:
                await resp.write(b": a comment line, which clients skip\n\n")
            await resp.write(chunk(f"w{i} "))
        await resp.write(chunk("", "length"))
        if body.get("stream_options", {}).get("include_usage") and model != "no-usage":
            prompt = body.get("prompt")
            n_in = len(prompt) if isinstance(prompt, list) else 7
            await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n,
                                                            "total_tokens": n_in + n}}))
        if model != "cut":
            await resp.write(b"data: [DONE]\n\n")
        return resp
