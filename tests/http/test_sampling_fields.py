"""Penalties, n, best_of, echo, max_tokens 0 and prompt_logprobs: how requests
parse (pdd.http.schemas) and how their answers are shaped (pdd.http.responses),
checked against the official openai client's types."""
from __future__ import annotations

import asyncio

import orjson
import pytest
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion

from pdd.http.choices import merged
from pdd.http.responses import LogprobsBuilder, completion_choice, prompt_logprobs_json, response, usage
from pdd.http.schemas import parse_chat_request, parse_completion_request
from pdd.model.tokenizer import Tokenizer

MODELS = ["tiny"]


def cmpl(**fields):
    return parse_completion_request(orjson.dumps({"model": "tiny", "prompt": "Hello", **fields}), MODELS)


def chat(**fields):
    return parse_chat_request(orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                            **fields}), MODELS)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer(tiny_model)


@pytest.mark.parametrize("parse", [cmpl, chat])
def test_penalties_reach_the_sampling_params(parse):
    sp = parse(max_tokens=4, presence_penalty=-1.5, frequency_penalty=2, repetition_penalty=1.25).sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (-1.5, 2.0, 1.25)
    assert parse(max_tokens=4).sampling.penalized is False


@pytest.mark.parametrize("parse", [cmpl, chat])
def test_logit_bias_is_parsed_from_openais_string_keys(parse):
    assert parse(max_tokens=4, logit_bias={"7": -100, "12": 2.5}).sampling.logit_bias == {7: -100.0, 12: 2.5}
    assert parse(max_tokens=4).sampling.logit_bias == {}


@pytest.mark.parametrize("parse", [cmpl, chat])
def test_n_is_parsed_and_best_of_equal_to_it_accepted(parse):
    assert parse(max_tokens=4, n=4).n == 4
    assert cmpl(n=3, best_of=3).n == 3 and cmpl(best_of=1).n == 1


def test_echo_with_logprobs_asks_the_engine_for_the_prompts_logprobs():
    req = cmpl(echo=True, logprobs=2)
    assert req.echo and req.sampling.prompt_logprobs == 2 and req.prompt_logprobs is None
    assert cmpl(echo=True).sampling.prompt_logprobs is None          # echo alone needs no logits
    assert cmpl(logprobs=2).sampling.prompt_logprobs is None
    both = cmpl(echo=True, logprobs=1, prompt_logprobs=4)
    assert both.sampling.prompt_logprobs == 4 and both.prompt_logprobs == 4


def test_max_tokens_zero_with_echo_runs_one_token_not_shown():
    req = cmpl(echo=True, logprobs=0, max_tokens=0)
    assert req.echo_only and req.sampling.max_tokens == 1
    assert not cmpl(echo=True, max_tokens=1).echo_only


@pytest.mark.parametrize("parse", [cmpl, chat])
def test_prompt_logprobs_are_a_vllm_field(parse):
    req = parse(max_tokens=4, prompt_logprobs=3)
    assert req.prompt_logprobs == 3 and req.sampling.prompt_logprobs == 3


def test_echoed_prompt_logprobs_have_the_openai_shape(tok):
    ids = tok.encode("Hello world, again")
    entries = [(-1.5 - i, 3, [(ids[i + 1], -1.5 - i), (7, -2.5)]) for i in range(len(ids) - 1)]
    lp = LogprobsBuilder("completion", tok, 1, ids[-1])
    frag = lp.add_prompt(ids, entries)
    assert len(frag["tokens"]) == len(ids)
    assert frag["token_logprobs"][0] is None and frag["top_logprobs"][0] is None
    assert frag["token_logprobs"][1:] == [e[0] for e in entries]
    assert "".join(frag["tokens"]) == tok.decode(ids, skip_special_tokens=False)
    offsets = [0]
    for t in frag["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert frag["text_offset"] == offsets
    assert all(len(top) == 1 for top in frag["top_logprobs"][1:])   # the top 1, which is the token itself here
    lp.add(9, -0.5, [(9, -0.5)], offsets[-1] + len(frag["tokens"][-1]))
    body = response(cmpl(echo=True, logprobs=1), [completion_choice(0, "Hello world, again!", "length",
                                                                    lp.result())], usage(len(ids), 1))
    parsed = construct_type(type_=Completion, value=body)
    assert parsed.choices[0].logprobs.token_logprobs[0] is None
    assert len(parsed.choices[0].logprobs.tokens) == len(ids) + 1


def test_prompt_logprobs_json_is_vllms_shape(tok):
    ids = [5, 6, 7]
    out = prompt_logprobs_json(tok, ids, [(-1.0, 2, [(9, -0.5), (6, -1.0)]), (-0.1, 1, [(7, -0.1), (3, -4.0)])], 1)
    assert out[0] is None
    assert out[1] == {"6": {"logprob": -1.0, "rank": 2, "decoded_token": tok.decode([6], skip_special_tokens=False)},
                      "9": {"logprob": -0.5, "rank": 1, "decoded_token": tok.decode([9], skip_special_tokens=False)}}
    assert list(out[2]) == ["7"]    # the token is the top one: one entry
    chat_body = response(chat(max_tokens=2), [], usage(3, 0), out)
    assert construct_type(type_=ChatCompletion, value=chat_body).model_extra["prompt_logprobs"] == out


def test_merged_yields_each_sources_items_in_order_and_raises_a_failure():
    async def source(name, n, fail=False):
        for i in range(n):
            await asyncio.sleep(0)
            yield f"{name}{i}"
        if fail:
            raise RuntimeError(f"{name} failed")

    async def collect(sources):
        got = []
        try:
            async for i, item in merged(sources):
                got.append((i, item))
        except RuntimeError as e:
            got.append(str(e))
        return got

    got = asyncio.run(collect([source("a", 3), source("b", 2)]))
    assert [x for i, x in got if i == 0] == ["a0", "a1", "a2"] and [x for i, x in got if i == 1] == ["b0", "b1"]
    failed = asyncio.run(collect([source("a", 50), source("b", 1, fail=True)]))
    assert failed[-1] == "b failed"
