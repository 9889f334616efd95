"""The client side of `pdd bench serve`: one streaming request to an
OpenAI-compatible server, timed chunk by chunk into a RequestRecord.

Times are taken on arrival of each SSE line. A content chunk is one whose
text (completions) or delta.content (chat) is not empty: role-only and
finish-only chunks carry no token. Output tokens are the server's
`usage.completion_tokens` when it honours stream_options.include_usage,
else the number of content chunks.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from pdd.bench.workloads import Item

ERROR_CHARS = 500   # an error's text is kept up to this length


@dataclass(frozen=True)
class Target:
    url: str                              # base URL, e.g. http://127.0.0.1:8000
    endpoint: str = "/v1/completions"     # or /v1/chat/completions
    model: str = ""
    api_key: str | None = None

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    item: int                    # index of the workload item
    turn: int                    # 0 unless multi-turn
    prompt_len: int              # nominal; the server's usage.prompt_tokens once it reports it
    max_tokens: int
    start_s: float = 0.0         # when it was sent, seconds after the run began
    success: bool = False
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float | None = None
    output_tokens: int = 0
    usage_reported: bool = False
    text: str = ""               # the answer: the next turn resends it; not written to the JSON

    def to_json(self) -> dict:
        ms = lambda x: None if x is None else round(1e3 * x, 3)  # noqa: E731
        return {"item": self.item, "turn": self.turn, "start_s": round(self.start_s, 6), "success": self.success,
                "error": self.error, "prompt_len": self.prompt_len, "max_tokens": self.max_tokens,
                "output_tokens": self.output_tokens, "usage_reported": self.usage_reported,
                "ttft_ms": ms(self.ttft_s), "e2el_ms": ms(self.e2el_s), "itl_ms": [ms(x) for x in self.itl_s]}


def build_body(target: Target, item: Item, turn: int, answers: list[RequestRecord], ignore_eos: bool,
               ) -> tuple[dict, int]:
    """The request body of `item`'s turn `turn` after the earlier turns' `answers`, and its nominal prompt length."""
    t = item.turns[turn]
    body: dict = {"model": target.model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True   # not OpenAI's; pdd, vLLM and SGLang honour it
    prompt_len = item.prefix_len + t.input_len + sum(item.turns[k].input_len + a.output_tokens
                                                     for k, a in enumerate(answers))
    if target.chat:
        if isinstance(t.content, list) or isinstance(item.prefix, list):
            raise ValueError("chat prompts are text: use --prompt-format text with /v1/chat/completions")
        messages = [{"role": "system", "content": item.prefix}] if item.prefix is not None else []
        for k, a in enumerate(answers):
            messages += [{"role": "user", "content": item.turns[k].content}, {"role": "assistant", "content": a.text}]
        body["messages"] = messages + [{"role": "user", "content": t.content}]
        body["max_completion_tokens"] = t.output_len
    elif isinstance(t.content, list):
        body["prompt"] = list(item.prefix or []) + t.content
        body["max_tokens"] = t.output_len
    else:
        parts = [item.prefix] if item.prefix is not None else []
        for k, a in enumerate(answers):
            parts += [item.turns[k].content, a.text]
        body["prompt"] = "\n".join(parts + [t.content])
        body["max_tokens"] = t.output_len
    return body, prompt_len


async def send(session: aiohttp.ClientSession, target: Target, body: dict, record: RequestRecord,
               t0: float) -> RequestRecord:
    """Send one request and fill `record`; failures end up in record.error, never raised."""
    start = time.perf_counter()
    record.start_s = start - t0
    try:
        async with session.post(target.url + target.endpoint, json=body, headers=target.headers()) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:ERROR_CHARS]}"
                return record
            await _read_stream(resp, record, start, target.chat)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"[:ERROR_CHARS]
    return record


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord, start: float, chat: bool) -> None:
    last, chunks, parts = start, 0, []
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue    # blank separators, comments, other SSE fields
        now = time.perf_counter()
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            # A server that fails after the headers (pdd does) sends the error as an event.
            err = obj["error"]
            record.error = f"error event: {err.get('message', err) if isinstance(err, dict) else err}"[:ERROR_CHARS]
            return
        if obj.get("usage"):
            record.output_tokens = obj["usage"].get("completion_tokens", 0)
            record.prompt_len = obj["usage"].get("prompt_tokens", record.prompt_len)
            record.usage_reported = True
        text = _content(obj, chat)
        if text:
            if record.ttft_s is None:
                record.ttft_s = now - start
            else:
                record.itl_s.append(now - last)
            last, chunks = now, chunks + 1
            parts.append(text)
    else:
        record.error = "the stream ended before 'data: [DONE]'"
        return
    if record.ttft_s is None:
        record.error = "no content in the stream"
        return
    record.e2el_s = now - start
    record.text = "".join(parts)
    if not record.usage_reported:
        record.output_tokens = chunks
    record.success = True


def _content(obj: dict, chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def served_model(session: aiohttp.ClientSession, target: Target) -> str:
    """The first model the server lists at /v1/models (what --model defaults to)."""
    async with session.get(target.url + "/v1/models", headers=target.headers()) as resp:
        if resp.status != 200:
            raise ValueError(f"{target.url}/v1/models: HTTP {resp.status}: {(await resp.text())[:ERROR_CHARS]}")
        data = (await resp.json()).get("data") or []
    if not data:
        raise ValueError(f"{target.url}/v1/models lists no model; pass --model")
    return data[0]["id"]
