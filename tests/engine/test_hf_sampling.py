"""The engine against Hugging Face transformers on the same checkpoint: a
prompt's logprobs (SamplingParams.prompt_logprobs) equal the log-softmax of
HF's logits over the prompt, however the prompt is sliced into steps; greedy
output with a repetition penalty equals HF's generate with its repetition
processor; with frequency and presence penalties, a greedy loop over HF's
logits with vLLM's formula."""
from __future__ import annotations

import pytest
import torch

from pdd import LLM, SamplingParams
from tests.engine.helpers import assert_all_blocks_free, random_prompts
from tests.engine.test_penalties import reference_vllm

transformers = pytest.importorskip("transformers")

PROMPTS = random_prompts([1, 2, 9, 16, 17, 45], seed=31)
TOP = 3


@pytest.fixture(scope="module")
def hf(tiny_model):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: the log-softmax at each position but the last."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


@pytest.mark.parametrize("engine_kw", [{}, dict(chunk_size=7, chunk_only_beside_decodes=False),
                                       dict(num_blocks=5, block_size=16, chunk_size=5)],
                         ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_equal_hugging_face(tiny_model, hf, engine_kw):
    llm = LLM(str(tiny_model), **engine_kw)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    outs = llm.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_prompt_logprobs(hf, prompt)
        assert len(out.prompt_logprobs) == len(prompt) - 1
        for q, (lp, rank, top) in enumerate(out.prompt_logprobs):
            target = prompt[q + 1]
            assert lp == pytest.approx(ref[q, target].item(), abs=1e-4)
            assert rank == int((ref[q] > ref[q, target]).sum()) + 1
            want_lp, want_ids = ref[q].topk(TOP)
            assert [t for t, _ in top] == want_ids.tolist()
            assert [x for _, x in top] == pytest.approx(want_lp.tolist(), abs=1e-4)
    if "num_blocks" in engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_prompt_logprobs_skip_the_prefix_cache_and_count_the_same(tiny_model, hf):
    """A prompt whose blocks are cached is computed anyway: cached positions would have no logits."""
    llm = LLM(str(tiny_model), block_size=16)
    prompt = PROMPTS[-1]
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    ref = hf_prompt_logprobs(hf, prompt)
    assert [lp for lp, _, _ in out.prompt_logprobs] == pytest.approx(
        ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist(), abs=1e-4)
    assert all(top == [] for _, _, top in out.prompt_logprobs)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_with_repetition_penalty_equals_hugging_face_generate(tiny_model, hf, penalty):
    prompts = random_prompts([5, 30], seed=32, vocab=60)
    outs = LLM(str(tiny_model)).generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                                 repetition_penalty=penalty))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
                              repetition_penalty=penalty, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == ids[0, len(prompt):].tolist()


def test_greedy_with_frequency_and_presence_equals_a_reference_loop(tiny_model, hf):
    prompts = random_prompts([4, 25], seed=33, vocab=60)
    rep, freq, pres = 1.1, 0.9, 0.6
    outs = LLM(str(tiny_model)).generate(prompts, SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=rep, frequency_penalty=freq,
        presence_penalty=pres))
    for prompt, out in zip(prompts, outs):
        output: list[int] = []
        for _ in range(16):
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
            output.append(int(reference_vllm(logits, prompt, output, rep, freq, pres).argmax()))
        assert out.token_ids == output
