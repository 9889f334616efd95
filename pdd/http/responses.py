"""What the HTTP API answers.

OpenAI's /v1/completions and /v1/chat/completions bodies, built as dicts from
the GenerateRequest pdd.http.schemas parsed: the whole response, stream chunks,
choices, usage, and logprobs in each kind's shape (LogprobsBuilder; vLLM's
prompt_logprobs); sse frames a chunk as a server-sent event. Each builder takes
its choice's index (prompt i's choice j: i * n + j). json_response and
error_response: the aiohttp responses of every handler (app, utility endpoints,
guard).
"""
from __future__ import annotations

import math

import orjson
from aiohttp import web

from pdd.http.reasoning import FIELDS as REASONING_FIELDS
from pdd.http.schemas import GenerateRequest
from pdd.http.validate import APIError


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> web.Response:
    return json_response(APIError(status, message, type=type_, param=param, code=code).body(), status)


# ---------------------------------------------------------------- completions and chat

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def _envelope(req: GenerateRequest, obj: str, choices: list[dict]) -> dict:
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
            "choices": choices}


def _stream_envelope(req: GenerateRequest, choice: dict, usage: dict | None) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    out = _envelope(req, obj, [choice])
    if req.include_usage:
        # OpenAI: with include_usage every chunk carries "usage": null except the last
        # (with continuous usage, the usage so far).
        out["usage"] = usage
    return out


def completion_chunk(req: GenerateRequest, text: str, finish_reason: str | None,
                     logprobs: dict | None = None, usage: dict | None = None, index: int = 0,
                     stop_reason: str | int | None = None) -> dict:
    return _stream_envelope(req, completion_choice(index, text, finish_reason, logprobs, stop_reason=stop_reason),
                            usage)


def chat_chunk(req: GenerateRequest, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None, usage: dict | None = None, index: int = 0,
               stop_reason: str | int | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _stream_envelope(req, _ended(choice, stop_reason), usage)


def _ended(choice: dict, stop_reason: str | int | None) -> dict:
    """vLLM's stop_reason beside a finish_reason: the stop string or stop token id
    that ended the choice (None: the end-of-sequence token, or another reason)."""
    if choice["finish_reason"] is not None:
        choice["stop_reason"] = stop_reason
    return choice


class StreamChunks:
    """A stream's chunks as SSE events, made from bytes built once per request:
    the same bytes as sse(completion_chunk(...)) / sse(chat_chunk(...)), without
    a dict per token to build and serialize whole (the envelope, id and model
    escaped once). Only the choice's text or delta, logprobs, finish reason and
    usage are serialized per chunk; a plain token's chunk is three joins."""

    def __init__(self, req: GenerateRequest):
        obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
        envelope = orjson.dumps(_envelope(req, obj, []))   # ...,"choices":[]}
        self._head = b"data: " + envelope[:-2]             # ...,"choices":[
        self._field = b',"text":' if req.kind == "completion" else b',"delta":'
        self._usage = req.include_usage
        usage_null = b',"usage":null' if req.include_usage else b""
        self._plain_tail = b',"logprobs":null,"finish_reason":null}]' + usage_null + b"}\n\n"
        self._heads: dict[int, bytes] = {}
        self._chat = req.kind == "chat"

    def plain(self, index: int, text: str) -> bytes:
        """chunk(index, text) of a completion, chunk(index, {"content": text}) of a chat
        (text not empty): a token's text and nothing else, the common chunk."""
        head = self._heads.get(index)
        if head is None:
            head = self._heads[index] = self._head + b'{"index":' + str(index).encode() + self._field
        if self._chat:
            return head + b'{"content":' + orjson.dumps(text) + b"}" + self._plain_tail
        return head + orjson.dumps(text) + self._plain_tail

    def chunk(self, index: int, content, finish_reason: str | None = None, logprobs: dict | None = None,
              usage: dict | None = None, stop_reason: str | int | None = None) -> bytes:
        """content: the choice's text (completions) or delta (chat)."""
        head = self._heads.get(index)
        if head is None:
            head = self._heads[index] = self._head + b'{"index":' + str(index).encode() + self._field
        if finish_reason is None and logprobs is None and usage is None:
            return head + orjson.dumps(content) + self._plain_tail
        tail = b',"usage":' + orjson.dumps(usage) if self._usage else b""
        ended = b',"stop_reason":' + orjson.dumps(stop_reason) if finish_reason is not None else b""
        return (head + orjson.dumps(content) + b',"logprobs":' + orjson.dumps(logprobs) + b',"finish_reason":'
                + orjson.dumps(finish_reason) + ended + b"}]" + tail + b"}\n\n")


def usage_chunk(req: GenerateRequest, usage: dict) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {**_envelope(req, obj, []), "usage": usage}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                      prompt_logprobs: list | None = None, stop_reason: str | int | None = None) -> dict:
    """prompt_logprobs: vLLM's, in its shape (prompt_logprobs_json), when asked for."""
    choice = _ended({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason},
                    stop_reason)
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None, *, reasoning: str | None = None,
                thinks: bool = False, stop_reason: str | int | None = None) -> dict:
    """thinks: a reasoning model's answer, whose message says its reasoning (None:
    none), under each name clients read (pdd.http.reasoning.FIELDS)."""
    message = {"role": "assistant", "content": text}
    if thinks:
        for name in REASONING_FIELDS:
            message[name] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return _ended({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason},
                  stop_reason)


def response(req: GenerateRequest, choices: list[dict], usage: dict, prompt_logprobs: list | None = None) -> dict:
    """The whole (non-streamed) answer: its choices in index order. Chat carries
    vLLM's prompt_logprobs beside them, completions in each choice."""
    out = {**_envelope(req, "chat.completion" if req.kind == "chat" else "text_completion", choices),
           "usage": usage}
    if req.kind == "chat" and prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    return out


def completion_response(req: GenerateRequest, text: str, finish_reason: str, usage: dict,
                        logprobs: dict | None) -> dict:
    return response(req, [completion_choice(0, text, finish_reason, logprobs)], usage)


def chat_response(req: GenerateRequest, text: str | None, finish_reason: str, usage: dict,
                  logprobs: dict | None, tool_calls: list[dict] | None = None) -> dict:
    return response(req, [chat_choice(0, text, finish_reason, logprobs, tool_calls)], usage)


def prompt_logprobs_json(tokenizer, prompt_ids: list[int], entries: list, num_top: int) -> list:
    """vLLM's prompt_logprobs: null for the first prompt token, then per token
    {token id (a string, as JSON keys are): {"logprob", "rank", "decoded_token"}}
    for the token itself and the top num_top. entries: the engine's
    (logprob, rank, [(token id, logprob), ...]) per prompt token but the first."""
    def one(tid: int, lp: float, rank: int) -> dict:
        return {"logprob": _finite(lp), "rank": rank,
                "decoded_token": tokenizer.decode([tid], skip_special_tokens=False)}
    out: list = [None]
    for tid, (lp, rank, top) in zip(prompt_ids[1:], entries):
        position = {str(tid): one(tid, lp, rank)}
        for k, (t, tlp) in enumerate(top[:num_top]):
            position.setdefault(str(t), one(t, tlp, k + 1))
        out.append(position)
    return out


class LogprobsBuilder:
    """Accumulates per-token logprobs into the OpenAI shape for the request kind.

    completions: {"tokens", "token_logprobs", "top_logprobs": [{token: lp}], "text_offset"};
      as OpenAI, a top dict also holds the sampled token, so it has up to num_top + 1 entries.
    chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.

    keep: accumulate for a whole answer (json, result). A stream sends each
    fragment as it is made and keeps none: its router memory stays flat
    however long it runs. What is kept is each token's entry as JSON, made
    with the token (so the work is spread over the answer, between its events,
    not done at its end) and about a fifth of the size of the same dicts.
    """

    def __init__(self, kind: str, tokenizer, num_top: int, prev_token: int | None = None, keep: bool = True,
                 tokens_as_ids: bool = False):
        """prev_token: the prompt's last token, the context of the first token's text.
        tokens_as_ids: each token named "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
        self.tokens_as_ids = tokens_as_ids
        if kind not in ("completion", "chat"):
            raise ValueError(f"kind must be 'completion' or 'chat', got {kind!r}")
        self.kind = kind
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.keep = keep
        self._follow(prev_token)
        # chat: "content" (entries as JSON); completions: the columns, "top_logprobs" as JSON.
        self._acc: dict[str, list] = self._empty()

    def _follow(self, token_id: int | None) -> None:
        """The token the next one's text is decoded after (decoded once, not per alternative)."""
        self.prev = token_id
        self.prev_text = None if token_id is None else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _empty(self) -> dict:
        if self.kind == "chat":
            return {"content": []}
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _token(self, token_id: int) -> str:
        """The text the token adds after the one before it. Decoded alone, a
        SentencePiece token loses its leading space ("▁Paris" -> "Paris").
        Special tokens too: the sampled token is reported whether or not it is shown."""
        decode, before = self.tokenizer.decode, self.prev_text
        if before is not None and not before.endswith("\ufffd"):
            both = decode([self.prev, token_id], skip_special_tokens=False)
            if both.startswith(before):
                return both[len(before):]
        return decode([token_id], skip_special_tokens=False)

    def _name(self, token_id: int, text: str | None = None) -> str:
        """How the logprobs name a token: its text (`text` when known), or its id."""
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._token(token_id) if text is None else text

    def _keep(self, frag: dict) -> None:
        if not self.keep:
            return
        for key, values in frag.items():
            if key in ("content", "top_logprobs"):   # the large part, kept as JSON
                values = [orjson.dumps(v) for v in values]
            self._acc[key].extend(values)

    def add_prompt(self, prompt_ids: list[int], entries: list | None) -> dict:
        """Completions with echo: the prompt's tokens, before any generated one.
        The first has no logprob (null, as OpenAI); the others the engine's
        prompt logprobs (entries: (logprob, rank, top) per token but the first).
        Offsets count from the start of the prompt's text. Returns the fragment
        (also accumulated)."""
        frag, offset = self._empty(), 0
        self._follow(None)
        for i, tid in enumerate(prompt_ids):
            text = self._token(tid)
            if i == 0 or entries is None or i > len(entries):
                entry = {"tokens": [self._name(tid, text)], "token_logprobs": [None], "top_logprobs": [None],
                         "text_offset": [offset]}
            else:
                lp, _, top = entries[i - 1]
                entry = self._completion_entry(tid, lp, top[:self.num_top], offset)
            for key, values in entry.items():
                frag[key].extend(values)
            offset += len(text)
            self._follow(tid)
        self._keep(frag)
        return frag

    def add(self, token_id: int, logprob: float, top: list[tuple[int, float]],
            text_offset: int) -> dict:
        """The fragment for one token (for a stream chunk); it is also accumulated."""
        top = top[:self.num_top]
        if self.kind == "chat":
            frag = {"content": [self._chat_entry(token_id, logprob, top)]}
        else:
            frag = self._completion_entry(token_id, logprob, top, text_offset)
        self._keep(frag)
        self._follow(token_id)
        return frag

    def _chat_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        def one(tid: int, lp: float) -> dict:
            tok = self._token(tid)
            return {"token": self._name(tid, tok), "logprob": _finite(lp), "bytes": self._bytes(tid, tok)}
        return {**one(token_id, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}

    def _bytes(self, token_id: int, text: str) -> list[int]:
        """A chat entry's "bytes": the token's own where the vocabulary says
        them, so that a client joining them rebuilds a character split over
        tokens (what OpenAI gives them for: the text of each piece is U+FFFD);
        else its text's."""
        raw = self.tokenizer.token_bytes(token_id)
        return list(raw if raw is not None else text.encode("utf-8"))

    def _completion_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]],
                          text_offset: int) -> dict:
        tok = self._name(token_id)
        top_dict: dict[str, float] = {}
        for t, lp in top:
            # Distinct ids can decode to the same string; keep the likelier (first).
            top_dict.setdefault(self._name(t), _finite(lp))
        top_dict.setdefault(tok, _finite(logprob))
        return {"tokens": [tok], "token_logprobs": [_finite(logprob)],
                "top_logprobs": [top_dict], "text_offset": [text_offset]}

    def json(self) -> orjson.Fragment:
        """The whole answer's logprobs as JSON, for orjson.dumps to write as they are."""
        if not self.keep:
            raise RuntimeError("LogprobsBuilder(keep=False) keeps no logprobs to answer with")
        out = {key: orjson.Fragment(b"[" + b",".join(values) + b"]") if key in ("content", "top_logprobs")
               else values for key, values in self._acc.items()}
        return orjson.Fragment(orjson.dumps(out))

    def result(self) -> dict:
        """The whole answer's logprobs as objects (a copy: later adds do not change it)."""
        return orjson.loads(orjson.dumps(self.json()))


def _finite(lp: float) -> float:
    # JSON has no -inf (orjson writes null, which clients reject as a float);
    # vLLM clamps the same way.
    lp = float(lp)
    return max(lp, -9999.0) if not math.isnan(lp) else -9999.0


# ---------------------------------------------------------------- server-sent events

def sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
