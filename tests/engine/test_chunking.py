"""Chunked prefill bounds the gap a prompt gives requests decoding beside it;
with nothing decoding, a prompt takes the whole step budget."""
from __future__ import annotations

import pytest
import torch

from pdd import LLM
from pdd.api import InvalidRequest, query_key_pairs
from pdd.engine.engine import default_step_budget
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts

SHAPE = dict(chunk_size=32, max_num_batched_tokens=96, num_blocks=128, async_scheduling=False)


@pytest.mark.parametrize("beside_decodes_only", [True, False])
def test_a_lone_prompt_takes_the_budget_and_one_beside_decodes_a_chunk(tiny_model, beside_decodes_only):
    llm = LLM(str(tiny_model), chunk_only_beside_decodes=beside_decodes_only, **SHAPE)
    engine = llm.engine
    short, long_a, long_b = random_prompts([8, 200, 200], seed=11)
    alone = engine.add_request("alone", long_a, greedy(2, ignore_eos=True))
    engine.step()
    assert alone.num_computed_tokens == (96 if beside_decodes_only else 32)
    while engine.has_unfinished():
        engine.step()

    decoder = engine.add_request("decoder", short, greedy(40, ignore_eos=True))
    engine.step()                                   # its prompt in one step; from now on it decodes
    assert decoder.decoding
    beside = engine.add_request("beside", long_b, greedy(2, ignore_eos=True))
    engine.step()
    assert beside.num_computed_tokens == 32         # a chunk: the decoder's gap stays one chunk long
    while engine.has_unfinished():
        engine.step()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("prefill_only", [True, False])
def test_a_prefill_only_request_does_not_count_as_decoding(tiny_model, prefill_only):
    """A prefill worker's requests end at their first token: while it is in
    flight (async scheduling) they do not make the next prompt's chunks small."""
    llm = LLM(str(tiny_model), **{**SHAPE, "async_scheduling": True})
    engine = llm.engine
    first, second = random_prompts([40, 200], seed=12)
    a = engine.add_request("a", first, greedy(1 if prefill_only else 5, ignore_eos=True), prefill_only=prefill_only)
    engine.step()                                   # a's prompt launched; its first token in flight
    b = engine.add_request("b", second, greedy(2, ignore_eos=True))
    engine.step()
    assert a.decoding is not prefill_only
    assert b.num_computed_tokens == (96 if prefill_only else 32)
    while engine.has_unfinished():
        engine.step()
    assert_all_blocks_free(llm)


def test_the_step_budget_defaults_by_device(tiny_model):
    assert LLM(str(tiny_model), num_blocks=64).engine.cfg.max_num_batched_tokens == 2048   # on the CPU
    assert default_step_budget(torch.device("cuda")) == 8192
    assert LLM(str(tiny_model), num_blocks=64, max_num_batched_tokens=100).engine.cfg.max_num_batched_tokens == 100


def test_prompt_tokens_beside_decodes_can_be_capped_for_the_whole_step(tiny_model):
    """Three prompts arrive while one request decodes: each may take a chunk (32),
    but together at most prefill_tokens_beside_decodes (40) of the step's 96."""
    llm = LLM(str(tiny_model), prefill_tokens_beside_decodes=40, **SHAPE)
    engine = llm.engine
    short, *longs = random_prompts([8, 100, 100, 100], seed=13)
    decoder = engine.add_request("decoder", short, greedy(40, ignore_eos=True))
    engine.step()
    prompts = [engine.add_request(f"p{i}", p, greedy(2, ignore_eos=True)) for i, p in enumerate(longs)]
    engine.step()
    assert [p.num_computed_tokens for p in prompts] == [32, 8, 0]
    assert decoder.num_output_tokens == 2            # the decode was not held back
    while engine.has_unfinished():
        engine.step()
    assert_all_blocks_free(llm)
    alone = LLM(str(tiny_model), prefill_tokens_beside_decodes=40, **SHAPE).engine
    lone = alone.add_request("lone", longs[0], greedy(2, ignore_eos=True))
    alone.step()
    assert lone.num_computed_tokens == 96            # nothing decodes: the whole budget


@pytest.mark.parametrize("beside_decodes_only", [True, False])
def test_a_prompt_computed_for_another_worker_is_scheduled_as_if_nothing_decoded(tiny_model, beside_decodes_only):
    """An adaptive prefill-leaning worker may decode a few requests: the prompts it
    computes for others keep the whole step (the router prices the gap), while a
    prompt that decodes here still takes a chunk within the cap."""
    llm = LLM(str(tiny_model), prefill_tokens_beside_decodes=40, chunk_only_beside_decodes=beside_decodes_only,
              **SHAPE)
    engine = llm.engine
    short, for_other, local = random_prompts([8, 200, 200], seed=14)
    decoder = engine.add_request("decoder", short, greedy(40, ignore_eos=True))
    engine.step()
    assert decoder.decoding
    remote = engine.add_request("remote", for_other, greedy(1, ignore_eos=True), prefill_only=True)
    here = engine.add_request("here", local, greedy(2, ignore_eos=True))
    engine.step()
    # the budget (96) less the decode; with chunks everywhere, a chunk but no cap
    assert remote.num_computed_tokens == (95 if beside_decodes_only else 32)
    assert here.num_computed_tokens == (0 if beside_decodes_only else 32)   # what is left of the step
    assert decoder.num_output_tokens == 2
    while engine.has_unfinished():
        engine.step()
    assert_all_blocks_free(llm)


def test_a_request_may_carry_a_smaller_chunk_of_its_own_beside_decodes(tiny_model):
    """Adaptive placement sizes a long local prompt's chunks (Admit.prefill_chunk):
    beside a decode that request takes at most its own chunk, another prompt the
    engine's; alone it takes the whole budget. Each step reports its prompt
    chunks' query-key pairs, which grow with the chunk's depth."""
    llm = LLM(str(tiny_model), **SHAPE)
    engine = llm.engine
    short, long_a, long_b = random_prompts([8, 200, 200], seed=15)
    decoder = engine.add_request("decoder", short, greedy(40, ignore_eos=True))
    engine.step()
    sized = engine.add_request("sized", long_a, greedy(2, ignore_eos=True), prefill_chunk=12)
    plain = engine.add_request("plain", long_b, greedy(2, ignore_eos=True))
    engine.step()
    assert (sized.num_computed_tokens, plain.num_computed_tokens) == (12, 32)
    assert engine.last_step.prefill_pairs == query_key_pairs(0, 12) + query_key_pairs(0, 32)
    engine.step()
    assert engine.last_step.prefill_pairs == query_key_pairs(12, 12) + query_key_pairs(32, 32)
    engine.abort_request("decoder")
    while decoder.num_computed_tokens and not decoder.status.finished:
        engine.step()
    before = sized.num_computed_tokens
    engine.step()                                   # nothing decodes: no cap of its own
    assert sized.num_computed_tokens - before > 12
    while engine.has_unfinished():
        engine.step()
    assert_all_blocks_free(llm)
    with pytest.raises(InvalidRequest, match="prefill_chunk"):
        engine.add_request("bad", short, greedy(2), prefill_chunk=-1)
