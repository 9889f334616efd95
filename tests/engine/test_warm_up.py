"""LLMEngine.warm_up(): serving-shaped steps at start that leave no trace (no
block held or cached, no recent hash, counters as before) and change nothing
the engine serves afterwards."""
from __future__ import annotations

import pytest
import torch

from pdd import LLM
from pdd.api import StepSample
from pdd.config import EngineConfig
from pdd.engine.engine import LLMEngine
from tests.engine.helpers import assert_all_blocks_free, greedy, random_prompts

# 3 chunks fill a step's budget; the plan's long prompt is 113 tokens.
SHAPE = dict(chunk_size=32, max_num_batched_tokens=96, num_blocks=64)


def _spy(engine: LLMEngine):
    """Record the warm-up's prompts and the shape of each of its steps."""
    prompts, steps = [], []
    add, step = engine.add_request, engine.step

    def add_request(rid, prompt, *a, **kw):
        prompts.append(list(prompt))
        return add(rid, prompt, *a, **kw)

    def step_():
        out = step()
        steps.append((engine.last_step, engine.scheduler.num_preemptions))
        return out

    engine.add_request, engine.step = add_request, step_
    return prompts, steps


def _state(engine: LLMEngine):
    kv, pool = engine.kv, engine.kv.pool
    return dict(free_order=list(pool.free_queue), freed_at=list(pool.freed_at),
                steps_launched=pool.steps_launched, steps_done=engine.steps_done,
                queried=kv.num_queried_tokens, hit=kv.num_hit_tokens,
                preemptions=engine.scheduler.num_preemptions)


def test_warm_up_runs_serving_steps_and_leaves_no_trace(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), **SHAPE))
    before = _state(engine)
    prompts, steps = _spy(engine)
    engine.warm_up()
    del engine.add_request, engine.step   # the spies

    # Serving-shaped: a step of several full chunks, decodes beside a chunk, a
    # prompt of several chunks; all resident at once (nothing preempted).
    assert max(len(s.prefill_chunks) for s, _ in steps) >= 3
    assert max(s.num_tokens for s, _ in steps) == SHAPE["max_num_batched_tokens"]
    assert any(s.num_decodes and s.prefill_chunks for s, _ in steps)
    assert max(map(len, prompts)) > 3 * SHAPE["chunk_size"]
    assert all(p == 0 for _, p in steps)

    # No trace.
    kv, pool, sched = engine.kv, engine.kv.pool, engine.scheduler
    assert not engine.has_unfinished() and engine.in_flight is None
    assert pool.num_free_blocks == pool.num_usable_blocks and pool.ref_counts[1:] == [0] * (pool.num_blocks - 1)
    assert not pool.cached and pool.block_hash == [None] * pool.num_blocks
    assert kv.take_recent_hashes() == []
    assert not kv.req_blocks and not kv._num_cached_blocks
    assert not sched.requests and not sched.waiting and not sched.running and not sched.waiting_for_kv
    assert kv.enable_prefix_caching
    assert _state(engine) == before
    assert engine.last_step == StepSample()

    # A warm-up prompt sent again finds nothing cached.
    prompt = max(prompts, key=len)
    engine.add_request("again", prompt, greedy(2))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].num_cached_tokens == 0
    assert kv.num_hit_tokens == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_serving_after_warm_up_equals_a_fresh_engine(tiny_model, async_scheduling):
    kw = dict(SHAPE, async_scheduling=async_scheduling)
    fresh, warm = LLM(str(tiny_model), **kw), LLM(str(tiny_model), **kw)
    warm.engine.warm_up()
    shared = random_prompts([40], seed=5)[0]
    prompts = random_prompts([3, 17, 64, 150], seed=4) + [shared + [7], shared + [8, 9]]

    def run(llm):
        outs = llm.generate(prompts, greedy(12))
        assert_all_blocks_free(llm)
        kv = llm.engine.kv
        return ([(o.token_ids, o.finish_reason, o.num_cached_tokens) for o in outs],
                kv.num_queried_tokens, kv.num_hit_tokens, sorted(kv.take_recent_hashes()),
                llm.engine.scheduler.num_preemptions)

    assert run(warm) == run(fresh)


@pytest.mark.parametrize("num_blocks", [2, 5, 9])
def test_warm_up_shrinks_to_a_small_pool(tiny_model, num_blocks):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), **dict(SHAPE, num_blocks=num_blocks)))
    before = _state(engine)
    prompts, steps = _spy(engine)
    engine.warm_up()
    assert prompts and all(p == 0 for _, p in steps)   # shrunk to fit: nothing preempted
    assert engine.kv.num_free_blocks == engine.kv.pool.num_usable_blocks
    assert _state(engine) == before


def test_warm_up_computes_a_short_chunk_deep_in_a_prompt(tiny_model):
    """On a GPU, prefill attention splits the keys of a short chunk deep in a
    prompt (pdd.ops): the warm-up must compile that path, not the first such chunk
    in service. Whole budgets up to 2k tokens deep, then 17 tokens alone."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model), **dict(SHAPE, num_blocks=512)))
    prompts, steps = _spy(engine)
    engine.warm_up()
    assert 22 * 96 + 17 in map(len, prompts)
    assert any(s.prefill_chunks == [17] and not s.num_decodes for s, _ in steps)


def test_warm_up_refuses_a_busy_engine(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), **SHAPE))
    engine.add_request("r", [1, 2, 3], greedy(2))
    with pytest.raises(RuntimeError):
        engine.warm_up()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warm_up_on_gpu_equals_a_fresh_engine(tiny_model):
    kw = dict(SHAPE, device="cuda", dtype="float32", num_blocks=None, kv_cache_bytes=256 * 2**20)
    fresh, warm = LLM(str(tiny_model), **kw), LLM(str(tiny_model), **kw)
    warm.engine.warm_up()
    assert warm.engine.kv.take_recent_hashes() == [] and not warm.engine.kv.pool.cached
    prompts = random_prompts([3, 17, 64, 150], seed=4)
    assert ([o.token_ids for o in warm.generate(prompts, greedy(12))]
            == [o.token_ids for o in fresh.generate(prompts, greedy(12))])
    assert_all_blocks_free(warm)


_NOTHING_COMPILES_AFTER_WARM_UP = """
import json, sys
import triton
from pdd import LLM
from tests.engine.helpers import greedy, random_prompts

llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", max_num_batched_tokens=2048, chunk_size=256,
          kv_cache_bytes=512 << 20)
llm.engine.warm_up()
compiled = []
triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(str(kw.get("repr", kw.get("key")))[:300])
# Continuous batching over prompts of every depth class: decodes beside chunks,
# short tails deep in prompts (split keys), batches of many sizes; then one alone.
llm.generate(random_prompts([5, 40, 300, 700, 1500, 3000, 17, 2100, 64, 129, 513, 1025], seed=9),
             greedy(24, ignore_eos=True))
llm.generate(random_prompts([2500], seed=10), greedy(8, ignore_eos=True))
print("COMPILED " + json.dumps(compiled))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nothing_compiles_in_service_after_the_warm_up(tiny_model, tmp_path):
    """A Triton kernel compiled in service stalls every request of the worker for
    seconds (2 s seen on H200 when the split prefill path was missing from the
    warm-up). In a fresh process (empty in-memory and on-disk kernel caches), a
    serving mix after warm_up() compiles nothing."""
    import json
    import os
    import subprocess
    import sys

    import triton
    if not hasattr(getattr(triton, "knobs", None), "runtime"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    proc = subprocess.run([sys.executable, "-c", _NOTHING_COMPILES_AFTER_WARM_UP, str(tiny_model)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COMPILED "))
    assert json.loads(line[len("COMPILED "):]) == []
