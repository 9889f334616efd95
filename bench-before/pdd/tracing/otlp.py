"""Spans, their OTLP/JSON encoding, and the exporter that posts them.

The encoding is OTLP/HTTP's JSON form of ExportTraceServiceRequest
(opentelemetry-proto, "JSON Protobuf Encoding"): lowerCamelCase keys,
trace and span ids as lowercase hex, 64-bit integers (times in ns, int
attributes) as decimal strings, enums (span kind, status code) as integers.

The exporter never makes its caller wait: `emit` appends to a bounded queue
(full: the span is dropped and counted), and one thread posts batches to
`<endpoint>/v1/traces`. A batch the collector does not take — refused,
unreachable, too slow — is dropped and counted, not retried: a collector that
is down costs a failed connection per batch, and no memory. The first failure
of a run of them is logged, and the recovery; nothing in between.
"""
from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field

import orjson

from pdd import __version__
from pdd.tracing.context import SpanContext

log = logging.getLogger(__name__)

KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_UNSET, STATUS_ERROR = 0, 2
SCOPE = {"name": "pdd", "version": __version__}

Value = str | bool | int | float


@dataclass
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Value] = field(default_factory=dict)


@dataclass
class Span:
    name: str
    context: SpanContext          # its trace id, its span id and its parent's
    start_ns: int                 # Unix time
    end_ns: int
    kind: int = KIND_INTERNAL
    attributes: dict[str, Value] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    error: str | None = None      # set: status ERROR with this message


def encode_value(v: Value) -> dict:
    if isinstance(v, bool):          # before int: a bool is an int in Python
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def encode_attributes(attrs: dict[str, Value]) -> list[dict]:
    return [{"key": k, "value": encode_value(v)} for k, v in attrs.items() if v is not None]


def encode_span(s: Span) -> dict:
    out = {"traceId": s.context.trace_id, "spanId": s.context.span_id, "name": s.name, "kind": s.kind,
           "startTimeUnixNano": str(s.start_ns), "endTimeUnixNano": str(max(s.end_ns, s.start_ns)),
           "attributes": encode_attributes(s.attributes),
           "status": {"code": STATUS_ERROR, "message": s.error} if s.error is not None else {"code": STATUS_UNSET}}
    if s.context.parent_id:
        out["parentSpanId"] = s.context.parent_id
    if s.events:
        out["events"] = [{"timeUnixNano": str(e.time_ns), "name": e.name,
                          "attributes": encode_attributes(e.attributes)} for e in s.events]
    return out


def encode_request(spans: list[Span], resource: dict[str, Value]) -> dict:
    """One ExportTraceServiceRequest: this process's spans under its resource."""
    return {"resourceSpans": [{"resource": {"attributes": encode_attributes(resource)},
                               "scopeSpans": [{"scope": SCOPE, "spans": [encode_span(s) for s in spans]}]}]}


def traces_url(endpoint: str) -> str:
    """Where spans go: the base endpoint + /v1/traces (OTEL_EXPORTER_OTLP_ENDPOINT's meaning)."""
    return endpoint.rstrip("/") + "/v1/traces"


class Exporter:
    """Batches spans to an OTLP/HTTP collector from its own thread."""

    def __init__(self, endpoint: str, resource: dict[str, Value], headers: dict[str, str] | None = None,
                 batch_size: int = 512, queue_size: int = 2048, interval_s: float = 1.0, timeout_s: float = 5.0):
        self.url = traces_url(endpoint)
        self.resource = resource
        self.headers = {**(headers or {}), "Content-Type": "application/json"}
        self.batch_size, self.queue_size = batch_size, queue_size
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.exported = self.dropped_queue_full = self.dropped_export_failed = 0
        self._queue: deque[Span] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._failing = False         # in a run of failed exports (logged at its start)
        self._dropped_at_failure = 0
        self._thread = threading.Thread(target=self._run, name="pdd-otlp", daemon=True)
        self._thread.start()

    def emit(self, span: Span) -> None:
        """Queue `span` for export; never waits (a full queue drops it, counted)."""
        with self._cond:
            if len(self._queue) >= self.queue_size or self._stopping:
                self.dropped_queue_full += 1
                return
            self._queue.append(span)
            if len(self._queue) >= self.batch_size:
                self._cond.notify()

    def stats(self) -> dict[str, int]:
        return {"exported": self.exported, "dropped_queue_full": self.dropped_queue_full,
                "dropped_export_failed": self.dropped_export_failed, "queued": len(self._queue)}

    def stop(self, timeout_s: float = 2.0) -> None:
        """Post what is queued (bounded by `timeout_s`), then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                deadline = time.monotonic() + self.interval_s
                while not self._stopping and len(self._queue) < self.batch_size:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
                stopping = self._stopping
            if batch:
                self._export(batch)
            if stopping and not self._queue:
                return

    def _export(self, batch: list[Span]) -> None:
        body = orjson.dumps(encode_request(batch, self.resource))
        try:
            req = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                resp.read()
        except (OSError, ValueError, urllib.error.URLError) as e:   # HTTPError (4xx, 5xx) is a URLError
            self.dropped_export_failed += len(batch)
            if not self._failing:
                self._failing, self._dropped_at_failure = True, self.dropped_export_failed - len(batch)
                log.warning("tracing: OTLP export to %s failed (%s); spans are dropped (counted in "
                            "pdd_trace_spans_dropped_total) until it answers", self.url, _reason(e))
            return
        self.exported += len(batch)
        if self._failing:
            self._failing = False
            log.warning("tracing: OTLP export to %s works again (%d spans dropped meanwhile)", self.url,
                        self.dropped_export_failed - self._dropped_at_failure)


def _reason(e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return f"{type(e).__name__}: {e}"
