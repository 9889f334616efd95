"""What the HTTP server refuses before any handler work, always in OpenAI's
error shape: what a web page could send to a key-less server (a body not
declared JSON, a Host that is not one of the server's names), an impossible
Content-Length, and requests aiohttp cannot parse. A real server on a
loopback port; the router core is a stand-in (no worker is needed)."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pdd import security
from pdd.config import ConfigError
from pdd.config_loader import load_cluster_config
from pdd.http.access import host_name
from pdd.http.app import build_app, serve_http
from tests.security.conftest import StubRouter


class NoTokenizer:
    vocab_size = 1000   # every request here is answered before a prompt is tokenized


async def start(**tables):
    cfg = load_cluster_config(env={}, overrides=tables)
    server = await serve_http(build_app(StubRouter(cfg), NoTokenizer(), "m"), "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.port}"


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


async def raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the answer to bytes sent as they are (the server closes after it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers["content-length"]))
    writer.close()
    return int(lines[0].split()[1]), headers, body


def assert_openai_error(status: int, body: dict, want_status: int, code: str) -> None:
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body


async def post(s: aiohttp.ClientSession, url: str, data: bytes, headers: dict) -> tuple[int, dict]:
    async with s.post(url + "/v1/completions", data=data, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def test_a_keyless_server_refuses_what_a_web_page_could_send():
    async def main():
        server, url = await start()
        before = security.counts()
        page = {"Origin": "https://evil.example.com"}
        async with aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as s:
            # No preflight needed for these: any page may POST them anywhere.
            for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"):
                status, body = await post(s, url, b'{"model": "m", "prompt": "hi"}', {**page, "Content-Type": ctype})
                assert_openai_error(status, body, 415, "unsupported_media_type")
                assert "Content-Type: application/json" in body["error"]["message"]
            status, body = await post(s, url, b'{"model": "m", "prompt": "hi"}', page)   # a Blob: no type at all
            assert_openai_error(status, body, 415, "unsupported_media_type")
            # DNS rebinding: the page's own domain now points at us; reading needs no CORS.
            rebound = {"Host": f"evil.example.com:{server.port}"}
            status, body = await post(s, url, b'{}', {**rebound, "Content-Type": "application/json"})
            assert_openai_error(status, body, 403, "host_not_allowed")
            for path in ("/v1/models", "/metrics", "/health"):
                async with s.get(url + path, headers=rebound) as r:
                    assert_openai_error(r.status, await r.json(), 403, "host_not_allowed")
            # The server's own names pass (the handler answers: no prompt given).
            for host in (f"127.0.0.1:{server.port}", "127.0.0.1", f"localhost:{server.port}", "LocalHost.",
                         f"[::1]:{server.port}", "[::1]", "10.0.0.7:8000"):
                for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
                    status, body = await post(s, url, b'{"model": "m"}', {"Host": host, "Content-Type": ctype})
                    assert status == 400 and body["error"]["param"] == "prompt", (host, ctype, body)
            async with s.get(url + "/v1/models", headers={"Host": f"localhost:{server.port}"}) as r:
                assert r.status == 200
        after = security.counts()
        assert after["http.unsupported_media_type"] - before.get("http.unsupported_media_type", 0) == 4
        assert after["http.host_not_allowed"] - before.get("http.host_not_allowed", 0) == 4
        await server.cleanup()

    run(main())


def test_allowed_hosts_widen_and_api_keys_lift_the_keyless_checks():
    async def main():
        json_type = {"Content-Type": "application/json"}
        server, url = await start(router={"allowed_hosts": ["gpu-box.lan"]})
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, url, b'{"model": "m"}', {**json_type, "Host": "GPU-box.lan:8000"})
            assert status == 400 and body["error"]["param"] == "prompt", body
            status, body = await post(s, url, b'{"model": "m"}', {**json_type, "Host": "other.lan"})
            assert_openai_error(status, body, 403, "host_not_allowed")
        await server.cleanup()

        server, url = await start(router={"allowed_hosts": ["*"]})
        async with aiohttp.ClientSession() as s:
            status, body = await post(s, url, b'{"model": "m"}', {**json_type, "Host": "anything.example"})
            assert status == 400 and body["error"]["param"] == "prompt", body
        await server.cleanup()

        # With keys a page cannot call at all: it cannot attach the key without a preflight.
        server, url = await start(security={"api_keys": ["key-one-1234"]})
        async with aiohttp.ClientSession() as s:
            headers = {"Host": "evil.example.com", "Content-Type": "text/plain",
                       "Authorization": "Bearer key-one-1234"}
            status, body = await post(s, url, b'{"model": "m"}', headers)
            assert status == 400 and body["error"]["param"] == "prompt", body
        await server.cleanup()

    run(main())


def test_an_impossible_content_length_gets_413_before_the_body():
    async def main():
        # The body will never come: waiting for it would end in a 408.
        server, _ = await start(security={"http_body_timeout_s": 5.0})
        status, headers, body = await raw(server.port, (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 99999999999\r\n\r\n{}"))
        assert headers["content-type"].startswith("application/json")
        assert_openai_error(status, json.loads(body), 413, "request_too_large")
        await server.cleanup()

    run(main())


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",                                                      # no request line
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nNo colon here\r\n\r\n",    # a malformed header
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 99999999999999999999999\r\n\r\n{}",                  # past any integer
    b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",     # a request line too long
], ids=["request-line", "header", "content-length", "long-line"])
def test_requests_aiohttp_cannot_parse_get_an_openai_shaped_400(request_bytes):
    async def main():
        server, _ = await start()
        before = security.counts().get("http.malformed_request", 0)
        status, headers, body = await raw(server.port, request_bytes)
        assert headers["content-type"].startswith("application/json")
        error = json.loads(body)
        assert_openai_error(status, error, 400, "malformed_request")
        assert error["error"]["message"].startswith("malformed HTTP request: ")
        assert security.counts()["http.malformed_request"] == before + 1
        await server.cleanup()

    run(main())


def test_an_unknown_path_or_method_is_said_with_the_request_and_a_405_says_what_is_allowed():
    async def main():
        server, url = await start()
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completion", json={}) as r:
                body = await r.json()
                assert r.status == 404 and body["error"]["message"].startswith("POST /v1/chat/completion: not found")
            async with s.get(url + "/v1/chat/completions") as r:
                body = await r.json()
                assert_openai_error(r.status, body, 405, None)
                assert r.headers["Allow"] == "POST"
                assert body["error"]["message"] == ("GET /v1/chat/completions: method not allowed; "
                                                    "this endpoint takes POST")
            async with s.delete(url + "/v1/models") as r:
                assert r.status == 405 and set(r.headers["Allow"].split(", ")) == {"GET", "HEAD"}
            # A kind of model pdd does not serve: the 404 says so.
            async with s.post(url + "/v1/embeddings", json={"model": "m", "input": "hello"}) as r:
                body = await r.json()
                assert_openai_error(r.status, body, 404, None)
                assert "pdd serves generative models" in body["error"]["message"] and "embeddings" in \
                    body["error"]["message"]
        await server.cleanup()

    run(main())


def test_host_names():
    assert host_name("Example.COM:8000") == "example.com"
    assert host_name("[::1]:8000") == host_name("[::1]") == "::1"
    assert host_name("localhost.") == "localhost"


@pytest.mark.parametrize("router, message", [
    ({"http_send_timeout_s": 0}, "router.http_send_timeout_s"),
    ({"max_buffered_tokens": 0}, "router.max_buffered_tokens"),
    ({"allowed_hosts": ["http://gpu-box.lan"]}, "router.allowed_hosts: 'http://gpu-box.lan' is not a host name"),
    ({"allowed_hosts": ["gpu-box.lan:8000"]}, "router.allowed_hosts"),
    ({"tool_call_parser": "xml"}, "router.tool_call_parser"),
])
def test_settings_errors_name_the_key(router, message):
    with pytest.raises(ConfigError, match=message):
        load_cluster_config(env={}, overrides={"router": router})
