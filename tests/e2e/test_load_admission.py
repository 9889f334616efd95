"""Admission control under a burst of large prompts, against a real cluster
(`pdd up` on loopback): while router.max_queued_requests requests wait for
their first token, a new request is answered 429 before its prompt is
tokenized (no turn in the tokenizer process, whose queue is one text at a
time), and the cluster serves large prompts again once the queue moves."""
from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.e2e.cluster import UpCluster, _wait_for, children
from tests.e2e.http_util import get, post
from tests.router.test_metrics import samples

# Whether a prompt is tokenized in the child process goes by the body's size
# (past pdd.http.tokenize.INLINE_BYTES): OpenAI's `user` field makes it large
# while the prompt still fits the tiny model's context.
LARGE_BODY = {"prompt": "hello world", "max_tokens": 4, "user": "u" * 20_000}


def test_an_overloaded_router_refuses_a_large_prompt_before_tokenizing_it(tmp_path, tiny_model):
    env = {"PDD_ROUTER__MAX_QUEUED_REQUESTS": "1", "PDD_ROUTER__ALLOW_FAULT_INJECTION": "1"}
    with UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1", env=env) as c:
        router = c.child_pid("router")
        assert children(router) == []   # no large prompt yet: no tokenizer process
        # The worker's steps block: a request placed there waits for its first token, filling the queue.
        c.admin("faults", "set", "colocated.hang_after_steps=1", "colocated-0")
        _wait_for(lambda: c.admin("faults")["workers"].get("colocated-0") == {"colocated.hang_after_steps": 1},
                  30.0, "the fault set")

        async def waiting_request():
            body = {"model": c.model_name, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
            async with aiohttp.ClientSession() as session:
                async with session.post(c.url + "/v1/completions", json=body) as resp:
                    return resp.status, await resp.json()

        async def main():
            waiting = asyncio.create_task(waiting_request())
            await asyncio.to_thread(_wait_for, lambda: c.admin("status")["queued_requests"] == 1, 60.0,
                                    "the first request queued")
            burst = await asyncio.gather(*(asyncio.to_thread(
                post, c.url + "/v1/completions", {"model": c.model_name, **LARGE_BODY}) for _ in range(4)))
            tokenizers = children(router)
            c.admin("faults", "clear", "colocated-0")
            return burst, tokenizers, await waiting

        burst, tokenizers, (status, _) = asyncio.run(main())
        for reply in burst:
            assert reply.status == 429 and reply.headers["Retry-After"] == "1", reply.body[:300]
            assert json.loads(reply.body)["error"]["code"] == "rate_limit_exceeded"
        assert tokenizers == []   # refused before any of them was tokenized
        assert status == 200      # the queued one completes once the steps run
        reply = post(c.url + "/v1/completions", {"model": c.model_name, **LARGE_BODY})
        assert reply.status == 200, reply.body[:300]   # served again, large bodies too
        assert children(router) != []                  # (and this one went to the tokenizer process)
        c.wait_idle(30.0)


def test_a_saturated_router_process_answers_429_with_a_spread_wait_and_says_so(tmp_path, tiny_model):
    """A real router whose loop-busy limit any loop is over (router.max_loop_busy
    = 1e-9: the forced fault, by configuration) is saturated from its first
    probes: every generation request gets 429 in OpenAI's shape, Retry-After in
    whole seconds and retry-after-ms drawn within half of it either side;
    `pdd admin status` says why and what wait it asks, /metrics counts the
    refusals by reason; what asks no worker (/v1/models, /health) is served."""
    env = {"PDD_ROUTER__MAX_LOOP_BUSY": "1e-9"}
    with UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1", env=env) as c:
        _wait_for(lambda: c.admin("status")["saturated"] == "loop_busy", 60.0, "the router saturated")
        for _ in range(5):
            reply = post(c.url + "/v1/completions", {"model": c.model_name, "prompt": "hello", "max_tokens": 4})
            assert reply.status == 429, reply.body[:300]
            error = json.loads(reply.body)["error"]
            assert error["code"] == "rate_limit_exceeded" and "router.max_loop_busy" in error["message"], error
            wait_s = int(reply.headers["Retry-After"])
            assert wait_s >= 1 and 500 * wait_s // 2 <= int(reply.headers["retry-after-ms"]) < 1500 * wait_s
        status = c.admin("status")
        assert status["saturated"] == "loop_busy" and status["retry_after_s"] >= 1, status
        metrics = get(c.url + "/metrics").body.decode()
        (refused,) = samples(metrics, "pdd_requests_rejected_total", reason="loop_busy")
        assert refused >= 5
        assert get(c.url + "/v1/models").status == 200 and get(c.url + "/health").status == 200
