"""Workloads: seeded, and their lengths follow the configured distributions."""
from __future__ import annotations

import dataclasses

import pytest

from pdd.bench.serve_client import RequestRecord, Target, build_body
from pdd.bench.workloads import WorkloadConfig, build_workload


def lengths(items):
    return [it.turns[0].input_len for it in items]


def test_random_is_seeded_and_within_its_ranges():
    cfg = WorkloadConfig("random", 200, input_len=(5, 50), output_len=(3, 9), token_id_range=(10, 20), seed=3)
    items = build_workload(cfg)
    assert items == build_workload(cfg)
    assert items != build_workload(dataclasses.replace(cfg, seed=4))
    assert len(items) == 200
    for it in items:
        (t,) = it.turns
        assert len(t.content) == t.input_len and 5 <= t.input_len <= 50 and 3 <= t.output_len <= 9
        assert all(10 <= x < 20 for x in t.content)
    assert min(lengths(items)) == 5 and max(lengths(items)) == 50   # both ends are drawn


def test_mixed_defaults_are_the_issues_mix():
    items = build_workload(WorkloadConfig("mixed", 2000, seed=0))
    short = [n for n in lengths(items) if n <= 2048]
    long = [n for n in lengths(items) if n > 2048]
    assert all(256 <= n for n in short) and all(8192 <= n <= 16384 for n in long)
    assert 0.08 <= len(long) / len(items) <= 0.12
    assert {it.turns[0].output_len for it in items} == {256}


def test_mixed_scales_down_for_a_tiny_model():
    cfg = WorkloadConfig("mixed", 400, input_len=(16, 64), long_input_len=(300, 500), long_fraction=0.5,
                         output_len=(8, 8), seed=1)
    n = lengths(build_workload(cfg))
    assert all(16 <= x <= 64 or 300 <= x <= 500 for x in n)
    assert 0.4 <= sum(x >= 300 for x in n) / len(n) <= 0.6
    assert max(lengths(build_workload(WorkloadConfig("mixed", 200, input_len=(16, 64), long_fraction=0.0)))) <= 64


def test_shared_prefix_items_share_a_prefix_and_differ_after_it():
    items = build_workload(WorkloadConfig("shared-prefix", 30, input_len=(4, 8), prefix_len=32, seed=2))
    assert len({tuple(it.prefix) for it in items}) == 1
    assert all(len(it.prefix) == 32 == it.prefix_len for it in items)
    assert len({tuple(it.turns[0].content) for it in items}) == 30
    items = build_workload(WorkloadConfig("shared-prefix", 60, prefix_len=8, num_prefixes=3, seed=2))
    assert len({tuple(it.prefix) for it in items}) == 3
    body, n = build_body(Target("u", model="m"), items[0], 0, [], ignore_eos=True)
    assert body["prompt"] == items[0].prefix + items[0].turns[0].content and n == 8 + items[0].turns[0].input_len


def test_text_prompts_have_one_word_per_nominal_token():
    items = build_workload(WorkloadConfig("random", 20, input_len=(3, 12), prompt_format="text", seed=5))
    assert all(len(it.turns[0].content.split()) == it.turns[0].input_len for it in items)


def test_multi_turn_resends_history_and_answers():
    (item,) = build_workload(WorkloadConfig("multi-turn", 1, input_len=(4, 4), output_len=(6, 6), turns=3,
                                            prompt_format="text"))
    assert len(item.turns) == 3
    answers = [RequestRecord(0, 0, 4, 6, success=True, output_tokens=6, text=" first answer"),
               RequestRecord(0, 1, 14, 6, success=True, output_tokens=6, text=" second answer")]
    u = [t.content for t in item.turns]
    body, n = build_body(Target("u", model="m"), item, 2, answers, ignore_eos=False)
    assert body["prompt"] == "\n".join([u[0], " first answer", u[1], " second answer", u[2]])
    assert n == 3 * 4 + 2 * 6 and "ignore_eos" not in body
    chat, _ = build_body(Target("u", "/v1/chat/completions", "m"), item, 1, answers[:1], ignore_eos=True)
    assert chat["messages"] == [{"role": "user", "content": u[0]}, {"role": "assistant", "content": " first answer"},
                                {"role": "user", "content": u[1]}]
    assert chat["max_completion_tokens"] == 6


def test_impossible_combinations_are_refused():
    with pytest.raises(ValueError, match="--prompt-format text"):
        build_workload(WorkloadConfig("multi-turn", 1, prompt_format="ids"))
    with pytest.raises(ValueError, match="--input-len"):
        build_workload(WorkloadConfig("random", 1, input_len=(9, 3)))
    with pytest.raises(ValueError, match="chat"):
        build_body(Target("u", "/v1/chat/completions", "m"), build_workload(WorkloadConfig("random", 1))[0], 0, [],
                   True)
