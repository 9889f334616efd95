"""A worker's side of a prefix-cache reset: ResetPrefixCache is applied between
steps, answered PrefixCacheReset with the blocks dropped; a prompt cached
before is computed again after, while blocks a running request holds keep
working (and stay findable). A real Worker driven by the fake router."""
from __future__ import annotations

from pdd.protocol import messages as m
from tests.engine.helpers import greedy, random_prompts
from tests.worker.harness import run_worker, worker_config

BLOCK = 16
LONG = 200     # tokens: the request that runs while the cache is reset


def expected(offline, prompt, max_tokens) -> list[int]:
    return offline.generate([prompt], greedy(max_tokens, ignore_eos=True))[0].token_ids


def test_a_reset_forgets_free_blocks_and_keeps_held_ones(tiny_model, offline):
    prompt = random_prompts([40], seed=3)[0]     # 2 full blocks a later request can find
    other = random_prompts([40], seed=4)[0]

    async def scenario(router):
        def cached(rid: str) -> int:
            return router.items(rid, 1)[0].num_cached_tokens

        async def run(rid: str, p: list[int], max_tokens: int = 4) -> list[int]:
            await router.send(m.Admit(rid, 1, p, greedy(max_tokens, ignore_eos=True)))
            return await router.tokens(rid, 1)

        first = await run("a", prompt)
        await run("b", prompt)
        await run("x", other)
        hits_before = cached("b")
        await router.send(m.ResetPrefixCache("r1"))
        reset = await router.next(m.PrefixCacheReset)
        again = await run("c", prompt)
        hits_after = cached("c")

        # A request holds the prompt's blocks (found in the cache c left) while the cache is reset.
        await router.send(m.Admit("long", 1, prompt, greedy(LONG, ignore_eos=True)))
        await router.until(lambda: router.items("long", 1))
        await router.send(m.ResetPrefixCache("r2"))
        held_reset = await router.next(m.PrefixCacheReset)
        await router.send(m.Admit("d", 1, prompt, greedy(4, ignore_eos=True)))
        long_tokens = await router.tokens("long", 1)
        await router.tokens("d", 1)
        # The engine hands over its messages in order: the reset was applied while "long" ran.
        finished = next(i for i, msg in enumerate(router.received) if isinstance(msg, m.TokenBatch)
                        and any(item.request_id == "long" and item.finished for item in msg.items))
        assert router.received.index(held_reset) < finished
        return (first, again, hits_before, hits_after, reset, held_reset, long_tokens, cached("long"), cached("d"),
                await router.idle_heartbeat())

    (first, again, hits_before, hits_after, reset, held_reset, long_tokens, long_hits, d_hits, hb), code = \
        run_worker(worker_config(tiny_model), scenario)
    assert hits_before == 2 * BLOCK
    assert (reset.worker_id, reset.reset_id) == ("colocated-0", "r1")
    assert reset.dropped_blocks >= 4            # both prompts' full blocks at least
    assert hits_after == 0 and again == first == expected(offline, prompt, 4)
    # The held blocks were not dropped: the running request's output is right,
    # and a request beside it still finds them.
    assert long_hits == 2 * BLOCK and held_reset.reset_id == "r2"
    assert long_tokens == expected(offline, prompt, LONG)
    assert d_hits == 2 * BLOCK
    assert hb.free_blocks == hb.total_blocks
    assert code == 0
