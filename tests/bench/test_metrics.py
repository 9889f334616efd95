"""The metric definitions on synthetic timelines, with hand-computed figures."""
from __future__ import annotations

import pytest

from pdd.bench.metrics_calc import compute, latency_stats, tpot_s
from pdd.bench.serve_client import RequestRecord


def rec(ttft, itl, e2el, out, prompt_len, item=0) -> RequestRecord:
    return RequestRecord(item, 0, prompt_len, out, success=True, ttft_s=ttft, itl_s=list(itl), e2el_s=e2el,
                         output_tokens=out)


def failed(error: str) -> RequestRecord:
    return RequestRecord(9, 0, 40, 8, error=error)


# A: 3 tokens; B: 2 tokens; C: 1 token (no TPOT); two failures with the same error.
RECORDS = [rec(0.1, [0.02, 0.03], 0.15, 3, 10), rec(0.2, [0.05], 0.3, 2, 20), rec(0.3, [], 0.3, 1, 30),
           failed("HTTP 500: boom"), failed("HTTP 500: boom")]


def test_tpot_per_request_excludes_single_token_requests():
    a, b, c = RECORDS[:3]
    assert tpot_s(a) == pytest.approx((0.15 - 0.1) / 2)
    assert tpot_s(b) == pytest.approx(0.1)
    assert tpot_s(c) is None
    assert tpot_s(RECORDS[3]) is None


def test_counts_throughputs_and_latencies():
    m = compute(RECORDS, duration_s=2.0)
    assert (m.completed, m.failed) == (3, 2)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 6)      # failed requests count nothing
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(33.0)
    # TTFT 100, 200, 300 ms; linear interpolation between ranks: p90 at rank 1.8, p99 at 1.98.
    assert (m.ttft_ms.mean, m.ttft_ms.median) == pytest.approx((200.0, 200.0))
    assert (m.ttft_ms.p90, m.ttft_ms.p99) == pytest.approx((280.0, 298.0))
    # TPOT 25 and 100 ms (C has none).
    assert m.tpot_ms.count == 2
    assert (m.tpot_ms.mean, m.tpot_ms.median, m.tpot_ms.p90) == pytest.approx((62.5, 62.5, 92.5))
    # ITL pooled over requests: 20, 30, 50 ms.
    assert m.itl_ms.count == 3
    assert (m.itl_ms.mean, m.itl_ms.median, m.itl_ms.p90) == pytest.approx((100 / 3, 30.0, 46.0))
    assert (m.e2el_ms.mean, m.e2el_ms.median) == pytest.approx((250.0, 300.0))
    assert m.errors == [{"error": "HTTP 500: boom", "count": 2}]
    assert m.goodput is None and m.slo_attainment is None


def test_goodput_counts_requests_meeting_every_slo():
    m = compute(RECORDS, 2.0, {"ttft": 250, "tpot": 50})
    # A meets both; B misses TPOT (100 ms); C misses TTFT (300 ms); failures never count.
    assert m.goodput == pytest.approx(0.5)
    assert m.slo_attainment == pytest.approx(1 / 5)
    # C has no TPOT, so a TPOT-only SLO cannot fail it.
    m = compute(RECORDS, 2.0, {"tpot": 50})
    assert m.goodput == pytest.approx(1.0)
    assert m.slo_attainment == pytest.approx(2 / 5)
    m = compute(RECORDS, 2.0, {"e2el": 150})
    assert m.goodput == pytest.approx(0.5)


def test_unknown_slo_metric_is_refused():
    with pytest.raises(ValueError, match="itl"):
        compute(RECORDS, 2.0, {"itl": 10})


def test_requested_percentiles_and_empty_samples():
    s = latency_stats([0.1, 0.2, 0.3], [50, 75])
    assert s.percentiles == pytest.approx({"p50": 200.0, "p75": 250.0})
    empty = latency_stats([], [75])
    assert (empty.count, empty.mean, empty.p99, empty.percentiles) == (0, None, None, {"p75": None})
    m = compute([failed("x")], 1.0, {"ttft": 1})
    assert (m.completed, m.goodput, m.slo_attainment, m.ttft_ms.mean) == (0, 0.0, 0.0, None)
