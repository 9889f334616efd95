"""Forced tool calls (`tool_choice` named or "required", issue 37): a call cut
by max_tokens is still the call, finish_reason "length"; a named function is
called exactly once, whatever `parallel_tool_calls` says; "required" takes one
call or more and may end after any. Through raw HTTP against a server whose
tokens come from the tiny random-weight model (tests/http/engine_server.py),
where only the grammar shapes the output; and the grammar itself."""
from __future__ import annotations

import json

import aiohttp
import pytest

from pdd import LLM
from pdd.grammar import GrammarCompiler
from pdd.http.tools import ToolCallReader, ToolFormat, forced_grammar
from pdd.model.tokenizer import Tokenizer
from tests.http.engine_server import post, post_stream, run, serve

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                          "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = ToolFormat("hermes", "<tool_call>", "arguments")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model))


def ask(**fields) -> dict:
    return {"model": "tiny", "messages": ASK, "tools": TOOLS, **fields}


# ---------------------------------------------------------------- cut by max_tokens

@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_cut_by_max_tokens_is_the_call_so_far(llm, choice):
    """Not the raw `<tool_call>` text as content: the call, its arguments as
    far as they got, finish_reason "length"; streamed the same."""
    async def main():
        server, url = await serve(llm)
        async with aiohttp.ClientSession() as s:
            # Past the name (29 tokens of the tiny tokenizer), short of the arguments' end (45 or more).
            body = ask(tool_choice=choice, max_tokens=34, seed=3)
            status, out = await post(s, url, body)
            chunks = await post_stream(s, url, body)
        await server.cleanup()
        return status, out, chunks

    status, out, chunks = run(main())
    assert status == 200, out
    choice_ = out["choices"][0]
    message = choice_["message"]
    assert choice_["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 34, out
    assert message["content"] is None, message
    call, = message["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "get_time") and call["id"].startswith("call_")
    args = call["function"]["arguments"]
    assert args.startswith("{") and not _parses(args), args   # as far as it got: not a whole object
    # The stream: no content, the same call in its deltas, the same finish.
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not "".join(d["delta"].get("content") or "" for d in deltas)
    streamed = [tc for d in deltas for tc in d["delta"].get("tool_calls") or []]
    assert {tc["index"] for tc in streamed} == {0}
    assert streamed[0]["function"]["name"] == call["function"]["name"]
    assert "".join(tc["function"]["arguments"] for tc in streamed) == args
    assert deltas[-1]["finish_reason"] == "length"


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_the_reader_of_a_forced_call_keeps_a_cut_call():
    forced = ToolFormat("hermes", "<tool_call>", "arguments", forced=True)
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert ToolCallReader.read(HERMES, cut) == (cut, [])   # auto: an unfinished call is text, as vLLM
    content, calls = ToolCallReader.read(forced, cut)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", '{"city": "Pa')]
    # Cut before the name is whole: no call, and no content either (the text is the grammar's, not an answer).
    assert ToolCallReader.read(forced, '<tool_call>\n{"name": "get_') == (None, [])
    reader = ToolCallReader(forced)
    assert reader.feed('<tool_call>\n{"na') + reader.finish() == []


# ---------------------------------------------------------------- how many calls

@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_choice_yields_exactly_one_call(llm, parallel):
    """Random weights write a second call whenever the grammar allows one; with
    a named function it does not, parallel_tool_calls or not: one call, whole,
    finish_reason "tool_calls"."""
    async def main():
        server, url = await serve(llm)
        async with aiohttp.ClientSession() as s:
            outs = [await post(s, url, ask(tool_choice=NAMED, parallel_tool_calls=parallel, max_tokens=120,
                                           seed=seed)) for seed in range(6)]
        await server.cleanup()
        return outs

    for status, out in run(main()):
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call, = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}


@pytest.fixture(scope="module")
def matchers(tiny_model):
    compiler = GrammarCompiler((tiny_model / "tokenizer.json").read_text(), 1024, (1023,))
    tok = Tokenizer(tiny_model)

    def run_text(so, text: str):
        m = compiler.matcher(so)
        return m, m.inner.consume_tokens(tok.encode(text, add_special_tokens=False))
    return run_text


@pytest.mark.parametrize("parallel", [True, False])
def test_the_named_grammar_ends_after_one_call(matchers, parallel):
    m, ok = matchers(forced_grammar(HERMES, TOOLS, NAMED, parallel), CALL)
    assert ok and m.stopped   # nothing but the end may follow
    _, ok = matchers(forced_grammar(HERMES, TOOLS, NAMED, parallel), CALL + "\n" + CALL)
    assert not ok


def test_the_required_grammar_may_end_after_any_call(matchers):
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    m, ok = matchers(forced_grammar(HERMES, TOOLS, "required", True), CALL)
    assert ok and m.inner.is_accepting() and not m.stopped   # may end, or call again
    m, ok = matchers(forced_grammar(HERMES, TOOLS, "required", True), CALL + "\n" + time_call)
    assert ok and m.inner.is_accepting()
    m, ok = matchers(forced_grammar(HERMES, TOOLS, "required", False), CALL)
    assert ok and m.stopped
