"""The API clients now expect, with the openai client, on real clusters (`pdd up`
colocated and 1P+1D) of a tiny reasoning checkpoint (`pdd make-model
--chat-template thinking`: its generation prompt opens <think>): the Responses
API — text whole and streamed, its reasoning item and events equal to chat's
reasoning, a forced tool call and its output sent back, structured output by
text.format — and a reasoning model's chat answer, whose text (random weights
never write </think>) is all reasoning, and with enable_thinking false all
content; a constraint applies after the reasoning (so here never: the
constrained answer is its reasoning, whole and streamed), and from the first
token with enable_thinking false."""
from __future__ import annotations

import json

import openai
import pytest

from pdd.model.make_model import make_model
from pdd.model.tokenizer import Tokenizer
from tests.e2e.cluster import UpCluster

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                       "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("thinking") / "model", preset="tiny", chat_template="thinking")


@pytest.fixture(scope="module", params=["colocated", "disagg"])
def cluster(request, tmp_path_factory, thinking_model):
    layout = ["--mode", "colocated"] if request.param == "colocated" else ["--mode", "disagg"]
    with UpCluster(tmp_path_factory.mktemp(request.param) / "run", thinking_model, *layout) as c:
        yield c


def client(c: UpCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0)


def test_the_responses_api_text_whole_and_streamed_is_chats_greedy_text(cluster):
    ai, model = client(cluster), cluster.model_name
    whole = ai.responses.create(model=model, input="Say hi", max_output_tokens=12, temperature=0)
    chat = ai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}],
                                      max_tokens=12, temperature=0)
    message = chat.choices[0].message
    (reasoning,) = [item for item in whole.output if item.type == "reasoning"]
    assert reasoning.content[0].text == message.reasoning_content != ""
    assert whole.output_text == (message.content or "")
    events = list(ai.responses.create(model=model, input="Say hi", max_output_tokens=12, temperature=0,
                                      stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                          "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    plain = ai.responses.create(model=model, input="Say hi", max_output_tokens=12, temperature=0,
                                extra_body=NO_THINKING)
    assert [item.type for item in plain.output] == ["message"] and plain.output_text


def test_a_forced_tool_call_and_its_output_sent_back(cluster):
    ai, model = client(cluster), cluster.model_name
    first = ai.responses.create(model=model, input="Weather in Paris?", tools=[TOOL], max_output_tokens=64,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                extra_body=NO_THINKING)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    follow = ai.responses.create(model=model, tools=[TOOL], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_structured_output_by_text_format(cluster):
    ai, model = client(cluster), cluster.model_name
    ask = {"model": model, "input": "Yes or no?", "max_output_tokens": 32, "temperature": 0,
           "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}}
    out = ai.responses.create(**ask, extra_body=NO_THINKING)
    assert json.loads(out.output_text)["answer"] in ("yes", "no")
    thought = ai.responses.create(**ask)   # the schema waits for the end of the reasoning
    assert [item.type for item in thought.output] == ["reasoning"] and thought.status == "incomplete"


def test_a_constraint_applies_after_the_reasoning(cluster):
    ai, model = client(cluster), cluster.model_name
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    ask = {"model": model, "messages": [{"role": "user", "content": "Think"}], "max_tokens": 16,
           "temperature": 0, "response_format": fmt}
    whole = ai.chat.completions.create(**ask).choices[0]
    assert whole.message.reasoning_content and whole.message.content is None and whole.finish_reason == "length"
    deltas = [c.choices[0].delta for c in ai.chat.completions.create(**ask, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.message.reasoning_content
    assert not any(d.content for d in deltas)
    # A forced call's grammar has the same free reasoning before it: the same tokens.
    forced = {k: v for k, v in ask.items() if k != "response_format"}
    call = ai.chat.completions.create(**forced, tools=[{"type": "function", "function": {
        "name": TOOL["name"], "parameters": TOOL["parameters"]}}],
        tool_choice={"type": "function", "function": {"name": TOOL["name"]}}).choices[0]
    assert call.message.reasoning_content == whole.message.reasoning_content and not call.message.tool_calls
    plain = ai.chat.completions.create(**{**ask, "max_tokens": 32}, extra_body=NO_THINKING).choices[0].message
    assert json.loads(plain.content)["answer"] in ("yes", "no")



def test_a_reasoning_that_ends_is_split_from_its_constrained_answer(cluster, thinking_model):
    """</think> is one token of this checkpoint (as of Qwen3's): biased up (by
    10: this random checkpoint's greedy reasoning then ends after two tokens),
    the reasoning ends, and the answer after it is the schema's, whole and
    streamed, a forced call the call."""
    ai, model = client(cluster), cluster.model_name
    (close,) = Tokenizer(thinking_model).encode("</think>", add_special_tokens=False)
    ask = {"model": model, "messages": [{"role": "user", "content": "Think"}], "max_tokens": 32,
           "temperature": 0, "logit_bias": {str(close): 10}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    whole = ai.chat.completions.create(**ask, response_format=fmt).choices[0]
    assert whole.message.reasoning_content and "think>" not in whole.message.reasoning_content
    assert json.loads(whole.message.content)["answer"] in ("yes", "no")
    deltas = [c.choices[0].delta for c in ai.chat.completions.create(**ask, response_format=fmt, stream=True)
              if c.choices]
    assert "".join(d.content or "" for d in deltas) == whole.message.content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.message.reasoning_content
    call = ai.chat.completions.create(**{**ask, "max_tokens": 128}, tools=[{"type": "function", "function": {
        "name": TOOL["name"], "parameters": TOOL["parameters"]}}],
        tool_choice={"type": "function", "function": {"name": TOOL["name"]}}).choices[0]
    assert [c.function.name for c in call.message.tool_calls] == [TOOL["name"]], call
    assert call.finish_reason == "tool_calls" and json.loads(call.message.tool_calls[0].function.arguments)["city"] in ("Paris", "Oslo")


def test_a_reasoning_models_answer_is_its_reasoning_and_enable_thinking_false_is_content(cluster):
    ai, model = client(cluster), cluster.model_name
    ask = {"model": model, "messages": [{"role": "user", "content": "Think"}], "max_tokens": 8, "temperature": 0}
    thought = ai.chat.completions.create(**ask).choices[0].message
    assert thought.reasoning_content and thought.content is None   # never closed: all reasoning
    streamed = list(ai.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought.reasoning_content
    plain = ai.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.choices[0].message.content and not getattr(plain.choices[0].message, "reasoning_content", None)
