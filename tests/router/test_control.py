"""The router's request state machine, driven event by event (no sockets: tests/router/sim.py)."""
from __future__ import annotations

import pytest

from pdd.api import SamplingParams
from pdd.kv.hashing import block_hashes
from pdd.protocol import messages as m
from pdd.router.inflight import Overloaded, Unavailable
from pdd.router.requests import RequestError
from tests.router.sim import LAYOUT, SimCluster, token


def run_to_end(c: SimCluster, limit: int = 10_000) -> None:
    """Deliver every message and let every worker finish what it holds."""
    for _ in range(limit):
        c.check()
        w = next((w for w in c.workers.values() if w.inbox), None)
        if w is not None:
            c.step_inbox(w)
            continue
        # A reservation moves on by a message, anything else by the worker's own progress.
        movable = [(w, k) for w in c.workers.values() for k, h in w.holds.items() if h.kind != "reserved"]
        if not movable:
            assert not any(w.holds for w in c.workers.values()), "reservations left waiting"
            return
        c.act(*movable[0])
    raise AssertionError("did not settle")


def expected(rid: str, n: int) -> list[int]:
    return [token(rid, i) for i in range(n)]


def prefilling(**cluster):
    """A disaggregated request of three tokens, its blocks reserved on d0 and its prefill begun on p0."""
    c = SimCluster(**cluster)
    p0, d0 = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode")
    s = c.submit(max_tokens=3)
    c.step_inbox(d0)
    c.step_inbox(p0)
    return c, p0, d0, s


def test_colocated_request_streams_every_token_once():
    c = SimCluster()
    c.add_worker("c0", "colocated")
    s = c.submit(max_tokens=5)
    assert s.mode == "colocated" and s.decode_worker == "c0" and s.epoch == 1
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 5))
    assert c.quiescent() and c.registry.workers["c0"].inflight == 0


def test_disaggregated_request_reserves_while_the_prompt_computes():
    c = SimCluster()
    p, d = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode")
    s = c.submit(max_tokens=4)
    assert (s.phase, s.decode_worker, s.prefill_worker, s.mode) == ("reserving", "d0", "p0", "disagg")
    # The prompt goes to the prefill worker at once, beside the Reserve: no serial hop before it computes.
    assert isinstance(d.inbox[0], m.Reserve) and isinstance(p.inbox[0], m.Prefill)
    # Hashed once, here: both workers get the prompt's block hashes.
    assert d.inbox[0].block_hashes == p.inbox[0].block_hashes == block_hashes(s.prompt_token_ids, LAYOUT.block_size)
    c.step_inbox(p)
    c.act(p, (s.request_id, s.epoch), "first")   # sampled before the reservation came back: streamed
    assert s.output_token_ids == [token(s.request_id, 0)] and s.phase == "reserving"
    c.step_inbox(d)                               # Reserved -> the target follows
    target = p.inbox[0]
    assert s.phase == "prefilling" and isinstance(target, m.KVTarget)
    assert target.dst_block_ids == [0, 1, 2] and target.epoch == s.epoch and target.lease_id == "L1"
    c.step_inbox(p)
    c.act(p, (s.request_id, s.epoch))             # the pages land: the decode worker starts on its own
    assert s.phase == "prefilling"
    c.act(d, (s.request_id, s.epoch))             # its first item repeats the first token: one copy kept
    assert s.phase == "decoding" and s.prefill_worker is None
    assert s.output_token_ids == [token(s.request_id, 0)]
    c.act(d, (s.request_id, s.epoch))
    assert s.output_token_ids == expected(s.request_id, 2)
    c.act(p, (s.request_id, s.epoch))             # PrefillDone, late: its figures only
    assert s.phase == "decoding" and not p.holds and not p.inbox
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 4))
    assert c.quiescent()


def test_a_prefill_worker_lost_before_the_reservation_is_replaced_at_it():
    c = SimCluster()
    c.add_worker("p0", "prefill")
    d0, p1 = c.add_worker("d0", "decode"), c.add_worker("p1", "prefill")
    s = c.submit(max_tokens=3)
    assert s.prefill_worker == "p0"
    c.kill("p0")
    assert s.phase == "reserving" and s.prefill_worker is None
    c.step_inbox(d0)
    assert s.prefill_worker == "p1" and [type(x) for x in p1.inbox] == [m.Prefill, m.KVTarget]
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))


@pytest.mark.parametrize("how", ["restarted", "lost and back"])
def test_a_prefill_worker_back_under_its_id_before_the_reservation_is_sent_the_prompt_again(how):
    """p0 gets the prompt, then its process is replaced (or it is taken for lost,
    drops all it held and registers again) while d0's Reserve waits: the p0
    registered at Reserved holds nothing of the request, so it must get the
    prompt with its KVTarget (a KVTarget alone is ignored: the request would
    wait out its lease)."""
    c = SimCluster()
    p0, d0 = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode")
    s = c.submit(max_tokens=3)
    assert isinstance(p0.inbox[0], m.Prefill)
    if how == "restarted":
        p0 = c.restart("p0")
    else:
        c.kill("p0")
        p0 = c.add_worker("p0", "prefill")
    assert s.phase == "reserving" and not p0.inbox
    c.step_inbox(d0)
    assert s.prefill_worker == "p0" and [type(x) for x in p0.inbox] == [m.Prefill, m.KVTarget]
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))
    assert c.quiescent()


def test_decode_worker_lost_while_reserving_is_placed_once():
    """The race of the issue: the decode worker dies while its Reserve waits; the
    request moves; the reserve timer, firing later, must not place it again."""
    c = SimCluster()
    c.add_worker("p0", "prefill")
    d0 = c.add_worker("d0", "decode")
    c.add_worker("d1", "decode")   # equal load: ties go by id, d0 first
    s = c.submit(max_tokens=3)
    assert s.decode_worker == "d0"
    c.step_inbox(d0, reserve="silent")
    c.kill("d0")
    assert s.epoch == 2 and s.decode_worker == "d1" and s.mode == "colocated"
    c.advance(60)                            # every timer of the old placement fires
    assert s.epoch == 2 and s.decode_worker == "d1"
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))
    assert c.quiescent()


def test_reserve_without_answer_times_out_and_goes_elsewhere():
    c = SimCluster(reserve_timeout_s=5)
    c.add_worker("p0", "prefill")
    d0 = c.add_worker("d0", "decode")
    c.add_worker("d1", "decode", num_blocks=8)
    s = c.submit(max_tokens=2)
    c.step_inbox(d0, reserve="silent")
    c.advance(5.1)
    assert s.decode_worker == "d1" and s.epoch == 2
    assert isinstance(d0.inbox[-1], m.Abort)      # the late reservation is released
    run_to_end(c)
    assert c.outcome(s.request_id)[0] == "done" and c.quiescent()


def test_prefill_worker_lost_mid_prefill_decode_worker_prefills():
    c, p0, d0, s = prefilling()
    c.kill("p0")
    assert s.phase == "decoding" and isinstance(d0.inbox[-1], m.PrefillLocally)
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))
    assert c.quiescent()


def test_prefill_failure_after_first_token_keeps_that_token():
    c, p0, d0, s = prefilling()
    c.act(p0, (s.request_id, s.epoch), "first")
    c.act(p0, (s.request_id, s.epoch), "fail")
    msg = d0.inbox[-1]
    assert isinstance(msg, m.PrefillLocally) and msg.first_token == token(s.request_id, 0)
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))


def running_on_c0(max_tokens: int):
    """Two colocated workers (c1 small, so c0 gets the request), the request admitted on c0."""
    c = SimCluster()
    c0, c1 = c.add_worker("c0", "colocated"), c.add_worker("c1", "colocated", num_blocks=8)
    s = c.submit(max_tokens=max_tokens)
    c.step_inbox(c0)
    return c, c0, c1, s


def test_decode_worker_lost_mid_stream_continues_elsewhere_without_gap():
    c, c0, c1, s = running_on_c0(6)
    for _ in range(3):
        c.act(c0, (s.request_id, 1))
    c.kill("c0")
    admit = c1.inbox[0]
    assert admit.block_hashes == block_hashes(admit.prompt_token_ids, LAYOUT.block_size)
    assert isinstance(admit, m.Admit) and admit.num_prior_output_tokens == 3 and admit.epoch == 2
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 6))


def test_restart_under_the_same_id_moves_the_old_process_requests():
    c = SimCluster()
    c.add_worker("c0", "colocated")
    s = c.submit(max_tokens=5)
    c.step_inbox(c.workers["c0"])
    c.act(c.workers["c0"], (s.request_id, 1))
    new = c.restart("c0")                         # the old process's request must not hang
    assert s.epoch == 2 and s.decode_worker == "c0"
    assert isinstance(new.inbox[0], m.Admit) and new.inbox[0].num_prior_output_tokens == 1
    assert c.registry.workers["c0"].inflight == 1
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 5))


def test_the_same_process_registering_with_a_new_session_has_its_requests_moved():
    """A worker that dropped what this router placed on it (its connection to
    the router closed, pdd.worker.links) registers again with a new session:
    the request it held is placed again, not left waiting for tokens that never
    come, and the count of what it holds stays exact."""
    c = SimCluster()
    w = c.add_worker("c0", "colocated")
    s = c.submit(max_tokens=5)
    c.step_inbox(w)
    c.act(w, (s.request_id, 1))
    w.holds.clear()                               # what it dropped
    again = w.register_message()
    c.control.handle("c0", again)                 # the same session: Registers that queued up, nothing moves
    assert s.epoch == 1 and isinstance(w.inbox.popleft(), m.RegisterReply) and not w.inbox
    again.session = 1
    c.control.handle("c0", again)
    assert isinstance(w.inbox.popleft(), m.RegisterReply)
    assert s.epoch == 2 and isinstance(w.inbox[-1], m.Admit) and w.inbox[-1].num_prior_output_tokens == 1
    assert c.registry.workers["c0"].inflight == 1
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 5))


def test_stale_epoch_tokens_are_dropped_and_the_copy_aborted():
    c, c0, _, s = running_on_c0(4)
    c.control.handle("c0", m.RequestFailed("c0", s.request_id, 1, "no room", retriable=True))
    assert s.epoch == 2
    c.control.handle("c0", m.TokenBatch("c0", [m.TokenItem(s.request_id, 1, 0, [999])]))
    assert 999 not in s.output_token_ids
    c.check()


def test_an_id_used_again_never_takes_the_messages_of_the_request_that_had_it():
    """A client sends X-Request-Id "x", leaves, and sends "x" again (a retry, or
    ids it reuses): the first one's messages still on their way (its first
    token, sent before its worker applied the Abort) are not the second's."""
    c = SimCluster()
    c0 = c.add_worker("c0", "colocated")
    sp = SamplingParams(max_tokens=3, seed=1)
    first = c.control.submit([1, 2, 3], sp, "x")
    c.control.abort(first)
    second = c.control.submit([4, 5, 6, 7], sp, "x")
    assert second.request_id == "x" and second.decode_worker == "c0"
    c.control.handle("c0", m.TokenBatch("c0", [m.TokenItem("x", first.epoch, 0, [999])]))
    assert second.output_token_ids == [] and second.epoch != first.epoch
    c.control.handle("c0", m.TokenBatch("c0", [m.TokenItem("x", second.epoch, 0, [7])]))
    assert second.output_token_ids == [7]
    c.check()


def test_tokens_are_kept_once_by_position_and_a_gap_places_the_request_again():
    c, c0, _, s = running_on_c0(6)
    for position, tokens in ((0, [10, 11]), (1, [11, 12]), (3, [13])):   # an overlap, then in order
        c.control.handle("c0", m.TokenBatch("c0", [m.TokenItem(s.request_id, 1, position, tokens)]))
    assert s.output_token_ids == [10, 11, 12, 13]
    c.control.handle("c0", m.TokenBatch("c0", [m.TokenItem(s.request_id, 1, 6, [16])]))   # 4 and 5 lost
    assert s.output_token_ids == [10, 11, 12, 13] and s.epoch == 2
    admit = c.workers[s.decode_worker].inbox[-1]
    assert isinstance(admit, m.Admit) and admit.epoch == 2 and admit.num_prior_output_tokens == 4
    c.check()


def test_non_retriable_failure_ends_the_request_with_one_error():
    c = SimCluster()
    c0 = c.add_worker("c0", "colocated")
    s = c.submit()
    c.step_inbox(c0)
    c.control.handle("c0", m.RequestFailed("c0", s.request_id, 1, "top_k: out of range"))
    assert c.outcome(s.request_id)[0] == "error"
    assert isinstance(c0.inbox[-1], m.Abort)
    run_to_end(c)
    assert c.quiescent()


@pytest.mark.parametrize("invalid, status, kind", [(True, 400, "invalid_request_error"), (False, 500, "server_error")])
def test_a_failure_that_is_the_requests_own_fault_is_answered_400(invalid, status, kind):
    """A worker's InvalidRequest (a grammar over its compile budget, say) is the
    client's to fix: a 400, where any other failure is the server's 500."""
    c = SimCluster()
    c0 = c.add_worker("c0", "colocated")
    s = c.submit()
    c.step_inbox(c0)
    c.control.handle("c0", m.RequestFailed("c0", s.request_id, 1, "structured_output: too slow", invalid=invalid))
    (error,) = [e for e in c.states[s.request_id].events if isinstance(e, RequestError)]
    assert (error.status, error.error_type) == (status, kind)
    run_to_end(c)
    assert c.quiescent()


def test_early_disconnects_leave_every_count_at_zero():
    c = SimCluster()
    c.add_worker("p0", "prefill")
    c.add_worker("d0", "decode", num_blocks=10_000)
    c.add_worker("d1", "decode", num_blocks=10_000)
    for _ in range(200):
        c.abort(c.submit().request_id)
    c.check()
    assert all(w.inflight == 0 for w in c.registry.workers.values())
    run_to_end(c)
    assert c.quiescent()


def test_modes_decide_what_placement_may_do():
    strict = SimCluster(mode="disagg")
    strict.add_worker("d0", "decode")
    with pytest.raises(Unavailable):
        strict.submit()
    off = SimCluster(mode="colocated")
    off.add_worker("p0", "prefill")
    off.add_worker("d0", "decode")
    assert off.submit().mode == "colocated"


def test_the_only_decode_worker_lost_its_requests_continue_on_the_prefill_worker():
    c = SimCluster()
    p, d = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode")
    s = c.submit(max_tokens=6)
    for _ in range(4):      # through reserving and prefilling to a few decoded tokens
        c.step_inbox(p)
        c.step_inbox(d)
        for w in (p, d):
            for key in list(w.holds):
                c.act(w, key)
    assert s.phase == "decoding" and len(s.output_token_ids) >= 2
    c.kill("d0")
    admit = p.inbox[-1]     # the last resort: it runs the same engine and can decode
    assert s.decode_worker == "p0" and s.mode == "colocated" and isinstance(admit, m.Admit)
    assert admit.num_prior_output_tokens == len(s.output_token_ids)
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 6))
    late = c.submit(max_tokens=2)   # new work too, until a decode worker is back
    assert late.decode_worker == "p0"
    c.add_worker("d1", "decode")
    assert c.submit().decode_worker == "d1"


def test_messages_from_unregistered_peers_change_nothing():
    c = SimCluster()
    c.add_worker("c0", "colocated")
    s = c.submit()
    c.control.handle("intruder", m.TokenBatch("intruder", [m.TokenItem(s.request_id, 1, 0, [5])]))
    c.control.handle("c0", m.TokenBatch("someone-else", [m.TokenItem(s.request_id, 1, 0, [5])]))
    assert s.output_token_ids == []
    c.check()


def test_failing_transfers_open_the_breaker_then_trials_close_it():
    c = SimCluster()
    p0, d0 = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode", num_blocks=10_000)

    def one(outcome: str):
        s = c.submit(max_tokens=2)
        if s.mode == "disagg":
            c.step_inbox(d0)
            c.step_inbox(p0)
            c.act(p0, (s.request_id, s.epoch), outcome)
        run_to_end(c)
        assert c.outcome(s.request_id) == ("done", expected(s.request_id, 2))
        return s

    for _ in range(5):
        assert one("fail").num_migrations == 0          # each prefilled locally, still answered
    assert c.control.breakers.snapshot(c.clock.now)[1]["state"] == "open"
    s = one("ok")
    assert s.mode == "colocated"   # no transfer attempted while open
    c.advance(10.0)                                      # cool-down over: half-open, one trial
    assert one("ok").mode == "disagg"
    assert one("ok").mode == "disagg"
    assert [b["state"] for b in c.control.breakers.snapshot(c.clock.now)] == ["closed", "closed"]


def test_a_trial_whose_client_left_lets_the_next_request_try():
    c = SimCluster()
    p0, d0 = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode", num_blocks=10_000)
    for _ in range(5):
        s = c.submit(max_tokens=2)
        c.step_inbox(d0)
        c.step_inbox(p0)
        c.act(p0, (s.request_id, s.epoch), "fail")
        run_to_end(c)
    gauge = c.control.metrics.breaker_state.labels("p0", "d0")
    assert gauge._value.get() == 1                       # open
    c.advance(10.0)
    c.control.show_breakers()                            # the router does it every heartbeat interval
    assert gauge._value.get() == 2                       # half-open before any request tries it
    trial = c.submit(max_tokens=2)
    assert trial.mode == "disagg"
    c.abort(trial.request_id)              # gone before its transfer said anything
    run_to_end(c)
    assert c.submit(max_tokens=2).mode == "disagg"   # the next one is the trial
    run_to_end(c)
    c.check()


def heartbeat(wid: str, steps: int, running_s: float) -> m.Heartbeat:
    return m.Heartbeat(wid, 1, 0, 64, 64, steps_completed=steps, step_running_s=running_s)


def test_a_hung_worker_loses_its_requests_and_gets_work_again_once_it_steps():
    c = SimCluster()
    c0 = c.add_worker("c0", "colocated")
    c.add_worker("c1", "colocated", num_blocks=8)
    s = c.submit(max_tokens=4)
    c.step_inbox(c0)
    c.act(c0, (s.request_id, 1))
    c.control.handle("c0", heartbeat("c0", 10, 1.0))
    assert s.decode_worker == "c0"
    c.control.handle("c0", heartbeat("c0", 10, 61.0))     # one step for 61 s: hung
    assert c.registry.workers["c0"].hung and s.decode_worker == "c1" and s.epoch == 2
    assert isinstance(c0.inbox[-1], m.Abort)
    assert c.submit().decode_worker == "c1"               # no new work while hung
    c.control.handle("c0", heartbeat("c0", 10, 70.0))
    assert c.registry.workers["c0"].hung
    c.control.handle("c0", heartbeat("c0", 11, 0.0))      # its steps advance again
    assert not c.registry.workers["c0"].hung
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 4))
    c.check()


def test_admission_control_refuses_beyond_the_queue_limit():
    c = SimCluster(max_queued_requests=3)
    c0 = c.add_worker("c0", "colocated")
    first = [c.submit() for _ in range(3)]
    with pytest.raises(Overloaded) as e:
        c.submit()
    assert e.value.retry_after_s >= 1 and "max_queued_requests = 3" in str(e.value)
    for _ in range(3):
        c.step_inbox(c0)
    c.act(c0, (first[0].request_id, 1))              # it has a token: no longer queued
    assert c.submit().decode_worker == "c0"
    c.check()


def test_deadline_ends_a_request_with_one_error_wherever_it_is():
    c, p0, d0, s = prefilling(request_timeout_s=20.0)   # and the prefill never ends
    c.advance(19.0)
    assert c.outcome(s.request_id)[0] == "open"
    c.advance(1.5)
    assert c.outcome(s.request_id)[0] == "error"
    assert isinstance(p0.inbox[-1], m.Abort) and isinstance(d0.inbox[-1], m.Abort)
    run_to_end(c)
    assert c.quiescent()
