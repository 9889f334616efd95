"""The router's metric families: names, labels, counters from workers' totals
(simulated cluster: tests/router/sim.py; the scrape of a real cluster is
tests/e2e/test_metrics.py)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdd.protocol import messages as m
from tests.router.sim import SimCluster
from tests.router.test_control import run_to_end


def families(c: SimCluster) -> dict:
    return {f.name: f for f in text_string_to_metric_families(c.control.metrics.render().decode())}


def samples(text: str, sample_name: str, **labels: str) -> list[float]:
    """The values of a scrape's series named `sample_name` with (at least) these labels."""
    return [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]


def value(c: SimCluster, sample_name: str, **labels: str) -> float:
    return sum(samples(c.control.metrics.render().decode(), sample_name, **labels))


def heartbeat(wid: str, hits: int, queries: int) -> m.Heartbeat:
    return m.Heartbeat(wid, 0, 0, 60, 64, prefix_hit_tokens=hits, prefix_query_tokens=queries)


def test_every_family_is_pdd_prefixed_with_build_and_process_metrics_and_no_created_series():
    c = SimCluster()
    c.add_worker("c0", "colocated")
    c.submit(max_tokens=3)
    run_to_end(c)
    text = c.control.metrics.render().decode()
    names = set(families(c))
    assert names and all(name.startswith("pdd_") for name in names), sorted(n for n in names if
                                                                            not n.startswith("pdd_"))
    assert "_created" not in text
    build = families(c)["pdd_build_info"].samples[0]
    assert build.name == "pdd_build_info" and set(build.labels) == {"version", "python"}
    assert {"pdd_process_cpu_seconds", "pdd_process_resident_memory_bytes"} <= names


def test_latencies_are_labelled_by_pool_and_the_decode_worker_that_streamed():
    c = SimCluster()
    c.add_worker("p0", "prefill")
    c.add_worker("d0", "decode")
    c.add_worker("c0", "colocated")
    c.registry.workers["c0"].draining = True
    s = c.submit(max_tokens=4)
    assert s.mode == "disagg"
    run_to_end(c)
    c.registry.workers["c0"].draining = False
    for wid in ("p0", "d0"):
        c.registry.workers[wid].draining = True
    s = c.submit(max_tokens=4)
    assert s.mode == "colocated"
    run_to_end(c)
    for pool, worker in (("disagg", "d0"), ("colocated", "c0")):
        assert value(c, "pdd_time_to_first_token_seconds_count", pool=pool, worker=worker) == 1
        assert value(c, "pdd_inter_token_latency_seconds_count", pool=pool, worker=worker) >= 3
        assert value(c, "pdd_time_per_output_token_seconds_count", pool=pool, worker=worker) == 1
    assert value(c, "pdd_prefill_to_decode_kv_transfer_seconds_count", prefill="p0", decode="d0") == 1
    assert "pdd_kv_transfer_bytes_total" in {s.name for s in families(c)["pdd_kv_transfer_bytes"].samples}


def test_prefix_cache_counters_take_the_deltas_of_a_workers_totals_and_a_restart_resets_them():
    c = SimCluster()
    c.add_worker("d0", "decode")
    for hits, queries in ((100, 400), (150, 500), (150, 500)):
        c.control.handle("d0", heartbeat("d0", hits, queries))
    assert value(c, "pdd_prefix_cache_hit_tokens_total", worker="d0") == 150
    assert value(c, "pdd_prefix_cache_query_tokens_total", worker="d0") == 500
    c.restart("d0")     # a new process: its totals start again from 0
    c.control.handle("d0", heartbeat("d0", 10, 40))
    assert value(c, "pdd_prefix_cache_hit_tokens_total", worker="d0") == 160
    assert value(c, "pdd_prefix_cache_query_tokens_total", worker="d0") == 540


def test_series_of_rare_events_are_there_from_the_start_at_zero():
    c = SimCluster()
    for name, labels in (("pdd_http_connections_refused_total", {}),
                         ("pdd_http_clients_cut_total", {"reason": "send_timeout"}),
                         ("pdd_http_clients_cut_total", {"reason": "buffer_limit"}),
                         ("pdd_breaker_state", {"prefill": "*", "decode": "*"}),
                         ("pdd_breaker_transitions_total", {"prefill": "*", "decode": "*", "to": "open",
                                                            "cause": "admin"})):
        assert len(samples(c.control.metrics.render().decode(), name, **labels)) == 1, (name, labels)
    assert value(c, "pdd_breaker_state") == 0 and value(c, "pdd_breaker_transitions_total") == 0


def test_a_stream_ended_at_the_buffer_limit_counts_as_a_client_cut():
    c = SimCluster(max_buffered_tokens=2)
    c.add_worker("c0", "colocated")
    before = value(c, "pdd_http_clients_cut_total", reason="buffer_limit")
    s = c.submit(max_tokens=8)     # nobody takes its events: the client does not read
    run_to_end(c)
    assert "did not read its stream" in str(s.events[-1])
    assert value(c, "pdd_http_clients_cut_total", reason="buffer_limit") == before + 1
