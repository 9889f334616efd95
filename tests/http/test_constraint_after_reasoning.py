"""Tools and structured output applied after the reasoning (issue 37), as vLLM
applies them: with a reasoning parser in effect and thinking on, the grammar
leaves the `<think>...</think>` part free and holds from the end of the
reasoning on; with enable_thinking false it holds from the first token.

Checked on the grammar a chat request compiles to, with the tiny thinking
checkpoint's vocabulary (which texts it takes whole, which tokens its mask
allows inside and after the reasoning), and end to end through raw HTTP on the
real engine: random weights never write </think>, so there a constrained
answer is all reasoning, token for token the unconstrained one as far as that
is text, whole and streamed, and with enable_thinking false the constrained
content."""
from __future__ import annotations

import json

import aiohttp
import numpy as np
import orjson
import pytest

from pdd import LLM
from pdd.api import InvalidRequest, StructuredOutput
from pdd.grammar import GrammarCompiler, fill_masks
from pdd.http.reasoning import ReasoningFormat
from pdd.http.schemas import parse_chat_request
from pdd.http.structured import check
from pdd.model.make_model import make_model
from pdd.model.tokenizer import Tokenizer
from tests.http.engine_server import post, post_stream, run, serve

R1 = ReasoningFormat("deepseek_r1", True)
QWEN3 = ReasoningFormat("qwen3", False)
MSGS = [{"role": "user", "content": "Yes or no?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
JSON_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA,
                                                                          "strict": True}}}
TOOL = {"type": "function", "function": {"name": "vote", "parameters": SCHEMA}}
FORCED = {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "vote"}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ANSWER = '{"answer": "yes"}'
CALL = '<tool_call>\n{"name": "vote", "arguments": {"answer": "no"}}\n</tool_call>'
# Reasoning that no schema would take: braces, a tag of its own, an unclosed string.
THOUGHT = 'Hm, {"answer": maybe} <b> "unclosed'


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("thinking"), chat_template="thinking")


@pytest.fixture(scope="module")
def grammar_of(thinking_model):
    """A fresh matcher for a chat request's constraint (its fields, a reasoning format)."""
    tok = Tokenizer(thinking_model)
    compiler = GrammarCompiler((thinking_model / "tokenizer.json").read_text(), tok.vocab_size,
                               (tok.vocab_size - 1,))

    def grammar_of(fields: dict, fmt: ReasoningFormat = R1):
        req = parse_chat_request(orjson.dumps({"model": "tiny", "messages": MSGS, **fields}), ["tiny"],
                                 reasoning_fmt=fmt)
        check(req.sampling.structured_output, req.structured_param)
        return compiler.matcher(req.sampling.structured_output), tok
    return grammar_of


def takes(grammar_of, fields: dict, text: str, fmt: ReasoningFormat = R1) -> bool:
    """Whether the request's grammar takes `text` as a whole output."""
    m, tok = grammar_of(fields, fmt)
    return m.inner.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.inner.is_accepting()


@pytest.mark.parametrize("fields, answer", [(JSON_FORMAT, ANSWER), (FORCED, CALL),
                                            ({"guided_regex": "(yes|no)!"}, "no!")],
                         ids=["json_schema", "forced call", "regex"])
def test_the_reasoning_is_free_and_the_constraint_holds_after_it(grammar_of, fields, answer):
    assert takes(grammar_of, fields, THOUGHT + "</think>" + answer)
    assert takes(grammar_of, fields, THOUGHT + "</think>\n\n" + answer)   # as models write it
    assert takes(grammar_of, fields, "<think>" + THOUGHT + "</think>" + answer)   # <think> written again
    assert not takes(grammar_of, fields, THOUGHT + "</think>" + THOUGHT)   # the answer is held to it
    assert not takes(grammar_of, fields, THOUGHT + "</think>\n\n\n" + answer)   # no padding before it
    assert not takes(grammar_of, fields, THOUGHT + "</think>" + answer + "</think>" + answer)


def test_qwen3_reasons_only_inside_a_leading_think(grammar_of):
    assert takes(grammar_of, JSON_FORMAT, "\n<think>" + THOUGHT + "</think>\n\n" + ANSWER, QWEN3)
    assert takes(grammar_of, JSON_FORMAT, ANSWER, QWEN3)   # it may answer without reasoning
    assert not takes(grammar_of, JSON_FORMAT, THOUGHT + "</think>" + ANSWER, QWEN3)


def test_enable_thinking_false_holds_the_constraint_from_the_first_token(grammar_of):
    for fields, answer in ((JSON_FORMAT, ANSWER), (FORCED, CALL)):
        assert takes(grammar_of, {**fields, **NO_THINKING}, answer)
        assert not takes(grammar_of, {**fields, **NO_THINKING}, THOUGHT + "</think>" + answer)


def test_a_reasoning_format_the_grammar_does_not_know_is_refused_naming_the_field():
    """(What a worker checks in an Admit from a router of another version.)"""
    with pytest.raises(InvalidRequest, match="structured_output.reasoning: .*'granite'"):
        StructuredOutput("json_object", "", "granite").validate()


def test_the_mask_allows_any_token_in_the_reasoning_and_only_the_schemas_after_it(grammar_of):
    m, tok = grammar_of(JSON_FORMAT)
    (hm,) = tok.encode("Hm", add_special_tokens=False)[:1]

    def allowed(token: int) -> bool:
        row = fill_masks([(m, 0)], 1)[0]
        return bool(row[token // 32] >> (token % 32) & 1)

    assert allowed(hm)   # the schema's first byte would be '{'
    m.inner.consume_tokens(tok.encode(THOUGHT, add_special_tokens=False))
    assert allowed(hm) and not m.stopped
    m.inner.consume_tokens(tok.encode("</think>", add_special_tokens=False))
    assert not allowed(hm)
    row = fill_masks([(m, 0)], 1)[0]
    firsts = {tok.decode([t])[:1] for t in np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
              if t < tok.vocab_size}
    assert firsts <= {"{", "\n"}, firsts


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def answers(thinking_model):
    """The chat answers (whole, streamed) of request bodies, from the engine
    running the thinking checkpoint (its reasoning parser: auto, deepseek_r1)."""
    llm = LLM(str(thinking_model))

    def answers(*bodies: dict, stream: bool = False) -> list:
        async def main():
            server, url = await serve(llm)
            try:
                async with aiohttp.ClientSession() as s:
                    outs = []
                    for body in bodies:
                        body = {"model": "tiny", "messages": MSGS, "max_tokens": 24, "temperature": 0, **body}
                        if stream:
                            outs.append(await post_stream(s, url, body))
                        else:
                            status, out = await post(s, url, body)
                            assert status == 200, out
                            outs.append(out["choices"][0])
                    return outs
            finally:
                await server.cleanup()
        return run(main())
    return answers


def test_a_constrained_answer_reasons_as_a_free_one(answers):
    """Token for token the free reasoning, up to where that one writes bytes
    that are no text (random weights do): the grammar's reasoning is text."""
    ask = {"messages": [{"role": "user", "content": "Think"}]}
    free, constrained, forced = answers(ask, {**ask, **JSON_FORMAT}, {**ask, **FORCED})
    thought = free["message"]["reasoning_content"]
    assert thought and free["message"]["content"] is None   # random weights: never closed
    text = thought.split("\ufffd")[0]
    assert len(text) >= 20, thought   # (the checkpoint is made the same every time)
    for c in (constrained, forced):
        assert c["message"]["reasoning_content"].startswith(text) and c["message"]["content"] is None
        # (the last token may begin a character that max_tokens cut)
        assert "\ufffd" not in c["message"]["reasoning_content"].rstrip("\ufffd")
        assert c["finish_reason"] == "length" and not c["message"].get("tool_calls")


def test_a_constrained_stream_reasons_as_the_whole_answer(answers):
    (whole,), (chunks,) = answers(JSON_FORMAT), answers(JSON_FORMAT, stream=True)
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == whole["message"]["reasoning_content"]
    assert not any(d.get("content") for d in deltas)


def test_without_thinking_the_content_obeys_from_the_first_token(answers):
    structured, forced = answers({**JSON_FORMAT, **NO_THINKING, "max_tokens": 64},
                                 {**FORCED, **NO_THINKING, "max_tokens": 64})
    assert json.loads(structured["message"]["content"])["answer"] in ("yes", "no")
    assert not structured["message"].get("reasoning_content")
    (call,) = forced["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["answer"] in ("yes", "no")
