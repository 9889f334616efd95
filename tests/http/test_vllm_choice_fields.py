"""Choice fields as vLLM has them (tests/http/engine_server.py: the tiny
random-weight model behind a real HTTP app): stop_reason beside finish_reason
(the stop string or the stop token id that ended a choice, None for the end of
sequence or the length limit), in a whole answer and in a stream's last chunk;
the echo of a token-id prompt decoded with its special tokens."""
from __future__ import annotations

import aiohttp
import orjson
import pytest

from pdd import LLM, SamplingParams
from tests.http.engine_server import run, serve

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model))


async def complete(s, url: str, body: dict, stream: bool):
    """(the choice of a whole answer) or (the stream's last choice chunk)."""
    async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "temperature": 0,
                                                      "ignore_eos": True, **body, "stream": stream}) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return (await r.json())["choices"][0]
        last = None
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"] is not None:
                    last = chunk["choices"][0]
        return last


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_choice(llm):
    out = llm.generate([PROMPT], [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)])[0]
    text, ids = out.text, out.token_ids
    stop_string = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip()
                       and text.find(text[i:i + 2]) == i)
    stop_token = next(t for i, t in enumerate(ids[3:], 3) if t not in ids[:i])

    async def main():
        server, url = await serve(llm)
        got = {}
        async with aiohttp.ClientSession() as s:
            for stream in (False, True):
                got["length", stream] = await complete(s, url, {"max_tokens": 12}, stream)
                got["string", stream] = await complete(s, url, {"max_tokens": 12, "stop": [stop_string]}, stream)
                got["token", stream] = await complete(s, url, {"max_tokens": 12, "stop_token_ids": [stop_token]},
                                                      stream)
        await server.cleanup()
        return got

    got = run(main())
    for stream in (False, True):
        assert (got["length", stream]["finish_reason"], got["length", stream]["stop_reason"]) == ("length", None)
        assert (got["string", stream]["finish_reason"], got["string", stream]["stop_reason"]) == ("stop",
                                                                                                 stop_string)
        assert (got["token", stream]["finish_reason"], got["token", stream]["stop_reason"]) == ("stop", stop_token)


def test_the_echo_of_a_token_id_prompt_keeps_its_special_tokens(llm):
    """vLLM decodes the ids as they are: the echoed text holds <|im_start|> where
    `tokens` (and text_offset) of the logprobs have it."""
    special = 1022   # the tiny tokenizer's <|im_start|>

    async def main():
        server, url = await serve(llm)
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": [special, 300, 301],
                                                              "echo": True, "max_tokens": 1, "logprobs": 0}) as r:
                assert r.status == 200, await r.text()
                choice = (await r.json())["choices"][0]
        await server.cleanup()
        return choice

    choice = run(main())
    assert choice["text"].startswith("<|im_start|>")
    assert choice["logprobs"]["tokens"][0] == "<|im_start|>" and choice["logprobs"]["text_offset"][:2] == [0, 12]


def test_return_tokens_as_token_ids_names_every_token_of_the_logprobs_by_its_id(llm):
    """Two tokens that decode alike (or to a piece of one character) stay apart:
    completions' tokens and top_logprobs keys, chat's token fields, all
    "token_id:<id>", the ids the model sampled; the text is the text."""
    out = llm.generate([PROMPT], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])[0]

    async def main():
        server, url = await serve(llm)
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                    "logprobs": 2, "return_tokens_as_token_ids": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                completion = (await r.json())["choices"][0]
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
                    "return_tokens_as_token_ids": True}
            async with s.post(url + "/v1/chat/completions", json=chat) as r:
                assert r.status == 200, await r.text()
                chat_choice = (await r.json())["choices"][0]
        await server.cleanup()
        return completion, chat_choice

    completion, chat_choice = run(main())
    lp = completion["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in out.token_ids] and completion["text"] == out.text
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    entries = chat_choice["logprobs"]["content"]
    assert len(entries) == 4 and all(e["token"].startswith("token_id:") and
                                     all(t["token"].startswith("token_id:") for t in e["top_logprobs"])
                                     for e in entries)
