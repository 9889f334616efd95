"""Structured outputs and tool calling through the official `openai` client
against `pdd up` (tiny random-weight model: only the grammar makes the output
valid). The same requests give the same output colocated, 1P+1D, and when the
decode worker is killed mid-stream (the request migrates with its tokens so
far; the new worker's matcher replays them)."""
from __future__ import annotations

import json
import os
import signal
import threading
from typing import Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.e2e.cluster import UpCluster
from tests.e2e.test_disagg import metric
from tests.e2e.test_disagg_faults import _wait_for, assert_all_free


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                          "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A seed whose json_object (keys and strings unbounded) ends within max_tokens
# on the tiny model; most random-weight objects run on.
JSON_OBJECT_SEED = 7


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, tiny_model):
    with UpCluster(tmp_path_factory.mktemp("co"), tiny_model, "--mode", "colocated", "--workers", "1") as c:
        yield c


@pytest.fixture(scope="module")
def disagg(tmp_path_factory, tiny_model):
    # Faults at run time: the kill test slows this cluster's decode steps itself.
    with UpCluster(tmp_path_factory.mktemp("pd"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "1", env={"PDD_ROUTER__ALLOW_FAULT_INJECTION": "1"}) as c:
        yield c


def client(cluster) -> OpenAI:
    return OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=300)


def forced_call(**kw) -> dict:
    return dict(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                parallel_tool_calls=False, seed=3, max_tokens=60, **kw)


def schema_request(**kw) -> dict:
    return dict(messages=[{"role": "user", "content": "A person, please."}], seed=5, max_tokens=120,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}, **kw)


def stream_text(cl: OpenAI, model: str, started: threading.Event | None = None, **request) -> dict:
    """A streamed chat answer reassembled: content, and each call's id, name
    and argument text from its deltas (the first delta of a call has its id,
    type and name; later ones add argument text)."""
    content, calls, finish, chunks = "", {}, None, 0
    for chunk in cl.chat.completions.create(model=model, stream=True, **request):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None, tc
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
        chunks += 1
        if started is not None and chunks >= 3:
            started.set()
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def answers(cluster) -> dict:
    """Every kind of request, its output checked; what must match across layouts."""
    cl, model = client(cluster), cluster.model_name
    out = {}

    parsed = cl.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Who?"}],
                                       response_format=Person, seed=11, max_tokens=80)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person), parsed.choices[0].message.content
    out["parse"] = person.model_dump()

    r = cl.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give me a JSON object."}],
                                   response_format={"type": "json_object"}, seed=JSON_OBJECT_SEED, max_tokens=150)
    assert r.choices[0].finish_reason == "stop"
    out["json_object"] = json.loads(r.choices[0].message.content)
    assert isinstance(out["json_object"], dict)

    r = cl.chat.completions.create(model=model, **schema_request())
    out["json_schema"] = json.loads(r.choices[0].message.content)
    jsonschema.validate(out["json_schema"], SCHEMA)
    assert stream_text(cl, model, **schema_request()) == {"content": r.choices[0].message.content, "calls": [],
                                                          "finish": "stop"}

    r = cl.chat.completions.create(model=model, messages=ASK, seed=2, max_tokens=20,
                                   extra_body={"guided_regex": "[a-z]{3}-[0-9]{2}"})
    out["guided_regex"] = r.choices[0].message.content
    assert len(out["guided_regex"]) == 6 and out["guided_regex"][3] == "-"
    r = cl.chat.completions.create(model=model, messages=ASK, seed=2, max_tokens=20,
                                   extra_body={"guided_choice": ["sunny", "rainy"]})
    out["guided_choice"] = r.choices[0].message.content
    assert out["guided_choice"] in ("sunny", "rainy")

    r = cl.chat.completions.create(model=model, **forced_call())
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    out["call"] = {"name": call.function.name, "arguments": call.function.arguments}
    streamed = stream_text(cl, model, **forced_call())
    assert streamed == {"content": None, "calls": [out["call"]], "finish": "tool_calls"}

    r = cl.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, seed=4, max_tokens=60)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    out["required"] = calls[0].function.name

    # The history round trip: the call (content null) and its result go back in.
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})}]
    r = cl.chat.completions.create(model=model, messages=history, tools=TOOLS, seed=6, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    return out


@pytest.fixture(scope="module")
def colocated_answers(colocated) -> dict:
    return answers(colocated)


def test_colocated(colocated, colocated_answers):
    assert set(colocated_answers) == {"parse", "json_object", "json_schema", "guided_regex", "guided_choice",
                                      "call", "required"}
    assert_all_free(colocated)


def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(colocated):
    cl = client(colocated)
    for extra, param in (({"response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
                          "response_format"),
                         ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
                         ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
                           "tool_choice": "required"}, "tools")):
        with pytest.raises(openai.BadRequestError) as info:
            cl.chat.completions.create(model=colocated.model_name, messages=ASK, max_tokens=4, **extra)
        assert info.value.body["param"] == param, info.value.body
    assert cl.chat.completions.create(model=colocated.model_name, messages=ASK, max_tokens=2).choices


def test_disaggregated_gives_the_colocated_answers(disagg, colocated_answers):
    assert answers(disagg) == colocated_answers
    assert_all_free(disagg)


def test_decode_worker_killed_mid_stream(disagg, colocated_answers):
    """1P+1D with slow decode steps; once both streams have tokens the decode
    worker is killed: the requests migrate (prompt + tokens so far) and the
    streams end as colocated ones do. (`pdd up` restarts it, without the fault.)"""
    c = disagg
    c.admin("faults", "set", "decode.step_delay_s=0.1", "decode-0")
    try:
        _wait_for(lambda: c.admin("faults")["workers"].get("decode-0") == {"decode.step_delay_s": 0.1}, 30.0,
                  "the decode steps slowed")
        cl, model = client(c), c.model_name
        pid = c.workers()["decode-0"]["pid"]
        migrations = metric(c, "pdd_request_migrations_total")
        started = [threading.Event(), threading.Event()]
        results = {}

        def run(key, event, request):
            results[key] = stream_text(cl, model, event, **request)
        threads = [threading.Thread(target=run, args=("schema", started[0], schema_request())),
                   threading.Thread(target=run, args=("call", started[1], forced_call()))]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(120), "a stream got no tokens"
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(300)
        assert json.loads(results["schema"]["content"]) == colocated_answers["json_schema"]
        assert results["call"]["calls"] == [colocated_answers["call"]]
        assert metric(c, "pdd_request_migrations_total") > migrations
        _wait_for(lambda: c.workers().get("decode-0", {}).get("pid") not in (None, pid), 120.0, "decode-0 back")
        assert_all_free(c)
    finally:
        c.admin("faults", "clear")
