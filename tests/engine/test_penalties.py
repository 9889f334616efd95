"""Repetition, frequency and presence penalties: the sampler's function against
Hugging Face's repetition processor and a direct reference of vLLM's
frequency/presence formula; and in the engine, the same output however the
request is run (async or not, chunked, preempted, disaggregated, resumed
elsewhere after some tokens), since penalties read the request's tokens so far."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pdd import LLM, SamplingParams
from pdd.api import InvalidRequest
from pdd.engine.penalties import Penalties, PenaltyRow, apply_penalties
from pdd.engine.sampler import SamplingBatch, sample
from pdd.engine.staging import Staging
from tests.engine.helpers import assert_all_blocks_free, random_prompts
from tests.engine.test_disagg_engine import Pair

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
VOCAB = 50


def _build(rows: dict[int, PenaltyRow], in_flight: torch.Tensor | None = None) -> Penalties:
    return Penalties.build(rows, VOCAB, CPU, Staging(CPU), in_flight)


def _row(prompt, output, rep=1.0, freq=0.0, pres=0.0, in_flight_row=None) -> PenaltyRow:
    return PenaltyRow(np.unique(np.asarray(prompt, dtype=np.int64)), list(output), rep, freq, pres, in_flight_row)


def reference_vllm(logits: torch.Tensor, prompt, output, rep: float, freq: float, pres: float) -> torch.Tensor:
    """vLLM's definitions written out token by token."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= freq * output.count(t) + pres
    return x


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_hugging_face(penalty):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g) * 4
    histories = [([1, 2, 3, 2], [7, 7, 9]), ([5] * 10, []), ([0], [49, 1, 0])]
    got = apply_penalties(logits, _build({r: _row(p, o, rep=penalty) for r, (p, o) in enumerate(histories)}))
    hf = transformers.RepetitionPenaltyLogitsProcessor(penalty)
    for r, (p, o) in enumerate(histories):
        want = hf(torch.tensor([p + o]), logits[r:r + 1].clone())[0]
        torch.testing.assert_close(got[r], want, rtol=0, atol=0)
        assert not torch.equal(got[r], logits[r])   # the case is not vacuous


def test_frequency_and_presence_follow_vllm_and_leave_other_rows_alone():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    cases = {0: ([1, 2], [3, 3, 3, 4], 1.2, 0.7, 0.4), 2: ([9, 9], [9, 8, 8], 1.0, -1.5, 2.0),
             3: ([], [5, 6, 5], 0.8, 2.0, -2.0)}
    got = apply_penalties(logits, _build({r: _row(p, o, rep, f, pr) for r, (p, o, rep, f, pr) in cases.items()}))
    for r, (p, o, rep, f, pr) in cases.items():
        torch.testing.assert_close(got[r], reference_vllm(logits[r], p, o, rep, f, pr))
    assert torch.equal(got[1], logits[1])                 # a row without penalties


def test_the_token_in_flight_counts_as_output():
    """With async scheduling a row's last output token is still on the device:
    counted there, as if the host had it."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    in_flight = torch.tensor([11, 4, 30])
    got = apply_penalties(logits, _build({0: _row([1], [4], 1.5, 0.5, 0.25, in_flight_row=1),
                                          1: _row([2], [], 1.5, 0.5, 0.25, in_flight_row=2)}, in_flight))
    torch.testing.assert_close(got[0], reference_vllm(logits[0], [1], [4, 4], 1.5, 0.5, 0.25))
    torch.testing.assert_close(got[1], reference_vllm(logits[1], [2], [30], 1.5, 0.5, 0.25))


def test_penalties_change_the_greedy_choice_and_logprobs_stay_the_models():
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 7], logits[0, 8] = 5.0, 4.0
    batch = SamplingBatch.build([SamplingParams(temperature=0.0, logprobs=0, seed=0)], [3], CPU)
    assert sample(logits, batch).tokens.tolist() == [7]
    batch.penalties = _build({0: _row([7], [], rep=2.0)})
    result = sample(logits, batch)
    assert result.tokens.tolist() == [8]                  # 7 was in the prompt: 5 / 2 < 4
    assert result.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 8].item())


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.01),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
                                         ("repetition_penalty", float("nan")), ("presence_penalty", True)])
def test_out_of_range_penalties_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value}).validate()


# ---------------------------------------------------------------- in the engine

PENALIZED = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.4),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, repetition_penalty=1.2,
                   frequency_penalty=0.8, presence_penalty=-0.5),
]
IDS = ["repetition", "frequency-presence", "seeded-all-three"]
PROMPTS = random_prompts([3, 17, 40], seed=21, vocab=40)   # a small id range: tokens repeat


@pytest.fixture(scope="module")
def colocated(tiny_model):
    return LLM(str(tiny_model))


@pytest.fixture(scope="module")
def expected(colocated):
    return {i: [o.token_ids for o in colocated.generate(PROMPTS, sp)] for i, sp in zip(IDS, PENALIZED)}


@pytest.mark.parametrize("sp,case", list(zip(PENALIZED, IDS)), ids=IDS)
def test_penalties_change_the_output(colocated, expected, sp, case):
    neutral = SamplingParams(**{**vars(sp), "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                                "presence_penalty": 0.0})
    assert [o.token_ids for o in colocated.generate(PROMPTS, neutral)] != expected[case]


@pytest.mark.parametrize("engine_kw", [dict(async_scheduling=False), dict(chunk_size=7, chunk_only_beside_decodes=False),
                                       dict(num_blocks=9, block_size=16)],
                         ids=["sync", "chunked", "preempted"])
@pytest.mark.parametrize("sp,case", list(zip(PENALIZED, IDS)), ids=IDS)
def test_penalized_output_is_the_same_however_the_engine_runs(tiny_model, expected, engine_kw, sp, case):
    llm = LLM(str(tiny_model), **engine_kw)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == expected[case]
    if "num_blocks" in engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("sp,case", list(zip(PENALIZED, IDS)), ids=IDS)
def test_penalized_output_is_the_same_disaggregated(tiny_model, expected, sp, case):
    """The decode engine counts the first token, which the prefill engine sampled, as output."""
    pair = Pair(tiny_model)
    assert [g["tokens"] for g in pair.generate(PROMPTS, sp)] == expected[case]
    pair.assert_idle()


@pytest.mark.parametrize("sp,case", list(zip(PENALIZED, IDS)), ids=IDS)
def test_a_resumed_request_counts_its_earlier_tokens_as_output(colocated, expected, sp, case):
    """A request moved after k tokens arrives with them as the prompt's tail
    (num_prior_output_tokens): they are output for frequency and presence."""
    engine = colocated.engine
    for n, (prompt, tokens) in enumerate(zip(PROMPTS, expected[case])):
        k = 5
        engine.add_request(f"resumed-{case}-{n}", prompt + tokens[:k], SamplingParams(**vars(sp)),
                           num_prior_output_tokens=k)
        got = []
        while engine.has_unfinished():
            for out in engine.step():
                got.extend(out.new_token_ids)
        assert got == tokens[k:]
