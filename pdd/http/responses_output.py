"""The Responses API's answer, from a chat answer: the response object, its
output items (a reasoning model's "reasoning" first, holding one
"reasoning_text" part, split off as chat splits it: pdd.http.reasoning; a
"message" holding one "output_text" part; a "function_call" per tool call,
read from the text by pdd.http.tools.ToolCallReader as chat reads them), and
the stream's events (`EventStream`; the reasoning's are
response.reasoning_text.delta and .done, as OpenAI's and vLLM's).
pdd.http.responses_api turns the request into chat's and calls these."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import orjson

from pdd.http.reasoning import ReasoningFormat, ReasoningSplit
from pdd.http.tools import ToolCallReader, ToolFormat
from pdd.http.validate import APIError


@dataclass
class ResponsesRequest:
    """What the Responses answer needs beyond the chat request."""
    id: str
    created_at: int
    settings: dict                  # the request's settings the response object repeats
    history: list[dict]             # the conversation before this turn's output (chat messages, no instructions)
    store: bool
    sources: list[str]              # per chat message, the field it came from ("input[3]"), for errors
    ignored_fields: tuple[str, ...] = ()


def usage(chat_usage: dict) -> dict:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    # cache_write_tokens: OpenAI's explicit (priced) cache writes; pdd's prefix cache has none.
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": (chat_usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(rr: ResponsesRequest, model: str, status: str, output: list[dict],
                    usage_: dict | None, error: dict | None = None) -> dict:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": rr.id, "object": "response", "created_at": rr.created_at, "status": status,
            "error": error, "incomplete_details": incomplete, **rr.settings, "model": model,
            "output": output, "usage": usage_}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str, status: str) -> dict:
    # No summary: the model's own reasoning is given whole, in content.
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": status, "summary": [],
            "content": [reasoning_text(text)], "encrypted_content": None}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(fmt: ToolFormat | None, thinks: ReasoningFormat | None, text: str,
                 finish_reason: str | None) -> list[dict]:
    """A whole answer's output items: its reasoning (a reasoning model's), its
    content, then its calls (read as chat reads them). Cut by
    max_output_tokens, the last is incomplete (as streamed)."""
    thought, text = ReasoningSplit.split(thinks, text) if thinks is not None else ("", text)
    content, calls = ToolCallReader.read(fmt, text) if fmt is not None else (text, [])
    items = [reasoning_item(thought, "completed")] if thought else []
    items += [message_item(content, "completed")] if content else []
    items += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
    if items:
        items[-1]["status"] = status_of(finish_reason)
    return items


def conversation(rr: ResponsesRequest, output: list[dict]) -> list[dict]:
    """The conversation with this answer, as chat messages (what the store keeps)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    answer = {"role": "assistant", "content": text if text or not calls else None}
    thought = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
    if thought:   # the template decides whether an earlier turn's reasoning is shown
        answer["reasoning_content"] = thought
    if calls:
        answer["tool_calls"] = calls
    return rr.history + [answer]


@dataclass
class EventStream:
    """The Responses stream events of one chat answer: feed it the text
    pieces as they come (`emit`, the relay's and the handler's), then say the
    end (`end`). Each item is done before the next is added."""
    rr: ResponsesRequest
    model: str
    fmt: ToolFormat | None
    thinks: ReasoningFormat | None = None
    output: list[dict] = field(default_factory=list)   # the items, as they stand
    finish_reason: str | None = None
    seq: int = 0
    _open: dict | None = None      # the item being written
    _calls: dict[int, dict] = field(default_factory=dict)   # the reader's call index -> its item

    def __post_init__(self):
        self.reader = ToolCallReader(self.fmt) if self.fmt is not None else None
        self.split = ReasoningSplit(self.thinks) if self.thinks is not None else None

    def event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def start(self) -> bytes:
        snapshot = response_object(self.rr, self.model, "in_progress", [], None)
        return (self.event("response.created", response=snapshot)
                + self.event("response.in_progress", response=snapshot))

    def emit(self, _index: int, pieces: list[tuple]) -> bytes:
        out = []
        for delta, _frag, reason in pieces:
            if self.split is not None:
                thought, delta = self.split.feed_last(delta, bool(reason))
                if thought:
                    out.append(self._thought(thought))
            if self.reader is None:
                deltas = [{"content": delta}] if delta else []
            else:
                deltas = self.reader.feed(delta) + (self.reader.finish() if reason else [])
            for d in deltas:
                out.append(self._delta(d))
            if reason:
                self.finish_reason = reason
                out.append(self._close())
        return b"".join(out)

    def _thought(self, text: str) -> bytes:
        out = b""
        if self._open is None or self._open["type"] != "reasoning":
            out = self._add(reasoning_item("", "in_progress"))
        self._open["content"][0]["text"] += text
        return out + self.event("response.reasoning_text.delta", item_id=self._open["id"],
                                output_index=len(self.output) - 1, content_index=0, delta=text)

    def _delta(self, d: dict) -> bytes:
        if "content" in d:
            out = b""
            if self._open is None or self._open["type"] != "message":
                out = self._add(message_item("", "in_progress"))
                out += self.event("response.content_part.added", item_id=self._open["id"],
                                  output_index=len(self.output) - 1, content_index=0, part=output_text(""))
            self._open["content"][0]["text"] += d["content"]
            return out + self.event("response.output_text.delta", item_id=self._open["id"],
                                    output_index=len(self.output) - 1, content_index=0, delta=d["content"],
                                    logprobs=[])
        out = []
        for tc in d["tool_calls"]:
            fn = tc["function"]
            if "id" in tc:   # a new call
                self._calls[tc["index"]] = item = call_item(tc["id"], fn["name"], "", "in_progress")
                out.append(self._add(item))
            item = self._calls[tc["index"]]
            if fn["arguments"]:
                item["arguments"] += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.output.index(item), delta=fn["arguments"]))
        return b"".join(out)

    def _add(self, item: dict) -> bytes:
        out = self._close()
        self.output.append(item)
        self._open = item
        return out + self.event("response.output_item.added", output_index=len(self.output) - 1,
                                item={**item, "content": []} if "content" in item else dict(item))

    def _close(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        index = self.output.index(item)
        item["status"] = status_of(self.finish_reason) if self.finish_reason else "completed"
        out = []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return b"".join(out)

    def end(self, usage_: dict) -> tuple[bytes, dict]:
        """The last event (response.completed, or .incomplete when cut by
        max_output_tokens) and the response it carries."""
        status = status_of(self.finish_reason)
        final = response_object(self.rr, self.model, status, self.output, usage_)
        return self.event(f"response.{status}", response=final), final

    def failed(self, error: APIError) -> bytes:
        """An error after the stream began: an error event, then response.failed."""
        # The response's error codes are OpenAI's few: the request's own fault, or the server's.
        err = {"code": "invalid_prompt" if error.status == 400 else "server_error", "message": error.message}
        return (self.event("error", code=err["code"], message=error.message, param=error.param)
                + self.event("response.failed", response=response_object(
                    self.rr, self.model, "failed", self.output, None, err)))
