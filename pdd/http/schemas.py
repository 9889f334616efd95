"""OpenAI-compatible /v1/completions and /v1/chat/completions requests: parsing
and validation into a GenerateRequest. Pure functions, no I/O: the aiohttp
handlers read the body, call `parse_*`, and answer with what pdd.http.responses
builds from the GenerateRequest.

Field names and shapes follow the OpenAI API (checked in the tests against the
official `openai` client's types), with vLLM's extra fields where they exist
(`top_k`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`,
`repetition_penalty`, `prompt_logprobs`, `guided_json`, ...). Structured
outputs and tool calling are read in pdd.http.structured. What we do not
implement (`best_of` above `n`, beam search, ...) is refused with a 400 naming
the field, never silently ignored. Fields no parser reads (newer OpenAI fields
such as `metadata` or `store`, a misspelt name) are accepted, as vLLM does, and
said: `GenerateRequest.ignored_fields` (the app logs each name once and lists
them in X-Pdd-Ignored-Fields).

A request with n > 1 has n choices, each a request of its own at the router
(pdd.router.control.ControlPlane.submit_choices); a completions request may
give a list of prompts, each with its n choices (prompt i's choice j has
index i * n + j, as OpenAI). Completions with `echo` start each choice's text
with its prompt, and with `logprobs` its logprobs cover the prompt's tokens
first, computed by the engine as prompt logprobs (SamplingParams.prompt_logprobs).
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from pdd.api import (INT64_MAX, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_STOP_STRING_CHARS,
                     MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, SEED_MAX, SEED_MIN, InvalidRequest, SamplingParams)
from pdd.http import structured
from pdd.http.reasoning import ReasoningFormat, constrained_after, for_request
from pdd.http.tools import ToolFormat, tool_format
from pdd.http.validate import (APIError, Fields, bad, json_type, load_object, reject_nonempty,
                               reject_tool_choice, reject_unless, token_ids, unsupported, wrong_type)

__all__ = [
    "GenerateRequest", "Prompt", "parse_completion_request", "parse_chat_request",
    "served_model", "parse_messages", "chat_template_args",
]

ROLES = ("system", "user", "assistant", "tool", "developer")
# vLLM's request fields for features we do not have: refused when set (not None,
# not empty, not false), as OpenAI's are.
UNSUPPORTED_EXTRAS = ("use_beam_search", "bad_words", "allowed_token_ids",
                      "priority", "chat_template", "documents",
                      "mm_processor_kwargs")
# Names a chat template is rendered with: chat_template_kwargs may not replace them.
TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")   # OpenAI's
MAX_LOGPROBS_COMPLETION = 5     # OpenAI's limits
MAX_LOGPROBS_CHAT = 20
MAX_CHOICES = 128               # OpenAI's limit on n
# Choices of one completions request, over its list of prompts (n each): each is
# a request at the router, and a 4 MiB body holds a million one-token prompts.
MAX_BATCH_CHOICES = 1024


@dataclass(frozen=True)
class Prompt:
    """One completions prompt: its text, or the token ids it was given as."""
    text: str | None
    token_ids: list[int] | None


@dataclass
class GenerateRequest:
    kind: str                            # "completion" | "chat"
    model: str
    # completions: the prompts, each with its n choices (prompt i's choice j: index i * n + j); chat: []
    prompts: list[Prompt]
    messages: list[dict] | None          # chat: [{"role": str, "content": str}, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool                  # stream_options.include_usage
    logprobs: int | None                 # top-N per token (0: only the sampled one); None: off
    request_id: str                      # "cmpl-<hex>" / "chatcmpl-<hex>"
    created: int                         # unix seconds
    # Chat without max_tokens means "up to the context limit", which depends on
    # the prompt length only the router knows after templating and tokenizing:
    # sampling.max_tokens is 0 and sampling is not validated yet; the router
    # sets max_tokens and calls sampling.validate().
    max_tokens_unset: bool = False
    # The field max_tokens came from, as errors name it (chat: max_completion_tokens when given).
    max_tokens_param: str = "max_tokens"
    # How token ids become text (vLLM's fields): special tokens left out, and
    # whether a matched stop string or stop token is part of the text.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>",
    # never its text (two tokens may decode alike, or to a piece of a character).
    tokens_as_ids: bool = False
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last N tokens
    # stream_options.continuous_usage_stats (vLLM's), with include_usage: every chunk
    # carries the usage so far, not null.
    continuous_usage: bool = False
    template_args: dict | None = None           # chat: Tokenizer.apply_chat_template's keywords
    n: int = 1                                  # choices, each sampled with seed + index
    # Completions: each choice's text starts with the prompt (and its logprobs
    # with the prompt's, when logprobs is set).
    echo: bool = False
    # max_tokens 0 with echo (as vLLM): the prompt alone; one token is generated
    # (the engine needs max_tokens >= 1) and not shown. max_tokens 0 without
    # echo leaves sampling.max_tokens 0: nothing is computed.
    echo_only: bool = False
    # vLLM's prompt_logprobs: the response carries, per prompt token, its logprob,
    # rank and the top N (sampling.prompt_logprobs may be larger, for echo).
    prompt_logprobs: int | None = None
    # Chat with tools (tool_choice not "none"): the format the output's calls are
    # read in (pdd.http.tools); None: the output is all content.
    tool_format: ToolFormat | None = None
    # Chat with a reasoning model: how its output splits into reasoning_content
    # and content (pdd.http.reasoning); None: all of it is content.
    reasoning: ReasoningFormat | None = None
    # The field sampling.structured_output came from: errors of its compilation
    # (pdd.http.structured.check, run by the app off its loop) name it.
    structured_param: str | None = None
    # Top-level fields of the body no parser read: accepted and ignored (said, never silently).
    ignored_fields: tuple[str, ...] = ()


def parse_completion_request(body: bytes, served_models: Sequence[str], max_tokens_default: int = 16,
                             vocab_size: int | None = None) -> GenerateRequest:
    """vocab_size (the tokenizer's): token ids at or above it are refused here."""
    f = Fields(load_object(body))
    model = served_model(f, served_models)
    prompts = _prompts(f, vocab_size)
    n = _choices(f)
    if len(prompts) * n > MAX_BATCH_CHOICES:
        raise bad("n", f"a request may ask for at most {MAX_BATCH_CHOICES} choices, got {len(prompts)} prompts "
                       f"x n {n}; send fewer prompts per request")
    best_of = f.integer("best_of")
    if best_of is not None and best_of != n:
        # vLLM V1 dropped it too: n choices and their logprobs do the same.
        raise unsupported("best_of", f" except equal to n ({n}): every choice is returned; got {best_of}")
    if f.string("suffix"):   # "" is the same as no suffix
        raise unsupported("suffix")
    echo = f.boolean("echo", False)
    logprobs = f.integer("logprobs", lo=0, hi=MAX_LOGPROBS_COMPLETION)
    max_tokens = f.integer("max_tokens", max_tokens_default, lo=0)
    # 0: nothing is generated. With echo the prompt is the answer: one token is
    # generated (the engine needs max_tokens >= 1) and not shown; without, no
    # worker is asked: each choice is empty, with its prompt's usage.
    sampling = _sampling(f, max(max_tokens, 1) if echo else max_tokens, logprobs, vocab_size)
    wanted = _prompt_logprobs(f)
    if echo and logprobs is not None:
        sampling.prompt_logprobs = max(logprobs, wanted or 0)
    sampling.structured_output, structured_param = structured.structured_output(f)
    stream, include_usage, continuous = _stream(f)
    _check_prompt_logprobs(wanted, stream)
    if max_tokens == 0 and sampling.min_tokens:
        raise bad("min_tokens", f"'min_tokens' must be 0 with 'max_tokens' 0, got {sampling.min_tokens}")
    if max_tokens == 0 and not echo and wanted is not None:
        raise bad("prompt_logprobs", "'prompt_logprobs' with 'max_tokens' 0 needs 'echo': true "
                                     "(without it nothing is computed)")
    # The engine's checks need a token to generate: the other values are checked all the same.
    _finish(sampling if sampling.max_tokens else dataclasses.replace(sampling, max_tokens=1), unset=False)
    req = GenerateRequest(
        kind="completion", model=model, prompts=prompts,
        messages=None, sampling=sampling, stream=stream, include_usage=include_usage,
        logprobs=logprobs, request_id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()), continuous_usage=continuous, n=n, echo=echo,
        echo_only=echo and max_tokens == 0, prompt_logprobs=wanted, structured_param=structured_param,
        **_text_options(f))
    req.ignored_fields = f.unread()
    return req


def parse_chat_request(body: bytes, served_models: Sequence[str], vocab_size: int | None = None,
                       tool_fmt: ToolFormat | None = None,
                       reasoning_fmt: ReasoningFormat | None = None) -> GenerateRequest:
    """tool_fmt: the format the model writes tool calls in (default: hermes);
    reasoning_fmt: how its output splits into reasoning and content (None: no split)."""
    f = Fields(load_object(body))
    model = served_model(f, served_models)
    messages = parse_messages(f)
    if f.boolean("echo", False):
        raise bad("echo", "echo is not supported in chat; set 'echo' to false or leave it out")
    n = _choices(f)
    reject_nonempty(f, "functions")    # the deprecated form of tools: clients send tools now
    reject_tool_choice(f, "function_call")
    listed, choice, parallel = structured.tools(f)
    logprobs = _chat_logprobs(f)
    # max_completion_tokens replaced max_tokens in OpenAI's chat API; both are
    # type-checked, and the newer one wins when both are given.
    max_tokens = f.integer("max_tokens", lo=1)
    newer = f.integer("max_completion_tokens", lo=1)
    max_tokens_param = "max_tokens" if newer is None else "max_completion_tokens"
    max_tokens = max_tokens if newer is None else newer
    unset = max_tokens is None
    sampling = _sampling(f, 0 if unset else max_tokens, logprobs, vocab_size)
    wanted = _prompt_logprobs(f)
    sampling.structured_output, structured_param = structured.structured_output(f)
    template_args, text_options = chat_template_args(f), _text_options(f)
    fmt = None
    if listed:
        template_args["tools"] = listed
    constrained = sampling.structured_output is not None
    if listed and choice not in ("none", "auto") and constrained:
        raise bad("tool_choice", "a forced tool call ('tool_choice' \"required\" or a named function) "
                                 "cannot be combined with response_format or guided decoding")
    # Calls are read from the output unless the tools are off, or a response
    # format makes the output that format's content.
    if listed and choice != "none" and not constrained:
        fmt = tool_fmt or tool_format("hermes", None)
        if fmt.keeps_special_tokens:   # its calls begin with a special token
            text_options["skip_special_tokens"] = False
        if choice != "auto":   # the output is the calls, a call cut short still one
            sampling.structured_output = structured.tool_grammar(fmt, listed, choice, parallel)
            structured_param = "tools"
            fmt = dataclasses.replace(fmt, forced=True)
    reasoning = for_request(reasoning_fmt, template_args)
    sampling.structured_output = constrained_after(sampling.structured_output, reasoning)
    stream, include_usage, continuous = _stream(f)
    _check_prompt_logprobs(wanted, stream)
    _finish(sampling, unset=unset)
    req = GenerateRequest(
        kind="chat", model=model, prompts=[], messages=messages,
        sampling=sampling, stream=stream, include_usage=include_usage, logprobs=logprobs,
        request_id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()),
        max_tokens_unset=unset, max_tokens_param=max_tokens_param, template_args=template_args,
        continuous_usage=continuous, n=n, prompt_logprobs=wanted, tool_format=fmt, reasoning=reasoning,
        structured_param=structured_param, **text_options)
    req.ignored_fields = f.unread()
    return req


def served_model(f: Fields, served: Sequence[str]) -> str:
    model = f.string("model")
    if model is None:
        # OpenAI requires `model`, but like vLLM we default to the model served
        # (every name is an alias of it): local tools (curl, scripts) often omit it.
        return served[0]
    if model not in served:
        raise APIError(404, f"The model '{model}' does not exist; served models: {_listing(served)}",
                       param="model", code="model_not_found")
    return model


def _listing(served: Sequence[str]) -> str:
    return ", ".join(f"'{m}'" for m in served) or "(none)"


_PROMPT_KINDS = ("a string, a list of strings, a list of token ids (integers) "
                 "or a list of lists of token ids")


def _prompts(f: Fields, vocab_size: int | None) -> list[Prompt]:
    """The prompts, from the four forms OpenAI accepts: a string, a list of
    token ids, or a list of either (a batch: n choices per prompt)."""
    p = f.obj.get("prompt")
    if p is None:
        raise bad("prompt", "'prompt' is required")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        kind = type(p[0])
        for i, item in enumerate(p):
            if not isinstance(item, kind):
                raise bad("prompt", f"'prompt': a list of prompts holds only strings or only lists of token "
                                    f"ids; index 0 is {json_type(p[0])}, index {i} is {json_type(item)}")
        param = "prompt" if len(p) == 1 else "prompt[{}]"
        return [_prompt(item, param.format(i), vocab_size) for i, item in enumerate(p)]
    if not isinstance(p, (str, list)):
        raise wrong_type("prompt", _PROMPT_KINDS, p)
    return [_prompt(p, "prompt", vocab_size)]


def _prompt(p: str | list, param: str, vocab_size: int | None) -> Prompt:
    if not p:
        raise bad(param, f"'{param}' must not be empty")
    if isinstance(p, str):
        return Prompt(p, None)
    # Anything else in the list is reported by index, as a bad token id.
    return Prompt(None, token_ids(param, p, vocab_size))


def parse_messages(f: Fields) -> list[dict]:
    messages = f.array("messages")
    if messages is None:
        raise bad("messages", "'messages' is required")
    if not messages:
        raise bad("messages", "'messages' must contain at least one message")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: object, i: int) -> dict:
    if not isinstance(m, dict):
        raise wrong_type(f"messages[{i}]", "an object", m)
    mf = Fields(m, prefix=f"messages[{i}].")
    role = mf.string("role")
    if role is None:
        raise bad(mf.param("role"), f"'{mf.param('role')}' is required")
    if role not in ROLES:
        raise bad(mf.param("role"), f"'{mf.param('role')}' must be one of "
                                    f"{', '.join(ROLES)}; got '{role}'")
    if mf.obj.get("function_call"):
        raise bad(mf.param("function_call"), f"'{mf.param('function_call')}' is not supported; use 'tool_calls'")
    calls = mf.obj.get("tool_calls")
    if calls and role != "assistant":
        raise bad(mf.param("tool_calls"), f"'{mf.param('tool_calls')}': only assistant messages hold tool calls")
    calls = structured.history_tool_calls(calls, mf.param("tool_calls")) if calls else None
    # An assistant message that only calls tools has no content (null): templates get "".
    message = {"role": role, "content": "" if calls and mf.obj.get("content") is None else _content(mf, role)}
    if calls:
        message["tool_calls"] = calls
    # Templates that know them write them; the others ignore them (reasoning_content:
    # an earlier answer's, as a reasoning model's template may show or drop it;
    # a client may send it back under either name of pdd.http.reasoning.FIELDS).
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = mf.string(key)
        if value is not None:
            message[key] = value
    reasoning = mf.string("reasoning")
    if reasoning is not None:
        message.setdefault("reasoning_content", reasoning)
    return message


def _content(mf: Fields, role: str) -> str:
    """The message's text; of parts, their texts. An assistant message may hold
    OpenAI's refusal parts (a conversation replayed as OpenAI answered it):
    their text, as vLLM takes them."""
    param = mf.param("content")
    content = mf.obj.get("content")
    if content is None:
        raise bad(param, f"'{param}' is required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(param, "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise wrong_type(f"{param}[{j}]", "an object", part)
        pf = Fields(part, prefix=f"{param}[{j}].")
        kind = pf.string("type")
        if kind == "refusal" and role == "assistant":
            key = "refusal"
        elif kind == "text":
            key = "text"
        else:
            raise bad(pf.param("type"), f"content part type '{kind}' is not supported; only 'text' parts are "
                                        "(and 'refusal' in an assistant message)")
        text = pf.string(key)
        if text is None:
            raise bad(pf.param(key), f"'{pf.param(key)}' is required")
        texts.append(text)
    return "\n".join(texts)   # as vLLM joins text parts


def _chat_logprobs(f: Fields) -> int | None:
    """Chat: `logprobs` is a switch and `top_logprobs` the count (0 when absent).
    Without logprobs a `top_logprobs` of 0 asks nothing (clients send it as a
    default; vLLM takes it); more is a client's mistake."""
    wanted = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", lo=0, hi=MAX_LOGPROBS_CHAT)
    if top and not wanted:
        raise bad("top_logprobs", "'top_logprobs' requires 'logprobs': true")
    return (top or 0) if wanted else None


def _choices(f: Fields) -> int:
    return f.integer("n", 1, lo=1, hi=MAX_CHOICES)


def _prompt_logprobs(f: Fields) -> int | None:
    """vLLM's prompt_logprobs: top N per prompt token (0: only the token's own)."""
    return f.integer("prompt_logprobs", lo=0, hi=MAX_LOGPROBS)


def _check_prompt_logprobs(wanted: int | None, stream: bool) -> None:
    if wanted is not None and stream:   # as vLLM: they belong to a whole response
        raise bad("prompt_logprobs", "'prompt_logprobs' is not available with 'stream': true")


def _sampling(f: Fields, max_tokens: int, logprobs: int | None, vocab_size: int | None) -> SamplingParams:
    """Types and the bounds a value needs to travel (int64); SamplingParams.validate
    (in _finish, or at the router for chat without max_tokens) checks the rest."""
    reject_unless(f, "length_penalty", 1.0)   # beam search's
    for name in UNSUPPORTED_EXTRAS:
        reject_nonempty(f, name)
    f.string("user")    # accepted and ignored, but a wrong type is still an error
    top_k = f.integer("top_k", 0, hi=INT64_MAX)   # above the vocabulary: the same as off
    if top_k < -1:
        raise bad("top_k", f"'top_k' must be -1 or 0 (off) or a positive integer, got {top_k}")
    stop_ids = f.array("stop_token_ids") or []
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=f.number("temperature", 1.0, lo=0, hi=2),
        top_k=top_k,
        top_p=f.number("top_p", 1.0, lo=0, hi=1, lo_exclusive=True),
        min_p=f.number("min_p", 0.0, lo=0, hi=1),
        seed=f.integer("seed", lo=SEED_MIN, hi=SEED_MAX),
        stop_token_ids=token_ids("stop_token_ids", stop_ids, vocab_size),
        stop=_stop(f),
        ignore_eos=f.boolean("ignore_eos", False),
        min_tokens=f.integer("min_tokens", 0, lo=0),
        logprobs=logprobs,
        presence_penalty=f.number("presence_penalty", 0.0, lo=-MAX_PENALTY, hi=MAX_PENALTY),
        frequency_penalty=f.number("frequency_penalty", 0.0, lo=-MAX_PENALTY, hi=MAX_PENALTY),
        repetition_penalty=f.number("repetition_penalty", 1.0, lo=0, hi=MAX_REPETITION_PENALTY, lo_exclusive=True),
        prompt_logprobs=_prompt_logprobs(f),
        logit_bias=_logit_bias(f, vocab_size),
    )


def _logit_bias(f: Fields, vocab_size: int | None) -> dict[int, float]:
    """OpenAI's map of token ids (JSON keys: strings of digits) to biases."""
    given = f.mapping("logit_bias") or {}
    if len(given) > MAX_LOGIT_BIAS_TOKENS:
        raise bad("logit_bias", f"'logit_bias' may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(given)}")
    bias = {}
    for key, value in given.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None or (vocab_size is not None and token >= vocab_size):
            raise bad("logit_bias", f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key!r}"
                      if vocab_size is not None else f"'logit_bias' keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"'logit_bias' values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                      f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {key}")
        bias[token] = float(value)
    return bias


def _stop(f: Fields) -> list[str]:
    stop = f.obj.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise wrong_type("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise bad("stop", f"'stop' must contain only strings, got {json_type(s)} at index {i}")
        if not s:
            raise bad("stop", "'stop' strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise bad("stop", f"'stop' strings may be at most {MAX_STOP_STRING_CHARS} characters, "
                              f"got {len(s)} at index {i}")
    return list(stop)


def _text_options(f: Fields) -> dict:
    truncate = f.integer("truncate_prompt_tokens", lo=1)
    return {"skip_special_tokens": f.boolean("skip_special_tokens", True),
            "include_stop_str_in_output": f.boolean("include_stop_str_in_output", False),
            "tokens_as_ids": f.boolean("return_tokens_as_token_ids", False),
            "truncate_prompt_tokens": truncate}


def chat_template_args(f: Fields) -> dict:
    """How the chat template is applied: Tokenizer.apply_chat_template's keywords."""
    generation = f.boolean("add_generation_prompt", True)
    continue_final = f.boolean("continue_final_message", False)
    if generation and continue_final:
        raise bad("continue_final_message", "'continue_final_message' needs 'add_generation_prompt': false "
                                            "(the last message is continued, no new one is started)")
    kwargs = f.mapping("chat_template_kwargs") or {}
    taken = sorted(set(kwargs) & set(TEMPLATE_NAMES))
    if taken:
        raise bad("chat_template_kwargs", f"'chat_template_kwargs' may not set {', '.join(taken)}")
    # A template variable for the templates that take it (chat_template_kwargs' own wins).
    effort = f.string("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad("reasoning_effort", f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, "
                                      f"got {effort!r}")
    extra = {} if effort is None else {"reasoning_effort": effort}
    return {"add_generation_prompt": generation, "continue_final_message": continue_final, **extra, **kwargs}


def _stream(f: Fields) -> tuple[bool, bool, bool]:
    """stream, include_usage, continuous usage (vLLM's continuous_usage_stats, which
    needs include_usage as there)."""
    stream = f.boolean("stream", False)
    options = f.mapping("stream_options")
    if options is None:
        return stream, False, False
    if not stream:   # as OpenAI: options without a stream are a client bug
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    of = Fields(options, prefix="stream_options.")
    include = of.boolean("include_usage", False)
    return stream, include, include and of.boolean("continuous_usage_stats", False)


def _finish(sampling: SamplingParams, *, unset: bool) -> None:
    """The engine's own checks (cross-field ones such as min_tokens <= max_tokens)."""
    if unset:
        return
    try:
        sampling.validate()
    except InvalidRequest as e:
        raise APIError(400, str(e), param=str(e).split(":", 1)[0]) from None
