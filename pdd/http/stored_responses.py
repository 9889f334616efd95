"""Stored responses: what `store` (true by default) keeps of a Responses
answer, in the memory of the router that made it — the response object
(GET /v1/responses/{id}) and the conversation up to and with its output
(previous_response_id) — the most recent RESPONSE_STORE_ENTRIES and
RESPONSE_STORE_CHARS characters at most, least recently used out first, lost
on restart; DELETE forgets one, POST .../cancel refuses (only background
responses can be cancelled, and pdd runs none).

Every id names the router that made it (`resp_r{index}_...`). With several
routers behind one port (SO_REUSEPORT: the kernel picks a router per
connection), a GET, DELETE or cancel that reaches another router is forwarded
to the maker's own port (router.http_ports), once; without own ports, the 404
says which router keeps it.
"""
from __future__ import annotations

import re
from collections import OrderedDict

import aiohttp
import orjson
from aiohttp import web

from pdd.http.responses import json_response
from pdd.http.validate import APIError

RESPONSE_STORE_ENTRIES = 1024
RESPONSE_STORE_CHARS = 64 << 20
# Set on a forwarded request: the router it reaches answers it itself.
FORWARDED_HEADER = "X-Pdd-Forwarded-By"


class ResponseStore:
    """Recent stored responses by id: the response object (GET) and the
    conversation up to and with its output (chat messages: previous_response_id),
    bounded by count and by size, least recently used out first.

    `router`: this router's index; every id it gives names it (`new_id`), so
    that a request for another router's response is told where it lives."""

    def __init__(self, max_entries: int = RESPONSE_STORE_ENTRIES, max_chars: int = RESPONSE_STORE_CHARS,
                 router: int = 0):
        self.max_entries, self.max_chars, self.router = max_entries, max_chars, router
        self._entries: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.chars = 0

    def new_id(self, unique: str) -> str:
        return f"resp_r{self.router}_{unique}"

    def get(self, response_id: str) -> list[dict] | None:
        """The conversation of a stored response, or None."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[1]

    def response(self, response_id: str) -> dict | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[0]

    def put(self, response: dict, messages: list[dict]) -> None:
        size = len(orjson.dumps(response)) + len(orjson.dumps(messages))
        if size > self.max_chars:
            return   # it would push out every other one and still not fit
        self._entries[response["id"]] = (response, messages, size)
        self.chars += size
        while len(self._entries) > self.max_entries or self.chars > self.max_chars:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.chars -= dropped

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.chars -= entry[2]
        return entry is not None

    def not_found(self, response_id: str) -> APIError:
        return APIError(404, f"Response with id '{response_id}' not found: {self.why_not_here(response_id)}")

    def why_not_here(self, response_id: str) -> str:
        """Why a response is not here: another router's (its id says which), or
        not kept (never stored, store false, pushed out, deleted)."""
        other = self.maker(response_id)
        if other is not None and other != self.router:
            return (f"it was made by router {other}, and each router keeps the responses it made in its own "
                    f"memory: ask router {other} (this is router {self.router})")
        return (f"this router keeps the last {self.max_entries} stored responses in memory, none made with "
                "store false, none deleted")

    def maker(self, response_id: str) -> int | None:
        """The index of the router that made `response_id` (None: not an id pdd made)."""
        made_by = _ROUTER_OF.match(response_id)
        return int(made_by.group(1)) if made_by else None

    def __len__(self) -> int:
        return len(self._entries)


_ROUTER_OF = re.compile(r"resp_r(\d+)_")


def retrieve(store: ResponseStore, response_id: str) -> dict:
    """GET /v1/responses/{id}: the stored response object."""
    response = store.response(response_id)
    if response is None:
        raise store.not_found(response_id)
    return response


def delete(store: ResponseStore, response_id: str) -> dict:
    """DELETE /v1/responses/{id}: OpenAI's deletion object."""
    if not store.delete(response_id):
        raise store.not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def cancel(store: ResponseStore, response_id: str) -> dict:
    """POST /v1/responses/{id}/cancel: a stored one is over."""
    if store.response(response_id) is None:
        raise store.not_found(response_id)
    raise APIError(400, f"Response with id '{response_id}' cannot be cancelled: only background responses can, "
                        "and this server runs none (it has completed)")


ENDPOINTS = {"GET": retrieve, "DELETE": delete, "POST": cancel}


async def answer(store: ResponseStore, request: web.Request, own_ports: tuple[int, ...], host: str) -> web.Response:
    """One of ENDPOINTS for the request's id: here, or forwarded to the router that made it."""
    response_id = request.match_info["response_id"]
    maker = store.maker(response_id)
    if maker is not None and maker != store.router and maker < len(own_ports) \
            and FORWARDED_HEADER not in request.headers:
        return await _forwarded(request, host, own_ports[maker], store.router)
    return json_response(ENDPOINTS[request.method](store, response_id))


async def _forwarded(request: web.Request, host: str, port: int, router: int) -> web.Response:
    """The answer of the router listening on `port` (on this host) to the same request."""
    headers = {FORWARDED_HEADER: str(router)}
    if "Authorization" in request.headers:   # that router checks the key too
        headers["Authorization"] = request.headers["Authorization"]
    url = f"http://{_dialable(host)}:{port}{request.rel_url}"
    try:
        async with aiohttp.ClientSession() as session, \
                session.request(request.method, url, headers=headers) as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")
    except aiohttp.ClientError as e:
        raise APIError(502, f"the response's router (port {port}) did not answer: {e}", type="server_error") from None


def _dialable(host: str) -> str:
    """Where this host's own ports are reached: a wildcard bind is reached on loopback."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
