"""1P+1D over the nixl data plane (`pdd up --mode disagg`, worker.transfer_backend
= nixl, one host): the text colocated produces, the pair's backend and why in
`pdd admin workers`; a decode worker killed mid-transfer (its restart is a new
NIXL agent) leaves the streams with their fault-free text and no block held."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from pdd import LLM
from pdd.admin.tables import workers as workers_table
from pdd.transfer.nixl_agent import unavailable as nixl_unavailable
from tests.e2e.cluster import UpCluster
from tests.e2e.streams import stream_all
from tests.e2e.test_chaos import fault_free, greedy
from tests.e2e.test_disagg import metric, mixed_workload, run_all
from tests.e2e.test_disagg_faults import _wait_for, assert_all_free
from tests.engine.helpers import random_prompts

pytestmark = pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))

ON_GPU = torch.cuda.is_available()
# On a GPU host `pdd up` puts both workers on the one GPU. Each then needs a
# fixed KV budget: by a share of gpu_memory_utilization the first pool takes
# 90% of the GPU and the second worker finds no room (each counts the other's
# memory as used). float32, so that batches composed differently (disagg, the
# in-process reference) give the same tokens; a cold start compiles kernels in
# both workers at once.
NIXL = {"PDD_WORKER__TRANSFER_BACKEND": "nixl",
        **({"PDD_ENGINE__DTYPE": "float32", "PDD_ENGINE__KV_CACHE_BYTES": str(1 << 30)} if ON_GPU else {})}
START_TIMEOUT_S = 600.0 if ON_GPU else 180.0


@pytest.fixture(scope="module")
def reference(request, tiny_model) -> LLM:
    """What the cluster must reproduce: the in-process engine. On a GPU one of
    the cluster's dtype and KV budget (the shared `offline` would take 90% of
    the GPU before the workers start)."""
    if not ON_GPU:
        return request.getfixturevalue("offline")
    return LLM(str(tiny_model), dtype="float32", kv_cache_bytes=1 << 30)


@contextlib.contextmanager
def logs_kept(c: UpCluster, name: str):
    """On a failure (the cluster not starting included), the logs of `pdd up`'s
    processes: copied whole under $PDD_TEST_LOGS/<name>/ when that is set (a
    device run points it into $OUT, which comes back), else their tails printed
    (pytest shows them with the failure)."""
    try:
        yield
    except BaseException:
        keep = os.environ.get("PDD_TEST_LOGS")
        if not keep:
            print(f"=== {name}: the logs of {c.run_dir}\n{c.logs()}")
            raise
        dest = Path(keep) / name
        dest.mkdir(parents=True, exist_ok=True)
        for log in c.run_dir.glob("*.log"):
            shutil.copy(log, dest / log.name)
        print(f"=== {name}: the logs of {c.run_dir} are in {dest}")
        raise


def test_1p1d_over_nixl_matches_colocated(tmp_path, tiny_model, reference):
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "disagg", "--prefill", "1", "--decode", "1",
                  env=NIXL, start_timeout_s=START_TIMEOUT_S)
    with logs_kept(c, "test_1p1d_over_nixl_matches_colocated"):
        c.start()
        try:
            prompts, params = mixed_workload(16, seed=24)
            expected = reference.generate(prompts, params)
            results = run_all(c, prompts, params)
            assert [r[0] for r in results] == [e.text for e in expected]
            assert metric(c, "pdd_requests_total", '{finish_reason="length",mode="disagg"}') == 16
            assert metric(c, "pdd_disagg_fallbacks_total", '{reason="transfer_failed"}') == 0
            # PrefillDone may come after the answer, and the workers' stats with their heartbeats.
            _wait_for(lambda: metric(c, "pdd_kv_transfer_blocks_sent_total") > 0, 30.0, "transfers counted")
            _wait_for(lambda: c.workers()["decode-0"]["transfer"]["nixl_writers"] >= 16, 30.0, "nixl writes reported")
            workers = c.wait_idle(timeout_s=5.0)
            # Through the decode worker's landing region (worker.nixl_landing_bytes by default: with
            # transfer_backend nixl, on loopback too), each range given back.
            assert workers["decode-0"]["transfer"]["nixl_landing_bytes"] > 0
            assert workers["decode-0"]["transfer"]["nixl_landed"] >= 1
            assert workers["decode-0"]["transfer"]["nixl_landing_ranges"] == 0
            # On a GPU the landing copy's kernel was compiled at start, with the others.
            assert {wid: w["kernels_compiled_in_service"] for wid, w in workers.items()} == \
                {"prefill-0": 0, "decode-0": 0}
            assert workers["prefill-0"]["transfer_to"] == {
                "decode-0": {"backend": "nixl", "reason": "both take nixl, and nothing else both take; "
                                                          "nixl is for two hosts"}}
            assert "prefill-0  decode-0  nixl" in workers_table(list(workers.values()))
            assert workers["decode-0"]["transfer"]["held_leases"] == 0
            assert_all_free(c)
        finally:
            assert c.stop() == 0, c.logs()


def test_a_decode_worker_killed_mid_transfer_over_nixl(tmp_path, tiny_model, reference):
    """Streams in flight, their prompts crawling through the prefill worker (so
    transfers are under way); the decode worker is killed: the prefill worker's
    writes to it fail, every stream ends with its fault-free text, and the
    restarted decode worker (a new NIXL agent) takes KV over nixl again."""
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "disagg", "--prefill", "1", "--decode", "1",
                  env={**NIXL, "PDD_FAULTS": "prefill.step_delay_s=0.1", "PDD_ENGINE__MAX_NUM_BATCHED_TOKENS": "64"},
                  start_timeout_s=START_TIMEOUT_S)
    with logs_kept(c, "test_a_decode_worker_killed_mid_transfer_over_nixl"):
        c.start()
        try:
            pid = c.workers()["decode-0"]["pid"]
            prompts = random_prompts([40 + 3 * i for i in range(12)], seed=43)
            sp = greedy(40)
            results = stream_all(c, prompts, [sp] * len(prompts), while_running=lambda: os.kill(pid, signal.SIGKILL),
                                 once_started=1)
            assert results == fault_free(reference, prompts, sp)
            _wait_for(lambda: c.workers().get("decode-0", {}).get("pid") not in (None, pid), 120.0, "decode-0 back")
            assert_all_free(c)
            # The new decode worker's pool is reached through its new agent. The writes
            # that failed with the old one may have opened the pair's breaker (same
            # ids): closed by hand, so that these go disaggregated.
            c.admin("breaker", "close", "all")
            sent = metric(c, "pdd_kv_transfer_blocks_sent_total")
            more = random_prompts([50, 70], seed=44)
            assert [r[0] for r in run_all(c, more, [sp] * 2)] == [e.text for e in reference.generate(more, [sp] * 2)]
            # PrefillDone may come after the answer (the decode worker starts on the data plane).
            _wait_for(lambda: metric(c, "pdd_kv_transfer_blocks_sent_total") > sent, 30.0, "the new transfers counted")
            # The decode worker's data-plane stats come with its heartbeats.
            _wait_for(lambda: c.workers()["decode-0"]["transfer"]["nixl_writers"] >= 2, 30.0, "nixl writes reported")
            workers = c.wait_idle(timeout_s=5.0)
            assert workers["decode-0"]["transfer"]["held_leases"] == 0
            assert workers["decode-0"]["transfer"]["nixl_landing_ranges"] == 0
            assert_all_free(c)
        finally:
            assert c.stop() == 0, c.logs()
