"""An FP8 KV cache across disaggregation, with real processes: 1P+1D with FP8
KV gives colocated FP8 KV's output token for token, moving FP8 pages (half a
bf16 page's bytes); a decode worker with a bf16 cache is refused beside the
FP8 prefill worker, naming the KV dtype."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pdd import LLM
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.test_disagg import PATIENT, metric, mixed_workload, other_ways, run_all, scrape
from tests.router.test_metrics import samples

# bf16 weights so that a worker differing only in its cache has the cluster's model dtype.
ENGINE = {"PDD_ENGINE__DTYPE": "bfloat16", "PDD_ENGINE__KV_CACHE_DTYPE": "fp8_e4m3"}


def transfers(cluster) -> tuple[float, float, float]:
    """(KV blocks sent, their bytes, blocks skipped) from one read of /metrics:
    a transfer's PrefillDone adds to all three at once."""
    text = scrape(cluster)
    return (sum(samples(text, "pdd_kv_transfer_blocks_sent_total")),
            sum(samples(text, "pdd_kv_transfer_bytes_total", decode="decode-0", prefill="prefill-0")),
            sum(samples(text, "pdd_kv_transfer_blocks_skipped_total")))


@pytest.fixture(scope="module")
def fp8_disagg(tmp_path_factory, tiny_model):
    with UpCluster(tmp_path_factory.mktemp("fp8-disagg"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "1", env={**ENGINE, **PATIENT}) as c:
        yield c


def test_1p1d_with_fp8_kv_equals_colocated_fp8_kv(fp8_disagg, tiny_model):
    prompts, params = mixed_workload(30, seed=31)
    colocated = LLM(str(tiny_model), dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    expected = colocated.generate(prompts, params)
    before = transfers(fp8_disagg)
    others = other_ways(fp8_disagg)
    results = run_all(fp8_disagg, prompts, params)
    assert [text for text, _ in results] == [e.text for e in expected]
    assert [reason for _, reason in results] == [e.finish_reason for e in expected]
    assert metric(fp8_disagg, "pdd_disagg_fallbacks_total", '{reason="transfer_failed"}') == 0
    # FP8 pages crossed: one byte per element, K and V of every layer of each block.
    page_bytes = colocated.engine.runner.kv_spec.bytes_per_block
    assert page_bytes == 2 * 4 * 2 * 32 * 16

    # PrefillDone may come after an answer: wait for every prompt's blocks to be
    # counted, unless a request went another way (a busy box's suspect worker, say:
    # its prompt sent none), then for the cluster to be idle (all counted by then).
    blocks = sum(-(-len(p) // 16) for p in prompts)

    def counted() -> bool:
        now = transfers(fp8_disagg)
        return now[0] + now[2] - before[0] - before[2] >= blocks or other_ways(fp8_disagg) > others
    try:
        _wait_for(counted, 30.0, "transfers counted")
    except AssertionError:
        # A shortfall names where the requests went (a prompt that fell back sends no blocks).
        series = scrape(fp8_disagg).splitlines()
        raise AssertionError(f"{transfers(fp8_disagg)} against {before} (sent, bytes, skipped), {blocks} blocks; "
                             f"{[s for s in series if s.startswith(('pdd_disagg_fallbacks', 'pdd_placement'))]}")
    fp8_disagg.wait_idle()
    now = transfers(fp8_disagg)
    num_blocks, num_bytes = now[0] - before[0], now[1] - before[1]
    assert num_blocks > 0 and num_bytes == num_blocks * page_bytes


def test_a_bf16_kv_decode_worker_is_refused_beside_the_fp8_kv_prefill_worker(fp8_disagg):
    # The cluster's config, bf16 weights as its workers have, a cache in the model's dtype.
    proc = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "serve", "--role", "decode", "--config",
         str(fp8_disagg.run_dir / "cluster.toml"), "--worker-id", "decode-bf16",
         "--set", "engine.dtype=bfloat16", "--set", "engine.kv_cache_dtype=auto"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert "mismatch on kv_cache_dtype: 'float8_e4m3fn' vs 'bfloat16'" in proc.stderr
    assert "decode-bf16" not in fp8_disagg.workers()
