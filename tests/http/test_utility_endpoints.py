"""vLLM's utility endpoints in vLLM's shapes (what `vllm bench serve`, aiperf,
guidellm and lm-eval call besides generation): the model list with `root`,
/tokenize (the same tokens generation uses), /detokenize, /version, and the
ignored-fields header. A real server on a loopback port with the tiny model's
tokenizer; the router core is a stand-in (none of this reaches a worker)."""
from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

import pdd
from pdd.config_loader import load_cluster_config
from pdd.http.app import build_app, serve_http
from pdd.http.schemas import parse_chat_request
from pdd.http.validate import APIError
from pdd.http.utility import parse_tokenize
from pdd.model.tokenizer import Tokenizer
from tests.security.conftest import StubRouter

JSON = {"Content-Type": "application/json"}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def serve(tiny_model, names=("/models/tiny", "tiny")):
    cfg = load_cluster_config(env={})
    app = build_app(StubRouter(cfg, max_model_len=64), Tokenizer(tiny_model), names, model_root=str(tiny_model))
    server = await serve_http(app, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.port}"


async def call(s: aiohttp.ClientSession, method: str, url: str, body=None) -> tuple[int, dict, dict]:
    async with s.request(method, url, json=body) as r:
        return r.status, await r.json(), dict(r.headers)


def test_models_lists_every_name_with_the_checkpoint_as_root(tiny_model):
    async def main():
        server, url = await serve(tiny_model)
        async with aiohttp.ClientSession() as s:
            status, body, _ = await call(s, "GET", url + "/v1/models")
            assert status == 200 and body["object"] == "list"
            assert [m["id"] for m in body["data"]] == ["/models/tiny", "tiny"]
            for m in body["data"]:   # what `vllm bench serve` reads: id and root; root loads a tokenizer
                assert m["object"] == "model" and m["root"] == str(tiny_model) and m["parent"] is None
                assert m["max_model_len"] == 64 and m["owned_by"] == "pdd"
            status, body, _ = await call(s, "GET", url + "/version")
            assert status == 200 and body == {"version": pdd.__version__}
        await server.cleanup()

    run(main())


def test_tokenize_gives_the_tokens_generation_uses(tiny_model):
    tok = Tokenizer(tiny_model)
    text = "The quick brown fox"

    async def main():
        server, url = await serve(tiny_model)
        async with aiohttp.ClientSession() as s:
            status, body, _ = await call(s, "POST", url + "/tokenize", {"model": "tiny", "prompt": text})
            assert status == 200
            assert body == {"count": len(tok.encode(text)), "max_model_len": 64, "tokens": tok.encode(text),
                            "token_strs": None}
            # vllm bench serve's alignment: no special tokens, then back to text.
            _, plain, _ = await call(s, "POST", url + "/tokenize",
                                     {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
            assert plain["tokens"] == tok.encode(text, add_special_tokens=False)
            assert plain["token_strs"] == [tok.id_to_token(t) for t in plain["tokens"]]
            status, back, _ = await call(s, "POST", url + "/detokenize", {"model": "/models/tiny",
                                                                          "tokens": plain["tokens"]})
            assert status == 200 and back == {"prompt": text}
            # A conversation: exactly what a chat completion of it is given.
            _, chat, _ = await call(s, "POST", url + "/tokenize", {"messages": MSGS})
            assert chat["tokens"] == tok.encode_chat(MSGS) and chat["count"] == len(chat["tokens"])
            _, cont, _ = await call(s, "POST", url + "/tokenize",
                                    {"messages": MSGS, "add_generation_prompt": False})
            assert cont["tokens"] == tok.encode_chat(MSGS, add_generation_prompt=False) != chat["tokens"]
            _, special, _ = await call(s, "POST", url + "/tokenize", {"messages": MSGS, "add_special_tokens": True})
            assert special["tokens"] == tok.encode(tok.apply_chat_template(MSGS), add_special_tokens=True)
        await server.cleanup()

    run(main())


def test_tokenizer_info_is_what_lm_eval_scores_through(tiny_model):
    """lm-eval's local-completions uses the server's tokenizer when GET
    /tokenizer_info answers with an eos_token and /tokenize with tokens: its
    EOS id is the first token of the EOS text, its chat template the one served."""
    tok = Tokenizer(tiny_model)

    async def main():
        server, url = await serve(tiny_model)
        async with aiohttp.ClientSession() as s:
            status, info, _ = await call(s, "GET", url + "/tokenizer_info")
            assert status == 200
            assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
            assert info["chat_template"] == tok.chat_template
            assert info["tokenizer_class"] and info["model_max_length"] == tok.config["model_max_length"]
            # Added tokens as their text, as vLLM writes transformers' AddedToken objects.
            assert info["added_tokens_decoder"][str(tok.token_to_id(tok.eos_token))] == tok.eos_token
            _, eos, _ = await call(s, "POST", url + "/tokenize", {"prompt": info["eos_token"],
                                                                  "add_special_tokens": False})
            assert eos["tokens"] == [tok.token_to_id(tok.eos_token)]
        await server.cleanup()

    run(main())


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model", ["gpt-9", "'/models/tiny', 'tiny'"]),
    ("/tokenize", {}, 400, "prompt", ["'prompt' (a string) or 'messages' is required"]),
    ("/tokenize", {"prompt": "x", "messages": MSGS}, 400, "messages", ["not both"]),
    ("/tokenize", {"prompt": 5}, 400, "prompt", ["must be a string"]),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", ["one of"]),
    ("/tokenize", {"messages": MSGS, "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message", ["add_generation_prompt"]),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", ["outside the vocabulary"]),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", ["must be an array"]),
    ("/detokenize", {}, 400, "tokens", ["required"]),
])
def test_bad_input_is_named(tiny_model, path, body, status, param, words):
    async def main():
        server, url = await serve(tiny_model)
        async with aiohttp.ClientSession() as s:
            got, answer, _ = await call(s, "POST", url + path, body)
            assert got == status, answer
            assert answer["error"]["param"] == param, answer
            for w in words:
                assert w in answer["error"]["message"], answer
            assert (await call(s, "GET", url + "/version"))[0] == 200   # and it serves on
        await server.cleanup()

    run(main())


def test_ignored_fields_are_listed_in_a_header(tiny_model):
    async def main():
        server, url = await serve(tiny_model)
        async with aiohttp.ClientSession() as s:
            _, _, headers = await call(s, "POST", url + "/tokenize", {"prompt": "x", "store": True, "metdata": 1})
            assert headers["X-Pdd-Ignored-Fields"] == "store, metdata"
            _, _, headers = await call(s, "POST", url + "/tokenize", {"prompt": "x"})
            assert "X-Pdd-Ignored-Fields" not in headers
            # On generation too, whatever the answer (here the stand-in's context is too short for it).
            status, _, headers = await call(s, "POST", url + "/v1/completions",
                                            {"prompt": "word " * 100, "reasoning_effort": "low"})
            assert status == 400 and headers["X-Pdd-Ignored-Fields"] == "reasoning_effort"
        await server.cleanup()

    run(main())


def test_tokenize_gives_the_template_a_chat_requests_tools():
    """The prompt /tokenize counts is the one a chat completion with these tools is given."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req, ignored = parse_tokenize(orjson.dumps({"messages": MSGS, "tools": tools}), ["tiny"])
    chat = parse_chat_request(orjson.dumps({"messages": MSGS, "tools": tools}), ["tiny"])
    assert req.template_args == chat.template_args and req.template_args["tools"] and ignored == ()
    with pytest.raises(APIError) as info:
        parse_tokenize(orjson.dumps({"messages": MSGS, "tools": [{"type": "function"}]}), ["tiny"])
    assert info.value.param == "tools[0].function"
