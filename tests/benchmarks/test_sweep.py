"""Sweep logic without clusters: layouts to `pdd up` arguments, the rate climb, the report."""
from __future__ import annotations

import pytest

from pdd.bench import layouts
from pdd.bench.layouts import parse_layouts
from benchmarks.sweep import SweepPoint, climb, highest_passing, markdown, parse_rates, slug


def test_layouts_become_pdd_up_arguments():
    colo, dis = parse_layouts("colocated:2, disagg:1p3d")
    assert colo.up_args == ("--mode", "colocated", "--workers", "2") and colo.env == {}
    assert dis.up_args == ("--mode", "disagg", "--prefill", "1", "--decode", "3")
    assert slug(dis) == "disagg-1p3d"
    (lay,) = parse_layouts("colocated:1", ["colocated:1=--config conf/colocated.toml"],
                           ["colocated:1=PDD_ENGINE__MAX_NUM_SEQS=8"])
    assert lay.up_args[-2:] == ("--config", "conf/colocated.toml")
    assert lay.env == {"PDD_ENGINE__MAX_NUM_SEQS": "8"}


@pytest.mark.parametrize("text", ["colocated:0", "colocated:1p1d", "disagg:2", "disagg:0p1d", "mystery:2",
                                  "colocated:2,colocated:2", "", "threshold:2"])
def test_bad_layouts_are_refused(text):
    with pytest.raises(ValueError):
        parse_layouts(text)


def test_adaptive_layouts_turn_adaptive_placement_on(monkeypatch):
    adaptive_n, adaptive_pd = parse_layouts("adaptive:2,adaptive:1p1d")
    assert adaptive_n.up_args == ("--mode", "colocated", "--workers", "2", "--adaptive")
    assert adaptive_pd.up_args == ("--mode", "disagg", "--prefill", "1", "--decode", "1", "--adaptive")
    monkeypatch.setattr(layouts, "ADAPTIVE_ENV", {"PDD_ROUTER__ADAPTIVE__TTFT_SLO_S": "1"})
    (lay,) = parse_layouts("auto:2")
    assert lay.up_args == ("--mode", "colocated", "--workers", "2", "--adaptive")
    assert lay.env == {"PDD_ROUTER__ADAPTIVE__TTFT_SLO_S": "1"}
    with pytest.raises(ValueError, match="not among"):
        parse_layouts("auto:2", ["auto:3=--x"])


def test_threshold_layouts_select_the_policy_through_the_environment():
    (lay,) = parse_layouts("threshold:1p1d",
                           extra_env=["threshold:1p1d=PDD_ROUTER__THRESHOLD__MAX_LOCAL_PREFILL_TOKENS=256"])
    assert lay.up_args == ("--mode", "disagg", "--prefill", "1", "--decode", "1")
    assert lay.env == {"PDD_ROUTER__MODE": "threshold", "PDD_ROUTER__THRESHOLD__MAX_LOCAL_PREFILL_TOKENS": "256"}


def point(rate: float, attainment: float | None, layout: str = "colocated:1") -> SweepPoint:
    return SweepPoint(layout, rate, 10, 0, 0, 100.0 * rate, 5.0, 4.0, rate, attainment)


def test_climb_adds_steps_until_the_slos_are_missed():
    ran = []

    def run_at(rate):
        ran.append(rate)
        return point(rate, 1.0 if rate <= 10 else 0.98)   # 98%: more than 1% missed

    pts = climb([2, 4, 8], run_at, until_fail=True, step=2)
    assert ran == [2, 4, 8, 10, 12]
    assert highest_passing(pts) == 10
    ran.clear()
    climb([2, 4, 8], run_at)
    assert ran == [2, 4, 8]
    ran.clear()
    climb([2], lambda r: ran.append(r) or point(r, 1.0), until_fail=True, step=3, max_rate=9)
    assert ran == [2, 5, 8]


def test_exactly_99_percent_passes():
    assert point(1, 0.99).passes() and not point(1, 0.9899).passes() and not point(1, None).passes()


def test_report_table():
    pts = [point(4, 1.0), point(8, 0.5), point(4, 1.0, "disagg:1p1d"), point(8, 1.0, "disagg:1p1d")]
    md = markdown(pts, {"ttft": 500.0})
    assert md.count("\n| colocated:1 |") == 2 and "| disagg:1p1d | 8 | 10 | 0 | 800.0 |" in md
    assert "- colocated:1: highest rate met: 4 req/s" in md and "- disagg:1p1d: highest rate met: 8 req/s" in md
    assert parse_rates("8, 4,12") == [4.0, 8.0, 12.0]
    with pytest.raises(ValueError):
        parse_rates("4,x")


def test_sweep_plot_is_written(tmp_path):
    from dataclasses import asdict

    from benchmarks.sweep import sweep_lines
    pts = [asdict(point(4, 1.0)), asdict(point(8, None)), asdict(point(4, 1.0, "disagg:1p1d"))]
    pts[1]["goodput"] = None   # no SLOs given: that panel has a gap, not an error
    path = sweep_lines(pts, tmp_path / "s.png", "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_placement_counts_read_the_routers_metrics():
    import http.server
    import threading

    from benchmarks.sweep import placement_counts

    text = ('# HELP pdd_placement_total Placement decisions\n# TYPE pdd_placement_total counter\n'
            'pdd_placement_total{kind="disagg",reason="cost"} 12.0\n'
            'pdd_placement_total{kind="local_prefill",reason="overloaded"} 3.0\n'
            'pdd_placement_created{kind="disagg",reason="cost"} 1.7e+09\n').encode()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert placement_counts(url) == {"disagg/cost": 12, "local_prefill/overloaded": 3}
    finally:
        server.shutdown()
        server.server_close()
    assert placement_counts(url) == {}      # nobody answers: no counts, no error
