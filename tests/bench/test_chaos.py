"""`pdd bench chaos`: the figures from request records, and its arguments checked."""
from __future__ import annotations

import argparse

import pytest

from pdd.bench.chaos import SCENARIOS, _result, back_after, main
from pdd.bench.serve_client import RequestRecord


def rec(start, ok=True, ttft=0.5, itl=(), error=""):
    return RequestRecord(0, 0, 10, 4, start_s=start, success=ok, error=error, ttft_s=ttft if ok else None,
                         itl_s=list(itl))


def test_back_after_counts_from_the_fault_to_the_first_success_after_the_last_failure():
    records = [rec(1.0), rec(5.5, ok=False, error="HTTP 503"), rec(6.0), rec(7.0, ok=False, error="x"),
               rec(8.0, ttft=1.0), rec(9.0, ttft=0.2)]
    assert back_after(records, fault_at=5.0) == 4.0           # request at 8.0: first token at 9.0
    assert back_after([rec(6.0, ttft=0.25)], fault_at=5.0) == 1.25  # no failure: its first token
    assert back_after([rec(6.0, ok=False, error="x")], fault_at=5.0) is None


def test_figures_during_the_fault_only():
    records = [rec(1.0, ttft=0.1, itl=[0.1, 0.1]),            # chunks at 1.1, 1.2, 1.3: before
               rec(4.8, ttft=0.1, itl=[0.2, 3.0]),            # chunks at 4.9, 5.1, 8.1: the 0.2 gap is during
               rec(6.0, ttft=2.0), rec(7.0, ok=False, error="HTTP 429: busy")]
    r = _result("x", "disagg:1p1d", records, 5.0, 8.0, {"decode-0": 0}, [], {})
    assert (r.sent, r.completed, r.failed) == (4, 3, 1)
    assert r.ttft_p99_ms == pytest.approx(2000.0) and r.itl_p99_ms == pytest.approx(200.0)
    assert r.errors == {"HTTP 429: busy": 1} and r.back_after_s is None   # none sent after 7.0 succeeded
    assert _result("x", "l", records[:3], 5.0, 8.0, {}, [], {}).back_after_s == pytest.approx(3.0)


def test_every_scenario_of_the_issue_is_there_and_bad_arguments_are_refused():
    assert set(SCENARIOS) == {"kill-decode", "kill-prefill", "hang-decode", "transfer-fail-cleared",
                              "transfer-fail-0.3", "abort-storm", "overload"}
    args = argparse.Namespace(scenarios="kill-decoder", fault_at=0.3, clear_at=0.6, request_rate=4.0)
    with pytest.raises(ValueError, match="unknown \\['kill-decoder'\\]"):
        main(args)
    args.scenarios, args.clear_at = "overload", 0.2
    with pytest.raises(ValueError, match="--fault-at < --clear-at"):
        main(args)
