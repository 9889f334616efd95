"""JSON objects are closed unless the schema opens them (issue 37), as vLLM's
default backend reads a schema: response_format json_schema (strict or not),
guided_json, structured_outputs.json and the arguments of a forced call. The
grammar the request compiles to refuses an extra key at any depth; a schema
that allows extra keys keeps them; parts of an intersection keep each other's
properties. End to end: a strict tool and a json_schema through raw HTTP,
random weights, many samples, never an extra key."""
from __future__ import annotations

import json

import aiohttp
import orjson
import pytest

from pdd import LLM
from pdd.closed_schema import closed
from pdd.grammar import GrammarCompiler
from pdd.http.schemas import parse_chat_request
from pdd.http.structured import check
from pdd.model.tokenizer import Tokenizer
from tests.http.engine_server import post, run, serve

# Open by JSON Schema's letter everywhere: the top, a nested object, an array's
# items, a $defs entry behind anyOf.
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string"},
                         "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                         "tags": {"type": "array",
                                  "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
                         "pet": {"anyOf": [{"$ref": "#/$defs/Dog"}, {"type": "null"}]}},
          "required": ["city"],
          "$defs": {"Dog": {"type": "object", "properties": {"name": {"type": "string"}}}}}
GOOD = '{"city": "Paris", "where": {"lat": 1.5}, "tags": [{"k": "a"}], "pet": {"name": "Rex"}}'
EXTRA = ['{"city": "Paris", "x": 1}', '{"city": "Paris", "where": {"lat": 1.5, "x": 1}}',
         '{"city": "Paris", "tags": [{"k": "a", "x": 1}]}', '{"city": "Paris", "pet": {"name": "Rex", "x": 1}}']
MSGS = [{"role": "user", "content": "hi"}]


def fmt(strict):
    spec = {"name": "place", "schema": SCHEMA}
    if strict is not None:
        spec["strict"] = strict
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


FORMS = {"json_schema strict": fmt(True), "json_schema not strict": fmt(False), "json_schema": fmt(None),
         "guided_json": {"guided_json": SCHEMA}, "structured_outputs.json": {"structured_outputs": {"json": SCHEMA}}}


@pytest.fixture(scope="module")
def accepts(tiny_model):
    """Whether the grammar of a chat request (its fields) takes `text` whole."""
    compiler = GrammarCompiler((tiny_model / "tokenizer.json").read_text(), 1024, (1023,))
    tok = Tokenizer(tiny_model)

    def accepts(fields: dict, text: str) -> bool:
        req = parse_chat_request(orjson.dumps({"model": "tiny", "messages": MSGS, **fields}), ["tiny"])
        check(req.sampling.structured_output, req.structured_param)
        m = compiler.matcher(req.sampling.structured_output)
        return m.inner.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.inner.is_accepting()
    return accepts


@pytest.mark.parametrize("form", list(FORMS))
def test_a_schema_without_additional_properties_refuses_extra_keys(accepts, form):
    assert accepts(FORMS[form], GOOD)
    for text in EXTRA:
        assert not accepts(FORMS[form], text), text


# The same without $defs (a tool's $defs were not found before issue 37 either).
FLAT = {**SCHEMA, "properties": {k: v for k, v in SCHEMA["properties"].items() if k != "pet"}}
del FLAT["$defs"]


@pytest.mark.parametrize("schema", [SCHEMA, FLAT], ids=["$defs", "flat"])
@pytest.mark.parametrize("strict", [True, None])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "locate"}}])
def test_a_forced_calls_arguments_refuse_extra_keys(accepts, schema, strict, choice):
    function = {"name": "locate", "parameters": schema}
    if strict is not None:
        function["strict"] = strict
    fields = {"tools": [{"type": "function", "function": function}], "tool_choice": choice}

    def call(args: str) -> str:
        return '<tool_call>\n{"name": "locate", "arguments": ' + args + '}\n</tool_call>'
    good, extra = (GOOD, EXTRA) if schema is SCHEMA else (GOOD.split(', "pet"')[0] + "}", EXTRA[:3])
    assert accepts(fields, call(good))   # its $defs found where the parameters sit in the call
    for text in extra:
        assert not accepts(fields, call(text)), text


@pytest.mark.parametrize("opened", [{"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                                    {"unevaluatedProperties": True}])
def test_a_schema_that_allows_extra_keys_keeps_them(accepts, opened):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, **opened}
    if "unevaluatedProperties" in opened:   # llguidance does not take it: only what `closed` makes of it
        assert closed(schema) == schema
        return
    assert accepts({"guided_json": schema}, '{"city": "Paris", "x": 1}')


def test_parts_of_an_intersection_keep_each_others_properties(accepts):
    """Closing each part of an allOf (or an object beside its $ref) would refuse
    what the other part names: those stay open."""
    base = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for schema in ({"allOf": [base, {"type": "object", "properties": {"b": {"type": "integer"}}}]},
                   {"$defs": {"Base": base}, "allOf": [{"$ref": "#/$defs/Base"},
                                                       {"properties": {"b": {"type": "integer"}}}]},
                   {"$defs": {"Base": base}, "$ref": "#/$defs/Base", "type": "object",
                    "properties": {"b": {"type": "integer"}}}):
        assert accepts({"guided_json": schema}, '{"a": 1, "b": 2}'), schema


def test_closed_writes_only_where_unset():
    schema = {"type": "object", "properties": {"a": {"type": "object"}, "b": {"const": {"x": 1}, "type": "object"}},
              "additionalProperties": {"type": "object", "properties": {}}, "x-guidance": {"lenient": True}}
    before = json.dumps(schema)
    assert closed(schema) == {
        "type": "object", "properties": {"a": {"type": "object", "additionalProperties": False},
                                         "b": {"const": {"x": 1}, "type": "object"}},
        "additionalProperties": {"type": "object", "properties": {}, "additionalProperties": False},
        "x-guidance": {"lenient": True}}
    assert json.dumps(schema) == before   # the caller's schema is not changed


def test_json_object_stays_any_object(accepts):
    assert accepts({"response_format": {"type": "json_object"}}, '{"x": 1, "y": {"z": 2}}')


# ---------------------------------------------------------------- end to end

# Bounded, so that random weights end it well within max_tokens.
BOUNDED = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Lima"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                          "at": {"type": "object", "properties": {"ok": {"type": "boolean"}}}},
           "required": ["city"]}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model))


def test_random_weights_never_write_an_extra_key(llm):
    """A strict tool's arguments and a json_schema's output, 8 samples each:
    only the keys the schema names (without closing, random weights add keys
    in most of them)."""
    tool = {"type": "function", "function": {"name": "locate", "strict": True, "parameters": BOUNDED}}
    bodies = [{"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": BOUNDED,
                                                                          "strict": True}}}]

    async def main():
        server, url = await serve(llm)
        async with aiohttp.ClientSession() as s:
            outs = [await post(s, url, {"model": "tiny", "messages": MSGS, "max_tokens": 200, "seed": seed, **body})
                    for body in bodies for seed in range(8)]
        await server.cleanup()
        return outs

    for status, out in run(main()):
        assert status == 200, out
        choice = out["choices"][0]
        message = choice["message"]
        text = message["tool_calls"][0]["function"]["arguments"] if message.get("tool_calls") else message["content"]
        assert choice["finish_reason"] in ("stop", "tool_calls"), choice
        value = json.loads(text)
        assert set(value) <= {"city", "n", "at"} and set(value.get("at", {})) <= {"ok"}, value
