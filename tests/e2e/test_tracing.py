"""OpenTelemetry export across a real cluster: `pdd up` (router, prefill and
decode workers as processes) posting OTLP/JSON to a fake collector on loopback.
A client's traceparent is continued by the router, whose phase spans parent
the workers' spans; a fallback shows as its own span; a collector that is down
costs dropped spans, counted, and no request."""
from __future__ import annotations

import os

import pytest

from pdd import __version__
from tests.e2e import http_util
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.test_disagg import PATIENT, metric
from tests.engine.helpers import random_prompts
from tests.tracing.collector import Collector, attrs, closed_port

ROUTER_PHASES = {"request", "queued", "reserving", "prefilling", "decoding"}


@pytest.fixture(scope="module")
def collector():
    c = Collector().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def traced(tmp_path_factory, tiny_model, collector):
    with UpCluster(tmp_path_factory.mktemp("traced"), tiny_model, "--mode", "disagg",
                   env={"PDD_TRACING__OTLP_ENDPOINT": collector.endpoint, "PDD_TRACING__EXPORT_INTERVAL_S": "0.1",
                        "PDD_ROUTER__ALLOW_FAULT_INJECTION": "true", **PATIENT}) as c:   # (spans of one path)
        yield c


def generate(c: UpCluster, seed: int, traceparent: str | None = None) -> http_util.Reply:
    body = {"model": c.model_name, "prompt": random_prompts([40], seed=seed)[0], "max_tokens": 4,
            "ignore_eos": True, "temperature": 0}
    r = http_util.post(c.url + "/v1/completions", body, headers={"traceparent": traceparent} if traceparent else {})
    assert r.status == 200, r.body
    return r


def response_traceparent(r: http_util.Reply) -> list[str]:
    value = next(v for k, v in r.headers.items() if k.lower() == "traceparent")
    return value.split("-")


def spans_of(collector: Collector, trace_id: str, wanted: dict[str, set[str]]) -> dict[tuple[str, str], list[dict]]:
    """The trace's spans by (service, name), once every wanted (service: names) has come."""
    def got():
        spans = [s for s in collector.spans() if s["traceId"] == trace_id]
        by = {}
        for s in spans:
            by.setdefault((s["resource"]["service.name"], s["name"]), []).append(s)
        have = {svc: {name for (sv, name) in by if sv == svc} for svc in wanted}
        return by if all(have[svc] >= names for svc, names in wanted.items()) else None
    return _wait_for(got, 60.0, f"the spans of trace {trace_id}: {wanted}")


def one(by: dict, service: str, name: str) -> dict:
    spans = by[(service, name)]
    assert len(spans) == 1, spans
    return spans[0]


def new_ids() -> tuple[str, str]:
    return os.urandom(16).hex(), os.urandom(8).hex()


def test_one_trace_from_the_client_through_the_router_and_both_workers(traced, collector):
    trace_id, client_span = new_ids()
    r = generate(traced, 1, f"00-{trace_id}-{client_span}-01")
    version, tid, root_id, flags = response_traceparent(r)
    assert (version, tid, flags) == ("00", trace_id, "01") and root_id != client_span
    by = spans_of(collector, trace_id, {"pdd-router": ROUTER_PHASES, "pdd-prefill": {"prefill", "kv_send"},
                                        "pdd-decode": {"kv_wait", "decode"}})
    assert all(s["traceId"] == trace_id for spans in by.values() for s in spans)
    root = one(by, "pdd-router", "request")
    assert (root["spanId"], root["parentSpanId"], root["kind"]) == (root_id, client_span, 2)
    rid = attrs(root)["pdd.request_id"]
    assert attrs(root)["pdd.prefill_worker"] == "prefill-0" and attrs(root)["pdd.decode_worker"] == "decode-0"
    phase = {name: one(by, "pdd-router", name) for name in ROUTER_PHASES - {"request"}}
    assert all(s["parentSpanId"] == root_id for s in phase.values())
    # Each worker's spans are children of the router's span of the phase its command came in.
    expected_parent = {("pdd-prefill", "prefill"): "reserving", ("pdd-prefill", "kv_send"): "prefilling",
                       ("pdd-decode", "kv_wait"): "reserving", ("pdd-decode", "decode"): "reserving"}
    for (service, name), parent in expected_parent.items():
        s = one(by, service, name)
        assert s["parentSpanId"] == phase[parent]["spanId"], (service, name)
        worker = service.removeprefix("pdd-") + "-0"
        assert s["resource"]["service.instance.id"] == worker and s["resource"]["service.version"] == __version__
        a = attrs(s)
        assert (a["pdd.worker_id"], a["pdd.role"], a["pdd.request_id"]) == (worker, service.removeprefix("pdd-"), rid)
        assert s["status"] == {"code": 0}
    send = attrs(one(by, "pdd-prefill", "kv_send"))
    assert int(send["pdd.bytes"]) > 0 and send["pdd.dst_worker"] == "decode-0"
    assert int(attrs(one(by, "pdd-prefill", "prefill"))["pdd.prompt_tokens"]) == 40
    assert attrs(one(by, "pdd-decode", "decode"))["pdd.finish_reason"] == "length"
    assert root["resource"]["service.name"] == "pdd-router" and root["resource"]["service.version"] == __version__


def test_a_failed_transfer_shows_its_fallback_and_the_local_prefill(traced, collector):
    traced.admin("faults", "set", "transfer.reject=1", "decode-0")
    try:
        _wait_for(lambda: traced.admin("faults")["workers"]["decode-0"].get("transfer.reject") == 1, 30.0,
                  "the fault on decode-0")
        trace_id, client_span = new_ids()
        generate(traced, 2, f"00-{trace_id}-{client_span}-01")
        by = spans_of(collector, trace_id, {"pdd-router": ROUTER_PHASES | {"fallback"},
                                            "pdd-prefill": {"prefill", "kv_send"},
                                            "pdd-decode": {"kv_wait", "prefill", "decode"}})
    finally:
        traced.admin("faults", "clear", "decode-0")
    root_id = one(by, "pdd-router", "request")["spanId"]
    fallback = one(by, "pdd-router", "fallback")
    assert fallback["parentSpanId"] == root_id and attrs(fallback)["pdd.fallback.reason"] == "transfer_failed"
    send = one(by, "pdd-prefill", "kv_send")
    assert send["status"]["code"] == 2 and "KV transfer failed" in send["status"]["message"]
    local = one(by, "pdd-decode", "prefill")
    assert attrs(local)["pdd.local_fallback"] is True
    assert local["parentSpanId"] == one(by, "pdd-router", "decoding")["spanId"]
    assert one(by, "pdd-decode", "decode")["parentSpanId"] == local["parentSpanId"]
    assert one(by, "pdd-decode", "kv_wait")["parentSpanId"] == one(by, "pdd-router", "reserving")["spanId"]


def test_a_collector_that_is_down_fails_no_request_and_the_drops_are_counted(tmp_path, tiny_model):
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1",
                  env={"PDD_TRACING__OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
                       "PDD_TRACING__EXPORT_INTERVAL_S": "0.1"}).start()
    try:
        for seed in (3, 4):
            r = generate(c, seed)      # no traceparent: a new trace, recorded (sample_ratio 1)
            assert response_traceparent(r)[3] == "01"
        _wait_for(lambda: metric(c, "pdd_trace_spans_dropped_total", '{reason="export_failed"}') >= 2, 60.0,
                  "the router's dropped spans counted")
        assert metric(c, "pdd_trace_spans_exported_total") == 0
    finally:
        assert c.stop() == 0, c.logs()
