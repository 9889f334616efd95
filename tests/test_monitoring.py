"""conf/prometheus/pdd-rules.yml and conf/grafana/pdd.json: valid, and they
query only series the router exposes (a real cluster's scrape:
tests/e2e/test_metrics.py)."""
from __future__ import annotations

from pdd.router.metrics import RouterMetrics
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


def test_two_clusters_series_stay_apart_in_every_rule_and_panel():
    """Every cluster names its workers prefill-0, decode-0, ...: the scrape job
    (one per cluster) must survive every aggregation of the rules, and every
    panel reads one job's series (the dashboard's `job` variable)."""
    import json
    import re

    rules = "\n".join(line for line in monitoring.RULES.read_text().splitlines()   # the queries alone
                      if "summary:" not in line and not line.lstrip().startswith("#"))
    groupings = re.findall(r"\b(?:sum|avg|max|min|count) by \(([^)]*)\)", rules)
    assert groupings
    for labels in groupings:
        assert {"job", "instance"} <= {x.strip() for x in labels.split(",")}, labels
    assert re.search(r"\b(?:sum|avg|max|min|count)\s*\(", rules) is None, "an aggregation without `by` drops job"
    dashboard = json.loads(monitoring.DASHBOARD.read_text())
    assert "job" in {v["name"] for v in dashboard["templating"]["list"]}
    for expr in monitoring.dashboard_queries():
        for mo in re.finditer(r"\bpdd_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert mo.group(1) and 'job="$job"' in mo.group(1), (mo.group(0), expr)


def exposed_families() -> dict[str, tuple[str, frozenset[str]]]:
    """Series name as a query writes it (a counter with `_total`) -> (type, label names)
    of every family the router's metrics have, those with no series yet included."""
    from prometheus_client.metrics import MetricWrapperBase
    from prometheus_client.parser import text_string_to_metric_families

    c = SimCluster()
    for wid, role in (("p0", "prefill"), ("d0", "decode")):
        c.add_worker(wid, role)
        c.control.handle(wid, m.Heartbeat(wid, 0, 0, 60, 64))
    metrics = RouterMetrics(c.registry)
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        labels = frozenset(k for s in family.samples for k in s.labels) - {"le", "quantile"}
        out[family.name + ("_total" if family.type == "counter" else "")] = (family.type, labels)
    for metric in vars(metrics).values():   # labelled families before their first series
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            name = metric._name + ("_total" if metric._type == "counter" else "")
            out[name] = (metric._type, frozenset(metric._labelnames))
    return out


def test_every_metric_the_docs_name_is_exposed_with_its_labels():
    exposed = exposed_families()
    wrong = []
    for name, labels, exact in monitoring.documented_metrics():
        if name in monitoring.TRACING_FAMILIES:
            continue
        if name.endswith("*"):
            if not any(n.startswith(name[:-1]) for n in exposed):
                wrong.append((name, "no such family"))
            continue
        if name not in exposed:
            wrong.append((name, "no such family"))
            continue
        kind, has = exposed[name]
        if name.endswith("_total") != (kind == "counter"):
            wrong.append((name, f"a {kind}"))
        if labels is not None and (labels != has if exact else not labels <= has):
            wrong.append((name, f"labels {sorted(has)}, documented {sorted(labels)}"))
    assert wrong == []
