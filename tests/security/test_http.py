"""HTTP access: API keys (401 in OpenAI's shape), timeouts that cut idle and
slow clients while normal requests are served, the connection limit, and
large prompts tokenized off the event loop. A real server on a loopback port;
the router core is a stand-in (no worker is needed for any of this)."""
from __future__ import annotations

import asyncio
import socket

import aiohttp

from pdd import security
from pdd.http.app import build_app, serve_http
from tests.router.test_metrics import samples
from tests.security.conftest import StubRouter, grows, secure_config

KEYS = ["key-one-1234", "key-two-5678"]


class StubTokenizer:
    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [1] * 100    # longer than the stand-in's context: the request ends in a 400


async def start(cfg, tokenizer=None):
    app = build_app(StubRouter(cfg), tokenizer or StubTokenizer(), "m")
    server = await serve_http(app, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.port}"


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


def test_api_keys(keys):
    async def main():
        server, url = await start(secure_config(keys, security={"api_keys": KEYS}))
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEYS[0]}"},
                            {"Authorization": KEYS[0]}):
                async with s.get(url + "/v1/models", headers=headers) as r:
                    assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
                    body = await r.json()
                    assert set(body["error"]) == {"message", "type", "param", "code"}
                    assert body["error"]["code"] == "invalid_api_key" and KEYS[0] not in str(body)
            async with s.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
                assert r.status == 401
            async with s.get(url + "/no/such/path") as r:
                assert r.status == 401   # nothing is revealed without a key, not even which paths exist
            for key in KEYS:
                async with s.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}) as r:
                    assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
            for path in ("/health", "/metrics"):   # open by default
                async with s.get(url + path) as r:
                    assert r.status == 200
        await server.cleanup()

    run(main())


def test_health_and_metrics_can_need_a_key_too(keys):
    async def main():
        server, url = await start(secure_config(keys, security={"api_keys": KEYS, "open_paths": []}))
        async with aiohttp.ClientSession() as s:
            for path in ("/health", "/metrics"):
                async with s.get(url + path) as r:
                    assert r.status == 401
                async with s.get(url + path, headers={"Authorization": f"Bearer {KEYS[1]}"}) as r:
                    assert r.status == 200
        await server.cleanup()

    run(main())


def test_without_keys_the_api_is_open(keys):
    async def main():
        server, url = await start(secure_config(keys))
        async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
            assert r.status == 200
        await server.cleanup()

    run(main())


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := await reader.read(65536):
        out += chunk
    return out


def test_idle_and_slow_clients_are_cut_while_a_normal_request_is_served(keys):
    async def main():
        cfg = secure_config(keys, security={"api_keys": KEYS, "http_header_timeout_s": 1.0,
                                            "http_body_timeout_s": 1.0, "http_idle_timeout_s": 1.0})
        server, url = await start(cfg)
        port = server.port
        before = security.counts()
        idle = await asyncio.open_connection("127.0.0.1", port)
        slowloris = await asyncio.open_connection("127.0.0.1", port)
        slowloris[1].write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthoriz")
        short = await asyncio.open_connection("127.0.0.1", port)
        short[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: 100\r\n\r\n{\"model\"")
        # A well-behaved client is served meanwhile, on its own connection.
        async with aiohttp.ClientSession() as s, \
                s.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}) as r:
            assert r.status == 200
        assert await read_all(idle[0]) == b""                 # closed quietly
        cut = await read_all(slowloris[0])
        assert cut.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in cut
        answer = await read_all(short[0])
        assert answer.startswith(b"HTTP/1.1 408") and b"request body did not arrive" in answer
        after = security.counts()
        for what in ("http.idle_timeout", "http.header_timeout", "http.body_timeout"):
            assert after.get(what, 0) > before.get(what, 0), what
        for _, w in (idle, slowloris, short):
            w.close()
        await server.cleanup()

    run(main())


async def get_on(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], path: str) -> bytes:
    """The answer to GET `path` on a keep-alive connection: its status line, then its body."""
    reader, writer = conn
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    return head.split(b"\r\n")[0] + b"\n" + await reader.readexactly(length)


def refused_total(answer: bytes) -> float:
    (value,) = samples(answer.decode().split("\n", 1)[1], "pdd_http_connections_refused_total")
    return value


def test_connection_limit(keys):
    async def main():
        server, url = await start(secure_config(keys, security={"http_max_connections": 2}))
        port = server.port
        held = []
        for _ in range(2):   # two keep-alive connections, each known to be accepted (answered)
            held.append(await asyncio.open_connection("127.0.0.1", port))
            assert (await get_on(held[-1], "/health")).startswith(b"HTTP/1.1 200")
        before = refused_total(await get_on(held[0], "/metrics"))
        r, w = await asyncio.open_connection("127.0.0.1", port)
        refused = await read_all(r)
        assert refused.startswith(b"HTTP/1.1 503") and b"too many connections" in refused
        w.close()
        assert refused_total(await get_on(held[0], "/metrics")) == before + 1
        held.pop()[1].close()   # one leaves: new connections are taken again
        async with aiohttp.ClientSession() as s:
            while True:
                try:
                    async with s.get(url + "/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:   # refused while the server has not seen the close yet
                    await asyncio.sleep(0.05)
        for _, w in held:
            w.close()
        await server.cleanup()

    run(main())


async def never_reading_client(port: int) -> asyncio.StreamWriter:
    """A client that asks for many answers and never reads one: they pile up in
    the server's buffers. Its receive buffer and segment are small, set before it
    connects (else loopback queues megabytes for it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 400)   # pipelined
    return writer


def test_a_client_that_takes_nothing_is_cut_and_counted(keys):
    async def main():
        server, url = await start(secure_config(keys, router={"http_send_timeout_s": 0.5}))
        async with aiohttp.ClientSession() as s:
            async def cut_total() -> float:
                async with s.get(url + "/metrics") as r:
                    (value,) = samples(await r.text(), "pdd_http_clients_cut_total", reason="send_timeout")
                    return value

            before_total, before = await cut_total(), security.counts()
            writer = await never_reading_client(server.port)
            await grows(before, "http.send_timeout")
            assert await cut_total() == before_total + 1
            writer.close()
        await server.cleanup()

    run(main())


def test_cors_only_for_the_configured_origins(keys):
    async def main():
        cfg = secure_config(keys, security={"api_keys": KEYS, "cors_origins": ["https://ui.example.com"]})
        server, url = await start(cfg)
        preflight = {"Origin": "https://ui.example.com", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        async with aiohttp.ClientSession() as s:
            async with s.options(url + "/v1/chat/completions", headers=preflight) as r:   # no key: a preflight has none
                assert r.status == 204
                assert r.headers["Access-Control-Allow-Origin"] == "https://ui.example.com"
                assert "POST" in r.headers["Access-Control-Allow-Methods"]
                assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            async with s.get(url + "/v1/models", headers={"Origin": "https://ui.example.com",
                                                          "Authorization": f"Bearer {KEYS[0]}"}) as r:
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "https://ui.example.com"
            async with s.get(url + "/v1/models", headers={"Origin": "https://ui.example.com"}) as r:
                assert r.status == 401   # the key is still needed
            other = {**preflight, "Origin": "https://evil.example.com"}
            async with s.options(url + "/v1/chat/completions", headers=other) as r:
                assert r.status != 204 and "Access-Control-Allow-Origin" not in r.headers
        await server.cleanup()
        server, url = await start(secure_config(keys))   # the default: no origin
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models", headers={"Origin": "https://ui.example.com"}) as r:
                assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        await server.cleanup()

    run(main())
