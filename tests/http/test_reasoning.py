"""Reasoning models (issue 37): a `<think>...</think>` part of the output goes
into `reasoning_content`, the rest into `content` (pdd.http.reasoning).

The split is checked at every delta boundary; end to end through raw HTTP and
the openai client against a real app whose router stand-in either replays
given tokens (random weights never write </think>) one event per token, or
runs the tiny random-weight reasoning checkpoint (`pdd make-model
--chat-template thinking`) for what the template does with enable_thinking
and reasoning_effort."""
from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest

from pdd import LLM
from pdd.api import SamplingParams
from pdd.config_loader import load_cluster_config
from pdd.http import schemas as s
from pdd.http.app import build_app, serve_http
from pdd.http.reasoning import ReasoningFormat, ReasoningSplit, detect, reasoning_format
from pdd.http.validate import APIError
from pdd.model.make_model import make_model
from pdd.model.tokenizer import Tokenizer
from pdd.router.requests import RequestState, TokenEvent
from tests.http.engine_server import EngineRouter, post, post_stream, run
from tests.security.conftest import StubRouter

R1 = ReasoningFormat("deepseek_r1", True)
QWEN3 = ReasoningFormat("qwen3", False)
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

# (format, output, (reasoning, content))
CASES = [
    (R1, "Let me think.</think>The answer is 4.", ("Let me think.", "The answer is 4.")),
    (R1, "<think>Let me think.</think>\n\n4", ("Let me think.", "\n\n4")),
    (R1, "\n<think>a</think>b", ("a", "b")),
    (R1, "a </b> <</think>c</think>d", ("a </b> <", "c</think>d")),
    (R1, "cut short, no end", ("cut short, no end", "")),
    (R1, "<thi", ("<thi", "")),
    (R1, "</think>only content", ("", "only content")),
    (QWEN3, "<think>Let me think.</think>The answer is 4.", ("Let me think.", "The answer is 4.")),
    (QWEN3, "\n\n<think>\nhm\n</think>\n\nok", ("\nhm\n", "\n\nok")),
    (QWEN3, "no thinking here</think> at all", ("", "no thinking here</think> at all")),
    (QWEN3, "x<think>a</think>b", ("", "x<think>a</think>b")),
    (QWEN3, "<think>cut short", ("cut short", "")),
    (QWEN3, "<thi", ("", "<thi")),
    (QWEN3, "", ("", "")),
]


def _fed(fmt: ReasoningFormat, deltas: list[str]) -> tuple[str, str]:
    split, reasoning, content = ReasoningSplit(fmt), "", ""
    for d in deltas:
        r, c = split.feed(d)
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("fmt,text,expected", CASES)
def test_the_split_of_a_whole_output(fmt, text, expected):
    assert ReasoningSplit.split(fmt, text) == expected


@pytest.mark.parametrize("fmt,text,expected", CASES)
def test_the_split_is_the_same_at_every_delta_boundary(fmt, text, expected):
    """Two and three deltas cut anywhere (a tag split across deltas included),
    and one character at a time: the deltas add up to the whole split."""
    n = len(text)
    for i in range(n + 1):
        assert _fed(fmt, [text[:i], text[i:]]) == expected, i
    for i, j in itertools.combinations(range(n + 1), 2):
        assert _fed(fmt, [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert _fed(fmt, list(text)) == expected


def test_reasoning_goes_out_before_the_tag_is_complete_and_only_a_possible_tag_waits():
    split = ReasoningSplit(R1)
    assert split.feed("Let me") == ("Let me", "")
    assert split.feed(" think.</th") == (" think.", "")   # "</th" may begin </think>
    assert split.feed("ink>The") == ("", "The")
    assert split.feed(" answer") == ("", " answer")    # past the reasoning: content as it comes
    assert split.finish() == ("", "")


class _Template:
    def __init__(self, template: str, prompt: str):
        self.chat_template, self.prompt = template, prompt

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        return self.prompt


def test_auto_reads_the_chat_template(tmp_path):
    assert detect(_Template("{{ messages }}", "")) == "none"
    assert detect(_Template("...<｜Assistant｜><think>\\n", "<｜User｜>hi<｜Assistant｜><think>\n")) == "deepseek_r1"
    assert detect(_Template("{%- if enable_thinking is false %}<think>\n\n</think>{% endif %}",
                            "<|im_start|>assistant\n")) == "qwen3"
    assert reasoning_format("auto", _Template("{{ messages }}", "")) is None
    assert reasoning_format("none", _Template("<think>", "<think>")) is None
    assert reasoning_format("qwen3", None) == QWEN3
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_format("r2", None)


def test_the_request_fields():
    """enable_thinking false turns the split off; a grammar applies after the
    reasoning, or from the first token without it; reasoning_effort is a
    template variable (chat_template_kwargs' own wins)."""
    def parse(**fields):
        return s.parse_chat_request(json.dumps({"messages": ASK, **fields}).encode(), ("tiny",), reasoning_fmt=R1)

    assert parse().reasoning == R1
    assert parse(chat_template_kwargs={"enable_thinking": False}).reasoning is None
    assert parse(chat_template_kwargs={"enable_thinking": True}).reasoning == R1
    after = parse(response_format={"type": "json_object"})
    assert after.reasoning == R1 and after.sampling.structured_output.reasoning == "deepseek_r1"
    plain = parse(response_format={"type": "json_object"}, chat_template_kwargs={"enable_thinking": False})
    assert plain.reasoning is None and plain.sampling.structured_output.reasoning == ""
    forced = parse(tools=TOOLS, tool_choice="required")
    assert forced.sampling.structured_output.reasoning == "deepseek_r1"
    assert parse(reasoning_effort="low").template_args["reasoning_effort"] == "low"
    assert parse(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}
                 ).template_args["reasoning_effort"] == "high"
    assert "reasoning_effort" not in parse().template_args
    with pytest.raises(APIError) as e:
        parse(reasoning_effort="extreme")
    assert e.value.param == "reasoning_effort"


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("thinking"), chat_template="thinking")


class ScriptedRouter(StubRouter):
    """Answers every request with the given output text's tokens, one event a
    token, each once the one before was taken (as a worker's steps come: the
    stream has a chunk per token, not the whole text in one)."""

    def __init__(self, tokenizer: Tokenizer, output: str):
        super().__init__(load_cluster_config(env={}), max_model_len=4096)
        self.token_ids = tokenizer.encode(output, add_special_tokens=False)
        self.prompts: list[list[int]] = []
        self._tasks: dict[str, asyncio.Task] = {}   # request id -> what delivers its tokens

    async def submit_choices(self, prompt_token_ids, sampling: SamplingParams, request_id: str, n: int,
                             span=None) -> list[RequestState]:
        self.prompts.append(list(prompt_token_ids))
        states = [RequestState(f"{request_id}-{i}", list(prompt_token_ids), sampling, []) for i in range(n)]
        for state in states:
            self._tasks[state.request_id] = asyncio.create_task(self._deliver(state))
        return states

    async def _deliver(self, state: RequestState) -> None:
        for k, tok in enumerate(self.token_ids):
            while state.events:   # the one before is not taken yet
                await asyncio.sleep(0)
            last = k == len(self.token_ids) - 1
            state.deliver(TokenEvent([tok], last, "stop" if last else None, None, 0))

    async def abort(self, state: RequestState, reason: str = "abort") -> None:
        """Its tokens stop (a client gone, or its text complete)."""
        task = self._tasks.pop(state.request_id, None)
        if task is not None:
            task.cancel()


async def _serve(router, model_dir):
    app = build_app(router, Tokenizer(model_dir), ("tiny",))
    server = await serve_http(app, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.port}"


def _scripted(thinking_model, output: str, *bodies: dict, stream: bool = False) -> list:
    async def main():
        server, url = await _serve(ScriptedRouter(Tokenizer(thinking_model), output), thinking_model)
        try:
            async with aiohttp.ClientSession() as sess:
                outs = []
                for body in bodies:
                    body = {"model": "tiny", "messages": ASK, **body}
                    if stream:
                        outs.append(await post_stream(sess, url, body))
                    else:
                        status, out = await post(sess, url, body)
                        assert status == 200, out
                        outs.append(out)
                return outs
        finally:
            await server.cleanup()
    return run(main())


def _deltas(chunks: list[dict]) -> list[tuple[str, str]]:
    """The stream's (field, text) deltas in order: reasoning_content or content."""
    out = []
    for ch in chunks:
        for choice in ch["choices"]:
            for key in ("reasoning_content", "content"):
                if choice["delta"].get(key):
                    out.append((key, choice["delta"][key]))
    return out


THOUGHT = "Let me think.</think>The answer is 4."


def test_a_whole_answer_has_reasoning_content_beside_content(thinking_model):
    (out,) = _scripted(thinking_model, THOUGHT, {})
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Let me think."   # either name a client reads
    assert message["content"] == "The answer is 4."
    assert out["choices"][0]["finish_reason"] == "stop"


def test_the_usage_counts_the_reasoning_tokens(thinking_model):
    tok = Tokenizer(thinking_model)
    thought = len(tok.encode(THOUGHT.split("</think>")[0] + "</think>", add_special_tokens=False))
    (out,) = _scripted(thinking_model, THOUGHT, {})
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
    assert 0 < thought < out["usage"]["completion_tokens"]


@pytest.mark.parametrize("name,text,expected", [
    ("deepseek_r1", "still thinking, cut by max_tokens", "all"),
    ("qwen3", "<think>still thinking", "all"),
    ("qwen3", "An answer without a thought.", 0),
    ("deepseek_r1", "Let me think.</think>The answer is 4.", "head"),
])
def test_reasoning_tokens_by_format(thinking_model, name, text, expected):
    from pdd.http.reasoning import reasoning_tokens
    tok = Tokenizer(thinking_model)
    ids = tok.encode(text, add_special_tokens=False)
    fmt = reasoning_format(name, tok)
    if expected == "all":
        want = len(ids)
    elif expected == "head":
        want = len(tok.encode(text[:text.index("</think>") + len("</think>")], add_special_tokens=False))
    else:
        want = expected
    assert reasoning_tokens(fmt, ids, text, tok) == want


def test_a_stream_sends_reasoning_content_deltas_then_content_deltas(thinking_model):
    """Token by token (</think> is five tokens of the tiny tokenizer): the
    reasoning deltas come first, then only content; each adds up to the whole."""
    (chunks,) = _scripted(thinking_model, THOUGHT, {}, stream=True)
    deltas = _deltas(chunks)
    kinds = [k for k, _ in deltas]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")   # no reasoning after content
    assert kinds.count("reasoning_content") > 1 and kinds.count("content") > 1
    assert "".join(t for k, t in deltas if k == "reasoning_content") == "Let me think."
    assert "".join(t for k, t in deltas if k == "content") == "The answer is 4."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    thoughts = [ch["choices"][0]["delta"] for ch in chunks if "reasoning" in ch["choices"][0]["delta"]]
    assert thoughts and all(d["reasoning"] == d["reasoning_content"] for d in thoughts)


def test_the_openai_client_reads_reasoning_content(thinking_model):
    from openai import AsyncOpenAI

    async def main():
        server, url = await _serve(ScriptedRouter(Tokenizer(thinking_model), THOUGHT), thinking_model)
        try:
            client = AsyncOpenAI(base_url=url + "/v1", api_key="none")
            whole = await client.chat.completions.create(model="tiny", messages=ASK)
            stream = await client.chat.completions.create(model="tiny", messages=ASK, stream=True)
            parts = [(getattr(ch.choices[0].delta, "reasoning_content", None), ch.choices[0].delta.content)
                     async for ch in stream if ch.choices]
            await client.close()
            return whole, parts
        finally:
            await server.cleanup()

    whole, parts = run(main())
    assert whole.choices[0].message.reasoning_content == "Let me think."
    assert whole.choices[0].message.content == "The answer is 4."
    assert "".join(r for r, _ in parts if r) == "Let me think."
    assert "".join(c for _, c in parts if c) == "The answer is 4."


def test_enable_thinking_false_leaves_the_output_content(thinking_model):
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    (out,) = _scripted(thinking_model, THOUGHT, body)
    (chunks,) = _scripted(thinking_model, THOUGHT, body, stream=True)
    assert out["choices"][0]["message"]["content"] == THOUGHT
    assert out["choices"][0]["message"].get("reasoning_content") is None
    assert {k for k, _ in _deltas(chunks)} == {"content"}
    assert "".join(t for _, t in _deltas(chunks)) == THOUGHT


def test_tool_calls_are_read_from_the_content_only(thinking_model):
    """A call the model thought about is no call; one it wrote after </think> is."""
    after = _scripted(thinking_model, "I should add.</think>" + CALL, {"tools": TOOLS})[0]["choices"][0]
    assert after["message"]["reasoning_content"] == "I should add."
    assert after["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in after["message"]["tool_calls"]] == ["add"]
    inside = _scripted(thinking_model, "Maybe " + CALL + "?</think>No need.", {"tools": TOOLS})[0]["choices"][0]
    assert inside["message"]["reasoning_content"] == "Maybe " + CALL + "?"
    assert inside["message"]["content"] == "No need." and not inside["message"].get("tool_calls")
    (chunks,) = _scripted(thinking_model, "I should add.</think>" + CALL, {"tools": TOOLS}, stream=True)
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "add"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"a": 2, "b": 2}
    assert "".join(t for k, t in _deltas(chunks) if k == "reasoning_content") == "I should add."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_thinking_checkpoint_opens_think_and_takes_reasoning_effort(thinking_model):
    """The random-weight model never closes its reasoning: all of it is
    reasoning_content (cut by max_tokens), none content. The template got
    enable_thinking and reasoning_effort (the prompts' lengths say so)."""
    llm = LLM(str(thinking_model))

    async def main():
        server, url = await _serve(EngineRouter(llm), thinking_model)
        try:
            async with aiohttp.ClientSession() as sess:
                outs = []
                for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "low"}):
                    status, out = await post(sess, url, {"model": "tiny", "messages": ASK, "max_tokens": 8,
                                                         "seed": 1, **extra})
                    assert status == 200, out
                    outs.append(out)
                return outs
        finally:
            await server.cleanup()

    thinking, plain, effort = run(main())
    tok = Tokenizer(thinking_model)
    opened = len(tok.encode_chat(ASK)) - len(tok.encode_chat(ASK, enable_thinking=False))
    assert opened > 0
    assert thinking["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + opened
    assert effort["usage"]["prompt_tokens"] > thinking["usage"]["prompt_tokens"]
    message = thinking["choices"][0]["message"]
    assert thinking["choices"][0]["finish_reason"] == "length"
    assert message["reasoning_content"] and message["content"] is None
    assert plain["choices"][0]["message"]["content"] and plain["choices"][0]["message"].get("reasoning_content") is None


# ---------------------------------------------------------------- configuration

def test_the_parser_is_a_setting_and_a_flag_of_pdd_up(tmp_path):
    from pdd.cli import build_parser
    from pdd.config import ConfigError
    from pdd.launcher import build_cluster

    assert load_cluster_config(env={}).router.reasoning_parser == "auto"
    with pytest.raises(ConfigError, match="router.reasoning_parser"):
        load_cluster_config(env={}, overrides={"router": {"reasoning_parser": "r2"}})
    args = build_parser().parse_args(["up", "--model", str(tmp_path), "--reasoning-parser", "qwen3",
                                      "--run-dir", str(tmp_path / "run")])
    assert build_cluster(args).cfg.router.reasoning_parser == "qwen3"
    made = build_parser().parse_args(["make-model", "--chat-template", "thinking", "--out", str(tmp_path)])
    assert made.chat_template == "thinking"


def test_the_default_checkpoint_has_no_reasoning_parser(tiny_model):
    assert reasoning_format("auto", Tokenizer(tiny_model)) is None


def test_an_earlier_answers_reasoning_content_reaches_the_template():
    history = ASK + [{"role": "assistant", "content": "4", "reasoning_content": "2 and 2"},
                     {"role": "user", "content": "And 3 + 3?"}]
    req = s.parse_chat_request(json.dumps({"messages": history}).encode(), ("tiny",))
    assert req.messages[1] == {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"}
    history[1] = {"role": "assistant", "content": "4", "reasoning": "2 and 2"}   # vLLM's newer name
    req = s.parse_chat_request(json.dumps({"messages": history}).encode(), ("tiny",))
    assert req.messages[1] == {"role": "assistant", "content": "4", "reasoning_content": "2 and 2"}
