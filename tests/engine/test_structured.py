"""Constrained decoding in the engine (pdd.grammar + the sampler's mask): with
random weights only the grammar makes the output valid, so a valid output is
the grammar at work. The output must not depend on how the request ran:
async scheduling on or off, resumed elsewhere from its tokens (migration),
prefilled on one engine and decoded on another."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdd import LLM, SamplingParams
from pdd.api import InvalidRequest, StructuredOutput
from pdd.engine.sampler import SamplingBatch, apply_allowed, sample
from tests.engine.helpers import random_prompts
from tests.engine.test_disagg_engine import Pair

# Bounded everywhere, so that any path through it ends well within max_tokens.
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "age", "ok", "tags"], "additionalProperties": False}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))
MAX_TOKENS = 120


def sp(so: StructuredOutput, seed: int, temperature: float = 1.0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, structured_output=so, **kw)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model))


def test_json_schema_output_is_valid(llm):
    outs = llm.generate(random_prompts([5, 9, 13, 7], seed=1),
                        [sp(JSON_SCHEMA, seed, temperature=t) for seed, t in ((1, 1.0), (2, 1.0), (3, 0.7), (4, 0.0))])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_output_parses(llm):
    """Any JSON object: keys and strings are unbounded, and random weights end
    one only by chance: these seeds are ones that end within max_tokens (the
    others are cut by max_tokens, still inside the object)."""
    prompt = random_prompts([6], seed=2)[0]
    outs = llm.generate([prompt] * 4, [sp(StructuredOutput("json_object"), seed) for seed in (9, 15, 19, 28)])
    for out in outs:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


@pytest.mark.parametrize("so, check", [
    (StructuredOutput("regex", "[a-z]{2,5}-[0-9]{3}"), lambda text: re.fullmatch("[a-z]{2,5}-[0-9]{3}", text)),
    (StructuredOutput("choice", json.dumps(["red", "green", "blue"])), lambda text: text in ("red", "green", "blue")),
    (StructuredOutput("grammar", 'start: "x" ("+" "y")* "=" NUM\nNUM: /[0-9]{1,3}/'),
     lambda text: re.fullmatch(r"x(\+y)*=[0-9]{1,3}", text)),
    (StructuredOutput("grammar", 'root ::= "(" [ab]{1,4} ")"'), lambda text: re.fullmatch(r"\([ab]{1,4}\)", text)),
])
def test_each_kind_holds(llm, so, check):
    outs = llm.generate(random_prompts([6, 6, 6], seed=2), [sp(so, seed) for seed in (5, 6, 7)])
    for out in outs:
        assert out.finish_reason == "stop" and check(out.text), out.text


def test_without_the_grammar_the_output_is_not_json(llm):
    """The model alone writes no JSON: what makes the outputs above valid is the mask."""
    outs = llm.generate(random_prompts([5, 9], seed=1), [SamplingParams(max_tokens=30, seed=s) for s in (1, 2)])
    for out in outs:
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_async_scheduling_does_not_change_the_output(tiny_model, llm):
    """With async scheduling the next step is launched before the last token is
    on the host; the mask waits for it. Same tokens either way."""
    prompts = random_prompts([4, 11, 8], seed=3)
    params = [sp(JSON_SCHEMA, seed) for seed in (11, 12, 13)]
    sync = LLM(str(tiny_model), async_scheduling=False)
    assert ([o.token_ids for o in llm.generate(prompts, params)]
            == [o.token_ids for o in sync.generate(prompts, params)])


def test_an_id_back_while_its_aborted_request_is_in_flight_starts_a_fresh_grammar(tiny_model, llm):
    """A request aborted while its step is in flight, and a new one under the
    same id (a worker's engine id, given again after a router restart): the
    token sampled for the old one must not feed the new one's grammar."""
    regex = StructuredOutput("regex", "[a-z]{2,5}-[0-9]{3}")
    old, new, other = random_prompts([7, 11, 9], seed=4)
    want = llm.generate([new], sp(regex, 0, temperature=0.0))[0].token_ids
    engine = LLM(str(tiny_model), num_blocks=64).engine
    engine.add_request("other", other, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.add_request("x", old, sp(regex, 0, temperature=0.0))
    engine.step()
    assert engine.abort_request("x") and engine.in_flight is not None   # "other" keeps the step in flight
    engine.add_request("x", new, sp(regex, 0, temperature=0.0))
    got = []
    while engine.has_unfinished():
        got += [t for out in engine.step() if out.request_id == "x" for t in out.new_token_ids]
    assert got == want


@pytest.mark.parametrize("k", [1, 7, 20])
def test_a_request_resumed_from_its_tokens_continues_the_same(llm, k):
    """A migrated request arrives as prompt + tokens so far (num_prior_output_tokens):
    its matcher replays them, and it continues as the request that ran whole."""
    prompt = random_prompts([9], seed=4)[0]
    whole = llm.generate([prompt], sp(JSON_SCHEMA, 21))[0].token_ids
    assert len(whole) > k
    engine = llm.engine
    engine.add_request("resumed", prompt + whole[:k], sp(JSON_SCHEMA, 21), num_prior_output_tokens=k)
    rest = []
    while engine.has_unfinished():
        rest += [t for o in engine.step() for t in o.new_token_ids]
    assert whole[:k] + rest == whole


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_disaggregated_equals_colocated(tiny_model, llm, temperature):
    """The prefill engine samples the first token under the grammar; the decode
    engine replays it into its own matcher and continues."""
    prompts = random_prompts([5, 21, 40], seed=5)
    params = sp(JSON_SCHEMA, 31, temperature=temperature)
    colocated = [o.token_ids for o in llm.generate(prompts, params)]
    pair = Pair(tiny_model)
    assert [r["tokens"] for r in pair.generate(prompts, params)] == colocated
    pair.assert_idle()


def ended(engine) -> dict:
    """Step until nothing is left: the last output of each request."""
    last = {}
    while engine.has_unfinished():
        last.update((out.request_id, out) for out in engine.step())
    return last


def test_a_spec_that_does_not_compile_is_refused(llm):
    """Its shape at once; its compile (off the step) fails the request, naming structured_output."""
    with pytest.raises(InvalidRequest, match="structured_output.kind"):
        llm.engine.make_request("bad", [1, 2, 3], sp(StructuredOutput("xml", ""), 1))
    for so, words in ((StructuredOutput("regex", "a(b"), "unclosed group"),
                      (StructuredOutput("json_schema", '{"type": "nope"}'), "nope"),
                      (StructuredOutput("json_schema", "{"), "cannot read")):
        llm.engine.add_request("bad", [1, 2, 3], sp(so, 1))
        out = ended(llm.engine)["bad"]
        assert out.finished and out.finish_reason == "error" and not out.new_token_ids
        assert out.error.startswith("structured_output") and words in out.error, out.error


# A row of 2,500 items: over llguidance's max_items_in_row, found at the first token.
WIDE_LARK = StructuredOutput("grammar", "start: " + " | ".join(f'"ch{i}"' for i in range(2500)))


def test_a_grammar_that_fails_while_decoding_ends_its_request_in_error(llm):
    """The matcher fails on the first token it takes (the router's check
    refuses this grammar; an engine must not trust that): the request ends
    with finish_reason "error" and the reason, never a "stop" whose text
    breaks the grammar; a request beside it is unaffected."""
    engine = llm.engine
    engine.add_request("wide", random_prompts([6], seed=8)[0], sp(WIDE_LARK, 1))
    engine.add_request("ok", random_prompts([6], seed=9)[0], sp(JSON_SCHEMA, 2))
    ends = ended(engine)
    wide, ok = ends["wide"], ends["ok"]
    assert wide.finish_reason == "error" and not wide.new_token_ids
    assert "structured_output" in wide.error and "max is 2000" in wide.error, wide.error
    assert ok.finish_reason == "stop" and ok.error is None


def test_many_choices_are_one_lexeme_and_hold(llm):
    """More choices than a parser row holds (max_items_in_row 2000): honoured."""
    choices = [f"ch{i}" for i in range(2500)]
    outs = llm.generate(random_prompts([6, 6], seed=2),
                        [sp(StructuredOutput("choice", json.dumps(choices)), seed) for seed in (5, 6)])
    for out in outs:
        assert out.finish_reason == "stop" and out.text in choices, out.text


def test_apply_allowed_unpacks_every_bit():
    vocab = 70   # three words, the last one partly padding
    allowed = torch.zeros(2, 3, dtype=torch.int32)
    allowed[0, 0] = 1 << 5
    allowed[0, 0] |= -(1 << 31)          # bit 31 is the int32's sign
    allowed[1, 2] = 1 << (66 - 64)
    logits = torch.randn(2, vocab)
    masked = apply_allowed(logits, allowed)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [5, 31]
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [66]
    batch = SamplingBatch.build([SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=1.0, seed=2)],
                                [3, 3], torch.device("cpu"))
    batch.allowed = allowed
    tokens = sample(logits, batch).tokens.tolist()
    assert tokens[0] in (5, 31) and tokens[1] == 66
