"""The router's event loop and memory under requests that make it work or hold
much, against a real cluster (`pdd up` on loopback): a non-streamed n = 128
answer with top-20 logprobs, /tokenize floods, streams whose clients stop
reading. The loop's availability is counted in the worker's steps, not in
seconds: a bystander stream's tokens come one TokenBatch per engine step, and
the router hands its client every token that has come at once, so the tokens
one write carries are the steps the router did not serve it for."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import aiohttp
import pytest

from pdd.http.tokenize import UTILITY_IN_FLIGHT
from tests.e2e.cluster import UpCluster
from tests.e2e.http_util import post
from tests.e2e.test_disagg_faults import _wait_for, assert_all_free

BIG_N, BIG_TOKENS, TOP = 128, 200, 20
# Steps one bystander write may carry while the large answer is made: measured
# on a busy 2-core machine, at most 44 with the answer made in slices, 210 at
# 200 tokens when it was made in one piece on the loop. The bound sits between,
# nearer the failure: a machine busier than that one (other processes taking
# the router's core) stretches the fixed figure, not the broken one's floor.
MAX_STEPS_UNSERVED = 140
BYSTANDER_TOKENS = 3000


async def bystander(session, c: UpCluster, writes: list[int], started: asyncio.Event) -> None:
    """A stream whose chunks each carry the usage so far: chunks that say the
    same count went out in one write. `writes`: the tokens of each write."""
    body = {"model": c.model_name, "prompt": "hello", "max_tokens": BYSTANDER_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    last = None
    async with session.post(c.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"]:
                continue
            count = chunk["usage"]["completion_tokens"]
            if count != last:
                writes.append(0)
                last = count
            writes[-1] += 1
            started.set()


@pytest.fixture(scope="module")
def roomy(tmp_path_factory, tiny_model):
    """One worker, its router holding the large answer's logprobs (and no more):
    the large answer's test and the tokenize flood's (which the bound does not
    touch) share it."""
    env = {"PDD_ROUTER__MAX_LOGPROB_ENTRIES": str(BIG_N * BIG_TOKENS * (TOP + 1))}
    with UpCluster(tmp_path_factory.mktemp("roomy") / "run", tiny_model, "--mode", "colocated", "--workers", "1",
                   env=env) as c:
        yield c


def test_a_large_answer_with_logprobs_leaves_the_loop_serving_other_streams(roomy):
    body: dict = {}
    c = roomy

    async def main():
        writes: list[int] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            started = asyncio.Event()
            side = asyncio.create_task(bystander(session, c, writes, started))
            await started.wait()
            before = len(writes)
            nonlocal body
            body = {"model": c.model_name, "messages": [{"role": "user", "content": "hi"}], "n": BIG_N,
                    "max_tokens": BIG_TOKENS, "ignore_eos": True, "logprobs": True, "top_logprobs": TOP}
            async with session.post(c.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
            during = writes[before:]
            assert not side.done(), "the bystander ended before the large answer: it saw no build"
            # Its part is done: the ~2,500 tokens it has left (seconds of the router's
            # and the worker's time) would show nothing more. Its client leaves.
            side.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await side
        return answer, during
    answer, during = asyncio.run(main())
    assert max(during) <= MAX_STEPS_UNSERVED, during
    _wait_for(lambda: c.admin("requests") == [], 60.0, "the bystander's request aborted")
    assert len(answer["choices"]) == BIG_N
    assert all(len(ch["logprobs"]["content"]) == BIG_TOKENS for ch in answer["choices"])
    # One entry more than the router holds for an answer: refused before anything runs, naming the fields.
    reply = post(c.url + "/v1/chat/completions", {**body, "max_tokens": BIG_TOKENS + 1})
    assert reply.status == 400, reply.body[:300]
    error = reply.json()["error"]
    assert error["param"] == "top_logprobs" and "router.max_logprob_entries" in error["message"], error
    assert "n 128" in error["message"] and "max_tokens 201" in error["message"], error
    assert c.admin("requests") == []
    # Streamed, the same request holds no logprobs at the router: not bounded by it.
    reply = post(c.url + "/v1/chat/completions", {**body, "n": 2, "max_tokens": 4, "stream": True})
    assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n"), reply.body[-300:]


# A prompt near router.max_body_bytes (4 MiB): seconds of its tokenizer child.
FLOOD_BODY = {"prompt": "hello world " * 290_000, "return_token_strs": True}
FLOOD = 4
# Past pdd.http.tokenize.INLINE_BYTES by its `user` field: tokenized in a child process too.
LARGE_CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "user": "u" * 20_000}


def test_a_tokenize_flood_does_not_delay_chat_requests(roomy):
    c = roomy
    chat = {"model": c.model_name, **LARGE_CHAT}
    assert post(c.url + "/v1/chat/completions", chat).status == 200   # its tokenizer child started

    async def main():
        done: list[str] = []   # what ended, in order

        async def one(name: str, path: str, body: dict):
            reply = await asyncio.to_thread(post, c.url + path, body)
            done.append(f"{name}:{reply.status}")
            return reply
        flood = [asyncio.create_task(one("tokenize", "/tokenize", {"model": c.model_name, **FLOOD_BODY}))
                 for _ in range(FLOOD)]
        # The flood's refusals come at once: by then the others are in the tokenizer.
        while not any(d == "tokenize:429" for d in done) and not all(t.done() for t in flood):
            await asyncio.wait(flood, return_when=asyncio.FIRST_COMPLETED)
        answer = await one("chat", "/v1/chat/completions", chat)
        return await asyncio.gather(*flood), answer, done
    flood, answer, done = asyncio.run(main())
    assert answer.status == 200, answer.body[:300]
    # Over its lane's share, a large /tokenize is refused (429, retry), not queued ...
    refused = [r for r in flood if r.status == 429]
    assert len(refused) == FLOOD - UTILITY_IN_FLIGHT and all(r.headers["Retry-After"] == "1" for r in refused), done
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
    # ... and the chat request is answered before the admitted ones are: it did not wait behind them.
    assert done.index("chat:200") < done.index("tokenize:200"), done
    admitted = [r.json() for r in flood if r.status == 200]
    assert all(a["count"] == len(a["tokens"]) == len(a["token_strs"]) > 290_000 for a in admitted)


# Each stream takes ~2,500 tokens (steps) to fill the router's socket buffer (the
# kernel grows it to ~4 MB on loopback, whatever the client's), and the router's
# work for them grows with the streams: on a 2-core machine running another
# suite, 4 were cut after 23 s, 8 after 45 s. Four keep the failure plain: with
# the streams' logprobs kept, the router held 40 MB after the cut; 2.5 MB without.
CUT_STREAMS = 4


def rss_bytes(pid: int) -> int:
    status = open(f"/proc/{pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def test_cut_never_reading_streams_with_logprobs_leave_nothing_held(tmp_path, tiny_model):
    # Default socket buffers: the router sends a stream MBs (thousands of tokens
    # with top-20 logprobs) before its buffer for it fills; what it kept of them
    # was ~10 MB a stream, still held after the cut.
    env = {"PDD_ROUTER__HTTP_SEND_TIMEOUT_S": "2", "PDD_ROUTER__MAX_BUFFERED_TOKENS": "100000"}
    with UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1", env=env) as c:
        router = c.child_pid("router")
        assert post(c.url + "/v1/chat/completions", {"model": c.model_name, "max_tokens": 4, "logprobs": True,
                    "top_logprobs": TOP, "messages": [{"role": "user", "content": "hi"}]}).status == 200
        before = rss_bytes(router)
        body = json.dumps({"model": c.model_name, "messages": [{"role": "user", "content": "hello"}],
                           "max_tokens": 4000, "ignore_eos": True, "stream": True, "logprobs": True,
                           "top_logprobs": TOP}).encode()
        socks = []
        for _ in range(CUT_STREAMS):
            sock = socket.create_connection(("127.0.0.1", c.port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(sock)
        try:
            _wait_for(lambda: c.admin("security").get("http.send_timeout", 0) >= CUT_STREAMS, 300.0,
                      "every never-reading stream cut")
            # Their state is gone at the router and their requests were aborted on the worker.
            _wait_for(lambda: c.admin("requests") == [], 60.0, "the router's request table empty")
            assert_all_free(c)
            held = rss_bytes(router) - before
        finally:
            for sock in socks:
                sock.close()
        # Kept logprobs were ~10 MB a stream; a stream keeps none now (its buffers
        # are the kernel's). A generous bound, for the allocator's noise.
        assert held < CUT_STREAMS * 2 * 2**20, f"router RSS grew by {held / 2**20:.0f} MB"
