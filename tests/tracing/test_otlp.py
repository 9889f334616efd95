"""The OTLP/JSON encoding (field names and types), W3C trace context, and the
exporter against a fake collector on loopback: batches, headers, a full queue,
a collector that is down."""
from __future__ import annotations

import logging
import re

import orjson
import pytest

from pdd.tracing.context import (SpanContext, parse_traceparent, phase_span_id, sampled_by_ratio, server_span)
from pdd.tracing.otlp import KIND_SERVER, Exporter, Span, SpanEvent, encode_request
from tests.e2e.cluster import _wait_for
from tests.tracing.collector import Collector, closed_port

TRACE, PARENT, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "1122334455667788"


def test_a_span_encodes_as_otlp_json_with_its_fields_typed():
    span = Span("request", SpanContext(TRACE, SPAN, True, PARENT), 1_700_000_000_123_456_789,
                1_700_000_001_000_000_000, KIND_SERVER,
                {"s": "x", "i": 7, "f": 0.5, "b": True, "none": None},
                [SpanEvent("first_token", 1_700_000_000_500_000_000, {"pdd.epoch": 1})], error="boom")
    root = Span("prefill", SpanContext(TRACE, "aaaaaaaaaaaaaaaa"), 5, 9)
    body = orjson.loads(orjson.dumps(encode_request([span, root], {"service.name": "pdd-router"})))
    rs, = body["resourceSpans"]
    assert rs["resource"] == {"attributes": [{"key": "service.name", "value": {"stringValue": "pdd-router"}}]}
    ss, = rs["scopeSpans"]
    assert ss["scope"]["name"] == "pdd" and isinstance(ss["scope"]["version"], str)
    s, r = ss["spans"]
    assert s == {
        "traceId": TRACE, "spanId": SPAN, "parentSpanId": PARENT, "name": "request", "kind": 2,
        "startTimeUnixNano": "1700000000123456789", "endTimeUnixNano": "1700000001000000000",
        "attributes": [{"key": "s", "value": {"stringValue": "x"}}, {"key": "i", "value": {"intValue": "7"}},
                       {"key": "f", "value": {"doubleValue": 0.5}}, {"key": "b", "value": {"boolValue": True}}],
        "events": [{"timeUnixNano": "1700000000500000000", "name": "first_token",
                    "attributes": [{"key": "pdd.epoch", "value": {"intValue": "1"}}]}],
        "status": {"code": 2, "message": "boom"}}
    # A root span has no parentSpanId; an unset status is code 0; INTERNAL is kind 1.
    assert "parentSpanId" not in r and "events" not in r
    assert (r["kind"], r["status"], r["startTimeUnixNano"], r["endTimeUnixNano"]) == (1, {"code": 0}, "5", "9")
    assert re.fullmatch(r"[0-9a-f]{32}", r["traceId"]) and re.fullmatch(r"[0-9a-f]{16}", r["spanId"])


@pytest.mark.parametrize("header, expected", [
    (f"00-{TRACE}-{PARENT}-01", SpanContext(TRACE, PARENT, True)),
    (f"00-{TRACE}-{PARENT}-00", SpanContext(TRACE, PARENT, False)),
    (f" 00-{TRACE}-{PARENT}-03 ", SpanContext(TRACE, PARENT, True)),          # other flag bits
    (f"01-{TRACE}-{PARENT}-01-future-fields", SpanContext(TRACE, PARENT, True)),   # a later version
    (f"00-{TRACE}-{PARENT}-01-extra", None),                                 # version 00 is exactly 55 chars
    (f"00-{TRACE.upper()}-{PARENT}-01", None),                               # hex is lowercase
    (f"ff-{TRACE}-{PARENT}-01", None),
    (f"00-{'0' * 32}-{PARENT}-01", None), (f"00-{TRACE}-{'0' * 16}-01", None),
    (f"00-{TRACE[:-1]}-{PARENT}-01", None), ("", None), (None, None), ("garbage", None),
])
def test_traceparent_parsing(header, expected):
    assert parse_traceparent(header) == expected


def test_the_server_span_continues_a_valid_traceparent_else_starts_a_sampled_trace():
    ctx = server_span(f"00-{TRACE}-{PARENT}-00", sample_ratio=1.0)
    assert (ctx.trace_id, ctx.parent_id, ctx.sampled) == (TRACE, PARENT, False)   # the caller decides
    assert re.fullmatch(r"[0-9a-f]{16}", ctx.span_id) and ctx.span_id != PARENT
    assert ctx.traceparent() == f"00-{TRACE}-{ctx.span_id}-00"
    fresh = server_span("not a traceparent", sample_ratio=1.0)
    assert fresh.parent_id == "" and fresh.sampled and fresh.trace_id != TRACE
    assert not server_span(None, sample_ratio=0.0).sampled
    assert sampled_by_ratio("0" * 16 + "7fffffffffffffff", 0.5) and not sampled_by_ratio("0" * 16 + "8" + "0" * 15, 0.5)
    # A phase's span id is a function of the root, the epoch and the phase.
    assert phase_span_id(SPAN, 1, "reserving") == phase_span_id(SPAN, 1, "reserving")
    assert len({phase_span_id(SPAN, e, p) for e in (1, 2) for p in ("reserving", "decoding")}) == 4


@pytest.fixture
def collector():
    c = Collector().start()
    yield c
    c.stop()


def spans(n: int) -> list[Span]:
    return [Span(f"s{i}", SpanContext(TRACE, f"{i + 1:016x}", True, PARENT), i, i + 1) for i in range(n)]


def test_the_exporter_posts_batches_with_its_headers(collector):
    e = Exporter(collector.endpoint + "/", {"service.name": "pdd-test"}, {"Authorization": "Bearer t0k"},
                 batch_size=2, queue_size=10, interval_s=0.05)
    try:
        for s in spans(3):
            e.emit(s)
        _wait_for(lambda: e.exported == 3, 30.0, "3 spans exported")
    finally:
        e.stop()
    assert sorted(s["name"] for s in collector.spans()) == ["s0", "s1", "s2"]
    assert all(s["resource"]["service.name"] == "pdd-test" for s in collector.spans())
    headers, _ = collector.posts[0]
    assert headers["Content-Type"] == "application/json" and headers["Authorization"] == "Bearer t0k"
    assert e.stats() == {"exported": 3, "dropped_queue_full": 0, "dropped_export_failed": 0, "queued": 0}


def test_a_full_queue_drops_and_counts_instead_of_waiting():
    # A batch never fills and the interval never ends: nothing leaves the queue.
    e = Exporter("http://127.0.0.1:9", {}, batch_size=100, queue_size=3, interval_s=3600)
    for s in spans(5):
        e.emit(s)
    assert (e.dropped_queue_full, e.stats()["queued"]) == (2, 3)
    e.stop(timeout_s=0)


def test_a_collector_that_is_down_costs_dropped_spans_and_one_log_line(caplog):
    url = f"http://127.0.0.1:{closed_port()}"
    e = Exporter(url, {}, batch_size=1, queue_size=10, interval_s=0.01, timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="pdd.tracing.otlp"):
        try:
            for s in spans(3):
                e.emit(s)
            _wait_for(lambda: e.dropped_export_failed == 3, 30.0, "3 failed exports")
        finally:
            e.stop()
    assert e.exported == 0
    failed = [r for r in caplog.records if url in r.getMessage()]
    assert len(failed) == 1 and "spans are dropped" in failed[0].getMessage()
