"""The keys of what the router's HTTP application and its requests hold: one
place, so that the app that sets them, the middlewares that read them and the
handlers that leave something for a response's headers all name the same ones."""
from __future__ import annotations

from aiohttp import web

from pdd.http.access import ApiKeys, KeylessChecks
from pdd.http.guard import Guards
from pdd.router.router import Router

ROUTER_KEY = web.AppKey("router", Router)
GUARDS_KEY = web.AppKey("guards", Guards)
API_KEYS_KEY = web.AppKey("api_keys", ApiKeys)
KEYLESS_KEY = web.AppKey("keyless_checks", KeylessChecks)
CORS_KEY = web.AppKey("cors_origins", frozenset)

# Where a handler leaves the body fields it ignored, for the response's header.
IGNORED_FIELDS_KEY = web.RequestKey("ignored_fields", str)
IGNORED_FIELDS_HEADER = "X-Pdd-Ignored-Fields"
