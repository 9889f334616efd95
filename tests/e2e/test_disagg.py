"""Prefill/decode disaggregation with real processes: router, prefill and decode
workers, KV over the tcp data plane on loopback."""
from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys

import aiohttp
import pytest

from pdd import SamplingParams
from tests.e2e import http_util
from tests.e2e.cluster import UpCluster, _wait_for
from tests.engine.helpers import random_prompts
from tests.router.test_metrics import samples


def scrape(cluster) -> str:
    return http_util.get(cluster.url + "/metrics").body.decode()


def metric(cluster, name: str, labels: str = "") -> float:
    text = scrape(cluster)
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def transfer_blocks(cluster) -> tuple[float, float]:
    """(KV blocks sent, skipped) from one read of /metrics: a transfer's PrefillDone adds to both at once."""
    text = scrape(cluster)
    return (sum(samples(text, "pdd_kv_transfer_blocks_sent_total")),
            sum(samples(text, "pdd_kv_transfer_blocks_skipped_total")))


# Ways a request of a disaggregated cluster may be served other than by a
# transfer: placed on one worker (its prefill or decode worker suspect for a
# moment: a late heartbeat on a busy box), or moved after a placement (a worker
# taken for lost or hung, a failed transfer, a fallback). Correct answers, but
# not the path a test of the transfer's counts looks at.
OTHER_WAYS = ("pdd_disagg_fallbacks_total", "pdd_request_migrations_total", "pdd_kv_transfer_failures_total")


def other_ways(cluster) -> float:
    """How many times requests went one of those ways so far (one read of /metrics)."""
    text = scrape(cluster)
    placed_alone = sum(samples(text, "pdd_placement_total")) - sum(samples(text, "pdd_placement_total", kind="disagg"))
    return sum(sum(samples(text, name)) for name in OTHER_WAYS) + placed_alone


def counted(cluster, since: tuple[float, float], blocks: int, others: float | None = None):
    """transfer_blocks once those counted after `since` add up to `blocks`, sent
    or skipped (a PrefillDone may come after its answer: wait for the count);
    None once a request went another way (other_ways past `others`)."""
    def read():
        if others is not None and other_ways(cluster) > others:
            return "another way"
        now = transfer_blocks(cluster)
        return now if sum(now) - sum(since) >= blocks else None
    try:
        out = _wait_for(read, 30.0, f"a transfer of {blocks} blocks counted")
    except AssertionError as e:
        raise AssertionError(f"{e}; /metrics: {transfer_blocks(cluster)}, other ways "
                             f"{other_ways(cluster)}\n{cluster.logs()}") from None
    return None if out == "another way" else out


async def complete(session, cluster, prompt, sp: SamplingParams) -> tuple[list[int], str]:
    body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": sp.max_tokens,
            "temperature": sp.temperature, "ignore_eos": sp.ignore_eos, "logprobs": 0}
    if sp.seed is not None:
        body["seed"] = sp.seed
    if sp.top_p < 1:
        body["top_p"] = sp.top_p
    async with session.post(cluster.url + "/v1/completions", json=body) as resp:
        data = await resp.json()
        assert resp.status == 200, data
    choice = data["choices"][0]
    return choice["text"], choice["finish_reason"]


def run_all(cluster, prompts, params) -> list[tuple[str, str]]:
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return await asyncio.gather(*(complete(session, cluster, p, sp) for p, sp in zip(prompts, params)))
    return asyncio.run(main())


def mixed_workload(n: int, seed: int):
    rng = random.Random(seed)
    prompts = random_prompts([rng.choice([1, 5, 16, 17, 33, 70, 150]) for _ in range(n)], seed=seed)
    params = []
    for i in range(n):
        if i % 2:
            params.append(SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.8, top_p=0.95, seed=i,
                                         ignore_eos=True))
    return prompts, params


PATIENT = {"PDD_ROUTER__HEARTBEAT_MISSES": "20"}


@pytest.fixture(scope="module")
def disagg(tmp_path_factory, tiny_model):
    # A worker is suspect (no new requests) after 10 s without a heartbeat, not 1.5 s:
    # on a busy box a late heartbeat would otherwise place a request on one worker.
    with UpCluster(tmp_path_factory.mktemp("disagg"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "1", env=PATIENT) as c:
        yield c


def test_50_requests_match_colocated(disagg, offline):
    prompts, params = mixed_workload(50, seed=21)
    expected = offline.generate(prompts, params)
    before = metric(disagg, "pdd_kv_transfer_blocks_sent_total")
    others = other_ways(disagg)
    results = run_all(disagg, prompts, params)
    for (text, reason), exp in zip(results, expected):
        assert text == exp.text
        assert reason == exp.finish_reason
    # Each served by a transfer, but for those a busy box sent another way (counted: other_ways).
    disaggregated = 50 - (other_ways(disagg) - others)
    assert disaggregated > 0
    assert metric(disagg, "pdd_requests_total", '{finish_reason="length",mode="disagg"}') >= disaggregated
    # A PrefillDone may come after its answer: wait for the count, do not read it once.
    _wait_for(lambda: metric(disagg, "pdd_kv_transfer_blocks_sent_total") > before, 30.0, "transfers counted")
    assert metric(disagg, "pdd_disagg_fallbacks_total", '{reason="transfer_failed"}') == 0
    for phase in ("reserve", "prefill"):  # where a disaggregated TTFT goes, as the router saw it
        assert metric(disagg, "pdd_disagg_phase_seconds_count", f'{{phase="{phase}"}}') >= disaggregated
    workers = disagg.wait_idle()
    assert {w["role"] for w in workers.values()} == {"prefill", "decode"}
    # auto on one CPU host: tcp (nixl, where its extra is installed, is offered for other hosts)
    assert all(w["transfer_backends"][-1] == "tcp" for w in workers.values())
    assert {(p, d, t["backend"]) for p, w in workers.items() for d, t in w["transfer_to"].items()} == \
        {("prefill-0", "decode-0", "tcp")}
    assert all(w["free_blocks"] == w["num_blocks"] for w in workers.values()), workers


def test_second_turn_sends_only_new_blocks(disagg, offline):
    """A conversation's second turn on the decode worker that holds its first:
    only the blocks it lacks cross. On a busy box a turn may finish another way
    (its prefill worker taken for hung, say: counted in OTHER_WAYS); then a new
    conversation tries again."""
    for attempt in range(3):
        if second_turn(disagg, offline, f"Tell me about the sea and the boats on it ({attempt})."):
            break
    else:
        pytest.fail("three conversations in a row went another way than by their transfers")
    disagg.wait_idle()


def second_turn(disagg, offline, question: str) -> bool:
    """False: a turn went another way (nothing asserted of its counts)."""
    tok = offline.tokenizer
    turn1 = tok.encode_chat([{"role": "user", "content": question}])
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out1 = offline.generate([turn1], sp)[0]
    sent0, skipped0 = transfer_blocks(disagg)
    others = other_ways(disagg)
    assert run_all(disagg, [turn1], [sp])[0][0] == out1.text
    bs = 16
    blocks1 = -(-len(turn1) // bs)
    first = counted(disagg, (sent0, skipped0), blocks1, others)
    if first is None:
        return False
    sent1, skipped1 = first
    # Turn 1 may find earlier tests' blocks on the decode worker; what is not cached is sent.
    assert sent1 - sent0 + skipped1 - skipped0 == blocks1

    turn2 = turn1 + out1.token_ids + tok.encode("<|im_end|>\n<|im_start|>user\nAnd the fish?<|im_end|>\n"
                                                "<|im_start|>assistant\n", add_special_tokens=False)
    out2 = offline.generate([turn2], sp)[0]
    assert run_all(disagg, [turn2], [sp])[0][0] == out2.text
    # The decode worker holds turn 1's prompt and output (all but the last
    # token): every full block of that is skipped; only the rest crosses.
    cached = (len(turn1) + len(out1.token_ids) - 1) // bs
    blocks2 = -(-len(turn2) // bs)
    second = counted(disagg, (sent1, skipped1), blocks2, others)
    if second is None:
        return False
    sent2, skipped2 = second
    assert skipped2 - skipped1 == cached
    assert sent2 - sent1 == blocks2 - cached
    return True


def test_two_prefill_two_decode(tmp_path, tiny_model, offline):
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "disagg", "--prefill", "2", "--decode", "2").start()
    try:
        prompts, params = mixed_workload(50, seed=5)
        expected = offline.generate(prompts, params)
        results = run_all(c, prompts, params)
        assert [r[0] for r in results] == [e.text for e in expected]
        workers = c.wait_idle()
        assert sorted(workers) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
        assert all(w["free_blocks"] == w["num_blocks"] for w in workers.values()), workers
    finally:
        assert c.stop() == 0, c.logs()


@pytest.mark.parametrize("override, field", [("engine.block_size=32", "block_size"),
                                             ("engine.dtype=bfloat16", "dtype")])
def test_mismatched_decode_worker_is_refused(disagg, override, field):
    proc = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "serve", "--role", "decode", "--config",
         str(disagg.run_dir / "cluster.toml"), "--worker-id", "decode-odd", "--set", override],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert f"mismatch on {field}" in proc.stderr
    assert "decode-odd" not in disagg.workers()
