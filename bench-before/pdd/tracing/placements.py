"""A worker's spans of a placement, kept on its record (pdd.worker.records).

A command that starts work here carries the traceparent of the router's
phase span it was sent in; the spans of that work are its children:

    prefill worker   prefill   Prefill received -> first token sampled
                     kv_send   KVTarget received -> transfer over (bytes, blocks; failed: error)
    decode worker    kv_wait   Reserve answered -> the KV landed, or a local prefill instead
                     prefill   Admit / PrefillLocally -> its first token (the prompt computing here)
                     decode    first token -> the placement ends (tokens generated, finish reason)

A span still open when its placement ends (finished, aborted, failed) ends
with it: `ended` is called from PlacementTable.release, the one path that
ends a placement. A command without a traceparent, or tracing off in this
process, makes no span and costs one check.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdd import tracing
from pdd.tracing.context import SpanContext, new_span_id, parse_traceparent
from pdd.tracing.otlp import Span, Value

if TYPE_CHECKING:
    from pdd.worker.records import WorkerPlacement


@dataclass
class _Open:
    context: SpanContext
    start_ns: int
    attributes: dict[str, Value]


@dataclass
class PlacementTrace:
    parent: SpanContext     # the router's span of the latest command that carried one
    open: dict[str, _Open] = field(default_factory=dict)


def begin(p: WorkerPlacement, name: str, traceparent: str = "", ends: str = "", **attrs: Value) -> None:
    """Start span `name` of placement `p`, a child of the router's span
    `traceparent` (""): the one its latest command came under). `ends`: the
    span this one follows, ended now."""
    parent = parse_traceparent(traceparent) if tracing.enabled() else None
    if parent is not None:
        if p.trace is None:
            p.trace = PlacementTrace(parent)
        p.trace.parent = parent
    if p.trace is None:
        return
    if ends:
        end(p, ends)
    p.trace.open[name] = _Open(p.trace.parent.child(new_span_id()), time.time_ns(), {
        "pdd.request_id": p.request_id, "pdd.epoch": p.epoch, **tracing.process_attributes(), **attrs})


def end(p: WorkerPlacement, name: str, error: str | None = None, **attrs: Value) -> None:
    """End span `name` of `p`, if open; `error`: it failed, so."""
    o = p.trace.open.pop(name, None) if p.trace is not None else None
    if o is not None:
        o.attributes.update(attrs)
        tracing.emit(Span(name, o.context, o.start_ns, time.time_ns(), attributes=o.attributes, error=error))


def tokens(p: WorkerPlacement, num_new: int, finish_reason: str | None) -> None:
    """A step's tokens for `p`: the first ends its prompt's span (prefill -> decode)."""
    if p.trace is None:
        return
    if num_new and "prefill" in p.trace.open:
        begin(p, "decode", ends="prefill")
    decode = p.trace.open.get("decode")
    if decode is not None:
        a = decode.attributes
        a["pdd.tokens_generated"] = int(a.get("pdd.tokens_generated", 0)) + num_new
        if finish_reason:
            a["pdd.finish_reason"] = finish_reason


def ended(p: WorkerPlacement) -> None:
    """`p` ended here: its open spans end with it."""
    if p.trace is not None:
        for name in list(p.trace.open):
            end(p, name)
