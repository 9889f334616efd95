"""The host KV tier behind the pool (pdd.kv.tier): evicted prefixes come back
loaded, not computed, with the same tokens; LRU; copies in flight; faults."""
from __future__ import annotations

import pytest
import torch

from pdd import LLM
from pdd.config import ConfigError, EngineConfig
from pdd.kv.cache import KVCacheSpec
from pdd.kv.copies import BlockCopier, CopyDone
from pdd.kv.tier import HostTier
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts

BS = 16
# 24 blocks: 23 usable, 368 tokens; a 200-token prompt + output takes 14. float32
# on a GPU too (its default is bf16, where a prefix hit need not give a fresh
# prefill's tokens): the loaded pages' tokens are compared with a fresh prefill's.
POOL = dict(num_blocks=24, chunk_size=64, max_num_batched_tokens=256, dtype="float32")


def _tier(llm) -> HostTier:
    return llm.engine.kv.tier


def _evict_with_others(llm, seed: int) -> None:
    """Prompts enough to take every block of the pool for themselves."""
    for p in random_prompts([300, 300], seed=seed):
        llm.generate([p], greedy(8))


@pytest.fixture(scope="module")
def tiered(tiny_model):
    spec_bytes = LLM(str(tiny_model), num_blocks=4, dtype="float32").engine.runner.kv_spec.bytes_per_block
    return LLM(str(tiny_model), host_kv_cache_bytes=200 * spec_bytes, **POOL)


@pytest.fixture(scope="module")
def plain(tiny_model):
    return LLM(str(tiny_model), **POOL)


def test_an_evicted_prefix_is_loaded_from_the_host_and_gives_the_tokens_of_a_fresh_prefill(tiered, plain):
    prompt = random_prompts([200], seed=1)[0]
    first = tiered.generate([prompt], greedy(20))[0]
    assert first.num_cached_tokens == 0
    _evict_with_others(tiered, seed=2)
    pool = tiered.engine.kv.pool
    hashes = tiered.engine.kv.update_hashes(type("R", (), {"block_hashes": [], "num_tokens": len(prompt),
                                                           "all_token_ids": prompt})())
    assert all(pool.get_cached_block(h) is None for h in hashes), "the pool still caches the prefix"
    before = _tier(tiered).stats.hit_blocks
    loads_before, waited_before = _tier(tiered).stats.loads, _tier(tiered).stats.load_wait_s
    again = tiered.generate([prompt], greedy(20))[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // BS * BS    # 192: every full block but the last token's
    assert _tier(tiered).stats.hit_blocks - before == 12
    assert _tier(tiered).stats.loads - loads_before == 1             # one load, its wait counted
    assert _tier(tiered).stats.load_wait_s > waited_before
    fresh = plain.generate([prompt], greedy(20))[0]
    assert again.token_ids == first.token_ids == fresh.token_ids
    assert_all_blocks_free(tiered)


def test_in_the_devices_own_dtype_a_host_hit_gives_a_pool_hits_tokens(tiny_model):
    """bf16 on a GPU (float32 on the CPU), where a prefix hit need not give a
    fresh prefill's tokens: the prefix loaded back from the host gives what the
    same prefix found in the pool gave, through the same computation, so every
    byte of KV must have come back as it was stored."""
    kw = {k: v for k, v in POOL.items() if k != "dtype"}
    spec_bytes = LLM(str(tiny_model), num_blocks=4).engine.runner.kv_spec.bytes_per_block
    llm = LLM(str(tiny_model), host_kv_cache_bytes=200 * spec_bytes, **kw)
    prompt = random_prompts([200], seed=5)[0]
    llm.generate([prompt], greedy(20))
    pool_hit = llm.generate([prompt], greedy(20))[0]
    assert pool_hit.num_cached_tokens == 192 and _tier(llm).stats.hit_blocks == 0
    _evict_with_others(llm, seed=6)
    host_hit = llm.generate([prompt], greedy(20))[0]
    assert host_hit.num_cached_tokens == 192 and _tier(llm).stats.hit_blocks == 12
    assert host_hit.token_ids == pool_hit.token_ids
    assert_all_blocks_free(llm)


def test_outputs_are_identical_with_the_tier_on_and_off_over_a_mixed_batch(tiered, plain):
    if tiered.engine.device.type == "cuda":
        # Measured on nvidia-h200 (in bf16): the batches the two engines form differ
        # (the tier's loads hold requests back), and GPU kernels are not batch
        # invariant, so random-weight greedy outputs part after a few tokens.
        pytest.skip("needs batch-invariant arithmetic: the CPU run checks it")
    prompts = random_prompts([40, 120, 250, 17, 90, 200], seed=7)
    shared = prompts[2][:160]
    prompts += [shared + p for p in random_prompts([30, 60], seed=8)]
    for rounds in range(2):
        on = tiered.generate(prompts, greedy(12))
        off = plain.generate(prompts, greedy(12))
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert _tier(tiered).stats.hit_blocks > 0
    assert_all_blocks_free(tiered)


def test_fp8_pages_come_back_under_their_scales(tiny_model):
    kw = dict(POOL, kv_cache_dtype="fp8_e4m3")
    spec_bytes = LLM(str(tiny_model), num_blocks=4, kv_cache_dtype="fp8_e4m3").engine.runner.kv_spec.bytes_per_block
    on = LLM(str(tiny_model), host_kv_cache_bytes=100 * spec_bytes, **kw)
    off = LLM(str(tiny_model), **kw)
    prompt = random_prompts([200], seed=11)[0]
    first = on.generate([prompt], greedy(16))[0]
    _evict_with_others(on, seed=12)
    again = on.generate([prompt], greedy(16))[0]
    assert again.num_cached_tokens == 192
    assert again.token_ids == first.token_ids == off.generate([prompt], greedy(16))[0].token_ids
    assert _tier(on).scales_identity == "unit"


# ------------------------------------------------------------ the tier alone


def _small_tier(blocks: int, capacity: int) -> tuple[HostTier, torch.Tensor]:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32)
    kv = torch.zeros((2, 2, blocks, 2, 1, 4))
    for b in range(blocks):
        kv[:, :, b] = float(b)
    return HostTier(spec, capacity * spec.bytes_per_block, BlockCopier(kv)), kv


def _settle(tier: HostTier, copy) -> None:
    assert copy.done.done()
    tier.finish(copy)


def test_a_full_tier_evicts_its_least_recently_used_block():
    tier, kv = _small_tier(blocks=8, capacity=3)
    _settle(tier, tier.store([1, 2, 3], [101, 102, 103]))
    assert tier.lookup([101, 102, 103]) == 3
    tier.load([101], [7]).done.wait()   # 101 used: 102 is now the least recent
    _settle(tier, tier.store([4], [104]))
    assert tier.lookup([102]) == 0 and tier.lookup([101]) == 1 and tier.lookup([103, 104]) == 2
    assert tier.stats.evicted_blocks == 1 and tier.stats.used_blocks == 3


def test_a_block_being_stored_is_not_found_and_a_slot_being_loaded_is_not_evicted():
    tier, kv = _small_tier(blocks=8, capacity=2)
    store = tier.store([1, 2], [101, 102])
    assert tier.lookup([101]) == 0, "found before its copy is done"
    assert tier.store([3], [101]) is None, "the same hash stored twice"
    tier.finish(store)
    load = tier.load([101, 102], [5, 6])   # both slots pinned by the load
    assert tier.store([3], [103]) is None, "evicted a slot a load reads"
    assert tier.lookup([101, 102]) == 2
    tier.finish(load)
    _settle(tier, tier.store([3], [103]))
    assert torch.equal(kv[:, :, 5], torch.full_like(kv[:, :, 5], 1.0))
    assert torch.equal(kv[:, :, 6], torch.full_like(kv[:, :, 6], 2.0))


def test_close_frees_the_tier():
    tier, _ = _small_tier(blocks=4, capacity=2)
    _settle(tier, tier.store([1], [101]))
    tier.close()
    assert tier.storage is None and tier.lookup([101]) == 0


class _HeldCopy(CopyDone):
    """A fault forced on purpose: a copy that stays in flight until the test
    lets it end (a real one on the CPU is done when it returns)."""

    def __init__(self):
        self.released = False

    def done(self) -> bool:
        return self.released


def _only_on_the_host(tiered, plain, n: int, seed: int) -> tuple[list[int], list[int]]:
    """A prompt of n tokens served once, then evicted from the pool (the host
    tier holds it), and the tokens of its fresh prefill."""
    prompt = random_prompts([n], seed=seed)[0]
    want = plain.generate([prompt], greedy(10))[0].token_ids
    tiered.generate([prompt], greedy(10))
    _evict_with_others(tiered, seed=seed + 1)
    return prompt, want


def _hold_loads(tiered, monkeypatch) -> _HeldCopy:
    """Loads from now on stay in flight until the returned copy is released
    (monkeypatch.undo() ends that for the loads after)."""
    held, copier = _HeldCopy(), _tier(tiered).copier
    real = copier.to_pool
    monkeypatch.setattr(copier, "to_pool", lambda *a: (real(*a), held)[1])
    return held


def test_abort_during_a_load_keeps_its_blocks_until_the_copy_ends(tiered, plain, monkeypatch):
    prompt, want = _only_on_the_host(tiered, plain, 200, seed=21)
    engine, held = tiered.engine, _hold_loads(tiered, monkeypatch)
    engine.add_request("aborted", prompt, greedy(10))
    engine.step()
    req = engine.scheduler.requests["aborted"]
    assert engine.kv.loading(req)
    loading_blocks = list(engine.kv.block_ids(req))
    assert engine.abort_request("aborted")
    pool = engine.kv.pool
    assert all(pool.ref_counts[b] == 1 for b in loading_blocks[-12:]), "freed while the copy writes them"
    held.released = True
    monkeypatch.undo()
    engine.step()
    assert all(pool.ref_counts[b] == 0 for b in loading_blocks)
    # The landed blocks are cached on the GPU now: the next one finds them there.
    again = tiered.generate([prompt], greedy(10))[0]
    assert again.num_cached_tokens == 192 and again.token_ids == want
    assert_all_blocks_free(tiered)


def test_the_setting_is_checked_and_an_allocation_failure_names_it(tiny_model):
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="engine.host_kv_cache_bytes"):
            EngineConfig(host_kv_cache_bytes=bad).validate()
    with pytest.raises(ConfigError, match="engine.host_kv_cache_bytes: .* hold no KV block"):
        LLM(str(tiny_model), num_blocks=8, host_kv_cache_bytes=1)
    with pytest.raises(ConfigError, match="engine.host_kv_cache_bytes: could not allocate"):
        LLM(str(tiny_model), num_blocks=8, host_kv_cache_bytes=2**62)


def test_two_requests_loading_the_same_blocks_at_once_both_get_the_tokens_of_a_fresh_prefill(tiered, plain,
                                                                                          monkeypatch):
    """The second one's lookup comes while the first one's load is in flight
    (held open: a fault forced on purpose): the GPU cache has nothing yet (a
    block is published only once landed), so it loads the same hashes into
    blocks of its own; both land, and the first copy stays the cached one."""
    prompt, want = _only_on_the_host(tiered, plain, 100, seed=51)   # two of it fit in the pool at once
    engine, held = tiered.engine, _hold_loads(tiered, monkeypatch)
    engine.add_request("first", prompt, greedy(10))
    engine.step()
    monkeypatch.undo()
    engine.add_request("second", prompt, greedy(10))
    engine.step()
    first, second = (engine.scheduler.requests[r] for r in ("first", "second"))
    assert engine.kv.loading(first) and engine.kv.loading(second)
    assert set(engine.kv.block_ids(first)).isdisjoint(engine.kv.block_ids(second))
    engine.step()   # the second's copy (a real one) has landed: it runs; the first still loads
    assert engine.kv.loading(first) and not engine.kv.loading(second)
    assert second in engine.scheduler.running
    held.released = True
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.num_cached_tokens == 96
    assert outs == {"first": want, "second": want}
    assert_all_blocks_free(tiered)
