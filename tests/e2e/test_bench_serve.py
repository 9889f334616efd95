"""`pdd bench serve` and `python -m benchmarks.sweep` against real `pdd up` clusters of
the tiny random-weight model (CPU, loopback): few prompts, small lengths."""
from __future__ import annotations

import json

import pytest

from benchmarks import sweep
from benchmarks.cli import run
from pdd.bench.workloads import WorkloadConfig, build_workload
from pdd.cli import main
from tests.e2e.cluster import UpCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    with UpCluster(tmp_path_factory.mktemp("up"), tiny_model, "--mode", "colocated", "--workers", "1",
                   "--ready-timeout", "150") as c:   # `pdd up` gives up (and cleans up) before the fixture does
        yield c


def serve(url: str, out, *args: str) -> dict:
    assert main(["bench", "serve", "--url", url, "--result-dir", str(out), "--result-filename", "r.json",
                 "--disable-tqdm", *args]) == 0
    return json.loads((out / "r.json").read_text())


def test_mixed_workload_as_token_ids(cluster, tmp_path):
    res = serve(cluster.url, tmp_path, "--dataset", "mixed", "--input-len", "16:64", "--long-input-len", "256:512",
                "--long-fraction", "0.25", "--output-len", "8", "--num-prompts", "8", "--request-rate", "20",
                "--seed", "1", "--goodput", "ttft:600000", "tpot:600000")
    assert (res["completed"], res["failed"], res["not_sent"]) == (8, 0, 0), res["metrics"]["errors"]
    assert res["config"]["target"]["model"] == cluster.model_name
    items = build_workload(WorkloadConfig("mixed", 8, input_len=(16, 64), long_input_len=(256, 512),
                                          long_fraction=0.25, output_len=(8, 8), seed=1))
    by_item = {r["item"]: r for r in res["requests"]}
    # pdd honours include_usage and ignore_eos: exactly 8 tokens each, and the prompt counted as sent.
    assert all(r["usage_reported"] and r["output_tokens"] == 8 and len(r["itl_ms"]) <= 7 for r in res["requests"])
    assert [by_item[i]["prompt_len"] for i in range(8)] == [it.turns[0].input_len for it in items]
    m = res["metrics"]
    assert m["total_output_tokens"] == 64 and m["slo_attainment"] == 1.0
    assert m["ttft_ms"]["count"] == 8 and m["tpot_ms"]["count"] == 8
    assert (tmp_path / "r.png").is_file()


def test_multi_turn_chat(cluster, tmp_path):
    res = serve(cluster.url, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset", "multi-turn",
                "--turns", "2", "--num-prompts", "2", "--input-len", "4:8", "--output-len", "4",
                "--max-concurrency", "2", "--no-plots")
    assert (res["completed"], res["failed"]) == (4, 0), res["metrics"]["errors"]
    turns = {(r["item"], r["turn"]): r for r in res["requests"]}
    for item in (0, 1):   # the second turn resent the first turn and its answer
        assert turns[item, 1]["prompt_len"] > turns[item, 0]["prompt_len"] + 4   # at least the new 4+ words


def test_sweep_of_one_layout(tiny_model, tmp_path):
    assert run(sweep, ["--model", str(tiny_model), "--layouts", "colocated:1", "--rates", "5,10",
                 "--num-prompts", "4", "--input-len", "8:16", "--output-len", "4", "--goodput", "ttft:600000",
                 "--num-warmups", "1", "--ready-timeout", "150", "--result-dir", str(tmp_path),
                 "--disable-tqdm"]) == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert [(p["layout"], p["rate"], p["completed"], p["failed"]) for p in report["points"]] == [
        ("colocated:1", 5.0, 4, 0), ("colocated:1", 10.0, 4, 0)]
    assert report["highest_rate_met"] == {"colocated:1": 10.0}
    # each request's first gap is told from its later ones (4 requests of 4 tokens: 3 gaps each)
    assert all(p["gaps"]["requests"] == 4 and p["gaps"]["first_median_ms"] is not None for p in report["points"])
    # and what placement estimated of the worker at each rate's end
    assert all(set(p["estimates"]) == {"colocated-0"} for p in report["points"])
    assert (tmp_path / "sweep.png").is_file() and "| colocated:1 | 10 | 4 | 0 |" in (tmp_path / "sweep.md").read_text()
    seeds = [json.loads((tmp_path / "colocated-1" / f"rate-{r}.json").read_text())["config"]["workload"]["seed"]
             for r in (5, 10)]
    assert seeds == [0, 1]   # fresh prompts at each rate: nothing answered from the previous rate's cache
