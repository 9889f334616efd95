"""A mixture of experts served 1P+1D (KV over tcp between real processes) gives
Hugging Face transformers' greedy tokens, as colocated does
(tests/engine/test_hf_moe.py), and its streams continue unchanged when the
decode worker is killed (-9) mid-stream: attention, and so the KV pages, are
those of a dense model."""
from __future__ import annotations

import os
import signal

import pytest

from pdd import LLM, SamplingParams
from tests.e2e.cluster import UpCluster
from tests.e2e.streams import stream_all
from tests.e2e.test_chaos import fault_free, greedy
from tests.e2e.test_disagg import metric, run_all
from tests.engine.helpers import random_prompts
from tests.engine.test_hf_equivalence import hf_greedy

pytest.importorskip("transformers")

NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_disagg(request, tmp_path_factory, model_factory):
    model_dir = model_factory(request.param)
    with UpCluster(tmp_path_factory.mktemp(f"disagg-{request.param}"), model_dir, "--mode", "disagg",
                   "--prefill", "1", "--decode", "1") as c:
        yield model_dir, c


def test_disaggregated_moe_matches_hf(moe_disagg):
    model_dir, cluster = moe_disagg
    prompts = random_prompts([5, 33, 150], seed=11)    # 150 tokens: KV of ten blocks crosses
    hf = hf_greedy(model_dir, prompts, NEW_TOKENS)
    offline = LLM(str(model_dir)).generate(prompts, [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)] * 3)
    assert [o.token_ids for o in offline] == hf
    before = metric(cluster, "pdd_requests_total", '{finish_reason="length",mode="disagg"}') + metric(
        cluster, "pdd_requests_total", '{finish_reason="stop",mode="disagg"}')
    results = run_all(cluster, prompts, [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)] * 3)
    assert [text for text, _ in results] == [o.text for o in offline]
    assert [reason for _, reason in results] == [o.finish_reason for o in offline]
    after = metric(cluster, "pdd_requests_total", '{finish_reason="length",mode="disagg"}') + metric(
        cluster, "pdd_requests_total", '{finish_reason="stop",mode="disagg"}')
    assert after - before == 3      # all three went prefill worker -> decode worker


def test_decode_worker_killed_mid_stream(moe_disagg):
    """Last in the module: it kills the module cluster's decode worker (pdd up restarts it)."""
    model_dir, cluster = moe_disagg
    pid = cluster.workers()["decode-0"]["pid"]
    prompts = random_prompts([10 + 9 * i for i in range(8)], seed=43)
    sp = greedy(80)
    results = stream_all(cluster, prompts, [sp] * 8, while_running=lambda: os.kill(pid, signal.SIGKILL))
    assert results == fault_free(LLM(str(model_dir)), prompts, sp)
    assert metric(cluster, "pdd_request_migrations_total") >= 1
