"""Each HTTP request's id, and its access line.

The id: the client's `X-Request-Id` when it is a sane token (1-128 of
A-Z a-z 0-9 _ . : -), else one made here (`cmpl-<hex>`, `chatcmpl-<hex>`, `req-<hex>`;
an unusable header is replaced, not refused). It is the request's id in the
router, in every control message to the workers, in every log line while the
request is handled (pdd.logs.request_context) and in its trace; every
response carries it back in `X-Request-Id`, errors and streams included. Two
requests in flight with the same id: the router suffixes the later one's
(`ID#2`, pdd.router.inflight) in logs and traces; its response still says `ID`.

The access line: one per request at INFO on logger `pdd.access` (GET /health
and /metrics at DEBUG: probes), written when the handler is done, however it
ended — method, path, status, duration, client address and, for a generation,
mode, prefill/decode workers, tokens in/out, cached tokens, TTFT, finish reason,
fallbacks and migrations; its trace id when traced.

Tracing (pdd.tracing, when tracing.otlp_endpoint is set): a generation's root
span continues the client's W3C `traceparent` (else starts a trace), and its
response says where with a `traceparent` of its own (the router's root span).
"""
from __future__ import annotations

import logging
import re
import time
import uuid

from aiohttp import web
from yarl import URL

from pdd.logs import ACCESS_LOGGER, request_context
from pdd.router.traces import Timeline

log = logging.getLogger(ACCESS_LOGGER)

HEADER = "X-Request-Id"
TRACEPARENT = "traceparent"
SERVER_NAME = "pdd"   # the Server header: no version for a scanner to match
MAX_ID_CHARS = 128
_SANE_ID = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_ID_CHARS}}}")
_PREFIXES = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl", "/v1/responses": "resp"}
_PROBES = ("/health", "/ready", "/metrics")

# Keys on the aiohttp request (typed where aiohttp has them, 3.12 on; plain names before).
_key = getattr(web, "RequestKey", lambda name, _type: name)
REQUEST_ID = _key("pdd_request_id", str)      # the id the response carries (the client's, or made here)
FROM_CLIENT = _key("pdd_id_from_client", bool)
STATE = _key("pdd_request_state", object)     # a generation's RequestState, once submitted
SPAN = _key("pdd_span", object)               # a generation's root SpanContext, when traced
STREAMED = _key("pdd_streamed", bool)
PREPARED_STATUS = _key("pdd_prepared_status", int)   # the status its headers went out with


def client_request_id(value: str | None) -> str | None:
    """`value` if it is a usable request id, else None."""
    return value if value is not None and _SANE_ID.fullmatch(value) else None


def logged_path(request: web.Request) -> str:
    """The request's path as a log line may hold it: a decoded path can carry a
    newline (`%0A`), with which anyone could append a forged line (an audit
    record, say) to the log; one that is not all printable is logged percent-encoded."""
    path = request.path
    return path if path.isprintable() else URL.build(path=path).raw_path


def new_request_id(path: str) -> str:
    return f"{_PREFIXES.get(path, 'req')}-{uuid.uuid4().hex}"


@web.middleware
async def request_log_middleware(request: web.Request, handler):
    """The outermost middleware: gives the request its id (and every line logged
    while it is handled), and writes its access line when it is done."""
    given = client_request_id(request.headers.get(HEADER))
    request[REQUEST_ID] = given or new_request_id(request.path)
    request[FROM_CLIENT] = given is not None
    start = time.monotonic()
    status = 500
    try:
        with request_context(request[REQUEST_ID]):
            response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:   # aiohttp answers it (what error_middleware leaves: < 400)
        status = e.status
        raise
    except BaseException:
        # Cancelled (the client left) or broken after the answer began: what it was sent says.
        prepared = request.get(PREPARED_STATUS)
        status = prepared if prepared is not None else 499   # nginx's "client closed request"
        raise
    finally:
        access_line(request, status, time.monotonic() - start)


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the request id and the Server name, before the headers go (streams too)."""
    rid = request.get(REQUEST_ID)
    if rid is not None:
        response.headers[HEADER] = rid
    response.headers["Server"] = SERVER_NAME
    span = request.get(SPAN)
    if span is not None:
        response.headers[TRACEPARENT] = span.traceparent()
    request[PREPARED_STATUS] = response.status


def access_line(request: web.Request, status: int, duration_s: float) -> None:
    level = logging.DEBUG if request.method == "GET" and request.path in _PROBES else logging.INFO
    if not log.isEnabledFor(level):
        return
    rid = request.get(REQUEST_ID)
    fields = {"request_id": rid, "status": status, "duration_s": round(duration_s, 4), "client": request.remote}
    state = request.get(STATE)
    if state is not None:
        if state.request_id != rid:   # its id was in flight already: suffixed at the router
            fields["request_id"], fields["client_request_id"] = state.request_id, rid
        now = time.monotonic()
        t = Timeline.of(state, now, ended=True).summary(now)
        fields.update(stream=bool(request.get(STREAMED)), mode=t["mode"], prefill_worker=t["prefill_worker"],
                      decode_worker=t["decode_worker"], prompt_tokens=t["prompt_tokens"],
                      output_tokens=t["output_tokens"], cached_tokens=state.num_cached_tokens, ttft_s=t["ttft_s"],
                      finish_reason=t["finish_reason"])
        if t["fallbacks"]:
            fields["fallbacks"] = t["fallbacks"]
        if t["migrations"]:
            fields["migrations"] = t["migrations"]
        if state.span is not None:
            fields["trace_id"] = state.span.trace_id
    log.log(level, "%s %s", request.method, logged_path(request), extra=fields)
