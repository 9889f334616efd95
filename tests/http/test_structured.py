"""Structured-output and tool-calling fields of a request (pdd.http.structured),
and reading tool calls from the generated text (pdd.http.tools)."""
from __future__ import annotations

import json
import random

import orjson
import pytest

from pdd.api import StructuredOutput
from pdd.grammar import GrammarCompiler
from pdd.http.schemas import parse_chat_request, parse_completion_request
from pdd.http.structured import check
from pdd.http.tools import ToolCallReader, ToolFormat, detect, forced_grammar
from pdd.http.validate import APIError
from pdd.model.tokenizer import Tokenizer

MODELS = ["tiny"]
MSGS = [{"role": "user", "content": "hi"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time"}}]
HERMES = ToolFormat("hermes", "<tool_call>", "arguments")
LLAMA = ToolFormat("llama3_json", "", "parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "arguments")


def chat(**fields):
    """Parsed, and its structured output compiled (what the app does next, off its loop)."""
    req = parse_chat_request(orjson.dumps({"model": "tiny", "messages": MSGS, **fields}), MODELS)
    check(req.sampling.structured_output, req.structured_param)
    return req


def refused(param: str, *words: str, **fields) -> None:
    with pytest.raises(APIError) as info:
        chat(**fields)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    for w in words:
        assert w in info.value.message, (w, info.value.message)


# ---------------------------------------------------------------- structured outputs

@pytest.mark.parametrize("fields, want", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PARAMS, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(PARAMS))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, StructuredOutput("json_object")),
    ({"guided_json": PARAMS}, StructuredOutput("json_schema", json.dumps(PARAMS))),
    ({"guided_json": json.dumps(PARAMS)}, StructuredOutput("json_schema", json.dumps(PARAMS))),
    ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutput("choice", '["a", "b"]')),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutput("grammar", 'root ::= "x"')),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutput("regex", "a+")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    ({"guided_json": None, "guided_choice": [], "response_format": {"type": "text"}}, None),
])
def test_structured_output_fields(fields, want):
    assert chat(**fields).sampling.structured_output == want
    completion = parse_completion_request(orjson.dumps({"model": "tiny", "prompt": "x", **fields}), MODELS)
    assert completion.sampling.structured_output == want


def test_many_choices_pass():
    """2,500 choices: one lexeme (pdd.grammar), not a parser row of 2,500 items."""
    choices = [f"ch{i}" for i in range(2500)]
    assert chat(guided_choice=choices).sampling.structured_output == StructuredOutput("choice", json.dumps(choices))


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format.type", ["text, json_object, json_schema"]),
    ({"response_format": {}}, "response_format.type", ["is required"]),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", ["is required"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PARAMS}}},
     "response_format.json_schema.name", ["is required"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": 3}}}},
     "response_format", ["invalid json_schema"]),
    ({"guided_json": "{not json"}, "guided_json", ["not valid JSON"]),
    ({"guided_json": {"type": "foo"}}, "guided_json", ["invalid json_schema", "foo"]),
    ({"guided_regex": "a(b"}, "guided_regex", ["invalid regex", "unclosed group"]),
    ({"guided_json": [1]}, "guided_json", ["a JSON schema object"]),
    ({"guided_regex": 5}, "guided_regex", ["a non-empty string"]),
    ({"guided_grammar": "root ::= (("}, "guided_grammar", ["grammar"]),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", ["only one of", "'guided_regex'"]),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", ["only one of"]),
    ({"structured_outputs": {"choice": "x"}}, "structured_outputs.choice", ["non-empty array"]),
    # Grammars that compile but fail once run (issue 35): an empty language, a
    # lexer out of fuel, a parser row over max_items_in_row.
    ({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}, "guided_json",
     ["invalid json_schema"]),
    ({"guided_regex": "(a{3000}){3000}"}, "guided_regex", ["invalid regex", "too many expressions"]),
    ({"guided_grammar": "start: " + " | ".join(f'"ch{i}"' for i in range(2500))}, "guided_grammar",
     ["max is 2000"]),
])
def test_bad_structured_outputs(fields, param, words):
    refused(param, *words, **fields)



def nested_schema(depth: int) -> str:
    """A schema `depth` objects deep, as JSON text (deeper than orjson.dumps writes)."""
    text = '{"type": "object"}'
    for _ in range(depth):
        text = '{"type": "object", "properties": {"a": ' + text + '}}'
    return text


@pytest.mark.parametrize("field, param", [
    ('"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": %s}}' % nested_schema(500),
     "response_format.json_schema.schema"),
    ('"guided_json": %s' % nested_schema(500), "guided_json"),
    ('"guided_json": %s' % json.dumps("[" * 5000 + "]" * 5000), "guided_json"),
])
def test_a_schema_nested_too_deep_is_a_400(field, param):
    """Deeper than Python's json encoder or decoder recurses (the body parser allows it)."""
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], %s}' % field
    with pytest.raises(APIError) as info:
        req = parse_chat_request(body.encode(), MODELS)
        check(req.sampling.structured_output, req.structured_param)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert "nested too deep" in info.value.message

# ---------------------------------------------------------------- tools in the request

def test_tools_go_to_the_template_and_auto_leaves_the_output_free():
    req = chat(tools=TOOLS)
    assert req.template_args["tools"] == TOOLS
    assert req.tool_format == HERMES and req.sampling.structured_output is None


def test_tool_choice_none_keeps_the_text_as_content():
    req = chat(tools=TOOLS, tool_choice="none")
    assert req.tool_format is None and req.sampling.structured_output is None


def test_a_response_format_beside_tools_is_the_content():
    """The output is then the format's content: no call is read from it."""
    req = chat(tools=TOOLS, response_format={"type": "json_object"})
    assert req.tool_format is None and req.sampling.structured_output == StructuredOutput("json_object")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_are_a_grammar(choice):
    req = chat(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    assert req.sampling.structured_output.kind == "grammar"


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [{"type": "function"}]}, "tools[0].function", ["is required"]),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", ["\"function\""]),
    ({"tools": [{"function": {"name": ""}}]}, "tools[0].function.name", ["letters"]),
    ({"tools": [{"function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters", ["an object"]),
    ({"tools": [{"function": {"name": "f", "parameters": {"type": "nope"}}}], "tool_choice": "required"},
     "tools", ["invalid grammar"]),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", ["more than once"]),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ["none, auto, required"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     ["'nope'", "not in 'tools'"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name", ["is required"]),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice", ["a string or an object"]),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     ["cannot be combined"]),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", ["a boolean"]),
])
def test_bad_tools(fields, param, words):
    refused(param, *words, **fields)


def test_history_with_tool_calls_and_results():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    req = chat(messages=msgs, tools=TOOLS)
    # Templates take the arguments as an object (as transformers' do).
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert req.messages[2] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "x", "tool_calls": [{"id": "c"}]}, "messages[1].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": {"id": "c"}}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": None}, "messages[1].content"),
])
def test_bad_history(message, param):
    refused(param, messages=MSGS + [message])


def test_the_tiny_template_renders_a_tool_history(tiny_model):
    """A template that knows nothing of tools still renders their messages."""
    tok = Tokenizer(tiny_model)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = chat(messages=MSGS + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "c", "content": "ok"}], tools=TOOLS)
    assert "<|im_start|>tool\nok<|im_end|>" in tok.apply_chat_template(req.messages, **req.template_args)


# ---------------------------------------------------------------- the model's format

class _Tok:
    def __init__(self, template, ids=None):
        self.chat_template, self.ids = template, ids or {}

    def token_to_id(self, token):
        return self.ids.get(token)


@pytest.mark.parametrize("template, want", [
    ("{% if tools %}<tool_call>{% endif %}", "hermes"),
    ("{{ '<|python_tag|>' }} ipython", "llama3_json"),
    ("[AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral"),
    (None, "hermes"),
])
def test_format_from_the_template(template, want):
    assert detect(_Tok(template)) == want


TEXTS = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"n": [1, {"x": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris", "n": [1, {"x": "}"}]}'), ("get_time", "{}")]),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "g", "parameters": {"a": 12}}',
     None, [("get_weather", '{"city": "Paris"}'), ("g", '{"a": 12}')]),
    (LLAMA, '<|python_tag|>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    (MISTRAL, 'ok [TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {"z": 1.5}}]',
     "ok", [("a", '{"q": "x"}'), ("b", '{"z": 1.5}')]),
    (HERMES, '<tool_call>\n{"arguments": {"name": "Bob"}, "name": "greet"}\n</tool_call>', None,
     [("greet", '{"name": "Bob"}')]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, [("f", '{"a": 1}')]),
    (HERMES, "plain answer with a <tool text", "plain answer with a <tool text", []),
    (HERMES, "an answer\n\n", "an answer\n\n", []),
    (LLAMA, 'hello {"name": 1}', 'hello {"name": 1}', []),
    (LLAMA, '{"a": 1}', '{"a": 1}', []),
]


@pytest.mark.parametrize("fmt, text, content, calls", TEXTS)
def test_calls_read_from_the_whole_text(fmt, text, content, calls):
    got_content, got_calls = ToolCallReader.read(fmt, text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)


@pytest.mark.parametrize("fmt, text, content, calls", TEXTS)
def test_stream_deltas_reassemble_to_the_whole_texts_calls(fmt, text, content, calls):
    for trial in range(12):
        rnd, reader, deltas, i = random.Random(trial), ToolCallReader(fmt), [], 0
        while i < len(text):
            n = rnd.randint(1, 6)
            deltas += reader.feed(text[i:i + n])
            i += n
        deltas += reader.finish()
        streamed, seen = {}, []
        for d in deltas:
            for tc in d.get("tool_calls", []):
                if tc["index"] not in streamed:   # OpenAI's first delta of a call: id, type, name
                    assert set(tc) == {"index", "id", "type", "function"} and tc["function"]["arguments"] == ""
                    streamed[tc["index"]] = [tc["function"]["name"], ""]
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                streamed[tc["index"]][1] += tc["function"]["arguments"]
            seen.append(d)
        assert ("".join(d.get("content", "") for d in deltas) or None) == content
        assert [tuple(streamed[k]) for k in sorted(streamed)] == calls


@pytest.mark.parametrize("fmt", [HERMES, LLAMA, MISTRAL])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_forcing_grammar_accepts_what_the_reader_reads(tiny_model, fmt, parallel):
    """The forced call's grammar takes the format's text of a valid call (and no
    other function); the reader reads that text back to the same call."""
    compiler = GrammarCompiler((tiny_model / "tokenizer.json").read_text(), 1024, (1023,))
    tok = Tokenizer(tiny_model)
    one = {"name": "get_weather", fmt.args_key: {"city": "Paris"}}
    body = json.dumps(one)
    text = {"hermes": f"<tool_call>\n{body}\n</tool_call>", "llama3_json": body,
            "mistral": f"[TOOL_CALLS][{body}]"}[fmt.name]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, ok in (("required", True), (named, True),
                       ({"type": "function", "function": {"name": "get_time"}}, False)):
        matcher = compiler.matcher(forced_grammar(fmt, TOOLS, choice, parallel))
        accepted = matcher.inner.consume_tokens(tok.encode(text, add_special_tokens=False))
        assert accepted == ok and (matcher.inner.is_accepting() or not ok)
    _, calls = ToolCallReader.read(fmt, text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
