"""A real `pdd up --mode disagg` router's /metrics after a disaggregated
request: the families by name and label, `promtool check metrics` clean, and
every series the dashboard and the alert rules query is there."""
from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import monitoring
from tests.e2e import http_util
from tests.e2e.cluster import UpCluster
from tests.e2e.test_disagg import PATIENT


@pytest.fixture(scope="module")
def disagg(tmp_path_factory, tiny_model):
    with UpCluster(tmp_path_factory.mktemp("metrics"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "1", env=PATIENT) as c:   # its requests are placed as the test expects
        yield c


def scrape(c: UpCluster) -> str:
    return http_util.get(c.url + "/metrics").body.decode()


def samples(text: str, name: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def wait_for_scrape(c: UpCluster, ready, what: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(c)
        if ready(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{text}")
        time.sleep(0.2)


def test_a_disaggregated_request_shows_in_the_families_by_pool_worker_and_pair(disagg):
    body = {"model": disagg.model_name, "prompt": "the metrics of one request " * 6, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    got = http_util.post(disagg.url + "/v1/completions", body)
    assert got.status == 200, got.body
    # Workers' totals arrive with their next heartbeats.
    text = wait_for_scrape(disagg, lambda t: {s.labels["worker"] for s in samples(
        t, "pdd_prefix_cache_query_tokens_total") if s.value > 0} == {"prefill-0", "decode-0"},
        "heartbeats with both workers' prefix-cache lookups")
    token_labels = {"pool": "disagg", "worker": "decode-0"}
    for name in ("pdd_time_to_first_token_seconds_count", "pdd_inter_token_latency_seconds_count",
                 "pdd_time_per_output_token_seconds_count"):
        assert [s.labels for s in samples(text, name)] == [token_labels], name
    pair = {"prefill": "prefill-0", "decode": "decode-0"}
    assert [(s.labels, s.value) for s in samples(text, "pdd_prefill_to_decode_kv_transfer_seconds_count")] \
        == [(pair, 1.0)]
    assert [s.labels for s in samples(text, "pdd_kv_transfer_bytes_total") if s.value > 0] == [pair]
    assert {s.labels["worker"] for s in samples(text, "pdd_scheduler_preemptions_total")} == {"prefill-0", "decode-0"}
    assert {s.labels["worker"] for s in samples(text, "pdd_kv_cache_page_free_pages")} == {"prefill-0", "decode-0"}
    assert samples(text, "pdd_placement_total")[0].labels["kind"] == "disagg"
    assert set(samples(text, "pdd_build_info")[0].labels) == {"version", "python"}
    assert samples(text, "pdd_process_resident_memory_bytes")[0].value > 0
    names = {f.name for f in text_string_to_metric_families(text)}
    assert all(n.startswith("pdd_") for n in names), sorted(n for n in names if not n.startswith("pdd_"))
    assert "_created" not in text

    checked = monitoring.check("metrics", stdin=text)
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), \
        checked.stdout + checked.stderr

    queried = set().union(*map(monitoring.queried_series, monitoring.dashboard_queries()),
                          monitoring.queried_series(monitoring.RULES.read_text()))
    assert queried - monitoring.exposed_series(text) == set()
