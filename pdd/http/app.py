"""The aiohttp application on the router: OpenAI-compatible endpoints, health, metrics.

Handlers parse (schemas.py), tokenize, hand the request to the router core and
turn its token events into text (TextStream: incremental detokenization and
stop strings) and then into SSE chunks or one JSON body (responses.py).
Whatever way a handler ends — finished, stop string, client gone, error —
`finally` makes sure the router forgets the request and the worker frees its
blocks.

Access (pdd.http.access, applied by pdd.http.middleware): with API keys every
path but `open_paths` needs `Authorization: Bearer KEY` (401 in OpenAI's error shape otherwise); without,
what a web page could send is refused (403, 415). Bodies must arrive within
`http_body_timeout_s` (408); a Content-Length over `router.max_body_bytes` is
answered 413 before any of the body is read. Idle, slow and non-reading
connections and the connection limit are pdd.http.guard's. Large prompts are
tokenized in a child process (pdd.http.tokenize), so one 4 MB prompt does not
stall every stream. Request ids (`X-Request-Id`) and the access line:
pdd.http.request_log.

A completions request may give a list of prompts: each is submitted with its
n choices (prompt i's choice j is choice i * n + j, as OpenAI and vLLM number
them), and the usage sums the prompts. Body fields no parser read are
accepted, logged once per name and listed in the X-Pdd-Ignored-Fields header
(pdd.http.validate.say_ignored). vLLM's utility endpoints (tokenize,
detokenize, tokenizer_info, version, reset_prefix_cache, the model list) are
pdd.http.utility's. /v1/responses (OpenAI's Responses API) is served as the
chat request it is (pdd.http.responses_api).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from contextlib import aclosing
from functools import partial

import orjson
from aiohttp import web

from pdd import security, tracing
from pdd.api import InvalidRequest
from pdd.http.text_stream import TextStream
from pdd.http import responses as r
from pdd.http import schemas as s
from pdd.http import responses_api, stored_responses, structured
from pdd.http.access import ApiKeys, KeylessChecks
from pdd.http.choices import Choice, merged
from pdd.http.choices import usage as choices_usage
from pdd.http.guard import GuardedServer, Guards, serve_guarded
from pdd.http.relay import DirectWriter, Relay
from pdd.http.keys import API_KEYS_KEY, CORS_KEY, GUARDS_KEY, IGNORED_FIELDS_KEY, KEYLESS_KEY, ROUTER_KEY
from pdd.http.middleware import (access_middleware, cors_headers, cors_middleware, error_middleware,
                                 ignored_fields_header)
from pdd.http import request_log
from pdd.http.responses import json_response
from pdd.http.validate import APIError
from pdd.http.tokenize import OffLoopTokenizer
from pdd.http.reasoning import FIELDS as REASONING_FIELDS
from pdd.http.reasoning import ReasoningSplit, reasoning_format, reasoning_tokens
from pdd.http.tools import ToolCallReader, tool_format
from pdd.http.utility import UtilityEndpoints
from pdd.http.validate import say_ignored
from pdd.model.tokenizer import Tokenizer
from pdd.router.requests import RequestError
from pdd.router.router import Router, Unavailable

log = logging.getLogger(__name__)

class OpenAIServer:
    def __init__(self, router: Router, tokenizer: Tokenizer, served_models: str | Sequence[str],
                 eos_token_ids: tuple[int, ...] = ()):
        """served_models: the names a request's "model" may be (the first is the one reported)."""
        self.router = router
        self.tokenizer = tokenizer
        self.served_models = (served_models,) if isinstance(served_models, str) else tuple(served_models)
        self.eos_token_ids = eos_token_ids   # the model's (generation_config.json): they end a request
        self.default_max_tokens = router.cfg.router.default_max_tokens
        self.body_timeout_s = router.cfg.security.http_body_timeout_s
        self.off_loop = OffLoopTokenizer(tokenizer)
        self.tool_format = tool_format(router.cfg.router.tool_call_parser, tokenizer)
        self.reasoning_format = reasoning_format(router.cfg.router.reasoning_parser, tokenizer)
        # Writes single-choice streams' chunks, once per loop turn, or spaced up to
        # router.stream_interval_ms apart as the router's loop gets busy.
        saturation = router.saturation
        self.relay = Relay(router.cfg.router.stream_interval_ms / 1000, lambda: saturation.busy)
        # Stored responses (GET, previous_response_id), their ids naming this router.
        self.response_store = stored_responses.ResponseStore(router=router.cfg.router.index)

    async def read_body(self, request: web.Request) -> bytes:
        """The request body, or 408 when it does not arrive in time (slow or short of its Content-Length)."""
        if request.content_length is not None and request.content_length > request.client_max_size:
            # It would be refused once that much had come: no reason to wait for it.
            raise web.HTTPRequestEntityTooLarge(max_size=request.client_max_size,
                                                actual_size=request.content_length)
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except TimeoutError:
            security.count("http.body_timeout")
            raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g}s",
                           code="request_timeout") from None

    # ------------------------------------------------------------------ endpoints

    def note_ignored(self, request: web.Request, fields: tuple[str, ...]) -> None:
        """The body fields nothing read: logged (once a name) and listed in the response's header."""
        header = say_ignored(fields)
        if header is not None:
            request[IGNORED_FIELDS_KEY] = header

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_body(request)
        req = s.parse_completion_request(body, self.served_models, self.default_max_tokens,
                                         vocab_size=self.tokenizer.vocab_size)
        self.note_ignored(request, req.ignored_fields)
        self._admit(req)
        prompts = []
        for p in req.prompts:
            if p.text is None:
                prompts.append(p.token_ids)
            else:   # one prompt: the body's size; in a list, each its own
                size = len(body) if len(req.prompts) == 1 else len(p.text)
                prompts.append(await self.off_loop.call(size, "encode", p.text))
        return await self._generate(request, req, prompts)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_body(request)
        req = s.parse_chat_request(body, self.served_models, vocab_size=self.tokenizer.vocab_size,
                                   tool_fmt=self.tool_format, reasoning_fmt=self.reasoning_format)
        self.note_ignored(request, req.ignored_fields)
        self._admit(req)
        ids = await self.off_loop.encode_chat(len(body), req.messages, req.template_args)
        return await self._generate(request, req, [ids])

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API, served as the chat request it is (pdd.http.responses_api)."""
        body = await self.read_body(request)
        req, rr = responses_api.parse(body, self.response_store, lambda chat: s.parse_chat_request(
            chat, self.served_models, vocab_size=self.tokenizer.vocab_size, tool_fmt=self.tool_format,
            reasoning_fmt=self.reasoning_format))
        self.note_ignored(request, rr.ignored_fields)
        if not request[request_log.FROM_CLIENT]:   # the request's id is the response's (not a client's: it may repeat)
            rr.id = self.response_store.new_id(request[request_log.REQUEST_ID].removeprefix("resp-"))
        self._admit(req)
        ids = await self.off_loop.encode_chat(len(body), req.messages, req.template_args)
        try:
            return await self._generate(request, req, [ids], partial(responses_api.answer, self, rr))
        except APIError as e:   # the prompt's length, the schema's compilation: in the Responses fields' names
            raise responses_api.renamed(e, rr.sources) from None

    async def stored_response(self, request: web.Request) -> web.Response:
        """GET, DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel (pdd.http.stored_responses)."""
        cfg = self.router.cfg.router
        return await stored_responses.answer(self.response_store, request, cfg.http_ports, cfg.host)

    def _admit(self, req: s.GenerateRequest) -> None:
        """A request that will be submitted is refused (429) before its prompt is
        tokenized when it would be at submission: a burst of large prompts while
        overloaded gets its answers at once, not each after its turn in the
        tokenizer process, which does no work for them."""
        if req.max_tokens_unset or req.sampling.max_tokens:   # max_tokens 0: answered without a worker
            self.router.check_admission()

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: 200 whenever the event loop answers, whatever the workers do
        (a restart would not bring them back). The status says what /ready would."""
        status = "shutting down" if not self.router.accepting else self._readiness()[0]
        return json_response({"status": status, "workers": len(self.router.registry.workers)})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: 200 while a new request would be placed (Router.ready), 503 with why otherwise."""
        status, reason = self._readiness()
        if reason:
            return json_response({"status": status, "reason": reason}, status=503)
        return json_response({"status": status, "workers": len(self.router.registry.workers)})

    def _readiness(self) -> tuple[str, str]:
        """(status, why it cannot serve or "")."""
        router = self.router
        if not router.accepting:
            return "unavailable", "shutting down"
        if router.ready:
            # Overloaded is still ready (a load balancer must not pull it): said, not failed.
            return ("overloaded" if router.overloaded else "ok"), ""
        if not router.registry.workers:
            return "unavailable", "no worker registered"
        return "unavailable", ("no worker can take a request: every worker is drained, draining or hung, or "
                               f"none serves in router.mode = {router.cfg.router.mode}")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.router.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ------------------------------------------------------------------ generation

    def _check_length(self, req: s.GenerateRequest, num_prompt: int, field: str) -> None:
        """field: the prompt's, as errors name it ("messages", "prompt", "prompt[2]" in a list)."""
        max_len = self.router.max_model_len()
        if max_len is None:
            raise Unavailable("no worker is available")
        if num_prompt >= max_len:
            raise APIError(400, f"{field}: the prompt has {num_prompt} tokens but this model's context is "
                                f"{max_len} tokens; shorten the prompt", param=field,
                           code="context_length_exceeded")
        if req.max_tokens_unset:
            req.sampling.max_tokens = max_len - num_prompt
            try:
                req.sampling.validate()
            except InvalidRequest as e:
                raise APIError(400, str(e), param=str(e).split(":", 1)[0]) from None
        elif num_prompt + req.sampling.max_tokens > max_len:
            name = req.max_tokens_param
            raise APIError(400, f"{name}: {num_prompt} prompt tokens ({field}) + {name} {req.sampling.max_tokens} "
                                f"exceed this model's context of {max_len} tokens; lower {name} or shorten "
                                "the prompt", param=name, code="context_length_exceeded")

    def _check_logprobs(self, req: s.GenerateRequest, prompts: list[list[int]]) -> None:
        """An answer that is not streamed is held whole at the router until its
        last choice ends: its logprob entries (every choice's tokens, each with
        its top N) are bounded, as the memory and the work of one request must
        be. A stream keeps none (each goes out with its token)."""
        if req.logprobs is None or req.stream:
            return
        limit = self.router.cfg.router.max_logprob_entries
        per_token = req.logprobs + 1
        echoed = sum(len(ids) for ids in prompts) if req.echo else 0
        entries = (len(prompts) * req.sampling.max_tokens + echoed) * req.n * per_token
        if entries <= limit:
            return
        top = "top_logprobs" if req.kind == "chat" else "logprobs"
        tokens = f"{len(prompts)} prompts x " if len(prompts) > 1 else ""
        raise APIError(400, f"{top}: n {req.n} x {tokens}{req.max_tokens_param} {req.sampling.max_tokens}"
                            f"{' (+ the echoed prompt)' if echoed else ''} x ({top} {req.logprobs} + 1) is "
                            f"{entries} logprob entries, over the {limit} an answer that is not streamed may "
                            f"hold (router.max_logprob_entries); lower n, {req.max_tokens_param} or {top}, "
                            "or stream the answer", param=top)

    async def _generate(self, request: web.Request, req: s.GenerateRequest, prompts: list[list[int]],
                        answer=None):
        """Every prompt's choices (token ids; completions may give several prompts).
        answer: (request, req, groups) -> the response, in place of the
        completions and chat answers (the Responses API's)."""
        if req.truncate_prompt_tokens is not None:
            prompts = [ids[-req.truncate_prompt_tokens:] for ids in prompts]
        for i, ids in enumerate(prompts):   # every prompt checked before any is submitted
            field = "messages" if req.kind == "chat" else "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            self._check_length(req, len(ids), field)
        self._check_logprobs(req, prompts)
        if not request[request_log.FROM_CLIENT]:
            req.request_id = request[request_log.REQUEST_ID]   # the response's "id" is the request's id
        if req.sampling.max_tokens == 0:
            return await self._prompts_only(request, req, prompts)
        if req.sampling.structured_output is not None:   # compiling a large schema takes a while
            await asyncio.get_running_loop().run_in_executor(
                None, structured.check, req.sampling.structured_output, req.structured_param)
        rid = request[request_log.REQUEST_ID]
        span = request[request_log.SPAN] = tracing.incoming(request.headers.get(request_log.TRACEPARENT))
        given = [p.text for p in req.prompts] or [None]
        groups: list[list[Choice]] = []   # per prompt, its n choices
        try:
            for p, ids in enumerate(prompts):
                prompt_rid = rid if len(prompts) == 1 else f"{rid}-{p}"
                states = await self.router.submit_choices(ids, req.sampling, prompt_rid, req.n, span)
                if p == 0:   # the access line reads the first choice (the one that computes the first prompt)
                    request[request_log.STATE], request[request_log.STREAMED] = states[0], req.stream
                groups.append([self._choice(req, ids, given[p], p * req.n + i, state)
                               for i, state in enumerate(states)])
            if answer is not None:
                return await answer(request, req, groups)
            if req.stream:
                return await self._stream(request, req, groups)
            return await self._complete(req, groups)
        finally:
            # The text may be complete before the worker's last event (a stop string,
            # or a stop token seen first): that is a finish, not an abort.
            for c in _flat(groups):
                await self.router.abort(c.state, "stop" if c.text.stopped else "abort")  # no-op once finished

    async def _pieces(self, req: s.GenerateRequest, c: Choice, first: Choice):
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
                pieces += self._take(req, c, first, ev)
                if c.ended:
                    break
            if c.text.stopped:
                # Its answer is complete: its worker stops now, not when the
                # whole response ends (other choices may run on for long).
                await self.router.abort(state, "stop")
            yield pieces

    def _take(self, req: s.GenerateRequest, c: Choice, first: Choice, ev) -> list[tuple]:
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

    def _choice(self, req: s.GenerateRequest, prompt_ids: list[int], given: str | None, index: int,
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

    def _usage(self, req: s.GenerateRequest, groups: list[list[Choice]]) -> dict:
        # The tokens the answer is made of: not those a worker sent after a stop string.
        usage = choices_usage(groups, req.echo_only)
        if req.reasoning is not None:   # a reasoning model's: how many of them it thought (OpenAI's field)
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(
                reasoning_tokens(req.reasoning, c.state.output_token_ids[:c.text.num_tokens], c.text.text,
                                 self.tokenizer) for c in _flat(groups))}
        return usage

    def _merged(self, req: s.GenerateRequest, groups: list[list[Choice]]):
        """(choice index, pieces) of every choice, as they come."""
        return aclosing(merged([self._pieces(req, c, group[0]) for group in groups for c in group]))

    def _prompt_logprobs(self, req: s.GenerateRequest, group: list[Choice]) -> list | None:
        """vLLM's prompt_logprobs field of one prompt, when asked for (its first choice computed them)."""
        state = group[0].state
        if req.prompt_logprobs is None or state.prompt_logprobs is None:
            return None
        return r.prompt_logprobs_json(self.tokenizer, state.prompt_token_ids, state.prompt_logprobs,
                                      req.prompt_logprobs)

    async def _collect(self, req: s.GenerateRequest, groups: list[list[Choice]]) -> None:
        """Every choice's text, to its end (and its finish_reason)."""
        choices = _flat(groups)
        async with self._merged(req, groups) as pieces_of:
            async for i, pieces in pieces_of:
                for _, _, reason in pieces:
                    choices[i].finish_reason = reason or choices[i].finish_reason

    async def _complete(self, req: s.GenerateRequest, groups: list[list[Choice]]) -> web.Response:
        await self._collect(req, groups)
        usage = self._usage(req, groups)
        # Each choice's body is made in a slice of its own, the loop serving
        # others between two (their logprobs are JSON already: LogprobsBuilder).
        body = []
        for group in groups:
            prompt_lps = self._prompt_logprobs(req, group)
            for c in group:
                body.append(orjson.Fragment(orjson.dumps(
                    self._chat_choice(req, c) if req.kind == "chat" else
                    r.completion_choice(c.index, c.full_text, c.finish_reason,
                                        c.logprobs.json() if c.logprobs else None, prompt_lps,
                                        stop_reason=_stop_reason(req, c)))))
                c.logprobs = None   # its JSON is in the body now
                await asyncio.sleep(0)
        return json_response(r.response(req, body, usage, prompt_lps if req.kind == "chat" else None))

    @staticmethod
    def _chat_choice(req: s.GenerateRequest, c: Choice) -> dict:
        """A whole chat answer; with tools, the calls read from its text (pdd.http.tools),
        from its content only when a reasoning model thought first (pdd.http.reasoning)."""
        logprobs = c.logprobs.json() if c.logprobs else None
        text, reasoning = c.text.text, None
        if req.reasoning is not None:
            reasoning, text = ReasoningSplit.split(req.reasoning, text)
            reasoning, text = reasoning or None, text or None
        if req.tool_format is None or text is None:
            return r.chat_choice(c.index, text, c.finish_reason, logprobs, reasoning=reasoning,
                                 thinks=req.reasoning is not None, stop_reason=_stop_reason(req, c))
        content, calls = ToolCallReader.read(req.tool_format, text)
        finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        return r.chat_choice(c.index, content, finish, logprobs, calls, reasoning=reasoning,
                             thinks=req.reasoning is not None, stop_reason=_stop_reason(req, c))

    async def _stream(self, request: web.Request, req: s.GenerateRequest, groups: list[list[Choice]]):
        resp = await _open_stream(request)
        chat = req.kind == "chat"
        choices = _flat(groups)

        def so_far() -> dict | None:   # vLLM's continuous usage: every chunk says the usage so far
            return self._usage(req, groups) if req.continuous_usage else None

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
            stop = _stop_reason(req, choices[i]) if reason else None
            if chat:
                return chunks.chunk(i, {"content": delta} if delta else {}, reason, frag, so_far(), stop)
            return chunks.chunk(i, delta, reason, frag, so_far(), stop)

        def emit(i: int, pieces: list[tuple]) -> bytes:
            if len(pieces) == 1:   # the common case while the router keeps up: one token's
                delta, frag, reason = pieces[0]
                if plain and frag is None and reason is None:
                    return chunks.plain(i, delta) if delta else b""
                return chunk(i, delta, reason, frag) if delta or frag or reason else b""
            return b"".join([chunk(i, delta, reason, frag) for delta, frag, reason in _joined(pieces)
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
                await self._stream_one(req, choices[0], resp, emit)
            else:
                async with self._merged(req, groups) as pieces_of:
                    async for i, pieces in pieces_of:
                        out = emit(i, pieces)
                        if out:
                            await resp.write(out)
        except RequestError as e:
            # Headers are gone: the error travels as an event (documented in the README).
            await resp.write(r.sse(APIError(e.status, str(e), type=e.error_type).body()))
        else:
            if req.include_usage:
                await resp.write(r.sse(r.usage_chunk(req, self._usage(req, groups))))
        return await _end_stream(resp)

    async def _stream_one(self, req: s.GenerateRequest, c: Choice, resp: web.StreamResponse, emit) -> None:
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
                    pieces += self._take(req, c, c, ev)
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
            async with aclosing(self._pieces(req, c, c)) as pieces_of:
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

    async def _prompts_only(self, request: web.Request, req: s.GenerateRequest, prompts: list[list[int]]):
        """max_tokens 0 without echo: nothing to compute, no worker asked; every
        choice empty, ended by the length limit, the usage the prompts'."""
        total = r.usage(sum(len(ids) for ids in prompts), 0, 0)
        indices = range(len(prompts) * req.n)
        lp = None
        if req.logprobs is not None:   # those of no token
            lp = r.LogprobsBuilder(req.kind, self.tokenizer, req.logprobs).result()
        if not req.stream:
            return json_response(r.response(req, [r.completion_choice(i, "", "length", lp) for i in indices], total))
        resp = await _open_stream(request)
        so_far = total if req.continuous_usage else None
        await resp.write(b"".join(r.sse(r.completion_chunk(req, "", "length", lp, so_far, i)) for i in indices))
        if req.include_usage:
            await resp.write(r.sse(r.usage_chunk(req, total)))
        return await _end_stream(resp)


async def _open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _end_stream(resp: web.StreamResponse) -> web.StreamResponse:
    await resp.write(r.SSE_DONE)
    await resp.write_eof()
    return resp


def _stop_reason(req: s.GenerateRequest, c: Choice) -> str | int | None:
    """What ended the choice, as vLLM says it: the stop string it met, or the
    stop token id of the request's stop_token_ids; None for the model's end of
    sequence and for any other end."""
    on = c.text.stopped_on if c.text is not None else None
    return on if isinstance(on, str) or (on is not None and on in req.sampling.stop_token_ids) else None


def _joined(pieces: list[tuple]) -> list[tuple]:
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


def _flat(groups: list[list[Choice]]) -> list[Choice]:
    """The choices of every prompt, in index order."""
    return [c for group in groups for c in group]


def build_app(router: Router, tokenizer: Tokenizer, served_models: str | Sequence[str],
              eos_token_ids: tuple[int, ...] = (), model_root: str | None = None) -> web.Application:
    """served_models: the names requests may give (the first is the one reported);
    model_root: the checkpoint they serve, as /v1/models says it (default: the first name)."""
    sec = router.cfg.security
    app = web.Application(middlewares=[request_log.request_log_middleware, cors_middleware, access_middleware,
                                       error_middleware],
                          client_max_size=router.cfg.router.max_body_bytes)
    app[CORS_KEY] = frozenset(sec.cors_origins)
    app.on_response_prepare.append(cors_headers)
    app.on_response_prepare.append(request_log.add_headers)
    app.on_response_prepare.append(ignored_fields_header)
    server = OpenAIServer(router, tokenizer, served_models, eos_token_ids)
    utility = UtilityEndpoints(router, tokenizer, server.off_loop, server.served_models,
                               model_root or server.served_models[0], server.read_body, server.note_ignored)
    app[ROUTER_KEY] = router
    app[GUARDS_KEY] = Guards(sec.http_max_connections, sec.http_header_timeout_s, sec.http_idle_timeout_s,
                             router.cfg.router.http_send_timeout_s)
    router.saturation.watch(app[GUARDS_KEY].buffered_bytes)
    app[API_KEYS_KEY] = ApiKeys(sec.api_keys, sec.open_paths)
    app[KEYLESS_KEY] = KeylessChecks(not sec.api_keys, router.cfg.router.host, router.cfg.router.allowed_hosts)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_post("/v1/responses", server.responses)
    app.router.add_get("/v1/responses/{response_id}", server.stored_response)
    app.router.add_delete("/v1/responses/{response_id}", server.stored_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", server.stored_response)
    app.router.add_get("/v1/models", utility.models)
    app.router.add_post("/tokenize", utility.tokenize)
    app.router.add_post("/detokenize", utility.detokenize)
    app.router.add_get("/tokenizer_info", utility.tokenizer_info)
    app.router.add_get("/version", utility.version)
    app.router.add_post("/reset_prefix_cache", utility.reset_prefix_cache)
    app.router.add_get("/health", server.health)
    app.router.add_get("/ready", server.ready)
    app.router.add_get("/metrics", server.metrics)

    async def close_tokenizer(_app) -> None:
        server.off_loop.close()
    app.on_cleanup.append(close_tokenizer)
    return app


async def serve_http(app: web.Application, host: str, port: int) -> GuardedServer:
    """Serve `app` on host:port (port 0: any free one, see .port); cleanup() stops it."""
    cfg = app[ROUTER_KEY].cfg
    sec = cfg.security
    # handler_cancellation: a client that disconnects cancels its handler at
    # once, so its request is aborted even while it waits for a token.
    # lingering_time: how long the unread rest of a refused body is drained.
    # aiohttp's own keep-alive timer is only a backstop behind the guard's
    # timers (which answer a slow request with a 408 where aiohttp would not).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=sec.http_idle_timeout_s + sec.http_header_timeout_s,
                           lingering_time=min(2.0, sec.http_body_timeout_s))
    await runner.setup()
    return await serve_guarded(runner, app[GUARDS_KEY], host, port, reuse_port=len(cfg.router.routers) > 1,
                               own_port=cfg.router.own_http_port if port else None)
