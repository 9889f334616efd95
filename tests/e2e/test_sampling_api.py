"""Penalties, n > 1 (also over a list of prompts), echo with logprobs and
prompt_logprobs over HTTP, on real clusters of each layout (colocated, and 1
prefill + 1 decode over tcp): the output equals the offline engine's (so the
layouts agree), and the prompt's logprobs equal Hugging Face transformers' on
the same checkpoint."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import torch

from pdd import SamplingParams
from tests.e2e import http_util
from tests.e2e.test_disagg import metric

transformers = pytest.importorskip("transformers")

PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog jumps over the fox again and again."


@pytest.fixture(scope="module")
def hf(tiny_model):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def completions(cluster, **body) -> dict:
    reply = http_util.post(cluster.url + "/v1/completions", {"model": cluster.model_name, **body})
    assert reply.status == 200, reply.body
    return reply.json()


def stream(cluster, **body) -> list[dict]:
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            async with session.post(cluster.url + "/v1/completions",
                                    json={"model": cluster.model_name, "stream": True, **body}) as resp:
                assert resp.status == 200
                raw = (await resp.read()).decode()
        return [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
    return asyncio.run(main())


PENALIZED = [dict(temperature=0, repetition_penalty=1.5),
             dict(temperature=0, frequency_penalty=1.2, presence_penalty=0.6),
             dict(temperature=0.8, seed=11, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.5)]


@pytest.mark.parametrize("fields", PENALIZED, ids=["repetition", "frequency-presence", "seeded"])
def test_penalized_output_is_the_offline_engines_in_every_layout(layout, offline, fields):
    sp = SamplingParams(max_tokens=30, ignore_eos=True, **fields)
    expected = offline.generate([PROMPT], sp)[0]
    assert expected.token_ids != offline.generate([PROMPT], SamplingParams(
        max_tokens=30, ignore_eos=True, temperature=fields["temperature"], seed=fields.get("seed")))[0].token_ids
    got = completions(layout, prompt=PROMPT, max_tokens=30, ignore_eos=True, **fields)
    assert got["choices"][0]["text"] == expected.text


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_gives_the_prompts_logprobs_as_hugging_face(layout, offline, hf, max_tokens):
    """What lm-eval's loglikelihood requests send (echo, logprobs, temperature 0)."""
    ids = offline.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    body = completions(layout, prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for q in range(1, len(ids)):
        assert lp["token_logprobs"][q] == pytest.approx(ref[q - 1, ids[q]].item(), abs=1e-4)
        best = int(ref[q - 1].argmax())
        assert max(lp["top_logprobs"][q].values()) == pytest.approx(ref[q - 1, best].item(), abs=1e-4)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == max_tokens
    if max_tokens:
        expected = offline.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))[0]
        assert choice["text"] == PROMPT + expected.text
        assert lp["token_logprobs"][-1] == pytest.approx(ref[-1, expected.token_ids[0]].item(), abs=1e-4)
    else:
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"


def test_prompt_logprobs_as_vllm_returns_them(layout, offline, hf):
    ids = offline.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    body = completions(layout, prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=2)
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for q in range(1, len(ids)):
        own = entries[q][str(ids[q])]
        assert own["logprob"] == pytest.approx(ref[q - 1, ids[q]].item(), abs=1e-4)
        assert own["rank"] == int((ref[q - 1] > ref[q - 1, ids[q]]).sum()) + 1
        assert {str(t) for t in ref[q - 1].topk(2).indices.tolist()} <= set(entries[q])


def test_n_choices_share_the_prompt_and_sample_with_their_own_seeds(layout, offline):
    ids = offline.tokenizer.encode(PROMPT)
    full = len(ids) // 16 * 16
    sp = dict(max_tokens=12, temperature=0.9, ignore_eos=True)
    expected = [offline.generate([PROMPT], SamplingParams(seed=40 + i, **sp))[0].text for i in range(3)]
    assert len(set(expected)) == 3
    cached_before = metric(layout, "pdd_prompt_cached_tokens_total")
    body = completions(layout, prompt=PROMPT, n=3, best_of=3, seed=40, **sp)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == expected
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 36
    # The later choices ran beside the first, whose decode worker had the prompt's full blocks.
    assert usage["prompt_tokens_details"]["cached_tokens"] == full
    assert metric(layout, "pdd_prompt_cached_tokens_total") - cached_before >= 2 * full

    chunks = stream(layout, prompt=PROMPT, n=2, seed=40, stream_options={"include_usage": True}, **sp)
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: expected[0], 1: expected[1]}
    assert chunks[-1]["usage"]["completion_tokens"] == 24


def test_a_list_of_prompts_has_n_choices_each_in_openai_order(layout, offline):
    """Prompt i's choice j is choice i * n + j (as OpenAI and vLLM), sampled with
    seed + j; usage counts each prompt once. echo and max_tokens 0 per prompt too."""
    prompts = [PROMPT, "Once upon a time"]
    sp = dict(max_tokens=6, temperature=0.9, ignore_eos=True)
    expected = [offline.generate([p], SamplingParams(seed=7 + j, **sp))[0].text for p in prompts for j in range(2)]
    assert expected[0] != expected[1] and expected[2] != expected[3]
    body = completions(layout, prompt=prompts, n=2, seed=7, **sp)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == expected
    num_prompt = sum(len(offline.tokenizer.encode(p)) for p in prompts)
    assert body["usage"]["prompt_tokens"] == num_prompt and body["usage"]["completion_tokens"] == 4 * 6

    chunks = stream(layout, prompt=prompts, n=2, seed=7, stream_options={"include_usage": True}, **sp)
    texts, finished = {i: "" for i in range(4)}, []
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"]:
                finished.append(c["index"])
    assert [texts[i] for i in range(4)] == expected and sorted(finished) == [0, 1, 2, 3]
    assert chunks[-1]["usage"]["prompt_tokens"] == num_prompt and chunks[-1]["usage"]["completion_tokens"] == 24

    echoed = completions(layout, prompt=prompts, n=2, echo=True, max_tokens=0)
    assert [(c["index"], c["text"]) for c in echoed["choices"]] == [(0, PROMPT), (1, PROMPT), (2, prompts[1]),
                                                                   (3, prompts[1])]
    assert echoed["usage"]["prompt_tokens"] == num_prompt and echoed["usage"]["completion_tokens"] == 0
    nothing = completions(layout, prompt=prompts, n=2, max_tokens=0)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in nothing["choices"]] == [
        (i, "", "length") for i in range(4)]
    assert nothing["usage"]["prompt_tokens"] == num_prompt and nothing["usage"]["completion_tokens"] == 0
    layout.wait_idle(timeout_s=30)


def test_n_choices_with_echo_and_logprobs(layout, offline):
    body = completions(layout, prompt=PROMPT, n=2, echo=True, logprobs=0, max_tokens=3, temperature=0)
    first, second = body["choices"]
    assert first["text"] == second["text"] and first["text"].startswith(PROMPT)
    n = len(offline.tokenizer.encode(PROMPT))
    # The prompt's are the first choice's (only it computes them); the generated
    # ones each choice's own (the second computed less of the prompt: not bit-equal).
    assert first["logprobs"]["token_logprobs"][:n] == second["logprobs"]["token_logprobs"][:n]
    assert first["logprobs"]["token_logprobs"][n:] == pytest.approx(second["logprobs"]["token_logprobs"][n:], abs=1e-4)
    layout.wait_idle(timeout_s=30)


def test_chat_choices_and_prompt_logprobs_through_the_openai_client(layout, offline):
    client = openai.OpenAI(base_url=layout.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name three colours and a fruit."}]
    ids = offline.tokenizer.encode_chat(messages)
    sp = dict(max_tokens=8, temperature=0.9, seed=3, presence_penalty=0.8)
    expected = [offline.generate([ids], SamplingParams(**{**sp, "seed": 3 + i}))[0].text
                for i in range(2)]
    r = client.chat.completions.create(model=layout.model_name, messages=messages, n=2,
                                       extra_body={"prompt_logprobs": 1}, **sp)
    assert [c.message.content for c in r.choices] == expected
    prompt_lps = r.model_extra["prompt_logprobs"]
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None and str(ids[1]) in prompt_lps[1]
    chunks = list(client.chat.completions.create(model=layout.model_name, messages=messages, n=2, stream=True, **sp))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == expected
