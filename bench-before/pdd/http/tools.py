"""Tool calling: which format the model writes its calls in, the grammar that
forces a call (`tool_choice` "required" or a named function), and the parser
that turns the generated text into OpenAI's `tool_calls`, whole or as stream
deltas.

Formats (`router.tool_call_parser`; "auto" reads the chat template):
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call (Hermes, Qwen 2.5/3; also the built-in tiny checkpoints).
- llama3_json: the text is `{"name": ..., "parameters": {...}}`, calls
  separated by "; ", optionally after `<|python_tag|>` (Llama 3.1-3.3).
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

One scanner reads the calls for both answers: the complete response parses
the whole text; a stream feeds it the text as it grows and sends what is new,
so the deltas of a stream reassemble to exactly the calls of the complete
response. A call's arguments are the JSON text the model wrote.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pdd.api import StructuredOutput
from pdd.closed_schema import closed
from pdd.grammar import JSON_OPTIONS

PARSERS = ("hermes", "llama3_json", "mistral")
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str          # where the calls begin in the text ("" for llama3_json: the text itself)
    args_key: str        # the call object's key for its arguments
    # mistral's [TOOL_CALLS] is a special token: the forcing grammar names it
    # by id, and the text the router parses must keep special tokens.
    marker_token: int | None = None
    # The output is the calls (a forced call: the grammar wrote it): none of it
    # is content, and a call cut short (max_tokens) is still the call it began.
    forced: bool = False

    @property
    def keeps_special_tokens(self) -> bool:
        return self.marker_token is not None


def tool_format(name: str, tokenizer) -> ToolFormat:
    """The format of `name` ("auto": the chat template's) for this tokenizer."""
    if name == "auto":
        name = detect(tokenizer)
    if name == "hermes":
        return ToolFormat("hermes", "<tool_call>", "arguments")
    if name == "llama3_json":
        return ToolFormat("llama3_json", "", "parameters")
    if name == "mistral":
        return ToolFormat("mistral", "[TOOL_CALLS]", "arguments", tokenizer.token_to_id("[TOOL_CALLS]"))
    raise ValueError(f"unknown tool-call parser {name!r}; choose from auto, {', '.join(PARSERS)}")


def detect(tokenizer) -> str:
    """The format the chat template writes calls in; hermes when it says nothing
    (a template that does not render tools: the model was not taught one)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


# ---------------------------------------------------------------- forcing a call

def forced_grammar(fmt: ToolFormat, tools: list[dict], choice, parallel: bool) -> StructuredOutput:
    """The grammar of the output when a call is required: "required", one call
    of any of the tools (or several, with `parallel`); a named function, one
    call of it. In the model's format, arguments valid for the function's
    parameters, their objects closed as a JSON schema's (pdd.closed_schema)."""
    functions = [t["function"] for t in tools]
    if isinstance(choice, dict):
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]
    # Each function's parameters sit inside the call's object: their local
    # $refs ("#/$defs/X", a nested pydantic model's) are made to point there.
    at = [f"/properties/{fmt.args_key}" if len(functions) == 1 else f"/anyOf/{i}/properties/{fmt.args_key}"
          for i in range(len(functions))]
    variants = [{"type": "object",
                 "properties": {"name": {"const": f["name"]},
                                fmt.args_key: _rebased(f.get("parameters") or {"type": "object"}, where)},
                 "required": ["name", fmt.args_key], "additionalProperties": False}
                for f, where in zip(functions, at)]
    schema = closed(variants[0] if len(variants) == 1 else {"anyOf": variants})
    call = "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    # A named function is called once; "required" takes one call or more
    # (with `parallel`) and ends when the model ends its calls.
    parallel = parallel and not isinstance(choice, dict)
    if fmt.name == "hermes":
        rules = ['start: call ("\\n" call)*' if parallel else "start: call",
                 'call: "<tool_call>\\n" obj "\\n</tool_call>"']
    elif fmt.name == "llama3_json":
        rules = ['start: obj ("; " obj)*' if parallel else "start: obj"]
    else:
        marker = f"<[{fmt.marker_token}]>" if fmt.marker_token is not None else json.dumps(fmt.marker)
        rules = [f'start: {marker} "[" obj ' + ('(", " obj)* ' if parallel else "") + '"]"']
    return StructuredOutput("grammar", "\n".join(rules + [f"obj: {call}"]))


# Keywords whose values are data, not schemas (a "$ref" key in them is no
# reference), and those whose values map names to schemas.
_DATA_KEYS = ("const", "enum", "default", "examples")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _rebased(node, at: str, names: bool = False):
    """`node` (a schema, or a part of one; `names`: a map of names to schemas)
    with its local $refs ("#...") made relative to the JSON pointer `at`, where
    the schema is embedded."""
    if isinstance(node, list):
        return [_rebased(v, at) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if names:
            out[key] = _rebased(value, at)
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + at + value[1:]
        elif key in _DATA_KEYS:
            out[key] = value
        else:
            out[key] = _rebased(value, at, key in _NAMED)
    return out


# ---------------------------------------------------------------- reading calls

@dataclass
class _Call:
    name: str | None      # None until the name's string is complete
    args: str             # the arguments' JSON text so far
    args_done: bool


def _string_end(s: str, i: int) -> int | None:
    """s[i] is '"': the index after its closing quote, None if unfinished."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """The index after the JSON value starting at s[i]; None if unfinished."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                end = _string_end(s, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None   # a number at the end may still grow


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _members(obj: str) -> list[tuple[str, int, int | None]]:
    """The top-level members of a JSON object's text (obj[0] == '{', possibly
    unfinished): (key, where its value starts, where it ends or None)."""
    out, i = [], 1
    while True:
        i = _skip_ws(obj, i)
        if i < len(obj) and obj[i] == ",":
            i = _skip_ws(obj, i + 1)
        if i >= len(obj) or obj[i] != '"':
            return out
        end = _string_end(obj, i)
        if end is None:
            return out
        try:
            key = json.loads(obj[i:end])
        except ValueError:
            return out
        i = _skip_ws(obj, end)
        if i >= len(obj) or obj[i] != ":":
            return out
        i = _skip_ws(obj, i + 1)
        if i >= len(obj):
            return out
        value_end = _value_end(obj, i)
        out.append((key, i, value_end))
        if value_end is None:
            return out
        i = value_end


def _objects(region: str) -> list[str]:
    """The top-level JSON objects of the calls region, the last maybe unfinished;
    anything between them (tags, brackets, separators) is skipped."""
    out, i = [], 0
    while True:
        i = region.find("{", i)
        if i < 0:
            return out
        end = _value_end(region, i)
        out.append(region[i:end] if end is not None else region[i:])
        if end is None:
            return out
        i = end


def _call(obj: str, args_key: str) -> _Call:
    name, args, done = None, "", False
    for key, start, end in _members(obj):
        value = obj[start:] if end is None else obj[start:end]
        if key == "name" and end is not None:
            try:
                loaded = json.loads(value)
            except ValueError:
                loaded = None
            name = loaded if isinstance(loaded, str) else None
        elif key in (args_key, "arguments", "parameters") and not args:
            if value.startswith(("{", "[")):
                args, done = value, end is not None
            elif end is not None:   # a string holding the JSON, or another scalar
                try:
                    loaded = json.loads(value)
                except ValueError:
                    loaded = value
                args, done = (loaded if isinstance(loaded, str) else json.dumps(loaded)), True
    return _Call(name, args, done)


class ToolCallReader:
    """The calls in a growing text. `feed` takes text as it comes and returns
    the stream deltas (OpenAI's chat chunk `delta` objects) it makes sendable;
    `finish` the rest; `result` the complete response's (content, tool_calls)."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []           # per call begun in the stream: its id
        self.args_sent: list[int] = []     # ... and the characters of its arguments sent

    def _region(self, final: bool) -> int | None:
        """Where the calls begin in the text; None: not (yet) known to."""
        if self.fmt.marker:
            i = self.text.find(self.fmt.marker)
            return None if i < 0 else i
        body = self.text.lstrip()
        if body.startswith(("{", "<|python_tag|>")):
            return len(self.text) - len(body)
        return None

    def _content_limit(self, final: bool) -> int:
        """How much of the text is content that may be sent (held back: what may
        still turn out to begin the calls, and trailing whitespace)."""
        text = self.text
        if final:
            return len(text)
        if self.fmt.marker:
            held = next((k for k in range(min(len(self.fmt.marker) - 1, len(text)), 0, -1)
                         if self.fmt.marker.startswith(text[-k:])), 0)
            return len(text) - held
        body = text.lstrip()
        if not body or "<|python_tag|>".startswith(body[:14]):
            return 0   # the text may still be a call
        return len(text)

    def _calls(self, start: int) -> list[_Call]:
        return [_call(obj, self.fmt.args_key) for obj in _objects(self.text[start:])]

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        return self._deltas(final=False)

    def finish(self) -> list[dict]:
        return self._deltas(final=True)

    def _deltas(self, final: bool) -> list[dict]:
        start = self._region(final)
        calls = self._calls(start) if start is not None else []
        if start is not None and final and not any(c.name for c in calls) and not self.fmt.forced:
            start, calls = None, []    # no call after all: all of it is content
        out = []
        if self.fmt.forced:
            content = ""
        elif start is not None:     # the content ends where the calls begin, less its trailing whitespace
            content = self.text[self.content_sent:start].rstrip() if self.content_sent < start else ""
            self.content_sent = max(self.content_sent, start)
        else:
            content = self.text[self.content_sent:self._content_limit(final)]
            if not final:   # trailing whitespace waits: it is dropped if calls follow
                content = content[:len(content.rstrip())]
            self.content_sent += len(content)
        if content:
            out.append({"content": content})
        for k, call in enumerate(calls):
            if call.name is None:
                break
            if k == len(self.ids):
                self.ids.append(_call_id())
                self.args_sent.append(0)
                out.append({"tool_calls": [{"index": k, "id": self.ids[k], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            new = call.args[self.args_sent[k]:]
            if new and (call.args_done or call.args.startswith(("{", "["))):
                out.append({"tool_calls": [{"index": k, "function": {"arguments": new}}]})
                self.args_sent[k] = len(call.args)
        return out

    @classmethod
    def read(cls, fmt: ToolFormat, text: str) -> tuple[str | None, list[dict]]:
        """A complete text's content and calls."""
        reader = cls(fmt)
        reader.text = text
        return reader.result()

    def result(self) -> tuple[str | None, list[dict]]:
        """The whole text's content (None when empty) and complete calls (forced:
        no content, and every call that has its name, its arguments as far as
        they got)."""
        start = self._region(True)
        calls = [c for c in self._calls(start) if c.name and (c.args_done or self.fmt.forced)] \
            if start is not None else []
        if self.fmt.forced:
            content = None
        elif not calls:
            return (self.text or None), []
        else:
            content = self.text[:start].rstrip() or None
        return content, [{"id": _call_id(), "type": "function", "function": {"name": c.name, "arguments": c.args}}
                         for c in calls]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
