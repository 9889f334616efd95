"""OpenAI request parsing/validation (pdd.http.schemas) and response builders (pdd.http.responses)."""
from __future__ import annotations

import json
import math

import orjson
import pytest
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdd.http.responses import (SSE_DONE, LogprobsBuilder, chat_chunk, chat_response, completion_chunk,
                                completion_response, sse, usage, usage_chunk)
from pdd.http.schemas import Prompt, parse_chat_request, parse_completion_request
from pdd.http.validate import APIError
from pdd.model.tokenizer import Tokenizer

MODELS = ["tiny", "other"]
MSGS = [{"role": "user", "content": "hi"}]


def cmpl(**fields) -> bytes:
    return orjson.dumps({"model": "tiny", "prompt": "Hello", **fields})


def chat(**fields) -> bytes:
    return orjson.dumps({"model": "tiny", "messages": MSGS, **fields})


def parse_cmpl(**fields):
    return parse_completion_request(cmpl(**fields), MODELS)


def parse_chat(**fields):
    return parse_chat_request(chat(**fields), MODELS)


def refused(parse, body: bytes, status: int = 400) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body, MODELS)
    err = info.value
    assert err.status == status
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"
    return err


def assert_refused(parse, body: bytes, param: str | None, *words: str, status: int = 400) -> None:
    err = refused(parse, body, status)
    assert err.param == param, err.message
    for w in words:
        assert w in err.message, (w, err.message)


# ---------------------------------------------------------------- body and model

@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
@pytest.mark.parametrize("body", [b"", b"{", b"not json", b"[1, 2]", b"\"text\"", b"null"])
def test_body_must_be_a_json_object(parse, body):
    assert_refused(parse, body, None, "JSON")


def test_unknown_model_is_404_listing_served_models():
    err = refused(parse_completion_request, cmpl(model="gpt-9"), status=404)
    assert err.param == "model" and err.code == "model_not_found"
    assert "gpt-9" in err.message and "'tiny'" in err.message and "'other'" in err.message
    err = refused(parse_chat_request, chat(model="gpt-9"), status=404)
    assert err.code == "model_not_found"


def test_model_defaults_to_the_reported_name():
    body = orjson.dumps({"prompt": "x"})
    assert parse_completion_request(body, MODELS).model == "tiny"   # the names are aliases of one model
    assert parse_completion_request(body, ["solo"]).model == "solo"
    assert parse_chat_request(orjson.dumps({"messages": MSGS}), ["solo"]).model == "solo"
    assert_refused(parse_completion_request, cmpl(model=3), "model", "'model' must be a string, got integer")


# ---------------------------------------------------------------- prompt

@pytest.mark.parametrize("prompt, text, ids", [
    ("Hello", "Hello", None),
    (["Hello"], "Hello", None),
    ([1, 2, 3], None, [1, 2, 3]),
    ([[0, 5]], None, [0, 5]),
])
def test_prompt_forms(prompt, text, ids):
    req = parse_cmpl(prompt=prompt)
    assert req.prompts == [Prompt(text, ids)]
    assert req.messages is None and req.kind == "completion"


@pytest.mark.parametrize("prompt, words", [
    ("", ["empty"]), ([], ["empty"]), ([""], ["empty"]), ([[]], ["empty"]),
    ([1, -2], ["non-negative", "-2", "index 1"]),
    ([1, True], ["boolean", "index 1"]),
    ([1, 2.5], ["number", "index 1"]),
    ([["a"]], ["string", "index 0"]),
    (5, ["'prompt' must be a string", "got integer"]),
    ({"text": "x"}, ["got object"]),
    (None, ["'prompt' is required"]),
])
def test_bad_prompts(prompt, words):
    assert_refused(parse_completion_request, cmpl(prompt=prompt), "prompt", *words)


# ---------------------------------------------------------------- messages

def test_messages_are_normalised():
    msgs = [{"role": "system", "content": "Be brief.", "name": "x"},
            {"role": "developer", "content": "d"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": ""},
            {"role": "tool", "content": "42", "tool_call_id": "t"}]
    req = parse_chat(messages=msgs)
    assert req.kind == "chat" and req.prompts == []
    # Text parts joined by newlines, as vLLM does; name and tool_call_id go to the template.
    assert req.messages == [{"role": "system", "content": "Be brief.", "name": "x"},
                            {"role": "developer", "content": "d"},
                            {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": ""},
                            {"role": "tool", "content": "42", "tool_call_id": "t"}]


def test_an_assistant_refusal_part_is_its_text():
    """A conversation replayed as OpenAI answered it: the assistant's refusal parts are its words."""
    req = parse_chat(messages=[MSGS[0], {"role": "assistant", "content": [
        {"type": "refusal", "refusal": "I can't."}, {"type": "text", "text": "Ask me else."}]}])
    assert req.messages[1] == {"role": "assistant", "content": "I can't.\nAsk me else."}


@pytest.mark.parametrize("messages, param, words", [
    (None, "messages", ["'messages' is required"]),
    ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],
     "messages[0].content[0].type", ["'refusal' is not supported", "assistant"]),
    ([{"role": "assistant", "content": [{"type": "refusal"}]}], "messages[0].content[0].refusal", ["required"]),
    ([], "messages", ["at least one"]),
    ("hi", "messages", ["'messages' must be an array, got string"]),
    (["hi"], "messages[0]", ["must be an object, got string"]),
    ([{"content": "x"}], "messages[0].role", ["required"]),
    ([{"role": "bot", "content": "x"}], "messages[0].role", ["'bot'", "user", "assistant"]),
    ([{"role": 1, "content": "x"}], "messages[0].role", ["must be a string, got integer"]),
    ([MSGS[0], {"role": "user"}], "messages[1].content", ["required"]),
    ([{"role": "user", "content": 7}], "messages[0].content", ["string or an array", "integer"]),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0].type", ["'image_url' is not supported", "text"]),
    ([{"role": "user", "content": ["x"]}], "messages[0].content[0]", ["object", "string"]),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", ["required"]),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text",
     ["must be a string, got integer"]),
])
def test_bad_messages(messages, param, words):
    assert_refused(parse_chat_request, chat(messages=messages), param, *words)


# ---------------------------------------------------------------- types

@pytest.mark.parametrize("field, value, kind, got", [
    ("max_tokens", "5", "an integer", "string"),
    ("max_tokens", 5.0, "an integer", "number"),
    ("max_tokens", True, "an integer", "boolean"),
    ("temperature", "0.5", "a number", "string"),
    ("temperature", False, "a number", "boolean"),
    ("top_p", [1], "a number", "array"),
    ("top_k", 1.5, "an integer", "number"),
    ("min_p", {}, "a number", "object"),
    ("seed", "1", "an integer", "string"),
    ("n", True, "an integer", "boolean"),
    ("ignore_eos", 1, "a boolean", "integer"),
    ("min_tokens", "1", "an integer", "string"),
    ("stream", "true", "a boolean", "string"),
    ("stream_options", True, "an object", "boolean"),
    ("user", 1, "a string", "integer"),
    ("stop_token_ids", 5, "an array", "integer"),
    ("presence_penalty", "0", "a number", "string"),
    ("frequency_penalty", True, "a number", "boolean"),
    ("logit_bias", [], "an object", "array"),
    ("response_format", "text", "an object", "string"),
])
@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_wrong_types(endpoint, field, value, kind, got):
    parse, make = ((parse_completion_request, cmpl) if endpoint == "completion"
                   else (parse_chat_request, chat))
    assert_refused(parse, make(**{field: value}), field, f"'{field}' must be {kind}, got {got}")


@pytest.mark.parametrize("parse, make, field, value, kind, got", [
    (parse_completion_request, cmpl, "logprobs", True, "an integer", "boolean"),
    (parse_completion_request, cmpl, "echo", "yes", "a boolean", "string"),
    (parse_completion_request, cmpl, "best_of", 1.0, "an integer", "number"),
    (parse_completion_request, cmpl, "suffix", 1, "a string", "integer"),
    (parse_chat_request, chat, "logprobs", 1, "a boolean", "integer"),
    (parse_chat_request, chat, "top_logprobs", "2", "an integer", "string"),
    (parse_chat_request, chat, "max_completion_tokens", "9", "an integer", "string"),
])
def test_wrong_types_endpoint_specific(parse, make, field, value, kind, got):
    assert_refused(parse, make(**{field: value}), field, f"'{field}' must be {kind}, got {got}")


def test_nested_field_types_are_named_with_their_path():
    assert_refused(parse_chat_request, chat(stream=True, stream_options={"include_usage": "yes"}),
                   "stream_options.include_usage",
                   "'stream_options.include_usage' must be a boolean, got string")


def test_null_means_default_and_unknown_fields_are_ignored():
    req = parse_cmpl(temperature=None, max_tokens=None, stop=None, n=None, logprobs=None,
                     stream=None, seed=None, tools=None, some_vendor_extra={"x": 1})
    assert req.sampling.max_tokens == 16 and req.sampling.temperature == 1.0
    assert req.sampling.stop == [] and not req.stream and req.logprobs is None


# ---------------------------------------------------------------- ranges and unsupported

@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", -5, [">= ", "got -5"]),   # completions take 0
    ("temperature", 2.5, ["between 0 and 2"]),
    ("temperature", -0.1, ["between 0 and 2"]),
    ("top_p", 0, ["> 0", "<= 1"]),
    ("top_p", 1.01, ["between 0 and 1"]),
    ("top_k", -2, ["-1 or 0 (off)"]),
    ("min_p", 1.5, ["between 0 and 1"]),
    ("min_tokens", -1, [">= 0"]),
    ("min_tokens", 17, ["max_tokens"]),                  # SamplingParams.validate, cross-field
    ("n", 129, ["between 1 and 128"]),
    ("n", 0, ["between 1 and 128"]),
    ("stop", [""], ["empty"]),
    ("stop", ["a", 1], ["strings", "integer", "index 1"]),
    ("stop", 3, ["string or an array of strings"]),
    ("stop", [str(i) for i in range(17)], ["at most 16"]),
    ("stop_token_ids", [1, -1], ["non-negative", "index 1"]),
    ("stream_options", {"include_usage": True}, ["only allowed when 'stream' is true"]),
    ("presence_penalty", 2.5, ["between -2.0 and 2.0"]),
    ("frequency_penalty", -2.01, ["between -2.0 and 2.0"]),
    ("repetition_penalty", 0, ["> 0"]),
    ("repetition_penalty", 101, ["between 0 and 100"]),
    ("prompt_logprobs", 21, ["between 0 and 20"]),
    ("logit_bias", {"x": -100}, ["keys must be token ids"]),
    ("logit_bias", {"5": 101}, ["values must be numbers in [-100, 100]", "token 5"]),
    ("logit_bias", {"5": True}, ["values must be numbers"]),
    ("logit_bias", {str(i): 1 for i in range(301)}, ["at most 300 tokens"]),
    # vLLM's fields for features we do not have: refused, not ignored
    ("length_penalty", 0.5, ["not supported", "only 1"]),
    ("use_beam_search", True, ["not supported"]),
    ("guided_json", [1], ["a JSON schema object"]),
    ("guided_choice", ["a", 1], ["non-empty array of non-empty strings"]),
    ("guided_regex", 5, ["a non-empty string"]),
    ("allowed_token_ids", [1, 2], ["not supported"]),
    ("bad_words", ["x"], ["not supported"]),
    ("truncate_prompt_tokens", 0, [">= 1"]),
    ("skip_special_tokens", "no", ["a boolean"]),
])
@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_bad_values(endpoint, field, value, words):
    parse, make = ((parse_completion_request, cmpl) if endpoint == "completion"
                   else (parse_chat_request, chat))
    fields = {field: value}
    if field == "min_tokens" and endpoint == "chat":
        fields["max_tokens"] = 16      # chat defers validation when max_tokens is unset
    assert_refused(parse, make(**fields), field, *words)


def test_max_tokens_0_is_a_completion_of_the_prompt_alone():
    """Completions take max_tokens 0 (nothing generated; evaluation clients send
    it with echo), every other value still checked; chat needs a token."""
    assert parse_cmpl(max_tokens=0).sampling.max_tokens == 0
    assert_refused(parse_completion_request, cmpl(max_tokens=-5), "max_tokens", ">= 0")
    assert_refused(parse_completion_request, cmpl(max_tokens=0, min_tokens=1), "min_tokens", "max_tokens")
    assert_refused(parse_completion_request, cmpl(max_tokens=0, top_k=-2), "top_k")
    for value in (0, -5):
        assert_refused(parse_chat_request, chat(max_tokens=value), "max_tokens", ">= 1")


@pytest.mark.parametrize("fields, param, words", [
    ({"logprobs": 6}, "logprobs", ["between 0 and 5"]),
    ({"logprobs": -1}, "logprobs", ["between 0 and 5"]),
    ({"best_of": 3}, "best_of", ["not supported", "equal to n (1)"]),
    ({"best_of": 2, "n": 3}, "best_of", ["not supported", "equal to n (3)"]),
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", ["must be 0"]),
    ({"max_tokens": 0, "prompt_logprobs": 1}, "prompt_logprobs", ["needs 'echo'"]),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", ["not available with 'stream'"]),
    ({"suffix": "end"}, "suffix", ["not supported"]),
])
def test_bad_completion_values(fields, param, words):
    assert_refused(parse_completion_request, cmpl(**fields), param, *words)


@pytest.mark.parametrize("fields, param, words", [
    ({"top_logprobs": 3}, "top_logprobs", ["requires 'logprobs': true"]),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", ["between 0 and 20"]),
    ({"max_tokens": 0}, "max_tokens", [">= 1"]),
    ({"max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens", [">= 1"]),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name", ["letters"]),
    ({"functions": [{"name": "f"}]}, "functions", ["not supported"]),
    ({"tool_choice": "required"}, "tool_choice", ["needs 'tools'"]),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", ["not in 'tools'"]),
    ({"function_call": {"name": "f"}}, "function_call", ["not supported"]),
    ({"echo": True}, "echo", ["echo is not supported in chat"]),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", ["not available with 'stream'"]),
    ({"continue_final_message": True}, "continue_final_message", ["'add_generation_prompt': false"]),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", ["may not set messages"]),
    ({"chat_template": "{{ messages }}"}, "chat_template", ["not supported"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0].function", ["is required"]),
])
def test_bad_chat_values(fields, param, words):
    assert_refused(parse_chat_request, chat(**fields), param, *words)


def test_harmless_values_of_unsupported_features_are_accepted():
    parse_cmpl(echo=False, best_of=1, suffix="", presence_penalty=0, frequency_penalty=0.0,
               logit_bias={}, n=1, user="u", response_format={"type": "text"},
               repetition_penalty=1.0, length_penalty=1, use_beam_search=False, guided_json=None,
               prompt_logprobs=None, priority=0, bad_words=[])
    parse_chat(tools=[], functions=[], tool_choice="none", function_call="auto", logit_bias={},
               response_format={"type": "text"}, parallel_tool_calls=True)


# ---------------------------------------------------------------- good requests

def test_completion_sampling_params():
    req = parse_cmpl(max_tokens=40, temperature=0, top_p=0.9, top_k=20, min_p=0.05, seed=7,
                     stop="\n\n", stop_token_ids=[2, 3], ignore_eos=True, min_tokens=4,
                     logprobs=3, stream=True, stream_options={"include_usage": True})
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (40, 0.0, 0.9, 20, 0.05, 7)
    assert isinstance(s.temperature, float) and s.greedy
    assert s.stop == ["\n\n"] and s.stop_token_ids == [2, 3] and s.ignore_eos and s.min_tokens == 4
    assert s.logprobs == 3 and req.logprobs == 3
    assert req.stream and req.include_usage and not req.max_tokens_unset
    assert req.request_id.startswith("cmpl-") and len(req.request_id) == 5 + 32
    assert req.created > 1_600_000_000


def test_completion_defaults():
    req = parse_completion_request(cmpl(), MODELS, max_tokens_default=33)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (33, 1.0, 1.0, 0, 0.0)
    assert s.seed is not None            # validate() drew one
    assert s.stop == [] and s.stop_token_ids == [] and s.logprobs is None
    assert not req.stream and not req.include_usage and req.logprobs is None
    assert parse_cmpl().sampling.max_tokens == 16


def test_chat_max_tokens_unset_is_deferred_to_the_router():
    req = parse_chat(min_tokens=5)
    assert req.max_tokens_unset and req.sampling.max_tokens == 0
    assert req.sampling.seed is None     # not validated yet: the router does it
    req.sampling.max_tokens = 100
    req.sampling.validate()


def test_chat_max_completion_tokens_wins():
    req = parse_chat(max_tokens=10, max_completion_tokens=20)
    assert req.sampling.max_tokens == 20 and not req.max_tokens_unset
    assert parse_chat(max_tokens=10).sampling.max_tokens == 10
    assert parse_chat(max_completion_tokens=7).sampling.max_tokens == 7


def test_chat_fields():
    req = parse_chat(logprobs=True, top_logprobs=5, stop=["a", "b"], stream=True, seed=-3,
                     max_tokens=8)
    assert req.logprobs == 5 and req.sampling.logprobs == 5
    assert req.sampling.stop == ["a", "b"] and req.stream and not req.include_usage
    assert 0 <= req.sampling.seed < 2 ** 63
    assert req.request_id.startswith("chatcmpl-")
    assert parse_chat(logprobs=True).logprobs == 0
    assert parse_chat(logprobs=False).logprobs is None


def test_text_and_template_options():
    req = parse_cmpl(skip_special_tokens=False, include_stop_str_in_output=True, truncate_prompt_tokens=5)
    assert (req.skip_special_tokens, req.include_stop_str_in_output, req.truncate_prompt_tokens) == (False, True, 5)
    req = parse_cmpl()
    assert (req.skip_special_tokens, req.include_stop_str_in_output, req.truncate_prompt_tokens) == (True, False, None)
    assert parse_chat().template_args == {"add_generation_prompt": True, "continue_final_message": False}
    req = parse_chat(add_generation_prompt=False, continue_final_message=True,
                     chat_template_kwargs={"enable_thinking": False})
    assert req.template_args == {"add_generation_prompt": False, "continue_final_message": True,
                                 "enable_thinking": False}


# ---------------------------------------------------------------- poison values
# Values that once reached the sampler (or the wire) and broke it: each is a 400
# naming its field, or gets a correct answer.

@pytest.mark.parametrize("fields, param", [
    ({"temperature": 1, "top_k": 9223372036854775808}, "top_k"),      # beyond int64
    ({"seed": 2**64}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),            # JSON parses it as a float
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"temperature": 1e308}, "temperature"),
    ({"stop": ["x"] * 5000}, "stop"),
    ({"stop": ["x" * 100_000]}, "stop"),
    ({"stop_token_ids": list(range(5000))}, "stop_token_ids"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
])
@pytest.mark.parametrize("endpoint", ["completion", "chat"])
def test_poison_values_are_refused_naming_the_field(endpoint, fields, param):
    base = {"prompt": "Hello"} if endpoint == "completion" else {"messages": MSGS}
    parse = parse_completion_request if endpoint == "completion" else parse_chat_request
    # The stdlib encoder: orjson cannot even write integers beyond 64 bits.
    assert_refused(parse, json.dumps({"model": "tiny", **base, **fields}).encode(), param)


def test_top_logprobs_0_without_logprobs_asks_nothing():
    """As vLLM takes it: clients that send every field send it by default."""
    assert parse_chat(top_logprobs=0).logprobs is None
    assert parse_chat(logprobs=False, top_logprobs=0).logprobs is None


def test_poison_logprobs_are_refused():
    assert_refused(parse_completion_request, cmpl(logprobs=10**9), "logprobs")
    assert_refused(parse_chat_request, chat(logprobs=True, top_logprobs=10**9), "top_logprobs")


@pytest.mark.parametrize("body", [b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": 1e999}',
                                  b'{"prompt": "hi", "temperature": Infinity}'])
def test_non_finite_numbers_are_not_json(body):
    assert_refused(parse_completion_request, body, None, "not valid JSON")


def test_extreme_values_with_a_correct_answer():
    s = parse_cmpl(temperature=1e-45).sampling
    assert s.temperature == 0.0 and s.greedy        # as vLLM: below 1e-5 is greedy
    assert parse_cmpl(top_p=1e-300).sampling.top_p == 1e-300   # the sampler keeps the likeliest token
    assert parse_cmpl(top_k=2**62).sampling.top_k == 2**62     # beyond the vocabulary: the engine turns it off
    assert parse_cmpl(seed=2**64 - 1).sampling.seed == 2**63 - 1   # seeds are taken modulo 2**63
    # Not refused here: the router's context-length check answers it with a 400.
    assert parse_cmpl(max_tokens=2**31).sampling.max_tokens == 2**31


def test_token_ids_are_checked_against_the_vocabulary_when_known():
    body = cmpl(stop_token_ids=[5, 1000])
    assert parse_completion_request(body, MODELS).sampling.stop_token_ids == [5, 1000]
    with pytest.raises(APIError) as info:
        parse_completion_request(body, MODELS, vocab_size=1000)
    assert info.value.param == "stop_token_ids" and "vocabulary [0, 1000)" in info.value.message
    with pytest.raises(APIError) as info:
        parse_chat_request(chat(stop_token_ids=[1000]), MODELS, vocab_size=1000)
    assert info.value.param == "stop_token_ids"
    with pytest.raises(APIError) as info:
        parse_completion_request(orjson.dumps({"model": "tiny", "prompt": [5, 1000]}), MODELS, vocab_size=1000)
    assert info.value.param == "prompt" and "index 1" in info.value.message


# ---------------------------------------------------------------- responses

def test_error_body_shape():
    err = APIError(404, "nope", param="model", code="model_not_found")
    assert err.body() == {"error": {"message": "nope", "type": "invalid_request_error",
                                    "param": "model", "code": "model_not_found"}}
    assert str(err) == "nope"


def test_usage():
    assert usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    u = usage(3, 4, cached_tokens=2)
    assert u["prompt_tokens_details"] == {"cached_tokens": 2}


def roundtrip(obj: dict) -> dict:
    return orjson.loads(orjson.dumps(obj))   # what the client receives


def test_completion_response_validates():
    req = parse_cmpl()
    resp = roundtrip(completion_response(req, "hi there", "length", usage(5, 2, 1), None))
    c = Completion.model_validate(resp)
    assert (c.id, c.object, c.created, c.model) == (req.request_id, "text_completion", req.created, "tiny")
    assert c.choices[0].text == "hi there" and c.choices[0].finish_reason == "length"
    assert c.choices[0].index == 0 and c.choices[0].logprobs is None
    assert c.usage.total_tokens == 7 and c.usage.prompt_tokens_details.cached_tokens == 1


def test_chat_response_validates():
    req = parse_chat()
    resp = roundtrip(chat_response(req, "hello", "stop", usage(5, 1), None))
    c = ChatCompletion.model_validate(resp)
    assert (c.id, c.object, c.model) == (req.request_id, "chat.completion", "tiny")
    m = c.choices[0]
    assert m.message.role == "assistant" and m.message.content == "hello" and m.finish_reason == "stop"
    assert c.usage.completion_tokens == 1


def test_chat_stream_chunks_validate():
    req = parse_chat(stream=True, stream_options={"include_usage": True})
    chunks = [chat_chunk(req, {"role": "assistant", "content": ""}, None),
              chat_chunk(req, {"content": "hel"}, None),
              chat_chunk(req, {}, "stop"),
              usage_chunk(req, usage(5, 2))]
    parsed = [ChatCompletionChunk.model_validate(roundtrip(c)) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].delta.content == "hel" and parsed[1].choices[0].finish_reason is None
    assert parsed[2].choices[0].finish_reason == "stop"
    assert all(p.id == req.request_id and p.object == "chat.completion.chunk" for p in parsed)
    # include_usage: "usage": null on every chunk but the last, which has no choices.
    assert all("usage" in c and c["usage"] is None for c in chunks[:3])
    assert parsed[3].choices == [] and parsed[3].usage.total_tokens == 7
    assert "usage" not in chat_chunk(parse_chat(stream=True), {"content": "x"}, None)


def test_completion_stream_chunks_validate():
    req = parse_cmpl(stream=True, stream_options={"include_usage": True})
    mid = roundtrip(completion_chunk(req, "hel", None))
    # Completion's type says finish_reason is never null, yet OpenAI streams null
    # there; the client builds stream chunks with construct_type, without validating.
    c = construct_type(type_=Completion, value=mid)
    assert isinstance(c, Completion) and c.choices[0].text == "hel" and c.choices[0].finish_reason is None
    assert mid["object"] == "text_completion" and mid["usage"] is None
    last = Completion.model_validate(roundtrip(completion_chunk(req, "lo", "stop")))
    assert last.choices[0].finish_reason == "stop" and last.id == req.request_id
    u = Completion.model_validate(roundtrip(usage_chunk(req, usage(2, 2))))
    assert u.choices == [] and u.usage.total_tokens == 4 and u.object == "text_completion"


def test_sse():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


# ---------------------------------------------------------------- logprobs

@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


def test_completion_logprobs_shape(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)[:2]
    assert len(ids) == 2
    b = LogprobsBuilder("completion", tok, num_top=2)
    texts = [tok.decode([i], skip_special_tokens=False) for i in ids]
    frag = b.add(ids[0], -0.5, [(ids[0], -0.5), (ids[1], -1.5), (7, -3.0)], 0)
    assert frag == {"tokens": [texts[0]], "token_logprobs": [-0.5],
                    "top_logprobs": [{texts[0]: -0.5, texts[1]: -1.5}], "text_offset": [0]}
    # The sampled token is always in its top dict, even when outside the top N.
    frag = b.add(ids[1], -4.0, [(ids[0], -0.1), (7, -0.2)], len(texts[0]))
    assert frag["top_logprobs"][0][texts[1]] == -4.0 and len(frag["top_logprobs"][0]) == 3
    res = b.result()
    assert res["tokens"] == texts and res["token_logprobs"] == [-0.5, -4.0]
    assert res["text_offset"] == [0, len(texts[0])] and len(res["top_logprobs"]) == 2
    req = parse_cmpl(logprobs=2)
    c = Completion.model_validate(roundtrip(completion_response(req, "".join(texts), "length",
                                                                usage(1, 2), res)))
    assert c.choices[0].logprobs.tokens == texts
    assert c.choices[0].logprobs.top_logprobs[0] == {texts[0]: -0.5, texts[1]: -1.5}
    chunk = construct_type(type_=Completion, value=roundtrip(completion_chunk(req, texts[0], None, frag)))
    assert chunk.choices[0].logprobs.token_logprobs == [-4.0]


def test_chat_logprobs_shape(tok):
    ids = tok.encode("café ok", add_special_tokens=False)
    b = LogprobsBuilder("chat", tok, num_top=1)
    frags = [b.add(t, -1.0 * (k + 1), [(t, -0.25), (ids[0], -2.0)], 0) for k, t in enumerate(ids)]
    for t, frag in zip(ids, frags):
        (entry,) = frag["content"]
        text = tok.decode([t], skip_special_tokens=False)
        assert entry["token"] == text and entry["bytes"] == list(text.encode("utf-8"))
        assert entry["top_logprobs"] == [{"token": text, "logprob": -0.25, "bytes": list(text.encode())}]
    res = b.result()
    assert [e["logprob"] for e in res["content"]] == [-1.0 * (k + 1) for k in range(len(ids))]
    req = parse_chat(logprobs=True, top_logprobs=1)
    c = ChatCompletion.model_validate(roundtrip(chat_response(req, "café ok", "stop", usage(1, 2), res)))
    assert [lp.token for lp in c.choices[0].logprobs.content] == [e["token"] for e in res["content"]]
    assert c.choices[0].logprobs.content[0].top_logprobs[0].logprob == -0.25
    chunk = ChatCompletionChunk.model_validate(roundtrip(chat_chunk(req, {"content": "x"}, None, frags[0])))
    assert chunk.choices[0].logprobs.content[0].logprob == -1.0


def test_logprobs_special_tokens_and_zero_top(tok):
    eos = tok.token_to_id(tok.eos_token)
    b = LogprobsBuilder("chat", tok, num_top=0)
    frag = b.add(eos, -0.1, [(eos, -0.1)], 0)
    assert frag["content"][0]["token"] == tok.eos_token and frag["content"][0]["top_logprobs"] == []
    b = LogprobsBuilder("completion", tok, num_top=0)
    assert b.add(eos, -0.1, [(eos, -0.1)], 0)["top_logprobs"] == [{tok.eos_token: -0.1}]


def test_logprobs_are_finite_json(tok):
    b = LogprobsBuilder("completion", tok, num_top=1)
    b.add(5, -math.inf, [(6, math.nan)], 0)
    res = roundtrip(b.result())
    assert res["token_logprobs"] == [-9999.0] and all(v == -9999.0 for v in res["top_logprobs"][0].values())


def test_result_is_a_snapshot(tok):
    b = LogprobsBuilder("chat", tok, num_top=0)
    b.add(5, -1.0, [], 0)
    first = b.result()
    b.add(6, -1.0, [], 0)
    assert len(first["content"]) == 1 and len(b.result()["content"]) == 2


def test_a_stream_keeps_no_logprobs(tok):
    """A stream sends each token's fragment and keeps none: the router's memory
    for a long stream with top_logprobs 20 stays flat (a client that stops
    reading held ~10 MB of them per stream)."""
    for kind in ("chat", "completion"):
        b = LogprobsBuilder(kind, tok, num_top=20, keep=False)
        frags = [b.add(5, -1.0, [(t, -2.0) for t in range(20)], 0) for _ in range(500)]
        assert all(frags) and all(not values for values in b._acc.values())
        with pytest.raises(RuntimeError, match="keep=False"):
            b.json()
