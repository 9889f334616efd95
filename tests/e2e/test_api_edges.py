"""The OpenAI API where real clients meet its edges, on real clusters of each
layout (colocated, and 1 prefill + 1 decode): choices that end apart, errors
named by the field the client sent, logprobs whose bytes rebuild the text."""
from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.e2e import http_util

PROMPT = "The quick brown fox jumps over the lazy dog"


def completions(cluster, headers: dict | None = None, **body) -> dict:
    reply = http_util.post(cluster.url + "/v1/completions", {"model": cluster.model_name, **body},
                           headers=headers)
    assert reply.status == 200, reply.body
    return reply.json()


def test_a_choice_ended_by_a_stop_string_stops_its_worker_while_the_others_run_on(layout):
    """n = 2: choice 0 meets a stop string in its first tokens, choice 1 never
    does and runs to max_tokens. Choice 0's request ends there, by the stop,
    not at max_tokens when the whole response is done."""
    body = dict(prompt=PROMPT, max_tokens=200, temperature=1.0, seed=42, n=2, ignore_eos=True)
    first, second = (c["text"] for c in completions(layout, **body)["choices"])
    stop = next(first[i:i + 4] for i in range(min(40, len(first) - 4))
                if first[i:i + 4] not in second and "\ufffd" not in first[i:i + 4])
    rid = f"stop-apart-{layout.layout}"
    choices = completions(layout, headers={"X-Request-Id": rid}, stop=[stop], **body)["choices"]
    assert [c["finish_reason"] for c in choices] == ["stop", "length"]
    assert choices[0]["text"] == first[:first.index(stop)] and choices[1]["text"] == second
    traced, = layout.admin("trace", f"{rid}-0")
    assert traced["finish_reason"] == "stop"
    assert traced["output_tokens"] < body["max_tokens"]


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_answer_longer_than_the_context_is_refused_naming_the_field_the_client_sent(layout, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client(layout).chat.completions.create(model=layout.model_name, messages=[{"role": "user", "content": "hi"}],
                                               **{field: 100_000})
    error = refused.value.body
    assert error["param"] == field and error["code"] == "context_length_exceeded"
    assert error["message"].startswith(f"{field}: ") and "100000" in error["message"]


SPLIT = "日本語 😀 ok"   # its characters are several byte tokens each: each piece's text is U+FFFD


def test_chat_logprob_bytes_rebuild_the_answer_where_characters_are_split_over_tokens(layout):
    """OpenAI's "bytes" are there for exactly this: joined, they are the answer's UTF-8."""
    ask = dict(model=layout.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
               temperature=0, logprobs=True, top_logprobs=2, extra_body={"guided_choice": [SPLIT]})
    answer = client(layout).chat.completions.create(**ask).choices[0]
    assert answer.message.content == SPLIT
    entries = answer.logprobs.content
    assert any(e.token == "\ufffd" for e in entries)
    assert bytes(b for e in entries for b in e.bytes).decode() == SPLIT
    streamed = [e for chunk in client(layout).chat.completions.create(stream=True, **ask)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in entries]


def test_the_prompt_of_a_list_that_does_not_fit_the_context_is_named(layout):
    """Of lm-eval's batch of prompts, the error says which one is too long."""
    context = http_util.get(layout.url + "/v1/models").json()["data"][0]["max_model_len"]
    create = client(layout).completions.create
    with pytest.raises(openai.BadRequestError) as refused:
        create(model=layout.model_name, prompt=[[1, 2, 3], [300] * (context + 4), [5]], max_tokens=1)
    assert refused.value.body["param"] == "prompt[1]"
    assert f"the prompt has {context + 4} tokens" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        create(model=layout.model_name, prompt=[[1, 2, 3], [5], [300] * (context - 4)], max_tokens=16)
    error = refused.value.body
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert f"{context - 4} prompt tokens (prompt[2]) + max_tokens 16" in error["message"]


def test_a_request_id_in_flight_already_serves_a_second_request_with_choices(layout):
    """A gateway retrying keeps its X-Request-Id: while the first request (n = 2)
    streams, the second, with the same id and n = 2, is served too (not a 503)."""
    rid = f"retried-{layout.layout}"

    async def main():
        async with aiohttp.ClientSession() as session:
            first = await session.post(layout.url + "/v1/completions", headers={"X-Request-Id": rid}, json={
                "model": layout.model_name, "prompt": PROMPT, "n": 2, "max_tokens": 3000, "ignore_eos": True,
                "stream": True})
            await first.content.readline()      # its first chunk: both of its choices are in flight
            async with session.post(layout.url + "/v1/completions", headers={"X-Request-Id": rid}, json={
                    "model": layout.model_name, "prompt": PROMPT, "n": 2, "max_tokens": 4}) as second:
                body = await second.json()
            in_flight = {r["request_id"] for r in layout.admin("requests")}
            first.close()
            return second.status, body, in_flight

    status, body, in_flight = asyncio.run(main())
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert f"{rid}-0" in in_flight   # the first was in flight all along
