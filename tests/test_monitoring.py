"""conf/prometheus/pdd-rules.yml and conf/grafana/pdd.json: valid, and they
query only series the router exposes (a real cluster's scrape:
tests/e2e/test_metrics.py)."""
from __future__ import annotations

from pdd.metrics import RouterMetrics
from pdd.protocol import messages as m
from tests import monitoring
from tests.router.sim import SimCluster


def simulated_scrape() -> str:
    """/metrics of the router's metrics over a simulated cluster whose workers
    sent a heartbeat (the families read from the registry need one)."""
    c = SimCluster()
    for wid, role in (("p0", "prefill"), ("d0", "decode")):
        c.add_worker(wid, role)
        c.control.handle(wid, m.Heartbeat(wid, 0, 0, 60, 64))
    return RouterMetrics(c.registry).render().decode()


def test_the_alert_rules_pass_promtool():
    got = monitoring.check("rules", str(monitoring.RULES))
    assert got.returncode == 0, got.stdout + got.stderr
    assert "SUCCESS: 9 rules found" in got.stdout


def test_the_dashboard_and_the_rules_query_only_series_the_router_exposes():
    queries = monitoring.dashboard_queries()
    assert len(queries) >= 10
    wanted = set().union(*map(monitoring.queried_series, queries), monitoring.queried_series(
        monitoring.RULES.read_text()))
    assert {"pdd_time_to_first_token_seconds_bucket", "pdd_inter_token_latency_seconds_bucket",
            "pdd_scheduler_iteration_latency_seconds_bucket", "pdd_kv_cache_page_free_pages",
            "pdd_kv_transfer_bytes_total", "pdd_breaker_state", "pdd_placement_total"} <= wanted
    assert wanted - monitoring.exposed_series(simulated_scrape()) == set()
