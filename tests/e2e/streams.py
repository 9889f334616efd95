"""Streaming completions against a test cluster: text, finish reason and error events per stream."""
from __future__ import annotations

import asyncio
import json

import aiohttp

from pdd import SamplingParams


async def stream_text(session, cluster, prompt, sp: SamplingParams, started: asyncio.Event | None = None):
    """(text, finish reason, error events) of one streamed completion."""
    body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": sp.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, reason, errors = [], None, []
    async with session.post(cluster.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            text.append(chunk["choices"][0]["text"])
            reason = chunk["choices"][0]["finish_reason"] or reason
            if started is not None:
                started.set()
    return "".join(text), reason, errors


def stream_all(cluster, prompts, params, while_running=None, once_started: int | None = None):
    """Stream every prompt at once; `while_running()` runs (in a thread) once all
    (or the first `once_started`) have a token."""
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            started = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(stream_text(session, cluster, p, sp, ev))
                     for p, sp, ev in zip(prompts, params, started)]
            if while_running is not None:
                need = len(prompts) if once_started is None else once_started
                waits = [asyncio.create_task(ev.wait()) for ev in started]
                while sum(w.done() for w in waits) < need:
                    await asyncio.wait([w for w in waits if not w.done()], return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                await asyncio.get_running_loop().run_in_executor(None, while_running)
            return await asyncio.gather(*tasks)
    return asyncio.run(main())
