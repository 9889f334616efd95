"""The aiohttp application on the router: OpenAI-compatible endpoints, health, metrics.

Handlers parse (schemas.py), tokenize, hand the request to the router core,
and pdd.http.answers turns its token events into the client's answer: text
(TextStream: incremental detokenization and stop strings), then SSE chunks or
one JSON body (responses.py).
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
from functools import partial

from aiohttp import web

from pdd import security, tracing
from pdd.api import InvalidRequest
from pdd.http import responses as r
from pdd.http import schemas as s
from pdd.http import responses_api, stored_responses, structured
from pdd.http.access import ApiKeys, KeylessChecks
from pdd.http.choices import Choice
from pdd.http.guard import GuardedServer, Guards, serve_guarded
from pdd.http.answers import Answers, end_stream, flat, open_stream
from pdd.http.relay import Relay
from pdd.http.keys import API_KEYS_KEY, CORS_KEY, GUARDS_KEY, IGNORED_FIELDS_KEY, KEYLESS_KEY, ROUTER_KEY
from pdd.http.middleware import (access_middleware, cors_headers, cors_middleware, error_middleware,
                                 ignored_fields_header)
from pdd.http import request_log
from pdd.http.responses import json_response
from pdd.http.validate import APIError
from pdd.http.tokenize import OffLoopTokenizer
from pdd.http.reasoning import reasoning_format
from pdd.http.tools import tool_format
from pdd.http.utility import UtilityEndpoints
from pdd.http.validate import say_ignored
from pdd.model.tokenizer import Tokenizer
from pdd.router.router import Router, Unavailable

log = logging.getLogger(__name__)

class OpenAIServer:
    def __init__(self, router: Router, tokenizer: Tokenizer, served_models: str | Sequence[str],
                 eos_token_ids: tuple[int, ...] = ()):
        """served_models: the names a request's "model" may be (the first is the one reported)."""
        self.router = router
        self.tokenizer = tokenizer
        self.served_models = (served_models,) if isinstance(served_models, str) else tuple(served_models)
        self.default_max_tokens = router.cfg.router.default_max_tokens
        self.body_timeout_s = router.cfg.security.http_body_timeout_s
        self.off_loop = OffLoopTokenizer(tokenizer)
        self.tool_format = tool_format(router.cfg.router.tool_call_parser, tokenizer)
        self.reasoning_format = reasoning_format(router.cfg.router.reasoning_parser, tokenizer)
        # The relay writes single-choice streams' chunks, once per loop turn, or
        # spaced up to router.stream_interval_ms apart as the router's loop gets busy.
        saturation = router.saturation
        self.answers = Answers(router, tokenizer, eos_token_ids,
                               Relay(router.cfg.router.stream_interval_ms / 1000, lambda: saturation.busy))
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

    async def read_generation_body(self, request: web.Request) -> bytes:
        """read_body for a request that would generate: refused first (429) while the
        router itself is saturated, before its body is read (see _admit)."""
        self.router.saturation.check()
        return await self.read_body(request)

    # ------------------------------------------------------------------ endpoints

    def note_ignored(self, request: web.Request, fields: tuple[str, ...]) -> None:
        """The body fields nothing read: logged (once a name) and listed in the response's header."""
        header = say_ignored(fields)
        if header is not None:
            request[IGNORED_FIELDS_KEY] = header

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_generation_body(request)
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
        body = await self.read_generation_body(request)
        req = s.parse_chat_request(body, self.served_models, vocab_size=self.tokenizer.vocab_size,
                                   tool_fmt=self.tool_format, reasoning_fmt=self.reasoning_format)
        self.note_ignored(request, req.ignored_fields)
        self._admit(req)
        ids = await self.off_loop.encode_chat(len(body), req.messages, req.template_args)
        return await self._generate(request, req, [ids])

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API, served as the chat request it is (pdd.http.responses_api)."""
        body = await self.read_generation_body(request)
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
        tokenizer process, which does no work for them. The router's own
        saturation (pdd.router.saturation) is asked even before the body is
        read: past saturation most arrivals are refused, and a
        refusal that first reads, parses and validates its body takes the CPU
        the streams in flight need (a request with max_tokens 0, which would
        ask no worker, is refused with the rest: not worth a parse to tell)."""
        if req.max_tokens_unset or req.sampling.max_tokens:   # max_tokens 0: answered without a worker
            self.router.check_admission(max(1, len(req.prompts)) * req.n)

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
                groups.append([self.answers.choice(req, ids, given[p], p * req.n + i, state)
                               for i, state in enumerate(states)])
            if answer is not None:
                return await answer(request, req, groups)
            if req.stream:
                return await self.answers.stream(request, req, groups)
            return await self.answers.complete(req, groups)
        finally:
            # The text may be complete before the worker's last event (a stop string,
            # or a stop token seen first): that is a finish, not an abort.
            for c in flat(groups):
                await self.router.abort(c.state, "stop" if c.text.stopped else "abort")  # no-op once finished

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
        resp = await open_stream(request)
        so_far = total if req.continuous_usage else None
        await resp.write(b"".join(r.sse(r.completion_chunk(req, "", "length", lp, so_far, i)) for i in indices))
        return await end_stream(resp, r.sse(r.usage_chunk(req, total)) if req.include_usage else b"")


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
