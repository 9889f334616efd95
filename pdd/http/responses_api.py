"""The Responses API (POST /v1/responses) on the chat path.

A Responses request is turned into the chat request the server already
serves (`to_chat`: input items become messages, `instructions` a system
message first, function tools and `text.format` chat's `tools` and
`response_format`), parsed by pdd.http.schemas.parse_chat_request and run as
chat runs it; `answer` turns the chat answer back into the response object
or the Responses stream events (pdd.http.responses_output). Errors of the
chat parser name the Responses field (`renamed`).

`previous_response_id`: the conversation of each stored response (`store`,
true by default) is kept in this router process's memory
(pdd.http.stored_responses, which also serves GET and DELETE of them); a
request naming one that is not there is refused (400). Its `instructions`
are not carried over, as OpenAI's are not.
"""
from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable

import orjson
from aiohttp import web

from pdd.http.responses import json_response
from pdd.http.stored_responses import ResponseStore
from pdd.http.responses_output import (EventStream, ResponsesRequest, conversation, output_items, response_object,
                                       status_of, usage)
from pdd.http.validate import APIError, Fields, bad, load_object, reject_nonempty, unsupported, wrong_type
from pdd.router.requests import RequestError

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# Fields passed on to chat as they are: vLLM's sampling extras, chat_template_kwargs
# (a reasoning model's enable_thinking), and OpenAI's user (read, not used).
PASSED = ("seed", "top_k", "chat_template_kwargs", "user")


# ---------------------------------------------------------------- request: Responses -> chat

def parse(body: bytes, store: ResponseStore, parse_chat: Callable[[bytes], object]):
    """(the chat GenerateRequest, the ResponsesRequest) of a Responses body;
    parse_chat: bytes of a chat request -> its GenerateRequest."""
    f = Fields(load_object(body))
    chat, rr = to_chat(f, store)
    try:
        req = parse_chat(orjson.dumps(chat))
    except APIError as e:
        raise renamed(e, rr.sources) from None
    rr.ignored_fields = f.unread()
    return req, rr


def to_chat(f: Fields, store: ResponseStore) -> tuple[dict, ResponsesRequest]:
    for name in ("background", "include", "conversation", "prompt"):
        reject_nonempty(f, name)
    if f.string("truncation", "disabled") != "disabled":
        raise unsupported("truncation", " except \"disabled\"")
    if f.integer("top_logprobs"):
        raise unsupported("top_logprobs")
    previous_id = f.string("previous_response_id")
    history = []
    if previous_id is not None:
        history = store.get(previous_id)
        if history is None:
            raise bad("previous_response_id", f"Previous response with id '{previous_id}' not found: "
                                              f"{store.why_not_here(previous_id)}; send the conversation in "
                                              "'input' instead")
    given, given_from = _input(f)
    instructions = f.string("instructions")
    first = [{"role": "system", "content": instructions}] if instructions is not None else []
    history = history + given
    messages = first + history
    sources = ["instructions"] * len(first) + ["previous_response_id"] * (len(history) - len(given)) + given_from
    if not messages:
        raise bad("input", "'input' must hold at least one item")
    chat = {"messages": messages, "stream": f.boolean("stream", False)}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", *PASSED):
        if f.obj.get(name) is not None:
            chat[name] = f.obj.get(name)
    effort = Fields(f.mapping("reasoning") or {}, prefix="reasoning.").string("effort")
    if effort is not None:   # OpenAI's reasoning.effort is chat's reasoning_effort (a template variable)
        chat["reasoning_effort"] = effort
    max_output = f.integer("max_output_tokens", lo=1)
    if max_output is not None:
        chat["max_completion_tokens"] = max_output
    tools = f.array("tools")
    if tools:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    choice = f.obj.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice)
    text = f.mapping("text") or {}
    fmt = Fields(text, prefix="text.").mapping("format")
    if fmt is not None:
        chat["response_format"] = _response_format(Fields(fmt, prefix="text.format."))
    metadata = f.mapping("metadata")
    stored = f.boolean("store", True)
    settings = {"model": f.obj.get("model"), "instructions": instructions, "max_output_tokens": max_output,
                "temperature": _or(f.obj.get("temperature"), 1.0), "top_p": _or(f.obj.get("top_p"), 1.0),
                "tools": tools or [], "tool_choice": choice if choice is not None else "auto",
                "parallel_tool_calls": _or(f.obj.get("parallel_tool_calls"), True),
                "text": {"format": fmt or {"type": "text"}}, "previous_response_id": previous_id,
                "store": stored, "metadata": metadata or {}, "truncation": "disabled",
                "reasoning": {"effort": effort, "summary": None} if effort is not None else None}
    rr = ResponsesRequest(store.new_id(uuid.uuid4().hex), int(time.time()), settings, history, stored, sources)
    return chat, rr


def _or(value, default):
    return default if value is None else value


def _input(f: Fields) -> tuple[list[dict], list[str]]:
    """The input as chat messages, and the item each came from: a string is one
    user message; items in order, function calls joined to the assistant
    message before them."""
    value = f.obj.get("input")
    if value is None:
        raise bad("input", "'input' is required")
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    if not isinstance(value, list):
        raise wrong_type("input", "a string or an array of input items", value)
    messages: list[dict] = []
    sources: list[str] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(param, "an object", item)
        itf = Fields(item, prefix=param + ".")
        kind = itf.string("type", "message")
        last = messages[-1] if messages else None
        if kind == "message":
            message = _message(itf)
            if (message["role"] == "assistant" and last is not None and last["role"] == "assistant"
                    and last["content"] == "" and "tool_calls" not in last):   # the answer of a reasoning item
                last["content"] = message["content"]
            else:
                messages.append(message)
                sources.append(param)
        elif kind == "reasoning":
            # An earlier answer's reasoning, sent back as OpenAI asks: its
            # assistant message's reasoning_content (the template decides
            # whether it is shown), the answer and calls after it joined to it.
            messages.append({"role": "assistant", "content": "", "reasoning_content": _reasoning_text(itf)})
            sources.append(param)
        elif kind == "function_call":
            call = {"id": _required(itf, "call_id"), "type": "function",
                    "function": {"name": _required(itf, "name"), "arguments": _required(itf, "arguments")}}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(param)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _required(itf, "call_id"),
                             "content": _content(itf, "output")})
            sources.append(param)
        else:
            raise bad(itf.param("type"), f"'{itf.param('type')}': input items of type {kind!r} are not supported; "
                                         "only message, reasoning, function_call and function_call_output")
    return messages, sources


def _reasoning_text(rf: Fields) -> str:
    """A reasoning item's text: its reasoning_text parts (else its summary's)."""
    for name in ("content", "summary"):
        parts = rf.obj.get(name)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise wrong_type(rf.param(name), "an array of text parts", parts)
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def _message(mf: Fields) -> dict:
    role = _required(mf, "role")
    if role not in INPUT_ROLES:
        raise bad(mf.param("role"), f"'{mf.param('role')}' must be one of {', '.join(INPUT_ROLES)}; got {role!r}")
    return {"role": role, "content": _content(mf, "content")}


def _content(mf: Fields, name: str):
    """A string, or the content parts as chat's text parts (chat checks and joins them)."""
    param = mf.param(name)
    value = mf.obj.get(name)
    if value is None:
        raise bad(param, f"'{param}' is required")
    if not isinstance(value, list):
        return value   # a string; anything else is chat's error
    parts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS and kind != "refusal":
            raise bad(f"{param}[{j}].type", f"'{param}[{j}].type': content parts of type {kind!r} are not "
                                            "supported; only input_text (and output_text or refusal in an "
                                            "assistant's)")
        parts.append(part if kind == "refusal" else {"type": "text", "text": part.get("text")})
    return parts


def _required(f: Fields, name: str) -> str:
    value = f.string(name)
    if value is None:
        raise bad(f.param(name), f"'{f.param(name)}' is required")
    return value


def _tool(t, param: str) -> dict:
    """A Responses function tool (name and parameters at its top level) as chat's."""
    if not isinstance(t, dict):
        raise wrong_type(param, "an object", t)
    tf = Fields(t, prefix=param + ".")
    kind = tf.string("type")
    if kind != "function":
        raise bad(tf.param("type"), f"'{tf.param('type')}': only function tools are supported, got {kind!r}")
    fn = {key: t[key] for key in ("name", "description", "parameters", "strict") if t.get(key) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice   # none, auto, required: chat's check
    if not isinstance(choice, dict):
        raise wrong_type("tool_choice", "a string or an object", choice)
    cf = Fields(choice, prefix="tool_choice.")
    if cf.string("type") != "function":
        raise bad("tool_choice.type", "'tool_choice.type' must be \"function\" (hosted tools and allowed_tools "
                                      "are not supported)")
    return {"type": "function", "function": {"name": _required(cf, "name")}}


def _response_format(ff: Fields) -> dict:
    kind = ff.string("type")
    if kind != "json_schema":
        return {"type": kind}   # text, json_object; anything else: chat's error, renamed
    spec = {"name": ff.string("name")}
    for key in ("schema", "strict", "description"):
        if ff.obj.get(key) is not None:
            spec[key] = ff.obj.get(key)
    return {"type": "json_schema", "json_schema": spec}


# Chat's field names in its errors -> the Responses request's.
_RENAMES = [(re.compile(r"response_format\.json_schema\."), "text.format."),
            (re.compile(r"response_format"), "text.format"),
            (re.compile(r"max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"reasoning_effort"), "reasoning.effort"),
            (re.compile(r"(tools\[\d+\])\.function\."), r"\1."),
            (re.compile(r"tool_choice\.function\."), "tool_choice.")]
_MESSAGE = re.compile(r"\bmessages(?:\[(\d+)\])?")


def renamed(e: APIError, sources: list[str]) -> APIError:
    """e with the Responses request's field names; sources: per chat message, its field."""
    def message_source(m: re.Match) -> str:
        k = m.group(1)
        return sources[int(k)] if k is not None and int(k) < len(sources) else "input"

    message, param = e.message, e.param
    for pattern, to in [*_RENAMES, (_MESSAGE, message_source)]:
        message = pattern.sub(to, message)
        param = pattern.sub(to, param) if param else param
    return APIError(e.status, message, type=e.type, param=param, code=e.code)


async def answer(server, rr: ResponsesRequest, request: web.Request, req, groups) -> web.StreamResponse:
    """The Responses answer of the chat request `req` (one choice), whole or
    streamed; server: the OpenAIServer that submitted it (its chat reading)."""
    (c,), = groups
    if not req.stream:
        await server.answers.collect(req, groups)
        output = output_items(req.tool_format, req.reasoning, c.text.text, c.finish_reason)
        body = response_object(rr, req.model, status_of(c.finish_reason), output, usage(server.answers.usage(req, groups)))
        if rr.store:
            server.response_store.put(body, conversation(rr, output))
        return json_response(body)
    events = EventStream(rr, req.model, req.tool_format, req.reasoning)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(events.start())
    try:
        await server.answers.stream_one(req, c, resp, events.emit)
    except RequestError as e:   # headers are gone: the error travels as events
        await resp.write(events.failed(APIError(e.status, str(e), type=e.error_type)))
    else:
        last, final = events.end(usage(server.answers.usage(req, groups)))
        if rr.store:
            server.response_store.put(final, conversation(rr, final["output"]))
        await resp.write(last)
    await resp.write_eof()   # no [DONE]: the last event says the end, as OpenAI's
    return resp
