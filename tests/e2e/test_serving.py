"""The serving stack end to end: `pdd up` (router + 2 colocated workers as real
processes, ZeroMQ and HTTP on loopback) driven by the official openai client."""
from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import aiohttp
import msgpack
import openai
import pytest

from pdd import SamplingParams
from pdd.http.text_stream import TextStream
from tests.e2e.streams import stream_all
from tests.engine.helpers import random_prompts
from tests.e2e.test_disagg_faults import _wait_for


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


PROMPTS = ["Hello there", "The quick brown fox jumps over", "café naïve 日本語", "def f(x):\n    return"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_match_offline_engine(cluster, offline, prompt):
    expected = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    c = client(cluster)
    r = c.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.completion_tokens == len(expected.token_ids)
    stream = c.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=24, temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == expected.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # One token per chunk: never more chunks carrying text than tokens generated.
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) <= len(expected.token_ids)


def test_chat_applies_the_template(cluster, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected = offline.chat(messages, SamplingParams(max_tokens=20, temperature=0.0))
    c = client(cluster)
    r = c.chat.completions.create(model=cluster.model_name, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode_chat(messages))
    chunks = list(c.chat.completions.create(model=cluster.model_name, messages=messages, max_tokens=20,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected.text


def test_seeded_sampling_and_logprobs_over_http(cluster, offline):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    expected = offline.generate(["Once upon a time"], sp)[0]
    c = client(cluster)
    r = c.completions.create(model=cluster.model_name, prompt="Once upon a time", max_tokens=12,
                             temperature=0.9, top_p=0.9, seed=7, extra_body={"ignore_eos": True}, logprobs=2)
    assert r.choices[0].text == expected.text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 12 and all(x <= 0 for x in lp.token_logprobs)


def test_stop_string_ends_the_stream_without_the_stop_text(cluster, offline):
    full = offline.generate(["The quick brown fox jumps over"], SamplingParams(max_tokens=24, temperature=0))[0]
    stop = full.text[5:8]
    assert stop
    c = client(cluster)
    r = c.completions.create(model=cluster.model_name, prompt="The quick brown fox jumps over", max_tokens=24,
                             temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full.text[:full.text.index(stop)]
    cluster.wait_idle()


def counted(cluster, counter: str, label: str) -> float:
    """The sum of `counter`'s series that carry `label` (e.g. 'reason="stop"')."""
    from tests.e2e import http_util as rq
    text = rq.get(cluster.url + "/metrics").body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(counter + "{") and label in line)


def finished_with(cluster, reason: str) -> float:
    return counted(cluster, "pdd_requests_total", f'finish_reason="{reason}"')


def test_a_stop_string_is_a_stop_in_usage_and_metrics(cluster, offline):
    """usage counts the tokens the answer is made of, not those a worker sent
    after the stop string; the metrics count a stop, not an abort."""
    prompt = "The quick brown fox jumps over"
    full = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    stop = full.text[5:8]
    probe = TextStream(offline.tokenizer, [stop], prompt_ids=offline.tokenizer.encode(prompt))
    for token in full.token_ids:
        probe.add([token])
        if probe.stopped:
            break
    stops_before = finished_with(cluster, "stop")
    c = client(cluster)
    r = c.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == probe.num_tokens < len(full.token_ids)
    chunks = list(c.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=24, temperature=0,
                                       stop=[stop], stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == probe.num_tokens
    # The router counts a request when its handler ends, which may be just after the client's last byte.
    assert _wait_for(lambda: finished_with(cluster, "stop") == stops_before + 2, 30.0, "two stops counted")


def test_a_stop_token_ends_the_text_without_its_own(cluster, offline):
    prompt = "Hello there"
    full = offline.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    i = 3
    stop_id = full.token_ids[i]
    i = full.token_ids.index(stop_id)   # its first place
    r = client(cluster).completions.create(model=cluster.model_name, prompt=prompt, max_tokens=16, temperature=0,
                                           extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
    before = TextStream(offline.tokenizer, prompt_ids=offline.tokenizer.encode(prompt))
    text = before.add(full.token_ids[:i]) + before.finish()
    assert r.choices[0].text == text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == i + 1


def test_continuous_usage_counts_up_in_every_chunk(cluster):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far."""
    chunks = list(client(cluster).completions.create(
        model=cluster.model_name, prompt="Hello there", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for ch in chunks)


def test_text_offsets_do_not_depend_on_held_back_text(cluster):
    """A stop string that never matches holds text back; the offsets of the
    tokens are those of the text they make all the same."""
    args = dict(model=cluster.model_name, prompt="café naïve 日本語", max_tokens=12, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True})
    c = client(cluster)
    plain = c.completions.create(**args).choices[0]
    held = c.completions.create(stop=["zzzz"], **args).choices[0]
    assert held.text == plain.text
    assert held.logprobs.text_offset == plain.logprobs.text_offset
    offsets = plain.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(plain.text)


def test_200_concurrent_streams(cluster, offline):
    rng = random.Random(0)
    prompts = random_prompts([rng.randint(1, 60) for _ in range(200)], seed=11)
    max_tokens = [rng.randint(1, 24) for _ in range(200)]
    expected = offline.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                          for n in max_tokens])

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    results = stream_all(cluster, prompts, params)
    assert results == [(exp.text, "length", []) for exp in expected]
    workers = cluster.wait_idle()
    assert all(w["free_blocks"] == w["num_blocks"] for w in workers.values()), workers


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", b"[1, 2]", 400, "object"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 5}, 400, "best_of"),
    ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "hello " * 5000, "max_tokens": 4}, 400, "context"),
    ("/v1/completions", {"prompt": "hi there you", "max_tokens": 4095}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/completions", {"prompt": "x" * (5 * 2**20)}, 413, "limit"),
    ("/v1/nope", {"prompt": "x"}, 404, "Not Found"),
]


@pytest.mark.parametrize("path, body, status, needle", BAD_REQUESTS,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(cluster, path, body, status, needle):
    from tests.e2e import http_util as rq
    if isinstance(body, dict) and "model" not in body and path != "/v1/nope":
        body = {"model": cluster.model_name, **body}
    resp = rq.post(cluster.url + path, body)
    assert resp.status == status, resp.body
    err = resp.json()["error"]
    assert needle.lower() in err["message"].lower(), err
    assert err["type"]
    good = client(cluster).completions.create(model=cluster.model_name, prompt="ok", max_tokens=2)
    assert good.usage.completion_tokens == 2 or good.choices[0].finish_reason == "stop"


def test_client_disconnect_aborts_and_frees_blocks(cluster):
    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"model": cluster.model_name, "prompt": "tell me a long story " * 20, "max_tokens": 3000,
                    "ignore_eos": True, "stream": True}
            resp = await session.post(cluster.url + "/v1/completions", json=body)
            await resp.content.readline()
            await resp.content.readline()
            assert len(cluster.admin("requests")) == 1
            resp.close()  # drop the connection mid-stream
        return cluster.wait_idle(timeout_s=30.0)

    workers = asyncio.run(main())
    assert cluster.admin("requests") == []
    assert all(w["running"] == 0 and w["free_blocks"] == w["num_blocks"] for w in workers.values()), workers


def test_admin_status_and_drain(cluster):
    status = cluster.admin("status")
    assert status["ready"] and len(status["workers"]) == 2
    ids = sorted(w["worker_id"] for w in status["workers"])
    assert ids == ["colocated-0", "colocated-1"]
    assert all(w["num_blocks"] > 0 and "free_blocks" in w for w in status["workers"])
    # The placement policy, its settings and what it reads of each worker (colocated: the load it picks by).
    placement = status["placement"]
    assert (placement["policy"], placement["settings"]) == ("colocated", {})
    assert sorted(placement["estimates"]) == ids
    assert all(0.0 <= e["load"] < 2.0 for e in placement["estimates"].values()), placement
    shown = subprocess.run([sys.executable, "-m", "pdd.cli", "admin", "--config", str(cluster.run_dir / "cluster.toml"),
                            "status"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "placement: policy=colocated" in lines, shown.stdout
    header = lines.index("placement: policy=colocated") + 2
    assert lines[header].split() == ["worker_id", "load"], shown.stdout
    assert sorted(line.split()[0] for line in lines[header + 1:header + 3]) == ids, shown.stdout

    cluster.admin("drain", "colocated-0")
    try:
        async def main():
            async with aiohttp.ClientSession() as session:
                body = {"model": cluster.model_name, "prompt": "x", "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                resps = [await session.post(cluster.url + "/v1/completions", json=body) for _ in range(4)]
                for r in resps:
                    await r.content.readline()
                placed = {req["worker_id"] for req in cluster.admin("requests")}
                for r in resps:
                    r.close()
                return placed
        assert asyncio.run(main()) == {"colocated-1"}
        cluster.admin("drain", "colocated-1")
        refused = counted(cluster, "pdd_requests_rejected_total", 'reason="no_worker"')
        with pytest.raises(openai.APIStatusError) as e:
            client(cluster).completions.create(model=cluster.model_name, prompt="x", max_tokens=2)
        assert e.value.status_code == 503
        assert counted(cluster, "pdd_requests_rejected_total", 'reason="no_worker"') == refused + 1
        from tests.e2e import http_util as rq
        ready = rq.get(cluster.url + "/ready")
        assert ready.status == 503 and "drained" in ready.json()["reason"]
        assert rq.get(cluster.url + "/health").status == 200   # alive all the same
    finally:
        cluster.admin("undrain", "colocated-0")
        cluster.admin("undrain", "colocated-1")
    assert client(cluster).completions.create(model=cluster.model_name, prompt="x", max_tokens=2).choices
    with pytest.raises(Exception, match="no worker"):
        cluster.admin("drain", "nope")
    with pytest.raises(Exception, match="name one worker"):
        cluster.admin("drain")
    with pytest.raises(Exception, match="no pair colocated-1 -> nope"):
        cluster.admin("breaker", "open", "colocated-1", "nope")
    cluster.wait_idle()


def test_admin_refuses_a_wrong_token(cluster):
    from pdd.admin.client import AdminError, call
    from pdd.security import admin_client_security
    keys = admin_client_security(cluster.cfg.security.keys_dir)   # an operator's key, a wrong token
    with pytest.raises(AdminError, match="bad admin token"):
        call(cluster.cfg.router.admin_addr, "wrong", "status", security=keys)


def test_malformed_control_messages_are_dropped(cluster, offline):
    from pdd.protocol.messages import PROTOCOL_VERSION
    sock = cluster.control_socket(b"intruder")
    v = PROTOCOL_VERSION
    for payload in (b"garbage", msgpack.packb({"t": "tokens", "v": v, "worker_id": "intruder", "items": 5}),
                    msgpack.packb({"t": "tokens", "v": v, "worker_id": "intruder", "items": [{"epoch": "x"}]}),
                    msgpack.packb({"t": "nope", "v": v}), msgpack.packb({"t": "register", "v": 99})):
        sock.send(payload)
    sock.send_multipart([b"a", b"b", b"c"])
    # One well-formed message last: the router answers an unknown worker's heartbeat
    # with ReRegister, so once that arrives everything before it was handled.
    sock.send(msgpack.packb({"t": "heartbeat", "v": v, "worker_id": "intruder", "running": 0, "waiting": 0,
                             "free_blocks": 0, "total_blocks": 0}))
    assert msgpack.unpackb(sock.recv())["t"] == "reregister"
    sock.close()
    assert sorted(cluster.workers()) == ["colocated-0", "colocated-1"]
    expected = offline.generate(["still alive?"], SamplingParams(max_tokens=3, temperature=0.0))[0]
    r = client(cluster).completions.create(model=cluster.model_name, prompt="still alive?", max_tokens=3,
                                           temperature=0)
    assert r.choices[0].text == expected.text


def test_metrics_and_health(cluster):
    from tests.e2e import http_util as rq
    health = rq.get(cluster.url + "/health")
    assert health.status == 200 and health.json()["status"] == "ok"
    text = rq.get(cluster.url + "/metrics").body.decode()
    for name in ("pdd_time_to_first_token_seconds_bucket", "pdd_inter_token_latency_seconds_bucket",
                 "pdd_e2e_request_latency_seconds_bucket", "pdd_scheduler_iteration_latency_seconds_bucket",
                 "pdd_prefill_chunk_size_tokens_bucket", "pdd_decode_batch_size_requests_bucket",
                 "pdd_kv_cache_page_free_pages{", "pdd_prefix_cache_hit_ratio{", "pdd_scheduler_preemptions_total{",
                 "pdd_prefix_cache_hit_tokens_total{", "pdd_requests_total{", "pdd_kernels_compiled_in_service_total{"):
        assert f"\n{name}" in text, name
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == [cluster.model_name]


def test_errors_aiohttp_answers_are_counted(cluster):
    from tests.e2e import http_util as rq
    assert rq.post(cluster.url + "/v1/nope", {}).status == 404
    text = rq.get(cluster.url + "/metrics").body.decode()
    assert any(line.startswith('pdd_http_errors_total{status="404"}') and float(line.split()[-1]) >= 1
               for line in text.splitlines())
