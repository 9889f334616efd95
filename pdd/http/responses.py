"""JSON response bodies, for every handler of the HTTP API (app, utility endpoints, guard)."""
from __future__ import annotations

import orjson
from aiohttp import web

from pdd.http.validate import APIError


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> web.Response:
    return json_response(APIError(status, message, type=type_, param=param, code=code).body(), status)
