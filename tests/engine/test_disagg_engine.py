"""Disaggregation at engine level: a prefill engine and a decode engine in one
process, KV moved by the connector over the `local` backend. Every way the
prefill can be sliced (chunks, its own prefix hits, the decode worker's prefix
hits) must give the colocated output, and only the missing blocks may move."""
from __future__ import annotations

import itertools

import pytest

from pdd import LLM, SamplingParams
from pdd.config import EngineConfig
from pdd.engine.engine import LLMEngine
from pdd.kv.layout import KVLayout
from pdd.transfer.base import TransferTarget
from pdd.transfer.connector import PrefillConnector
from pdd.transfer.leases import LeaseTable
from pdd.transfer.local import LocalReceiver, LocalSender
from tests.engine.helpers import random_prompts

BS = 16


class Pair:
    """Prefill engine -> decode engine, as the workers and router drive them."""

    def __init__(self, model_dir, **engine_kw):
        # Small pools: a test makes many pairs, and the CPU default (512 MiB each) held ~8 GiB.
        cfg = EngineConfig(model=str(model_dir), block_size=BS, **{"kv_cache_bytes": 64 << 20, **engine_kw})
        self.p, self.d = LLMEngine(cfg), LLMEngine(cfg)
        layout = KVLayout("tiny", "w", "float32", BS, self.p.model_config.num_layers,
                          self.p.model_config.num_kv_heads, self.p.model_config.head_dim)
        self.leases = LeaseTable()
        self.receiver = LocalReceiver(self.d.runner.kv_cache, layout, self.leases)
        self.receiver.start()
        self.sender = LocalSender(layout)
        self.connector = PrefillConnector(self.sender, self.p.runner.kv_cache, BS)
        self.p.attach_connector(self.connector)
        self.ids = itertools.count()

    def generate(self, prompts, sp: SamplingParams):
        """All prompts reserved and prefilled together, then decoded together."""
        reqs = {}
        for prompt in prompts:
            rid = f"r{next(self.ids)}"
            blocks, cached = self.d.reserve(rid, prompt, SamplingParams(**vars(sp)))
            skip = cached // BS
            lease = self.leases.grant(rid, blocks[skip:], 30.0)
            self.p.add_request(rid, prompt, SamplingParams(**vars(sp)), prefill_only=True)
            self.connector.add(TransferTarget(rid, lease, "d", self.receiver.address, tuple(blocks), skip))
            reqs[rid] = {"lease": lease, "tokens": [], "skip": skip, "blocks": len(blocks)}
        while self.p.has_unfinished():
            for out in self.p.step():
                reqs[out.request_id]["tokens"] = list(out.new_token_ids)
                self.connector.finish(out.request_id)
        results = {r.request_id: r for r in self.sender.poll()}
        assert set(results) == set(reqs) and all(r.ok for r in results.values()), results
        for rid, info in reqs.items():
            info["result"] = results[rid]
            self.leases.close(info["lease"])
            done = self.d.kv_ready(rid, info["tokens"][0])
            assert done is None or done.finished
        while self.d.has_unfinished():
            for out in self.d.step():
                reqs[out.request_id]["tokens"].extend(out.new_token_ids)
        return list(reqs.values())

    def assert_idle(self):
        for e in (self.p, self.d):
            assert not e.has_unfinished() and not e.scheduler.waiting_for_kv
            assert e.kv.num_free_blocks == e.kv.pool.num_usable_blocks
        assert len(self.leases) == 0


@pytest.fixture(scope="module")
def colocated(tiny_model):
    return LLM(str(tiny_model))


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=3, ignore_eos=True)


@pytest.mark.parametrize("chunk_size", [16, 7, 4096])
@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_disaggregated_equals_colocated(tiny_model, colocated, chunk_size, sp):
    pair = Pair(tiny_model, chunk_size=chunk_size, max_num_batched_tokens=64,
                chunk_only_beside_decodes=False)   # pages of every chunk shape, prefill-only requests too
    prompts = random_prompts([1, 15, 16, 17, 40, 130], seed=6)
    expected = colocated.generate(prompts, sp)
    got = pair.generate(prompts, sp)
    assert [g["tokens"] for g in got] == [e.token_ids for e in expected]
    for g in got:  # nothing cached on either side yet: every block crosses once
        assert g["result"].blocks_sent == g["blocks"] and g["result"].blocks_skipped == 0
    pair.assert_idle()


def test_only_blocks_the_decode_engine_lacks_are_sent(tiny_model, colocated):
    pair = Pair(tiny_model)
    base = random_prompts([100], seed=12)[0]
    first = pair.generate([base], GREEDY)[0]
    # Same 70-token start: the decode engine caches 4 blocks (and so does the
    # prefill engine, which skips computing them but must not send them).
    branch = base[:70] + random_prompts([30], seed=13)[0]
    second = pair.generate([branch], GREEDY)[0]
    assert second["skip"] == 4 and second["result"].blocks_skipped == 4
    assert second["result"].blocks_sent == second["blocks"] - 4
    assert first["tokens"] == colocated.generate([base], GREEDY)[0].token_ids
    assert second["tokens"] == colocated.generate([branch], GREEDY)[0].token_ids
    pair.assert_idle()


def test_prefill_cache_hits_the_decode_engine_lacks_are_still_sent(tiny_model, colocated):
    pair = Pair(tiny_model)
    prompt = random_prompts([90], seed=14)[0]
    pair.generate([prompt], GREEDY)
    pair.d.kv.pool.reset_prefix_cache()      # the decode side forgets; the prefill side still caches
    again = pair.generate([prompt], GREEDY)[0]
    assert again["skip"] == 0 and again["result"].blocks_sent == again["blocks"]
    assert again["tokens"] == colocated.generate([prompt], GREEDY)[0].token_ids
    pair.assert_idle()


def test_first_token_can_end_the_request(tiny_model, colocated):
    pair = Pair(tiny_model)
    prompt = random_prompts([20], seed=15)[0]
    got = pair.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert got["tokens"] == colocated.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids
    pair.assert_idle()


def test_reservation_fallback_to_local_prefill(tiny_model, colocated):
    pair = Pair(tiny_model)
    prompt = random_prompts([50], seed=16)[0]
    blocks, cached = pair.d.reserve("x", prompt, SamplingParams(**vars(GREEDY)))
    lease = pair.leases.grant("x", blocks, 30.0)
    pair.leases.close(lease)
    pair.d.prefill_locally("x")
    tokens = []
    while pair.d.has_unfinished():
        for out in pair.d.step():
            tokens.extend(out.new_token_ids)
    assert tokens == colocated.generate([prompt], GREEDY)[0].token_ids
    pair.assert_idle()


@pytest.mark.parametrize("max_tokens", [1, 12])
def test_local_prefill_continues_after_a_streamed_first_token(tiny_model, colocated, max_tokens):
    """The client already has the first token (FirstToken came ahead of the
    pages) when the transfer fails: the decode worker keeps that token and
    continues after it, as if the KV had arrived."""
    pair = Pair(tiny_model)
    prompt = random_prompts([45], seed=18)[0]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=7, ignore_eos=True)
    want = colocated.generate([prompt], sp)[0].token_ids
    blocks, _ = pair.d.reserve("z", prompt, sp)
    out = pair.d.prefill_locally("z", first_token=want[0])
    tokens = [want[0]]
    if max_tokens == 1:
        assert out is not None and out.finished and out.finish_reason == "length"
    else:
        assert out is None
    while pair.d.has_unfinished():
        for o in pair.d.step():
            tokens.extend(o.new_token_ids)
    assert tokens == want
    pair.assert_idle()


def test_local_prefill_after_its_prefix_was_cached_meanwhile(tiny_model, colocated):
    """Reserved with no prefix hit; another request then caches the same prefix;
    the KV never comes and the prompt is computed here. It must compute in its
    own blocks, not take the other's cached ones after them (found by a fault
    run: a lost prefill worker, shared-prefix prompts, wrong answers)."""
    pair = Pair(tiny_model)
    prefix = random_prompts([10 * BS], seed=19)[0]
    mine, other = prefix + [11, 12, 13], prefix + [21, 22, 23]
    blocks, cached = pair.d.reserve("r", mine, SamplingParams(**vars(GREEDY)))
    assert cached == 0
    pair.d.add_request("o", other, SamplingParams(**vars(GREEDY)))
    while len(pair.d.kv.pool.cached) < 10:
        pair.d.step()
    pair.d.prefill_locally("r")
    tokens = []
    for out in pair.d.step():   # the prompt, in one step
        tokens.extend(out.new_token_ids if out.request_id == "r" else ())
    assert pair.d.kv.block_ids(pair.d.scheduler.requests["r"]) == blocks
    assert not set(blocks) & set(pair.d.kv.block_ids(pair.d.scheduler.requests["o"]))
    while pair.d.has_unfinished():
        for out in pair.d.step():
            tokens.extend(out.new_token_ids if out.request_id == "r" else ())
    assert tokens == colocated.generate([mine], GREEDY)[0].token_ids
    pair.assert_idle()


def test_abort_of_a_reservation_frees_its_blocks(tiny_model):
    pair = Pair(tiny_model)
    pair.d.reserve("y", random_prompts([70], seed=17)[0], SamplingParams(**vars(GREEDY)))
    assert pair.d.kv.num_free_blocks < pair.d.kv.pool.num_usable_blocks
    assert pair.d.abort_request("y")
    pair.assert_idle()


def test_local_prefill_of_a_reservation_gives_every_prompt_logprob(tiny_model, colocated):
    """A request asking for its prompt's logprobs, reserved where its prefix is
    cached, then prefilled here after all: it computes every prompt position
    (cached blocks have no logits), as it would admitted here."""
    pair = Pair(tiny_model)
    prompt = random_prompts([3 * BS + 5], seed=20)[0]
    pair.d.add_request("warm", prompt[:2 * BS + 1], SamplingParams(**vars(GREEDY)))
    while pair.d.has_unfinished():
        pair.d.step()
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    _, cached = pair.d.reserve("r", prompt, SamplingParams(**vars(sp)))
    pair.d.prefill_locally("r")
    got = []
    while pair.d.has_unfinished():
        got += [out.prompt_logprobs for out in pair.d.step() if out.prompt_logprobs is not None]
    want = colocated.generate([prompt], sp)[0].prompt_logprobs
    assert len(got) == 1 and len(got[0]) == len(prompt) - 1
    assert [(rank, top[0][0]) for _, rank, top in got[0]] == [(rank, top[0][0]) for _, rank, top in want]
    assert [lp for lp, _, _ in got[0]] == pytest.approx([lp for lp, _, _ in want], abs=1e-4)
    assert cached == 0
    pair.assert_idle()


def test_a_local_prefill_waiting_with_its_blocks_gives_them_to_the_request_ahead(tiny_model, colocated):
    """A reservation prefilled here after all waits holding its blocks, behind
    a request that needs some of them (one sequence at a time: it cannot run
    first). The waiting one gives its blocks up and is computed afterwards;
    holding them, it left the other preempting itself forever."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model), block_size=4, num_blocks=9, max_num_seqs=1))
    first, reserved = random_prompts([16, 12], seed=5)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("a", first, SamplingParams(**vars(sp)))
    tokens = {"a": [], "r": []}
    while len(tokens["a"]) < 2:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.reserve("r", reserved, SamplingParams(**vars(sp)))
    assert engine.kv.num_free_blocks == 0
    engine.prefill_locally("r")
    for _ in range(200):   # a few dozen steps finish both
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens == {"a": colocated.generate([first], sp)[0].token_ids,
                      "r": colocated.generate([reserved], sp)[0].token_ids}
    assert engine.kv.num_free_blocks == engine.kv.pool.num_usable_blocks
