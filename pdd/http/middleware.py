"""The router's HTTP middlewares (the application keys they read: pdd.http.keys).

In order (pdd.http.app.build_app): request ids and the access line
(pdd.http.request_log), a browser's CORS preflight, access (API keys; key-less,
what a web page could send: pdd.http.access) with the connection guard told a
request is in progress (pdd.http.guard), then every error a handler raises
turned into OpenAI's error shape with its HTTP status, counted by status.
The on_response_prepare hooks add headers to every response, streams included.
"""
from __future__ import annotations

import logging

from aiohttp import web

from pdd import security
from pdd.http import request_log
from pdd.http.keys import (API_KEYS_KEY, CORS_KEY, GUARDS_KEY, IGNORED_FIELDS_HEADER, IGNORED_FIELDS_KEY, KEYLESS_KEY,
                           ROUTER_KEY)
from pdd.http.responses import error_response, json_response
from pdd.http.validate import APIError
from pdd.router.requests import RequestError
from pdd.router.router import Overloaded, Unavailable

log = logging.getLogger(__name__)

def _cors_origin(request: web.Request) -> str | None:
    """The request's Origin when `security.cors_origins` lets that page call us."""
    origin, allowed = request.headers.get("Origin"), request.app[CORS_KEY]
    if origin is None or not allowed:
        return None
    return origin if ("*" in allowed or origin in allowed) else None


@web.middleware
async def cors_middleware(request: web.Request, handler):
    """Answers a browser's preflight (OPTIONS, before any API key is asked for:
    browsers send none with it) for the origins configured."""
    if (request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
            and _cors_origin(request) is not None):
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                "Authorization, Content-Type"),
            "Access-Control-Max-Age": "600"})
    return await handler(request)


async def ignored_fields_header(request: web.Request, response: web.StreamResponse) -> None:
    # on_response_prepare: streams too, and whoever builds the response.
    ignored = request.get(IGNORED_FIELDS_KEY)
    if ignored is not None:
        response.headers[IGNORED_FIELDS_HEADER] = ignored


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    # on_response_prepare: before the headers go, for streams too.
    origin = _cors_origin(request)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"


@web.middleware
async def access_middleware(request: web.Request, handler):
    """Tells the connection guard a request is in progress; refuses it without a
    valid API key or, key-less, when a web page could have sent it."""
    guard = request.app[GUARDS_KEY].get(request.transport)
    if guard is not None:
        guard.request_started()
    try:
        if not request.app[API_KEYS_KEY].allows(request):
            security.count("http.bad_api_key")
            request.app[ROUTER_KEY].metrics.http_errors.labels("401").inc()
            resp = error_response(401, "missing or invalid API key: send 'Authorization: Bearer KEY'",
                                  code="invalid_api_key")
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        refusal = request.app[KEYLESS_KEY].refusal(request)
        if refusal is not None:
            security.count(f"http.{refusal.code}")
            request.app[ROUTER_KEY].metrics.http_errors.labels(str(refusal.status)).inc()
            return json_response(refusal.body(), refusal.status)
        return await handler(request)
    finally:
        if guard is not None:
            guard.request_finished()


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        request.app[ROUTER_KEY].metrics.http_errors.labels(str(e.status)).inc()
        resp = json_response(e.body(), e.status)
        if e.status == 408:
            resp.force_close()  # the rest of the body may still come: this connection is done
        return resp
    except Overloaded as e:
        request.app[ROUTER_KEY].metrics.http_errors.labels("429").inc()
        resp = error_response(429, str(e), "rate_limit_error", code="rate_limit_exceeded")
        resp.headers["Retry-After"] = str(e.retry_after_s)
        if e.retry_after_ms is not None:
            resp.headers["retry-after-ms"] = str(e.retry_after_ms)
        return resp
    except Unavailable as e:
        request.app[ROUTER_KEY].metrics.http_errors.labels("503").inc()
        return error_response(503, str(e), "service_unavailable")
    except RequestError as e:
        return error_response(e.status, str(e), e.error_type)
    except web.HTTPRequestEntityTooLarge:
        request.app[ROUTER_KEY].metrics.http_errors.labels("413").inc()
        limit = request.app[ROUTER_KEY].cfg.router.max_body_bytes
        return error_response(413, f"request body is larger than the limit of {limit} bytes",
                              code="request_too_large")
    except web.HTTPException as e:   # aiohttp's own: unknown path (404), wrong method (405), ...
        if e.status < 400:
            raise
        request.app[ROUTER_KEY].metrics.http_errors.labels(str(e.status)).inc()
        return _aiohttp_error(request, e)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request_log.logged_path(request))
        return error_response(500, "internal server error", "server_error")


# OpenAI endpoints of models pdd does not serve: a 404 that says so, not just "no such endpoint".
NOT_GENERATIVE = {"/v1/embeddings": "embeddings", "/v1/audio": "audio", "/v1/images": "images",
                  "/v1/moderations": "moderations", "/v1/rerank": "rerankers", "/rerank": "rerankers",
                  "/v1/score": "scoring", "/score": "scoring", "/pooling": "pooling"}


def _aiohttp_error(request: web.Request, e: web.HTTPException) -> web.Response:
    """aiohttp's own error in OpenAI's shape, saying which request it answers;
    a 405 with the Allow header HTTP requires of it."""
    where = f"{request.method} {request.path}"
    if isinstance(e, web.HTTPNotFound):
        what = next((kind for path, kind in NOT_GENERATIVE.items() if request.path.startswith(path)), None)
        if what is not None:
            return error_response(404, f"{where}: not found: pdd serves generative models (completions, chat, "
                                       f"responses), not {what}")
        return error_response(404, f"{where}: not found (no such endpoint)")
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        resp = error_response(405, f"{where}: method not allowed; this endpoint takes {allowed}")
        resp.headers["Allow"] = allowed
        return resp
    return error_response(e.status, e.reason or "error")
