"""A generate request's choices, from the router's token events to the client's
answer: each choice's text (TextStream: incremental detokenization and stop
strings), logprobs and finish reason as pieces, then SSE chunks (a
single-choice stream written by the relay, pdd.http.relay) or one JSON body
(pdd.http.responses). The Responses API streams a chat choice through the same
pieces (pdd.http.responses_api).
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing

import orjson
from aiohttp import web

from pdd.http import responses as r
from pdd.http import schemas as s
from pdd.http.choices import Choice, merged
from pdd.http.choices import usage as choices_usage
from pdd.http.reasoning import FIELDS as REASONING_FIELDS
from pdd.http.reasoning import ReasoningSplit, reasoning_tokens
from pdd.http.relay import DirectWriter, Relay
from pdd.http.responses import json_response
from pdd.http.text_stream import TextStream
from pdd.http.tools import ToolCallReader
from pdd.http.validate import APIError
from pdd.model.tokenizer import Tokenizer
from pdd.router.requests import RequestError
from pdd.router.router import Router


class Answers:
    def __init__(self, router: Router, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], relay: Relay):
        """eos_token_ids: the model's (generation_config.json): they end a request."""
        self.router = router
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.relay = relay

    async def pieces(self, req: s.GenerateRequest, c: Choice, first: Choice):
        """Lists of (text delta, logprobs fragment, finish_reason), one per token,
        a list for whatever arrived since the last one; the last piece finishes.
        With echo the prompt comes first, as one piece (its logprobs are the
        first choice's: only it computes them). Raises RequestError when the
        request fails (after the pieces before it). The relay (_stream_one) may
        have taken some of the events, and ended the choice."""
        state = c.state
        while not c.ended:
            pieces = []
            for ev in await state.take_events():
                if isinstance(ev, RequestError):
                    if pieces:
                        yield pieces
                    raise ev
                pieces += self.take(req, c, first, ev)
                if c.ended:
                    break
            if c.text.stopped:
                # Its answer is complete: its worker stops now, not when the
                # whole response ends (other choices may run on for long).
                await self.router.abort(state, "stop")
            yield pieces

    def take(self, req: s.GenerateRequest, c: Choice, first: Choice, ev) -> list[tuple]:
        """The pieces of one token event of choice `c`; c.ended once it ends it."""
        text, lp = c.text, c.logprobs
        pieces = []
        if c.echo_text is not None and not c.echoed:
            c.echoed = True
            frag = lp.add_prompt(c.state.prompt_token_ids, first.state.prompt_logprobs) if lp else None
            pieces.append((c.echo_text, frag, None))
        if req.echo_only:   # its one token is not shown
            if ev.finished:
                pieces.append(("", None, "length"))
                c.ended = True
            return pieces
        if lp is None and len(ev.token_ids) == 1:   # the common case: one token, no logprobs
            delta = text.add(ev.token_ids)
            if text.stopped:
                c.ended = True
                pieces.append((delta, None, "stop"))
                return pieces
            pieces.append((delta, None, None))
        else:
            lps = ev.logprobs or [None] * len(ev.token_ids)
            for tok, tok_lp in zip(ev.token_ids, lps):
                offset = c.echo_chars + text.generated_chars
                delta = text.add([tok])
                frag = lp.add(tok, tok_lp[0], tok_lp[1], offset) if lp is not None and tok_lp else None
                if text.stopped:
                    c.ended = True
                    pieces.append((delta, frag, "stop"))
                    return pieces
                pieces.append((delta, frag, None))
        if ev.finished:
            last = text.finish()   # may complete a stop string the held-back text began
            pieces.append((last, None, "stop" if text.stopped else ev.finish_reason))
            c.ended = True
        return pieces

    def choice(self, req: s.GenerateRequest, prompt_ids: list[int], given: str | None, index: int,
                state) -> Choice:
        """given: the prompt's text as the request gave it (None: given as token ids, or chat)."""
        sp = req.sampling
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
        text = TextStream(self.tokenizer, sp.stop, req.skip_special_tokens, prompt_ids=prompt_ids,
                          stop_token_ids=stop_ids, min_tokens=sp.min_tokens,
                          include_stop_str=req.include_stop_str_in_output)
        lp = None
        if req.logprobs is not None:
            lp = r.LogprobsBuilder(req.kind, self.tokenizer, req.logprobs, prompt_ids[-1], keep=not req.stream,
                                   tokens_as_ids=req.tokens_as_ids)
        echo = None
        if req.echo:   # the prompt as given, or as the model saw it when given as ids or cut
            # Its ids decoded as they are, special tokens too (as vLLM): the text
            # says what `tokens` and `text_offset` of its logprobs say.
            as_given = given is not None and req.truncate_prompt_tokens is None
            echo = given if as_given else self.tokenizer.decode(prompt_ids, False)
        return Choice(index, state, text, lp, echo)

    def usage(self, req: s.GenerateRequest, groups: list[list[Choice]], final: bool = True) -> dict:
        """final: the answer's whole usage; False: a chunk's usage so far (continuous
        usage), without the reasoning count, which reads the whole text again."""
        # The tokens the answer is made of: not those a worker sent after a stop string.
        usage = choices_usage(groups, req.echo_only)
        if final and req.reasoning is not None:   # a reasoning model's: how many of them it thought (OpenAI's field)
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(
                reasoning_tokens(req.reasoning, c.state.output_token_ids[:c.text.num_tokens], c.text.text,
                                 self.tokenizer) for c in flat(groups))}
        return usage

    def merged(self, req: s.GenerateRequest, groups: list[list[Choice]]):
        """(choice index, pieces) of every choice, as they come."""
        return aclosing(merged([self.pieces(req, c, group[0]) for group in groups for c in group]))

    def prompt_logprobs(self, req: s.GenerateRequest, group: list[Choice]) -> list | None:
        """vLLM's prompt_logprobs field of one prompt, when asked for (its first choice computed them)."""
        state = group[0].state
        if req.prompt_logprobs is None or state.prompt_logprobs is None:
            return None
        return r.prompt_logprobs_json(self.tokenizer, state.prompt_token_ids, state.prompt_logprobs,
                                      req.prompt_logprobs)

    async def collect(self, req: s.GenerateRequest, groups: list[list[Choice]]) -> None:
        """Every choice's text, to its end (and its finish_reason)."""
        choices = flat(groups)
        async with self.merged(req, groups) as pieces_of:
            async for i, pieces in pieces_of:
                for _, _, reason in pieces:
                    choices[i].finish_reason = reason or choices[i].finish_reason

    async def complete(self, req: s.GenerateRequest, groups: list[list[Choice]]) -> web.Response:
        await self.collect(req, groups)
        usage = self.usage(req, groups)
        # Each choice's body is made in a slice of its own, the loop serving
        # others between two (their logprobs are JSON already: LogprobsBuilder).
        body = []
        for group in groups:
            prompt_lps = self.prompt_logprobs(req, group)
            for c in group:
                body.append(orjson.Fragment(orjson.dumps(
                    self.chat_choice(req, c) if req.kind == "chat" else
                    r.completion_choice(c.index, c.full_text, c.finish_reason,
                                        c.logprobs.json() if c.logprobs else None, prompt_lps,
                                        stop_reason=stop_reason(req, c)))))
                c.logprobs = None   # its JSON is in the body now
                await asyncio.sleep(0)
        return json_response(r.response(req, body, usage, prompt_lps if req.kind == "chat" else None))

    @staticmethod
    def chat_choice(req: s.GenerateRequest, c: Choice) -> dict:
        """A whole chat answer; with tools, the calls read from its text (pdd.http.tools),
        from its content only when a reasoning model thought first (pdd.http.reasoning)."""
        logprobs = c.logprobs.json() if c.logprobs else None
        text, reasoning = c.text.text, None
        if req.reasoning is not None:
            reasoning, text = ReasoningSplit.split(req.reasoning, text)
            reasoning, text = reasoning or None, text or None
        if req.tool_format is None or text is None:
            return r.chat_choice(c.index, text, c.finish_reason, logprobs, reasoning=reasoning,
                                 thinks=req.reasoning is not None, stop_reason=stop_reason(req, c))
        content, calls = ToolCallReader.read(req.tool_format, text)
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        return r.chat_choice(c.index, content, finish, logprobs, calls, reasoning=reasoning,
                             thinks=req.reasoning is not None, stop_reason=stop_reason(req, c))

    async def stream(self, request: web.Request, req: s.GenerateRequest, groups: list[list[Choice]]):
        resp = await open_stream(request)
        chat = req.kind == "chat"
        choices = flat(groups)

        def so_far() -> dict | None:   # vLLM's continuous usage: every chunk says the usage so far
            return self.usage(req, groups, final=False) if req.continuous_usage else None

        chunks = r.StreamChunks(req)

        def thought_chunk(i: int, delta: str, reason, frag=None) -> bytes:
            """A reasoning model's: its reasoning part goes out as such, the rest as the answer."""
            thought, delta = thinking[i].feed_last(delta, bool(reason))
            if not thought:   # (all of it may be held back: a tag may begin)
                return answer_chunk(i, delta, reason, frag) if delta or reason or frag else b""
            out = chunks.chunk(i, dict.fromkeys(REASONING_FIELDS, thought), None, frag, so_far())
            return out + answer_chunk(i, delta, reason) if delta or reason else out

        def answer_chunk(i: int, delta: str, reason, frag=None) -> bytes:
            reader = tool_calls.get(i)
            if reader is not None:   # the text goes through the tool-call reader
                deltas = reader.feed(delta) + (reader.finish() if reason else [])
                reason = "tool_calls" if reason == "stop" and reader.ids else reason
                out = [chunks.chunk(i, d, None, frag if k == 0 else None, so_far()) for k, d in enumerate(deltas)]
                if reason or (frag and not deltas):
                    out.append(chunks.chunk(i, {}, reason, None if deltas else frag, so_far()))
                return b"".join(out)
            stop = stop_reason(req, choices[i]) if reason else None
            if chat:
                return chunks.chunk(i, {"content": delta} if delta else {}, reason, frag, so_far(), stop)
            return chunks.chunk(i, delta, reason, frag, so_far(), stop)

        def emit(i: int, pieces: list[tuple]) -> bytes:
            if len(pieces) == 1:   # the common case while the router keeps up: one token's
                delta, frag, reason = pieces[0]
                if plain and frag is None and reason is None:
                    return chunks.plain(i, delta) if delta else b""
                return chunk(i, delta, reason, frag) if delta or frag or reason else b""
            if plain and all([frag is None and reason is None for _, frag, reason in pieces]):
                text = "".join([delta for delta, _, _ in pieces])   # the steps' tokens since the last write
                return chunks.plain(i, text) if text else b""
            return b"".join([chunk(i, delta, reason, frag) for delta, frag, reason in joined(pieces)
                             if delta or frag or reason])

        # Each choice's text goes through its own tool-call reader (chat with tools).
        tool_calls = {c.index: ToolCallReader(req.tool_format) for c in choices} if req.tool_format is not None else {}
        # ... and, before it, through its reasoning split (a reasoning model's chat).
        thinking = {c.index: ReasoningSplit(req.reasoning) for c in choices} if req.reasoning is not None else {}
        chunk = thought_chunk if thinking else answer_chunk
        plain = not thinking and not tool_calls and not req.continuous_usage   # (emit's) a token's text is its chunk

        if chat:
            await resp.write(b"".join(chunks.chunk(c.index, {"role": "assistant", "content": ""}, usage=so_far())
                                      for c in choices))
        try:
            if len(choices) == 1:
                await self.stream_one(req, choices[0], resp, emit)
            else:
                async with self.merged(req, groups) as pieces_of:
                    async for i, pieces in pieces_of:
                        out = emit(i, pieces)
                        if out:
                            await resp.write(out)
        except RequestError as e:
            # Headers are gone: the error travels as an event (documented in the README).
            last = r.sse(APIError(e.status, str(e), type=e.error_type).body())
        else:
            last = r.sse(r.usage_chunk(req, self.usage(req, groups))) if req.include_usage else b""
        return await end_stream(resp, last)

    async def stream_one(self, req: s.GenerateRequest, c: Choice, resp: web.StreamResponse, emit) -> None:
        """One choice's stream. While its client keeps up, the relay writes each
        step's chunk of it (pdd.http.relay: no wake-up of this handler, no
        awaited write per token); the handler wakes for the end, an error, and
        what the relay left (the client fell behind: it goes out here, with
        aiohttp's drain)."""
        state, direct, failed, live = c.state, DirectWriter(resp), [], True

        def flush() -> None:   # the relay's, once per loop iteration with events
            if not live or not state.events:   # (the handler took them meanwhile)
                return
            if c.ended or isinstance(state.events[-1], RequestError) or not direct.can_write():
                state.nudge()   # the handler deals with these
                return
            try:
                pieces = []
                for ev in state.take_now():
                    pieces += self.take(req, c, c, ev)
                    if c.ended:
                        break
                out = emit(c.index, pieces)
                if out:
                    direct.write(out)
            except Exception as e:   # noqa: BLE001 -- raised in the handler, as if it had happened there
                failed.append(e)
                c.ended = True
            if c.ended:
                state.nudge()   # the handler ends the stream

        if direct.usable:
            state.listener = self.relay.listener(flush)
        try:
            async with aclosing(self.pieces(req, c, c)) as pieces_of:
                async for pieces in pieces_of:
                    if failed:
                        raise failed[0]
                    out = emit(c.index, pieces)
                    if out:
                        direct.busy = True   # what comes meanwhile waits for these bytes
                        try:
                            await resp.write(out)
                        finally:
                            direct.busy = False
        finally:
            live, state.listener = False, None


async def open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def end_stream(resp: web.StreamResponse, last: bytes = b"") -> web.StreamResponse:
    """`last` (the usage chunk, an error event), [DONE] and the end of the body in one
    write: a system call a request fewer than writing each (on 16-token answers the
    two writes of the end were 11% of the router's samples; docs/benchmarks.md)."""
    await resp.write_eof(last + r.SSE_DONE)
    return resp


def stop_reason(req: s.GenerateRequest, c: Choice) -> str | int | None:
    """What ended the choice, as vLLM says it: the stop string it met, or the
    stop token id of the request's stop_token_ids; None for the model's end of
    sequence and for any other end."""
    on = c.text.stopped_on if c.text is not None else None
    return on if isinstance(on, str) or (on is not None and on in req.sampling.stop_token_ids) else None


def joined(pieces: list[tuple]) -> list[tuple]:
    """Several tokens' pieces as few chunks: the text of those without logprobs
    goes out as one delta (with the finish reason of the last, when it ends
    the choice), as vLLM streams the tokens of one engine iteration. A token
    with its logprobs keeps a chunk of its own: its text is what they describe."""
    out, text = [], []
    for delta, frag, reason in pieces:
        if frag is not None:
            if text:
                out.append(("".join(text), None, None))
                text = []
            out.append((delta, frag, reason))
        elif reason is not None:
            text.append(delta)
            out.append(("".join(text), None, reason))
            text = []
        else:
            text.append(delta)
    if text:
        out.append(("".join(text), None, None))
    return out


def flat(groups: list[list[Choice]]) -> list[Choice]:
    """The choices of every prompt, in index order."""
    return [c for group in groups for c in group]
