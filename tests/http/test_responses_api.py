"""The Responses API (POST /v1/responses, pdd.http.responses_api) through the
official openai client against a real server whose tokens come from the tiny
random-weight model (tests/http/engine_server.py): text whole and streamed,
the same greedy text as chat, a tool round trip, structured output by
text.format, previous_response_id, and the fields it refuses."""
from __future__ import annotations

import asyncio
import json
import typing

import aiohttp
import openai
import orjson
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from pdd import LLM
from pdd.http.app import build_app, serve_http
from pdd.http.stored_responses import ResponseStore
from pdd.model.tokenizer import Tokenizer
from pdd.router.requests import RequestState, TokenEvent
from tests.http.engine_server import EngineRouter, post, run, serve

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                          "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER}]
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model))


def with_client(llm, body):
    """body(client, url, session) run against a fresh server."""
    async def main():
        server, url = await serve(llm)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            async with aiohttp.ClientSession() as s:
                return await body(client, url, s)
        finally:
            await client.close()
            await server.cleanup()
    return run(main())


def test_text_whole_and_streamed_match_chat_greedy(llm):
    """The same greedy text as /v1/chat/completions for the same messages,
    whole and streamed; the stream's events in the Responses order."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]

    async def body(client, url, s):
        status, chat = await post(s, url, {"model": "tiny", "messages": messages, "max_tokens": 12,
                                           "temperature": 0})
        assert status == 200, chat
        whole = await client.responses.create(model="tiny", instructions="Be brief.", input="Say hello",
                                              max_output_tokens=12, temperature=0)
        events = [e async for e in await client.responses.create(
            model="tiny", instructions="Be brief.", input=[{"role": "user", "content": "Say hello"}],
            max_output_tokens=12, temperature=0, stream=True)]
        return chat, whole, events

    chat, whole, events = with_client(llm, body)
    text = chat["choices"][0]["message"]["content"]
    assert text and whole.output_text == text
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == ("incomplete" if chat["choices"][0]["finish_reason"] == "length" else "completed")
    item, = whole.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert whole.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert whole.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens

    kinds = [e.type for e in events]
    assert kinds[:5] == STREAM_ORDER, kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and final.id == events[0].response.id


def test_stream_helper_parses_the_final_response(llm):
    """client.responses.stream() with a pydantic text_format: the events
    accumulate into the final response, its output parsed into the model."""
    class Weather(pydantic.BaseModel):
        city: typing.Literal["Paris", "Tokyo", "Lima"]
        unit: typing.Literal["c", "f"]

    async def body(client, url, s):
        async with client.responses.stream(model="tiny", input="The weather", text_format=Weather,
                                           max_output_tokens=200, temperature=0) as stream:
            kinds = [e.type async for e in stream]
            final = await stream.get_final_response()
        return kinds, final

    kinds, final = with_client(llm, body)
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert final.status == "completed" and isinstance(final.output_parsed, Weather)
    assert final.output_parsed == Weather.model_validate_json(final.output_text)


def test_tool_round_trip(llm):
    """A forced call (tool_choice names the function) comes back as a
    function_call item; its output in the next request's input, after the
    call, is read: the answer is text (tool_choice none)."""
    async def body(client, url, s):
        first = await client.responses.create(
            model="tiny", input="What is the weather in Paris?", tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200, temperature=0)
        call = next(item for item in first.output if item.type == "function_call")
        streamed = [e async for e in await client.responses.create(
            model="tiny", input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=200, temperature=0, stream=True)]
        second = await client.responses.create(
            model="tiny", tools=TOOLS, tool_choice="none", max_output_tokens=8, temperature=0,
            input=[{"role": "user", "content": "What is the weather in Paris?"},
                   {"type": "function_call", "call_id": call.call_id, "name": call.name,
                    "arguments": call.arguments},
                   {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
        # The same conversation as chat: the same prompt (the call and its output templated).
        status, chat = await post(s, url, {
            "model": "tiny", "max_tokens": 8, "temperature": 0, "tool_choice": "none",
            "tools": [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
            "messages": [{"role": "user", "content": "What is the weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": call.call_id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}]})
        assert status == 200, chat
        # The same again from the store: the first response's conversation, then the tool's output.
        chained = await client.responses.create(
            model="tiny", tools=TOOLS, tool_choice="none", max_output_tokens=8, temperature=0,
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
        return first, call, streamed, second, chat, chained

    first, call, streamed, second, chat, chained = with_client(llm, body)
    assert first.status == "completed", first
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Tokyo", "Lima") and args["unit"] in ("c", "f")
    # Streamed: the call's item, its argument deltas adding up to the done arguments.
    kinds = [e.type for e in streamed]
    assert kinds[:3] == STREAM_ORDER[:3] and kinds[-1] == "response.completed", kinds
    added = next(e for e in streamed if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments and json.loads(done.arguments)["unit"] in ("c", "f")
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    final_call, = streamed[-1].response.output
    assert final_call.type == "function_call" and final_call.arguments == done.arguments
    # The round trip: the tool's output was in the prompt, as chat templates it.
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert second.output_text and second.output_text == chat["choices"][0]["message"]["content"]
    assert chained.usage.input_tokens == second.usage.input_tokens and chained.output_text == second.output_text


def test_structured_output_by_text_format(llm):
    """text.format json_schema: the output parses and holds to the schema; json_object: a JSON object."""
    async def body(client, url, s):
        schema = await client.responses.create(
            model="tiny", input="The weather as JSON", max_output_tokens=200, temperature=0,
            text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
        streamed = [e async for e in await client.responses.create(
            model="tiny", input="The weather as JSON", max_output_tokens=200, temperature=0, stream=True,
            text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})]
        return schema, streamed

    schema, streamed = with_client(llm, body)
    assert schema.status == "completed", schema
    value = json.loads(schema.output_text)
    assert set(value) == {"city", "unit"} and value["city"] in ("Paris", "Tokyo", "Lima")
    assert value["unit"] in ("c", "f")
    assert schema.text.format.type == "json_schema"
    done = next(e for e in streamed if e.type == "response.output_text.done")
    assert json.loads(done.text) == value


def test_previous_response_id_continues_the_conversation(llm):
    """The stored conversation (input and output) comes before the new input:
    the prompt is the one chat sees for the whole conversation. store false
    keeps nothing; an unknown id is a 400 naming the field. The same
    conversation given whole (the output items as input) is the same prompt."""
    async def body(client, url, s):
        first = await client.responses.create(model="tiny", input="Hi there", max_output_tokens=6, temperature=0)
        second = await client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                               max_output_tokens=6, temperature=0)
        status, chat = await post(s, url, {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [
            {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}]})
        # The conversation kept by the client: the output items given back as input, as they came.
        replayed = await client.responses.create(
            model="tiny", max_output_tokens=6, temperature=0,
            input=[{"role": "user", "content": "Hi there"}, *[item.model_dump() for item in first.output],
                   {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}])
        unstored = await client.responses.create(model="tiny", input="Hi", store=False, max_output_tokens=2)
        errors = []
        for rid in (unstored.id, "resp_nothing"):
            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(model="tiny", input="x", previous_response_id=rid)
            errors.append(info.value)
        return first, second, chat, replayed, errors

    first, second, chat, replayed, errors = with_client(llm, body)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert second.output_text and second.output_text == chat["choices"][0]["message"]["content"]
    assert replayed.usage.input_tokens == second.usage.input_tokens and replayed.output_text == second.output_text
    for e in errors:
        assert e.body["param"] == "previous_response_id" and "not found" in e.body["message"]


def test_refused_and_ignored_fields(llm):
    """What pdd does not do is a 400 naming the field (in the Responses
    request's names); a field nothing reads is listed in X-Pdd-Ignored-Fields."""
    async def body(client, url, s):
        out = {}
        cases = {"tools[0].type": {"tools": [{"type": "web_search"}]},
                 "background": {"background": True},
                 "input[0].content[0].type": {"input": [{"role": "user", "content": [
                     {"type": "input_image", "image_url": "http://x"}]}]},
                 "max_output_tokens": {"max_output_tokens": 0},
                 # Chat's errors, in the Responses request's names (the instructions are message 0).
                 "input[1].content[0].text": {"instructions": "Be brief.", "input": [
                     {"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "input_text"}]}]},
                 "tools[0].name": {"tools": [{"type": "function", "name": "no spaces"}]},
                 "text.format.type": {"text": {"format": {"type": "yaml"}}},
                 "text.format.name": {"text": {"format": {"type": "json_schema", "schema": WEATHER}}},
                 "input[0].type": {"input": [{"type": "item_reference", "id": "msg_1"}]}}
        for param, fields in cases.items():
            async with s.post(url + "/v1/responses", json={"model": "tiny", "input": "hi", **fields}) as r:
                out[param] = (r.status, await r.json())
        async with s.post(url + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                                       "frobnicate": 1, "store": False}) as r:
            out["ignored"] = (r.status, r.headers.get("X-Pdd-Ignored-Fields"))
            # The response's id is the request's.
            assert (await r.json())["id"] == "resp_r0_" + r.headers["X-Request-Id"].removeprefix("resp-")
        return out

    out = with_client(llm, body)
    for param, (status, error) in out.items():
        if param == "ignored":
            assert (status, error) == (200, "frobnicate")
            continue
        assert status == 400 and error["error"]["param"] == param, (param, error)


def test_store_is_bounded():
    """The least recently used goes first, past the count or the size."""
    store = ResponseStore(max_entries=2, max_chars=1000)

    def put(rid: str, text: str) -> None:
        store.put({"id": rid}, [{"role": "user", "content": text}])

    for rid in ("a", "b", "c"):
        put(rid, rid)
    assert store.get("a") is None and store.get("b") and store.get("c") and len(store) == 2
    store.get("b")   # now the most recent
    put("d", "d")
    assert store.get("c") is None and store.get("b") and store.get("d")
    put("big", "x" * 600)
    put("big2", "y" * 600)
    assert store.get("big") is None and store.get("big2") and store.chars <= 1000
    assert store.delete("big2") and store.get("big2") is None and not store.delete("big2")


def test_bodies_hold_to_openai_types(llm):
    """The response object and every stream event validate as the openai
    package's types (pydantic, not the client's lenient construction)."""
    call = {"input": "hi", "max_output_tokens": 100, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False}

    async def body(client, url, s):
        out = []
        for fields in ({"input": "hi", "max_output_tokens": 5}, call):
            async with s.post(url + "/v1/responses", json={"model": "tiny", **fields}) as r:
                out.append(await r.json())
            async with s.post(url + "/v1/responses", json={"model": "tiny", **fields, "stream": True}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                out += [orjson.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
        return out

    bodies = with_client(llm, body)
    events = pydantic.TypeAdapter(ResponseStreamEvent)
    kinds = set()
    for b in bodies:
        if b.get("object") == "response":
            Response.model_validate(b)
        else:
            kinds.add(events.validate_python(b).type)
    assert {"response.output_text.delta", "response.function_call_arguments.done"} <= kinds


class FailingRouter(EngineRouter):
    """Every request gets some tokens, then its worker is lost."""

    async def submit_choices(self, prompt_token_ids, sampling, request_id, n, span=None):
        states = [RequestState(f"{request_id}-{i}", list(prompt_token_ids), sampling, []) for i in range(n)]
        for state in states:
            state.deliver(TokenEvent([100, 200, 300], False, None, None, 0))
            state.fail("the worker was lost and no other could take the request", 503)
        return states


def test_a_stream_that_fails_ends_with_response_failed(llm):
    """After the text so far: an error event, then response.failed carrying
    the error; nothing is stored."""
    async def main():
        app = build_app(FailingRouter(llm), Tokenizer(llm.engine.model_dir), ("tiny",))
        server = await serve_http(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/responses", json={"input": "hi", "stream": True}) as r:
                    events = [orjson.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
                async with s.post(url + "/v1/responses", json={
                        "input": "again", "previous_response_id": events[0]["response"]["id"]}) as r:
                    again = r.status
        finally:
            await server.cleanup()
        return events, again

    events, again = run(main())
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "the worker was lost and no other could take the request"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == events[-2]["message"]
    Response.model_validate(failed)
    pydantic.TypeAdapter(ResponseStreamEvent).validate_python(events[-2])
    assert again == 400


class TokenByTokenRouter(EngineRouter):
    """The engine's tokens delivered one an event, each in a loop iteration of
    its own, as a worker's arrive: the relay writes the stream's events."""

    async def submit_choices(self, prompt_token_ids, sampling, request_id, n, span=None):
        done = await super().submit_choices(prompt_token_ids, sampling, request_id, n, span)
        states = [RequestState(s.request_id, list(prompt_token_ids), sampling, []) for s in done]

        async def deliver(state, tokens, reason):
            for k, tok in enumerate(tokens):
                await asyncio.sleep(0)
                last = k == len(tokens) - 1
                state.deliver(TokenEvent([tok], last, reason if last else None, None, 0))

        for state, d in zip(states, done):
            self.tasks.add(asyncio.create_task(deliver(state, d.output_token_ids, d.finish_reason)))
        return states


def shown(output: list[dict]) -> list[tuple]:
    """Output items less their ids."""
    return [(i["type"], i.get("name"), i.get("arguments"), [p["text"] for p in i.get("content", [])])
            for i in output]


@pytest.mark.parametrize("fields", [{"input": "Say hello", "max_output_tokens": 12},
                                    {"input": "Weather?", "tools": TOOLS, "tool_choice": "required",
                                     "parallel_tool_calls": False, "max_output_tokens": 200}])
def test_stream_through_the_relay_is_the_whole_answer(llm, fields):
    """Token by token (the relay's path), the stream's final response has the
    output of the whole answer: the same text, the same call."""
    async def main():
        router = TokenByTokenRouter(llm)
        router.tasks = set()
        app = build_app(router, Tokenizer(llm.engine.model_dir), ("tiny",),
                        eos_token_ids=tuple(llm.engine.model_config.eos_token_ids))
        server = await serve_http(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        body = {"model": "tiny", "temperature": 0, **fields}
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/responses", json=body) as r:
                    whole = await r.json()
                async with s.post(url + "/v1/responses", json={**body, "stream": True}) as r:
                    events = [orjson.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
        finally:
            await server.cleanup()
        return whole, events

    whole, events = run(main())
    final = events[-1]["response"]
    assert events[-1]["type"] == f"response.{whole['status']}"
    assert shown(final["output"]) == shown(whole["output"]) and whole["output"]
    deltas = sum(1 for e in events if e["type"].endswith(".delta"))
    assert deltas > 1   # it came in pieces
