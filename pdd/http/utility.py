"""vLLM's endpoints beside generation, in vLLM's shapes: what benchmark and
evaluation clients (vllm bench serve, aiperf, guidellm, lm-eval) call.

    GET  /v1/models           every served name: {"id", "root", "parent", "max_model_len", ...}
    POST /tokenize            {"prompt"} | {"messages", ...} -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize          {"tokens"} -> {"prompt"}
    GET  /tokenizer_info      the tokenizer's configuration (tokenizer_config.json), its class and chat template
    GET  /version             {"version"}
    POST /reset_prefix_cache  every worker forgets the cached blocks no request holds

A client that reads `root` (or the first `id`) finds the checkpoint the
tokenizer loads from. The tokenizer is the router's, used as generation uses
it (chat through the same template), so the counts /tokenize gives are the
counts a request's usage reports; large bodies go to a child process of their
own, so that /tokenize never delays generation (pdd.http.tokenize).
/tokenizer_info (which vLLM serves only when asked to) is what lm-eval's
local-completions looks for before it loads a tokenizer itself: with it and
/tokenize, lm-eval scores through pdd's own tokenizer and needs no
transformers.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

import pdd
from pdd.http import structured
from pdd.http.responses import json_response
from pdd.http.tokenize import OffLoopTokenizer, template_error, tokenize
from pdd.http.schemas import chat_template_args, parse_messages, served_model
from pdd.http.validate import APIError, Fields, bad, load_object, token_ids
from pdd.router.inflight import Overloaded

if TYPE_CHECKING:
    from pdd.model.tokenizer import Tokenizer
    from pdd.router.router import Router


@dataclass(frozen=True)
class TokenizeRequest:
    text: str | None                  # a prompt, or
    messages: list[dict] | None       # a conversation, through the chat template
    template_args: dict | None
    add_special_tokens: bool
    return_token_strs: bool


def parse_tokenize(body: bytes, served: Sequence[str]) -> tuple[TokenizeRequest, tuple[str, ...]]:
    """The request and the body's fields it ignores."""
    f = Fields(load_object(body))
    served_model(f, served)
    strs = f.boolean("return_token_strs", False)
    if f.obj.get("prompt") is not None and f.obj.get("messages") is not None:
        raise bad("messages", "give 'prompt' or 'messages', not both")
    if f.obj.get("messages") is None:
        text = f.string("prompt")
        if text is None:
            raise bad("prompt", "'prompt' (a string) or 'messages' is required")
        req = TokenizeRequest(text, None, None, f.boolean("add_special_tokens", True), strs)
    else:
        messages, template_args = parse_messages(f), chat_template_args(f)
        listed, _, _ = structured.tools(f)
        if listed:   # the template writes them into the prompt, as for a chat completion
            template_args["tools"] = listed
        # As vLLM: the template writes a conversation's special tokens, so none are added by default.
        req = TokenizeRequest(None, messages, template_args, f.boolean("add_special_tokens", False), strs)
    return req, f.unread()


def parse_detokenize(body: bytes, served: Sequence[str], vocab_size: int) -> tuple[list[int], tuple[str, ...]]:
    f = Fields(load_object(body))
    served_model(f, served)
    tokens = f.array("tokens")
    if tokens is None:
        raise bad("tokens", "'tokens' (a list of token ids) is required")
    return token_ids("tokens", tokens, vocab_size), f.unread()


def tokenizer_info(tokenizer: Tokenizer) -> dict:
    """As vLLM gives it: tokenizer_config.json's settings without its file
    paths, each added token as its text, the class and the template served."""
    def plain(value):
        if isinstance(value, dict):
            if isinstance(value.get("content"), str):   # an AddedToken, serialised
                return value["content"]
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    info = {k: plain(v) for k, v in tokenizer.config.items() if k not in ("vocab_file", "merges_file")}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")   # what tokenizer.json alone loads as
    info.pop("chat_template", None)
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


@dataclass(frozen=True)
class UtilityEndpoints:
    """read_body and note_ignored: the generation endpoints' own (pdd.http.app), so
    that a body is read and its unread fields reported the same way everywhere."""
    router: Router
    tokenizer: Tokenizer
    off_loop: OffLoopTokenizer
    served_models: tuple[str, ...]
    model_root: str
    read_body: Callable[[web.Request], Awaitable[bytes]]
    note_ignored: Callable[[web.Request, tuple[str, ...]], None]

    async def models(self, request: web.Request) -> web.Response:
        created, max_len = int(self.router.started_at), self.router.max_model_len()
        return json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "pdd", "root": self.model_root,
             "parent": None, "max_model_len": max_len} for name in self.served_models]})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return json_response(tokenizer_info(self.tokenizer))

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": pdd.__version__})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self.read_body(request)
        req, ignored = parse_tokenize(body, self.served_models)
        self.note_ignored(request, ignored)
        try:
            ids, strs = await self.off_loop.utility(len(body), tokenize, req.text, req.messages,
                                                           req.template_args, req.add_special_tokens,
                                                           req.return_token_strs)
        except (APIError, Overloaded):
            raise
        except Exception as e:
            if req.messages is None:
                raise
            raise template_error(e) from None   # the template's errors are the client's (400)
        return json_response({"count": len(ids), "max_model_len": self.router.max_model_len(), "tokens": ids,
                              "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self.read_body(request)
        ids, ignored = parse_detokenize(body, self.served_models, self.tokenizer.vocab_size)
        self.note_ignored(request, ignored)
        # Special tokens stay: /tokenize then /detokenize gives the text back as it was.
        text = await self.off_loop.utility(len(body), _decode, ids)
        return json_response({"prompt": text})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """200 once every worker has answered; 504 naming those that did not in time."""
        for name in ("reset_running_requests", "reset_external"):
            value = request.query.get(name, "false").lower()
            if value not in ("false", "0", ""):
                why = ("requests that run keep their blocks" if name == "reset_running_requests"
                       else "pdd keeps no KV cache outside its workers")
                raise APIError(400, f"{name}={value} is not supported: {why}", param=name)
        result = await self.router.reset_prefix_cache()
        if result["no_answer"]:
            done = ", ".join(sorted(result["reset"])) or "none"
            raise APIError(504, f"prefix cache reset: no answer within {result['timeout_s']:g}s from "
                                f"{', '.join(result['no_answer'])} (reset: {done})",
                           type="server_error", code="reset_incomplete")
        return json_response(result)
