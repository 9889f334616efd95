"""Who may call the HTTP API: API keys, and what a key-less server asks of a request.

With `security.api_keys` every path but `open_paths` needs `Authorization:
Bearer KEY`. A browser cannot attach that header to a cross-site request
without a CORS preflight, which pdd answers only for `security.cors_origins`.

Without keys, a web page the user visits could still use a server it can
reach (the `pdd up` default: key-less on loopback), so a key-less server
refuses what a page can send without a preflight or through DNS rebinding:

- a POST whose body is not declared JSON (`Content-Type: application/json`,
  any parameters): text/plain, form and multipart bodies are what a page may
  POST to any origin unasked (415). A POST without a body has no type to
  declare (`curl -X POST .../reset_prefix_cache`, as benchmark clients send
  it): a page could send that too, and all it can do is flush the prefix
  cache (the next prompts compute again; no data is read or changed);
- a `Host` that is none of the server's names (403): an IP address (a page
  served from an address can only name the address it came from), `localhost`,
  `router.host`, or a name in `router.allowed_hosts` ("*": any). A rebinding
  page names its own domain. A request without `Host` is no browser's.
"""
from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

from pdd.http.validate import APIError


class ApiKeys:
    """The configured `Authorization: Bearer` keys; none = the API is open."""

    def __init__(self, keys, open_paths):
        self.keys = [k.encode() for k in keys]
        self.open_paths = frozenset(open_paths)

    def allows(self, request: web.Request) -> bool:
        if not self.keys or request.path in self.open_paths:
            return True
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        given = value.strip().encode("utf-8", "replace")
        ok = False
        for key in self.keys:  # every key compared, in constant time: no timing hint of which matched
            ok |= hmac.compare_digest(given, key)
        return ok and scheme.lower() == "bearer"


def host_name(host: str) -> str:
    """The name in a Host header: no port, no IPv6 brackets, lower case, no trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class KeylessChecks:
    """What a key-less server refuses (the module's docstring says why)."""

    def __init__(self, active: bool, bound_host: str, allowed_hosts):
        self.active = active
        self.any_host = "*" in allowed_hosts
        self.names = {"localhost", host_name(bound_host), *(host_name(h) for h in allowed_hosts)}

    def refusal(self, request: web.Request) -> APIError | None:
        if not self.active:
            return None
        host = request.headers.get("Host")
        if host is not None and not self.any_host:
            name = host_name(host)
            if name not in self.names and not _is_address(name):
                return APIError(403, f"Host {host!r} is not a name of this server; an operator can allow "
                                     "it in router.allowed_hosts (or set security.api_keys)",
                                code="host_not_allowed")
        if request.method == "POST" and request.body_exists and request.content_type != "application/json":
            got = request.headers.get("Content-Type")
            return APIError(415, "the request body must be JSON: send 'Content-Type: application/json' "
                                 f"(got {'none' if got is None else repr(got)})", code="unsupported_media_type")
        return None
