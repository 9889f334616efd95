"""The streaming client and the arrival/concurrency runner against a fake
OpenAI-compatible server (tests/bench/fake_server.py): events and values only."""
from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest

from pdd.bench.metrics_calc import compute
from pdd.bench.runner import LoadConfig, arrival_offsets, run_load
from pdd.bench.serve_client import RequestRecord, Target, build_body, send
from pdd.bench.workloads import Item, Turn, WorkloadConfig, build_workload
from tests.bench.fake_server import MODEL, FakeServer


@pytest.fixture
def server():
    with FakeServer() as s:
        yield s


def one(server, model=MODEL, endpoint="/v1/completions", content=(11, 12, 13), max_tokens=5) -> RequestRecord:
    target = Target(server.url, endpoint, model)
    item = Item((Turn(list(content) if endpoint == "/v1/completions" else "hello there", 3, max_tokens),))
    body, n = build_body(target, item, 0, [], ignore_eos=True)

    async def main():
        async with aiohttp.ClientSession() as session:
            return await send(session, target, body, RequestRecord(0, 0, n, max_tokens), 0.0)
    return asyncio.run(main())


def test_a_stream_is_timed_chunk_by_chunk(server):
    r = one(server)
    assert r.success and r.error == ""
    assert r.output_tokens == 5 and r.usage_reported and r.prompt_len == 3
    assert len(r.itl_s) == 4                       # the finish-only chunk and the comment carry no token
    assert 0 <= r.ttft_s <= r.e2el_s
    assert r.ttft_s + sum(r.itl_s) <= r.e2el_s
    assert r.text == "w0 w1 w2 w3 w4 "
    (body,) = server.bodies
    assert body["prompt"] == [11, 12, 13] and body["stream"] and body["ignore_eos"]
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 5


def test_chat_skips_the_role_chunk(server):
    r = one(server, endpoint="/v1/chat/completions", max_tokens=4)
    assert r.success and r.output_tokens == 4 and len(r.itl_s) == 3
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "hello there"}]


def test_without_usage_output_tokens_are_content_chunks(server):
    r = one(server, model="no-usage", max_tokens=6)
    assert r.success and not r.usage_reported and r.output_tokens == 6


def test_non_200_is_a_failure_with_its_text(server):
    r = one(server, model="http-500")
    assert not r.success and r.error.startswith("HTTP 500") and "boom" in r.error
    m = compute([r], 1.0)
    assert (m.completed, m.failed) == (0, 1) and m.errors[0]["count"] == 1


def test_error_event_mid_stream_is_a_failure(server):
    r = one(server, model="error-mid")
    assert not r.success and r.error == "error event: worker lost"
    assert r.ttft_s is not None and r.e2el_s is None   # two tokens came, then the error


def test_stream_cut_before_done_is_a_failure(server):
    r = one(server, model="cut")
    assert not r.success and "[DONE]" in r.error


def test_unreachable_server_is_a_failure():
    with FakeServer() as s:
        url = s.url
    r = one(type("Gone", (), {"url": url, "bodies": []}))
    assert not r.success and "ClientConnectorError" in r.error


def test_arrivals_are_seeded_and_shaped():
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    a = arrival_offsets(20000, 10.0, 1.0, seed=7)
    assert a == arrival_offsets(20000, 10.0, 1.0, seed=7) and a != arrival_offsets(20000, 10.0, 1.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean ** 2
    assert mean == pytest.approx(0.1, rel=0.03) and cv2 == pytest.approx(1.0, rel=0.05)   # Poisson
    steady = arrival_offsets(20000, 10.0, 4.0, seed=7)
    gaps = [y - x for x, y in zip(steady, steady[1:])]
    mean = sum(gaps) / len(gaps)
    cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean ** 2
    assert mean == pytest.approx(0.1, rel=0.03) and cv2 == pytest.approx(0.25, rel=0.05)   # gamma, shape 4
    # The same seed gives the same arrivals at any rate, only scaled.
    assert arrival_offsets(50, 20.0, 1.0, 3) == pytest.approx([x / 2 for x in arrival_offsets(50, 10.0, 1.0, 3)])


def test_max_concurrency_bounds_requests_in_flight():
    items = build_workload(WorkloadConfig("random", 9, input_len=(4, 8), output_len=(3, 3)))
    with FakeServer(gate_at=3) as s:   # the first three are held until all three are in
        out = asyncio.run(run_load(Target(s.url, model=MODEL), items, LoadConfig(max_concurrency=3)))
        assert s.max_in_flight == 3
    assert len(out.records) == 9 and all(r.success for r in out.records) and out.not_sent == 0


def test_duration_stops_sending_on_schedule(server):
    items = build_workload(WorkloadConfig("random", 40, input_len=(2, 4), output_len=(2, 2)))
    load = LoadConfig(request_rate=400.0, duration_s=0.05, seed=2)
    due = sum(t < 0.05 for t in arrival_offsets(40, 400.0, 1.0, 2))
    assert 0 < due < 40
    done = []
    out = asyncio.run(run_load(Target(server.url, model=MODEL), items, load, on_done=done.append))
    assert len(out.records) == len(server.bodies) == len(done) == due
    assert out.not_sent == 40 - due


def conversation(server, turns=3):
    items = build_workload(WorkloadConfig("multi-turn", 1, input_len=(3, 3), output_len=(2, 2), turns=turns,
                                          prompt_format="text"))
    return asyncio.run(run_load(Target(server.url, model=MODEL), items, LoadConfig()))


def test_later_turns_resend_the_earlier_answers(server):
    out = conversation(server)
    assert [(r.turn, r.success) for r in out.records] == [(0, True), (1, True), (2, True)]
    assert [b["prompt"].count("w0 w1 ") for b in server.bodies] == [0, 1, 2]
    assert out.records[2].prompt_len == 7   # the fake server's usage figure replaced the nominal 3 * 3 + 2 * 2


def test_a_conversation_stops_at_a_failed_turn():
    with FakeServer(fail_request=2) as s:
        out = conversation(s)
        assert len(s.bodies) == 2
    assert [(r.turn, r.success) for r in out.records] == [(0, True), (1, False)]
    assert out.not_sent == 1


def test_bench_serve_cli_against_the_fake_server(server, tmp_path):
    from pdd.cli import main
    code = main(["bench", "serve", "--url", server.url, "--dataset", "shared-prefix", "--prefix-len", "16",
                 "--input-len", "2:6", "--output-len", "4", "--num-prompts", "6", "--request-rate", "inf",
                 "--max-concurrency", "2", "--goodput", "ttft:60000", "tpot:60000", "--metric-percentiles", "50,95",
                 "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm", "--num-warmups", "1"])
    assert code == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert (res["completed"], res["failed"], res["not_sent"], res["num_requests"]) == (6, 0, 0, 6)
    assert res["config"]["target"]["model"] == MODEL          # found at /v1/models
    assert res["config"]["load"]["request_rate"] == "inf"
    m = res["metrics"]
    assert m["total_output_tokens"] == 24 and m["goodput"] > 0 and m["slo_attainment"] == 1.0
    assert set(m["ttft_ms"]["percentiles"]) == {"p50", "p95"}
    assert len(res["requests"]) == 6 and all(len(r["itl_ms"]) == 3 for r in res["requests"])
    assert len(server.bodies) == 7                             # one warm-up, six measured
    assert (tmp_path / "r.png").stat().st_size > 0
