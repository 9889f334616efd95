"""Trace context: ids, the W3C `traceparent` header, sampling.

A span is known by (trace id, span id): 16 and 8 random bytes, written as 32
and 16 lowercase hex digits, never all zeros (W3C Trace Context). The header
is `00-<trace id>-<parent span id>-<flags>`; flag bit 0 says the caller
records the trace (sampled).

Some span ids are derived instead of drawn: the router's span of one phase
of one placement is `phase_span_id(root, epoch, phase)`, so a control message
sent in that phase can name its parent before the span exists, and the span
built from the request's timeline when it ends gets the same id — the
timeline stays the one record of the phases.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


@dataclass(frozen=True)
class SpanContext:
    trace_id: str          # 32 lowercase hex digits
    span_id: str           # 16 lowercase hex digits
    sampled: bool = True   # recorded and exported
    parent_id: str = ""    # the span this one is a child of ("" for a trace's root)

    def traceparent(self) -> str:
        """This span as the parent of what it calls (the W3C header's value)."""
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"

    def child(self, span_id: str) -> SpanContext:
        return SpanContext(self.trace_id, span_id, self.sampled, self.span_id)

    def sibling(self) -> SpanContext:
        """Another span under the same parent (each choice of an n > 1 request is a root of its own)."""
        return SpanContext(self.trace_id, new_span_id(), self.sampled, self.parent_id)


def new_trace_id() -> str:
    while (tid := os.urandom(16).hex()) == _ZERO_TRACE:
        pass
    return tid


def new_span_id() -> str:
    while (sid := os.urandom(8).hex()) == _ZERO_SPAN:
        pass
    return sid


def derived_span_id(*parts: object) -> str:
    """A span id that is a function of `parts` (a root span id first: unique per trace)."""
    sid = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).hexdigest()
    return sid if sid != _ZERO_SPAN else "0" * 15 + "1"


def phase_span_id(root_span_id: str, epoch: int, phase: str) -> str:
    """The router's span of `phase` in placement `epoch` of the request whose root span is `root_span_id`."""
    return derived_span_id(root_span_id, epoch, phase)


def parse_traceparent(value: str | None) -> SpanContext | None:
    """The remote parent a `traceparent` value names (its span id is the caller's
    span), or None when absent or invalid — then a new trace begins (W3C:
    an invalid header is ignored, not an error). A future version is read by
    its first four fields, as the spec asks."""
    if not value:
        return None
    value = value.strip()
    m = _TRACEPARENT.match(value)
    if m is None:
        return None
    version, trace_id, span_id, flags = m.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    if version == "00" and len(value) != 55:
        return None
    if version != "00" and len(value) > 55 and value[55] != "-":
        return None
    return SpanContext(trace_id, span_id, bool(int(flags, 16) & 1))


def sampled_by_ratio(trace_id: str, ratio: float) -> bool:
    """Whether a new trace is recorded: its id's last 8 bytes below ratio * 2**64
    (every process deciding on the same trace id decides alike)."""
    return int(trace_id[16:], 16) < ratio * 2.0 ** 64


def server_span(header: str | None, sample_ratio: float) -> SpanContext:
    """The context of a request's root span at this server: a child of the
    caller's span, recorded as the caller says, when `header` is a valid
    traceparent; else the root of a new trace, recorded at `sample_ratio`."""
    parent = parse_traceparent(header)
    if parent is not None:
        return SpanContext(parent.trace_id, new_span_id(), parent.sampled, parent.span_id)
    trace_id = new_trace_id()
    return SpanContext(trace_id, new_span_id(), sampled_by_ratio(trace_id, sample_ratio))
