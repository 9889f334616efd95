"""Heartbeat journals: every entry the engine thread appends reaches exactly
one heartbeat, however appends and reads interleave."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdd import ops
from pdd.api import StepSample
from pdd.worker.stats import EngineStats, HeartbeatReader, Journal, JournalCursor


def test_a_cursor_takes_each_entry_once():
    journal, cursor = Journal(maxlen=8), JournalCursor()
    journal.extend([1, 2])
    old = journal.view()
    journal.extend([3])
    assert cursor.take(journal.view()) == [1, 2, 3]
    assert cursor.take(old) == []            # an older snapshot read late brings nothing twice
    assert cursor.take(journal.view()) == []
    journal.extend([4, 5])
    assert cursor.take(journal.view()) == [4, 5]


def test_a_reader_that_falls_behind_gets_the_newest_entries():
    journal, cursor = Journal(maxlen=4), JournalCursor()
    journal.extend(list(range(10)))
    assert cursor.take(journal.view()) == [6, 7, 8, 9]   # bounded: the oldest were dropped
    journal.extend([10])
    assert cursor.take(journal.view()) == [10]


def test_views_are_immutable_snapshots():
    journal = Journal(maxlen=4)
    journal.extend([1])
    view = journal.view()
    journal.extend([2, 3, 4, 5])
    assert view.items == (1,) and view.end == 1


def fake_engine(published: list[int], running=(), waiting=(), long_threshold: int | None = 0) -> SimpleNamespace:
    """Just what EngineStats.snapshot reads; `published`: hashes the prefix cache publishes."""
    def take_recent_hashes():
        out = published[:]
        published.clear()
        return out
    kv = SimpleNamespace(tier=None, num_free_blocks=7, pool=SimpleNamespace(num_usable_blocks=7), hit_rate=lambda: 0.25,
                         num_hit_tokens=32, num_queried_tokens=128, take_recent_hashes=take_recent_hashes)
    scheduler = SimpleNamespace(running=list(running), waiting=list(waiting), num_preemptions=0,
                                num_waiting=lambda: len(waiting),
                                cfg=SimpleNamespace(long_prefill_token_threshold=long_threshold))
    return SimpleNamespace(kv=kv, scheduler=scheduler)


def test_heartbeats_carry_samples_and_hashes_once():
    published = [11, 12]
    engine, stats, reader = fake_engine(published), EngineStats(), HeartbeatReader("w")
    stats.record(StepSample(latency_s=0.5, num_tokens=40, num_decodes=2, prefill_chunks=[38], prefill_pairs=741))
    first = reader.heartbeat(stats.snapshot(engine, {}), 0.0, False)
    published.append(13)
    stats.record(StepSample(latency_s=0.25, num_tokens=3, num_decodes=3))
    stats.record(StepSample())                      # took results only: no sample
    snap = stats.snapshot(engine, {})
    second = reader.heartbeat(snap, 0.1, True)
    again = reader.heartbeat(snap, 0.2, True)      # the loop heartbeats twice on one snapshot
    s1 = StepSample(latency_s=0.5, num_tokens=40, num_decodes=2, prefill_chunks=[38], prefill_pairs=741)
    s2 = StepSample(latency_s=0.25, num_tokens=3, num_decodes=3)
    assert (first.recent_hashes, first.steps) == ([11, 12], [s1])
    assert (second.recent_hashes, second.steps) == ([13], [s2])
    assert second.steps_completed == 3 and second.step_running_s == 0.1 and second.draining
    assert again.recent_hashes == again.steps == [] and again.steps_completed == 3


def test_heartbeats_count_the_prompt_tokens_not_computed_yet():
    def req(prompt, computed):
        return SimpleNamespace(num_prompt_tokens=prompt, num_computed_tokens=computed, decoding=computed >= prompt)
    # A request half prefilled, one decoding (its computed tokens pass its prompt), one waiting.
    engine = fake_engine([], running=[req(100, 60), req(10, 14)], waiting=[req(50, 0)])
    hb = HeartbeatReader("w").heartbeat(EngineStats().snapshot(engine, {}), 0.0, False)
    assert hb.prefill_tokens_pending == 40 + 50
    assert (hb.running, hb.decoding) == (2, 1)     # the prompt being computed is no decode load
    assert (hb.long_prefill_tokens_pending, hb.long_prefills_pending) == (0, 0)   # first come, first served


def test_heartbeats_count_the_long_prompts_tokens_apart():
    """As the scheduler tells them apart: more than long_prefill_token_threshold
    tokens left to compute (a long prompt mostly computed is short again)."""
    def req(prompt, computed):
        return SimpleNamespace(num_prompt_tokens=prompt, num_computed_tokens=computed, decoding=computed >= prompt)
    queues = dict(running=[req(10_000, 2_000), req(10_000, 8_000), req(10, 14)],
                  waiting=[req(300, 0), req(5_000, 0), req(1_000, 0)])
    for threshold, expected in ((2_000, (8_000 + 5_000, 2)), (None, (0, 0)), (0, (0, 0))):
        engine = fake_engine([], long_threshold=threshold, **queues)
        hb = HeartbeatReader("w").heartbeat(EngineStats().snapshot(engine, {}), 0.0, False)
        assert hb.prefill_tokens_pending == 8_000 + 2_000 + 300 + 5_000 + 1_000
        assert (hb.long_prefill_tokens_pending, hb.long_prefills_pending) == expected


def test_heartbeats_carry_the_prefix_caches_totals():
    """Totals, not a ratio: the router turns them into counters to rate()."""
    hb = HeartbeatReader("w").heartbeat(EngineStats().snapshot(fake_engine([]), {}), 0.0, False)
    assert (hb.prefix_hit_tokens, hb.prefix_query_tokens, hb.prefix_hit_rate) == (32, 128, 0.25)


def test_heartbeats_carry_the_kernels_compiled_in_service(monkeypatch):
    """Each kernel Triton reports compiled after the warm-up is counted, and the
    count travels in the heartbeats (the router's pdd_kernels_compiled_in_service_total)."""
    triton = pytest.importorskip("triton")
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    monkeypatch.setattr(runtime, "jit_post_compile_hook", None)   # put back after the test
    seen = []
    assert ops.report_compiles(seen.append)
    before = ops.compiles_reported()
    runtime.jit_post_compile_hook(repr="_copy_pages_kernel", key="k")   # as Triton calls it after a compile
    hb = HeartbeatReader("w").heartbeat(EngineStats().snapshot(fake_engine([]), {}), 0.0, False)
    assert hb.kernels_compiled_in_service == before + 1
    assert seen == ["_copy_pages_kernel key=k"]
