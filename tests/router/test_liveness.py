"""Liveness on a simulated clock (tests/router/sim.py): a worker is lost when
it is silent while both it and the router could run. Silent past the window
(3 heartbeats of 0.5 s) it is suspect: no new requests, it keeps its own;
heard within the grace it is healthy with nothing moved; silent past the
grace it is lost and its requests move. The router's own stall counts
against no worker."""
from __future__ import annotations

from pdd.protocol import messages as m
from tests.router.sim import SimCluster
from tests.router.test_control import expected, run_to_end, running_on_c0

GRACE_S = 5.0     # router.liveness_grace_s (the default)


def liveness(c: SimCluster, event: str) -> float:
    return c.control.metrics.liveness.labels(event)._value.get()


def heartbeat(wid: str) -> m.Heartbeat:
    return m.Heartbeat(wid, 1, 0, 64, 64)


def pass_time(c: SimCluster, seconds: float, beating: tuple[str, ...] = ()) -> None:
    """`seconds` of the router's timer loop on time, a liveness check every
    heartbeat interval; the workers in `beating` heartbeat meanwhile."""
    for _ in range(round(seconds / 0.5)):
        c.advance(0.5)
        for wid in beating:
            c.control.handle(wid, heartbeat(wid))
            assert isinstance(c.workers[wid].inbox.pop(), m.HeartbeatAck)
        c.control.membership.check_liveness()


def test_a_router_stalled_for_3s_loses_no_worker_and_moves_no_request():
    c, c0, c1, s = running_on_c0(6)
    c.act(c0, (s.request_id, 1))
    c.clock.now += 3.0               # no tick for 3 s: the router did not run
    c.control.router_stalled(3.0)    # its timer loop, woken 3 s late, says so first
    c.control.membership.check_liveness()
    assert set(c.registry.workers) == {"c0", "c1"}
    assert not any(w.suspect for w in c.registry.workers.values())
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 6))
    assert s.num_migrations == 0 and liveness(c, "suspect") == liveness(c, "lost") == 0


def test_a_worker_silent_past_the_window_is_suspect_and_heard_within_the_grace_keeps_its_request():
    c, c0, c1, s = running_on_c0(6)
    c.act(c0, (s.request_id, 1))
    pass_time(c, 2.0, beating=("c1",))            # c0 silent past 1.5 s
    w = c.registry.workers["c0"]
    assert w.suspect and not w.accepting and liveness(c, "suspect") == 1
    assert isinstance(c0.inbox[-1], m.HeartbeatAck)   # probed: a live process gets it
    assert c.submit().decode_worker == "c1"            # no new work for a suspect
    pass_time(c, GRACE_S - 1.0, beating=("c1",))     # still within the grace
    assert "c0" in c.registry.workers and s.decode_worker == "c0" and s.epoch == 1
    c.act(c0, (s.request_id, 1))                      # its next tokens: heard
    assert not w.suspect and w.accepting and liveness(c, "back") == 1
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 6))
    assert s.num_migrations == 0 and liveness(c, "lost") == 0
    assert c.control.metrics.migrations._value.get() == 0
    c.check()


def test_a_suspect_worker_registering_again_as_the_same_process_keeps_its_request():
    c, c0, c1, s = running_on_c0(4)
    pass_time(c, 2.0, beating=("c1",))
    assert c.registry.workers["c0"].suspect
    c.control.handle("c0", c0.register_message())    # same incarnation: the same process
    assert isinstance(c0.inbox.pop(), m.RegisterReply)
    w = c.registry.workers["c0"]
    assert not w.suspect and w.inflight == 1 and s.decode_worker == "c0" and s.epoch == 1
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 4)) and s.num_migrations == 0


def test_a_suspect_prefill_worker_keeps_the_prompt_it_was_sent():
    """Its Reserved comes while p0 is suspect: the KVTarget still goes to p0,
    which holds the prompt, not to a local prefill."""
    c = SimCluster()
    p0, d0 = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode")
    s = c.submit(max_tokens=3)
    c.step_inbox(p0)
    pass_time(c, 2.0, beating=("d0",))
    assert c.registry.workers["p0"].suspect
    c.step_inbox(d0)                                  # Reserved
    assert s.phase == "prefilling" and s.prefill_worker == "p0"
    assert isinstance(p0.inbox[-1], m.KVTarget)
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 3))
    assert s.mode == "disagg" and s.num_migrations == 0


def test_a_worker_silent_past_the_grace_is_lost_and_its_requests_move():
    c, c0, c1, s = running_on_c0(6)
    c.act(c0, (s.request_id, 1))
    pass_time(c, 1.5 + GRACE_S + 0.5, beating=("c1",))
    assert "c0" not in c.registry.workers and liveness(c, "lost") == 1
    assert s.decode_worker == "c1" and s.epoch == 2
    del c.workers["c0"]                               # it was dead: what it holds is nobody's
    run_to_end(c)
    assert c.outcome(s.request_id) == ("done", expected(s.request_id, 6))

