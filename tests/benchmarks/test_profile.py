"""`benchmarks.router_tokens --py-spy`: the top of the routers' profiles from py-spy's
raw folded stacks (several processes of one point pooled), and the series the
front door and chaos read from /metrics."""
from __future__ import annotations

import pytest

from benchmarks.profile import top_functions
from pdd.bench.scrape import series


def test_top_functions_pool_the_processes_and_count_a_frame_once_per_stack(tmp_path):
    a, b = tmp_path / "routers-1-streams-8-100.txt", tmp_path / "routers-1-streams-8-101.txt"
    a.write_text("main (pdd/cli.py:10);_stream (pdd/http/app.py:20);write (aiohttp/web.py:30) 6\n"
                 "main (pdd/cli.py:10);_stream (pdd/http/app.py:20) 2\n")
    # a recursive frame is on the stack once, however deep
    b.write_text("main (pdd/cli.py:10);step (pdd/router/loop.py:5);step (pdd/router/loop.py:5) 2\n")
    top = top_functions([a, b], n=3)
    assert top[0] == ("main (cli.py)", 1.0, 0.0)
    assert top[1] == ("_stream (app.py)", 0.8, pytest.approx(0.2))
    assert dict((f, (inc, leaf)) for f, inc, leaf in top_functions([a, b]))["step (loop.py)"] == (0.2, 0.2)
    empty = tmp_path / "empty.txt"   # py-spy stopped before its first sample
    empty.write_text("")
    assert top_functions([empty]) == []


def test_series_sum_a_name_and_labels_and_leave_the_others_out():
    lines = ['# HELP pdd_requests_rejected_total refused', 'pdd_requests_rejected_total{reason="queue"} 3.0',
             'pdd_requests_rejected_total{reason="queue"} 2.0', 'pdd_http_errors_total 1', 'pdd_other_total 9']
    assert series(lines, ("pdd_requests_rejected_total", "pdd_http_errors_total")) == {
        'pdd_requests_rejected_total{reason="queue"}': 5.0, "pdd_http_errors_total": 1.0}
