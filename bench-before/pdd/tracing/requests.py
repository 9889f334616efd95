"""The router's spans of a request, made from its timeline when it ends.

The timeline (pdd.router.traces) is the record of the phases; nothing else
is kept while the request runs. When it ends, `export` turns it into spans:

    request                       the root: arrival to end (a child of the client's span)
      queued / reserving / prefilling / decoding
                                  one per phase entered, per placement: from its event to
                                  the next phase, fallback or the end
      fallback                    a re-placement: from the fallback to the next phase

A phase span's id is `phase_span_id(root, epoch, phase)`: the control
messages sent in that phase named it as their parent already
(`phase_traceparent`), so the workers' spans hang under it.

The transfer figures a prefill worker reports after the request ended
(pdd.router.traces.TraceStore.late) are not exported again: that worker's own
`kv_send` span carries them.
"""
from __future__ import annotations

from pdd import tracing
from pdd.router.requests import RequestState
from pdd.router.traces import PHASES, Timeline
from pdd.tracing.context import SpanContext, derived_span_id, phase_span_id
from pdd.tracing.otlp import KIND_SERVER, Span, SpanEvent

_BOUNDARIES = (*PHASES, "fallback", "end")


def phase_traceparent(state: RequestState) -> str:
    """The traceparent of the request's current phase span, for a control
    message sent now ("": the request is not traced)."""
    ctx = state.span
    if ctx is None or not ctx.sampled:
        return ""
    return f"00-{ctx.trace_id}-{phase_span_id(ctx.span_id, state.epoch, state.phase)}-01"


def export(ctx: SpanContext | None, timeline: Timeline) -> None:
    """Emit the spans of a request that ended (nothing when it is not traced)."""
    if ctx is None or not ctx.sampled or not tracing.enabled():
        return
    for span in spans(ctx, timeline):
        tracing.emit(span)


def spans(ctx: SpanContext, t: Timeline) -> list[Span]:
    """The root span of a finished request's timeline, then its phase and fallback spans."""
    def ns(at: float) -> int:   # monotonic (the timeline's clock) -> Unix ns
        return int((t.started_at + (at - t.arrival)) * 1e9)

    end = t.ended if t.ended is not None else (t.events[-1].at if t.events else t.arrival)
    summary = t.summary(end)
    error = next((e.note for e in t.events if e.what == "error"), None)
    root = Span("request", ctx, ns(t.arrival), ns(end), KIND_SERVER, {
        "pdd.request_id": t.request_id, "pdd.mode": t.mode, "pdd.finish_reason": t.finish_reason or "",
        "pdd.prompt_tokens": t.prompt_tokens, "pdd.output_tokens": t.output_tokens,
        "pdd.cached_tokens": t.cached_tokens, "pdd.migrations": t.migrations,
        "pdd.prefill_worker": summary["prefill_worker"], "pdd.decode_worker": summary["decode_worker"],
        "pdd.fallbacks": summary["fallbacks"], **tracing.process_attributes()},
        error=error if t.finish_reason == "error" else None)
    out = [root]
    marks = [e for e in t.events if e.what in _BOUNDARIES]
    fallbacks = 0
    for i, e in enumerate(marks):
        if e.what == "end":
            break
        until = marks[i + 1].at if i + 1 < len(marks) else end
        attrs = {"pdd.epoch": e.epoch, "pdd.decode_worker": e.decode, "pdd.prefill_worker": e.prefill}
        if e.what == "fallback":
            fallbacks += 1
            sid = derived_span_id(ctx.span_id, e.epoch, "fallback", fallbacks)
            attrs.update({"pdd.fallback.reason": e.note.partition(":")[0], "pdd.note": e.note})
        else:
            sid = phase_span_id(ctx.span_id, e.epoch, e.what)
        out.append(Span(e.what, ctx.child(sid), ns(e.at), ns(until), attributes=attrs))
    for e in t.events:
        if e.what not in _BOUNDARIES:
            root.events.append(SpanEvent(e.what, ns(e.at), {"pdd.epoch": e.epoch, "pdd.note": e.note,
                                                             "pdd.decode_worker": e.decode,
                                                             "pdd.prefill_worker": e.prefill}))
    return out
