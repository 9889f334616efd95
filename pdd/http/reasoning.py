"""Reasoning models: the output's `<think>...</think>` part, split from the
answer into `reasoning` and `reasoning_content` (FIELDS; as vLLM's reasoning
outputs).

Parsers (`router.reasoning_parser`; "auto" reads the chat template):
- deepseek_r1: the template opens `<think>` in the prompt, so the output starts
  inside the reasoning, which ends at `</think>`; an explicit leading `<think>`
  (a model that writes it again) is dropped. Output that never closes it is all
  reasoning (cut by max_tokens mid-thought).
- qwen3: reasoning only between an explicit leading `<think>` and `</think>`;
  an output that does not begin with `<think>` is all content.
- none: no split; every model without `<think>` in its template.

`chat_template_kwargs.enable_thinking` false (the template is told not to
think) turns the split off for that request: the output is content, and a
structured output (or a forced tool call) constrains it from its first token.
With thinking on, the constraint applies after the reasoning, as vLLM's: the
model reasons freely, and from the end of its reasoning on the grammar holds
(`constrained_after`; pdd.grammar composes the grammar, so every engine that
replays the output's tokens into it agrees where the reasoning ended).

ReasoningSplit is incremental: `feed` takes a text delta and returns the
(reasoning, content) deltas it makes sendable, holding back only what may still
be the start of a tag; once the reasoning is over each delta is content as it
comes, with no scan. The deltas of a stream concatenate to the complete split.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdd.api import REASONING_FORMATS as PARSERS
from pdd.api import StructuredOutput
OPEN, CLOSE = "<think>", "</think>"
# The names a chat message and a stream delta give the reasoning under: vLLM's
# `reasoning` (its name since late 2025, the only one it emits now), and the
# `reasoning_content` it had before, which LiteLLM, LangChain and most other
# clients still read. Both, so that either kind of client finds it.
FIELDS = ("reasoning", "reasoning_content")

# ReasoningSplit's states
_START, _THINKING, _CONTENT = 0, 1, 2


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    # The output begins inside the reasoning (the template opened <think>).
    starts_inside: bool


def reasoning_format(name: str, tokenizer) -> ReasoningFormat | None:
    """The parser `name` selects ("auto": the chat template's; None: no split)."""
    if name == "auto":
        name = detect(tokenizer)
    if name == "none":
        return None
    if name == "deepseek_r1":
        return ReasoningFormat("deepseek_r1", True)
    if name == "qwen3":
        return ReasoningFormat("qwen3", False)
    raise ValueError(f"unknown reasoning parser {name!r}; choose from auto, none, {', '.join(PARSERS)}")


def detect(tokenizer) -> str:
    """deepseek_r1 when the template's generation prompt ends inside an opened
    <think>, qwen3 when the template otherwise mentions <think>, none else."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if OPEN not in template:
        return "none"
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    except Exception:   # noqa: BLE001 -- a template that needs more than one plain message: read its text only
        prompt = ""
    return "deepseek_r1" if prompt.rstrip().endswith(OPEN) else "qwen3"


def for_request(fmt: ReasoningFormat | None, template_args: dict | None) -> ReasoningFormat | None:
    """The split one chat request gets: none with enable_thinking false."""
    if fmt is None:
        return None
    if template_args and template_args.get("enable_thinking") is False:
        return None
    return fmt


def constrained_after(so: StructuredOutput | None, fmt: ReasoningFormat | None) -> StructuredOutput | None:
    """The request's constraint, applied after the reasoning when it has one."""
    if so is None or fmt is None:
        return so
    return dataclasses.replace(so, reasoning=fmt.name)


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplit:
    """One choice's output split into reasoning and content, delta by delta."""

    __slots__ = ("starts_inside", "state", "pending", "reasoning", "content")

    def __init__(self, fmt: ReasoningFormat):
        # Either starts by looking for a leading <think> (deepseek_r1: to drop it).
        self.starts_inside = fmt.starts_inside
        self.state = _START
        self.pending = ""        # text held back: it may be (the start of) a tag
        self.reasoning = ""      # everything released so far, each part
        self.content = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """A text delta -> the (reasoning, content) deltas sendable now."""
        if self.state == _CONTENT:   # the common case once thinking is over
            self.content += delta
            return "", delta
        self.pending += delta
        return self._split(final=False)

    def feed_last(self, delta: str, last: bool) -> tuple[str, str]:
        """`feed`, and with the output's last delta what was held back too."""
        reasoning, content = self.feed(delta)
        if last:
            more_reasoning, more = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """End of the output: what was held back."""
        if self.state == _CONTENT or not self.pending:
            return "", ""
        return self._split(final=True)

    def _split(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self.state == _START:
            head = self.pending.lstrip()
            if head.startswith(OPEN):
                self.pending, self.state = head[len(OPEN):], _THINKING
            elif OPEN.startswith(head) and not final:
                return "", ""   # may still be <think>
            elif self.starts_inside:
                self.state = _THINKING
            else:   # qwen3 without a leading <think>: all of it is content
                self.state, content, self.pending = _CONTENT, self.pending, ""
        if self.state == _THINKING:
            end = self.pending.find(CLOSE)
            if end >= 0:
                reasoning, content = self.pending[:end], self.pending[end + len(CLOSE):]
                self.state, self.pending = _CONTENT, ""
            else:
                keep = 0 if final else _held(self.pending, CLOSE)
                cut = len(self.pending) - keep
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    @classmethod
    def split(cls, fmt: ReasoningFormat, text: str) -> tuple[str, str]:
        """A complete output's (reasoning, content)."""
        s = cls(fmt)
        s.feed(text)
        s.finish()
        return s.reasoning, s.content


def reasoning_tokens(fmt: ReasoningFormat, token_ids: list[int], text: str, tokenizer) -> int:
    """How many of an answer's tokens (`token_ids`, whose text is `text`) are its
    reasoning, the tags included: usage's reasoning_tokens. Exact where `</think>`
    is a token of its own (Qwen3's, DeepSeek-R1's): the tokens up to it. Else the
    reasoning's text encoded again (tokens a model split differently count as the
    tokenizer splits them), or every token when the reasoning never ended."""
    close = tokenizer.token_to_id(CLOSE)
    if close is not None and close in token_ids:
        return token_ids.index(close) + 1
    reasoning, content = ReasoningSplit.split(fmt, text)
    if not reasoning and not (text.lstrip().startswith(OPEN)):
        return 0
    if CLOSE not in text:   # cut mid-thought: all of it is reasoning
        return len(token_ids)
    head = text[:text.index(CLOSE) + len(CLOSE)]
    return min(len(token_ids), len(tokenizer.encode(head, add_special_tokens=False)))

