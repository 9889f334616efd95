"""The host KV tier on real clusters (colocated, and 1 prefill + 1 decode over
tcp), each worker with a pool far smaller than the prompts it serves: a prefix
evicted from the pool is served from the host tier, counted as cached, with the
text of a fresh prefill; a decode worker's tier keeps a finished conversation
for its next turn; the tiers' accounting is in /metrics and `pdd admin workers`."""
from __future__ import annotations

import pytest

from pdd import SamplingParams
from tests.e2e import http_util
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.test_disagg import PATIENT, metric
from tests.engine.helpers import random_prompts

BS = 16
POOL_BLOCKS = 24            # 368 tokens: two 300-token prompts evict everything else
LAYOUTS = {"colocated": ("--mode", "colocated", "--workers", "1"),
           "disagg": ("--mode", "disagg", "--prefill", "1", "--decode", "1")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def tiered(request, tmp_path_factory, tiny_model, offline):
    block_bytes = offline.engine.runner.kv_spec.bytes_per_block
    # float32 on a GPU too (its default is bf16): the texts are compared with the
    # CPU engine's, and a bf16 prefix hit need not give a fresh prefill's tokens.
    env = {"PDD_ENGINE__NUM_BLOCKS": str(POOL_BLOCKS), "PDD_ENGINE__HOST_KV_CACHE_BYTES": str(400 * block_bytes),
           "PDD_ENGINE__DTYPE": "float32", **PATIENT}   # (PATIENT: every worker counts its hits)
    with UpCluster(tmp_path_factory.mktemp(f"hostkv-{request.param}"), tiny_model, *LAYOUTS[request.param],
                   env=env) as c:
        c.layout = request.param
        yield c


def complete(cluster, prompt: list[int], max_tokens: int) -> dict:
    reply = http_util.post(cluster.url + "/v1/completions", {
        "model": cluster.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert reply.status == 200, reply.body
    return reply.json()


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def fresh(offline, prompt: list[int], max_tokens: int) -> str:
    """The text of a prefill from nothing (the offline engine's cache reset first)."""
    offline.engine.kv.reset_prefix_cache()
    return offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].text


def evict(cluster, seed: int) -> None:
    for p in random_prompts([300, 300], seed=seed):
        complete(cluster, p, 4)


def host_stats(cluster) -> dict[str, dict]:
    """worker id -> its host tier's stats, from `pdd admin workers`: from a
    heartbeat each worker sent once idle (sent after this call began)."""
    seen = {wid: w["heartbeats"] for wid, w in cluster.workers().items()}

    def idle_and_fresh() -> dict[str, dict] | None:
        workers = cluster.workers()
        done = all(w["heartbeats"] > seen[wid] and w["running"] == w["waiting"] == 0
                   and w["free_blocks"] == w["num_blocks"] for wid, w in workers.items())
        return workers if done and not cluster.admin("requests") else None

    workers = _wait_for(idle_and_fresh, what="a heartbeat from every idle worker")
    return {wid: w["host_kv"] for wid, w in workers.items()}


def hit_blocks_metric(cluster) -> float:
    """pdd_host_kv_cache_hit_blocks_total over every worker."""
    return sum(metric(cluster, "pdd_host_kv_cache_hit_blocks_total", f'{{worker="{wid}"}}')
               for wid in cluster.workers())


def decode_worker(cluster) -> str:
    return next(wid for wid, w in cluster.workers().items() if w["role"] in ("decode", "colocated"))


def test_an_evicted_prefix_is_served_from_the_host_tier_with_a_fresh_prefills_text(tiered, offline):
    prompt = random_prompts([200], seed=31)[0]
    first = complete(tiered, prompt, 12)
    assert cached_tokens(first) == 0
    evict(tiered, seed=32)
    hits_before = hit_blocks_metric(tiered)
    before = host_stats(tiered)
    again = complete(tiered, prompt, 12)
    assert cached_tokens(again) == (len(prompt) - 1) // BS * BS
    assert again["choices"][0]["text"] == first["choices"][0]["text"] == fresh(offline, prompt, 12)
    after = host_stats(tiered)
    # Every worker that held the prompt loaded it back: in 1P+1D the prefill
    # worker (to compute the last token) and the decode worker (its reservation).
    for wid in after:
        assert after[wid]["hit_blocks"] - before[wid]["hit_blocks"] == 12, (wid, before, after)
        assert after[wid]["bytes_in"] > 0 and after[wid]["used_blocks"] > 0
    assert hit_blocks_metric(tiered) - hits_before == 12 * len(after)
    for wid in after:   # each load counted, and what it made its request wait
        assert after[wid]["loads"] > before[wid]["loads"] and after[wid]["load_wait_s"] > before[wid]["load_wait_s"]
        assert metric(tiered, "pdd_host_kv_cache_loads_total", f'{{worker="{wid}"}}') >= 1
    rows = tiered.admin("workers")
    assert all(r["host_kv_blocks"] == f"{r['host_kv']['used_blocks']}/{r['host_kv']['capacity_blocks']}"
               for r in rows)


def test_a_follow_up_turn_loads_the_conversation_from_the_decode_workers_host_tier(tiered, offline):
    turn1 = random_prompts([150], seed=41)[0]
    reply1 = complete(tiered, turn1, 30)
    # The conversation so far, as the decode worker holds it: the prompt and what it decoded.
    offline.engine.kv.reset_prefix_cache()
    out = offline.generate([turn1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert out.text == reply1["choices"][0]["text"]
    history = turn1 + out.token_ids
    evict(tiered, seed=42)
    decode = decode_worker(tiered)
    before = host_stats(tiered)[decode]["hit_blocks"]
    turn2 = history + random_prompts([40], seed=43)[0]
    reply2 = complete(tiered, turn2, 10)
    # Every full block of the history but the last (its last token's KV is
    # written by the step that decoded the next one, and the final decoded
    # token has none): what the decode worker loaded instead of computing.
    held = (len(history) - 1) // BS * BS
    assert cached_tokens(reply2) >= held
    assert host_stats(tiered)[decode]["hit_blocks"] - before >= held // BS
    assert reply2["choices"][0]["text"] == fresh(offline, turn2, 10)
