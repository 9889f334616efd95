"""A real HTTP app on a loopback port whose router core is a stand-in that
runs each request on an offline engine in this process (pdd.LLM, the tiny
random-weight model): the grammar of a structured output or a forced call
shapes the tokens as on a worker, the app reads them as from a worker."""
from __future__ import annotations

import asyncio
import dataclasses
import threading

import aiohttp
import orjson

from pdd import LLM
from pdd.api import SamplingParams
from pdd.config_loader import load_cluster_config
from pdd.http.app import build_app, serve_http
from pdd.model.tokenizer import Tokenizer
from pdd.router.requests import RequestState, TokenEvent
from tests.security.conftest import StubRouter


class EngineRouter(StubRouter):
    """Submits to the engine and delivers each choice's tokens in one event,
    with the engine's finish reason and logprobs."""

    def __init__(self, llm: LLM):
        super().__init__(load_cluster_config(env={}), max_model_len=llm.engine.max_model_len)
        self.llm = llm
        self.lock = threading.Lock()   # one generate at a time: the engine is not shared across threads

    async def submit_choices(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
                             n: int, span=None) -> list[RequestState]:
        params = [dataclasses.replace(sampling, seed=None if sampling.seed is None else sampling.seed + i)
                  for i in range(n)]
        outs = await asyncio.get_running_loop().run_in_executor(None, self._generate, prompt_token_ids, params)
        states = []
        for i, out in enumerate(outs):
            state = RequestState(f"{request_id}-{i}", list(prompt_token_ids), params[i], [])
            logprobs = [[lp, [list(t) for t in top]] for lp, top in out.logprobs] if out.logprobs else None
            state.deliver(TokenEvent(out.token_ids, True, out.finish_reason, logprobs, 0))
            states.append(state)
        return states

    def _generate(self, prompt: list[int], params: list[SamplingParams]):
        with self.lock:
            return self.llm.generate([prompt] * len(params), params)

    async def abort(self, state: RequestState, reason: str = "abort") -> None:
        """Every request has finished by the time the app sees it."""


async def serve(llm: LLM):
    """(the server, its base URL)."""
    app = build_app(EngineRouter(llm), Tokenizer(llm.engine.model_dir), ("tiny",),
                    eos_token_ids=tuple(llm.engine.model_config.eos_token_ids))
    server = await serve_http(app, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.port}"


async def post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


async def post_stream(s: aiohttp.ClientSession, url: str, body: dict) -> list[dict]:
    """The chunks of a streamed answer (the SSE events before [DONE])."""
    chunks = []
    async with s.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(orjson.loads(line[6:]))
    return chunks


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))
