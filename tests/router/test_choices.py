"""n > 1 and prompt logprobs in the router's state machine (no sockets: tests/router/sim.py).

The first choice is placed as any request; the others wait, on no worker,
until its decode worker has run the prompt (its first TokenBatch), then go
beside it. A request asking for its prompt's logprobs is prefilled where it
decodes."""
from __future__ import annotations

from pdd.api import SamplingParams
from pdd.protocol import messages as m
from tests.router.sim import SimCluster
from tests.router.test_control import expected, run_to_end

PROMPT = list(range(1, 11))


def submit(c: SimCluster, n: int, **sp):
    states = c.control.submit_choices(PROMPT, SamplingParams(**{"max_tokens": 3, "seed": 7, **sp}), "req", n)
    for s in states:
        c.states[s.request_id] = s
    return states


def admits(w) -> list[m.Admit]:
    return [msg for msg in w.inbox if isinstance(msg, m.Admit)]


def test_later_choices_wait_for_the_first_and_go_beside_it():
    c = SimCluster()
    c0, c1 = c.add_worker("c0", "colocated"), c.add_worker("c1", "colocated")
    first, *rest = submit(c, 3)
    assert [s.request_id for s in (first, *rest)] == ["req-0", "req-1", "req-2"]
    assert [s.sampling.seed for s in (first, *rest)] == [7, 8, 9]
    assert all(s.phase == "queued" and not s.owners for s in rest)
    worker = c.workers[first.decode_worker]
    c.check()
    c.step_inbox(worker)
    c.act(worker, (first.request_id, first.epoch))       # its first token: the prompt is cached there
    assert [s.decode_worker for s in rest] == [first.decode_worker] * 2
    assert [(a.request_id, a.sampling.seed) for a in admits(worker)] == [("req-1", 8), ("req-2", 9)]
    assert not admits(c1 if worker is c0 else c0)
    run_to_end(c)
    for s in (first, *rest):
        assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))
    assert c.quiescent()


def test_later_choices_go_to_the_decode_worker_once_the_kv_landed_there():
    c = SimCluster()
    p, d = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode")
    first, second = submit(c, 2)
    assert first.mode == "disagg" and second.phase == "queued"
    c.step_inbox(p)
    c.act(p, (first.request_id, first.epoch), "first")   # the prefill worker's first token: not yet
    assert second.phase == "queued" and first.output_token_ids
    c.step_inbox(d)                                       # Reserved: the KV target goes to p0
    c.step_inbox(p)
    c.act(p, (first.request_id, first.epoch))             # the pages land; d0 starts on its own
    assert second.phase == "queued"
    c.act(d, (first.request_id, first.epoch))             # d0's first TokenBatch: it holds the prompt
    assert second.decode_worker == "d0" and second.mode == "colocated"
    assert [a.request_id for a in admits(d)] == ["req-1"]
    run_to_end(c)
    assert c.outcome("req-1") == ("done", expected("req-1", 3))
    assert c.control.metrics.placements.labels("local_prefill", "shared_prompt")._value.get() == 1
    assert c.quiescent()


def test_a_failing_first_choice_fails_the_waiting_ones():
    c = SimCluster()
    w = c.add_worker("c0", "colocated")
    first, second = submit(c, 2)
    c.step_inbox(w)
    c.control.handle("c0", m.RequestFailed("c0", first.request_id, first.epoch, "bad prompt", retriable=False))
    assert c.outcome("req-0")[0] == "error" and c.outcome("req-1")[0] == "error"
    c.check()
    run_to_end(c)
    assert c.quiescent()


def test_a_client_gone_drops_the_waiting_choices_without_placing_them():
    c = SimCluster()
    w = c.add_worker("c0", "colocated")
    first, second = submit(c, 2)
    c.abort("req-0")
    c.check()
    assert "req-1" not in c.control.inflight.requests and not admits(w)[1:]
    run_to_end(c)
    assert c.quiescent()


def test_a_first_choice_ended_by_a_stop_string_before_its_tokens_places_the_others():
    c = SimCluster()
    p, d = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode")
    first, second = submit(c, 2)
    c.step_inbox(p)
    c.act(p, (first.request_id, first.epoch), "first")
    c.control.abort(first, "stop")             # the first token's text held the stop string
    assert second.phase != "queued" and second.owners
    run_to_end(c)
    assert c.outcome("req-1") == ("done", expected("req-1", 3)) and c.quiescent()


def test_prompt_logprobs_are_computed_where_the_request_decodes():
    c = SimCluster()
    c.add_worker("p0", "prefill")
    d = c.add_worker("d0", "decode")
    (s,) = submit(c, 1, prompt_logprobs=0)
    assert s.mode == "colocated" and s.decode_worker == "d0" and admits(d)
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3)) and c.quiescent()


def test_a_shutdown_fails_every_choice_once():
    c = SimCluster()
    c.add_worker("c0", "colocated")
    submit(c, 3)
    c.control.fail_all("the router is shutting down")
    assert [c.outcome(f"req-{i}")[0] for i in range(3)] == ["error"] * 3   # outcome() asserts one end each
    c.check()
