"""Random orders of messages, timer expiries, client aborts, worker losses and
restarts over a few requests, against the invariants of the control plane:

- every request ends exactly once: its full answer, or one error event (or the
  client left); never tokens after its end;
- a completed answer is exactly the tokens a fault-free run gives (no gap, no
  duplicate, even across migrations);
- never admitted twice: no worker ever holds two placements of one request;
- per-worker inflight counts exact after every event;
- once the dust settles, no worker holds anything (every reservation freed on
  both sides) and the router holds no request.

CI runs a fixed set of seeds; PDD_INTERLEAVING_SEEDS=N runs N more locally.
"""
from __future__ import annotations

import os
import random

import pytest

from pdd.router.inflight import Unavailable
from tests.router.sim import SimCluster, token

SEEDS = list(range(40)) + list(range(1000, 1000 + int(os.environ.get("PDD_INTERLEAVING_SEEDS", "0"))))
ROLES = [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"), ("c0", "colocated")]


def random_step(c: SimCluster, rng: random.Random, chaos: bool) -> None:
    actions = []
    inboxes = [w for w in c.workers.values() if w.inbox]
    busy = [w for w in c.workers.values() if w.holds]
    if inboxes:
        actions += [("deliver", 6)]
    if busy:
        actions += [("act", 6)]
    actions += [("time", 1)]
    if chaos:
        actions += [("submit", 2), ("abort", 1), ("kill", 0.15), ("restart", 0.15), ("revive", 0.3)]
    kind = rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
    if kind == "deliver":
        w = rng.choice(inboxes)
        c.step_inbox(w, reserve=rng.choices(["ok", "refuse", "silent"], [8, 1, 1])[0])
    elif kind == "act":
        w = rng.choice(busy)
        c.act(w, rng.choice(list(w.holds)), rng.choices(["ok", "first", "fail"], [6, 3, 1])[0])
    elif kind == "time":
        c.advance(rng.choice([0.5, 3.0, 6.0, 40.0]))
    elif kind == "submit":
        try:
            c.submit(max_tokens=rng.randint(1, 5), n=rng.choice([1, 1, 1, 2, 3]))
        except Unavailable as e:  # no worker at the moment, or overloaded: a 503/429 for the client
            assert "no " in str(e) or "overloaded" in str(e), e
    elif kind == "abort":
        open_ = [rid for rid in c.states if rid in c.control.inflight.requests]
        if open_:
            c.abort(rng.choice(open_))
    elif kind == "kill" and len(c.workers) > 1:
        c.kill(rng.choice(sorted(c.workers)))
    elif kind == "restart" and c.workers:
        c.restart(rng.choice(sorted(c.workers)))
    elif kind == "revive":
        dead = [(wid, role) for wid, role in ROLES if wid not in c.workers]
        if dead:
            c.add_worker(*rng.choice(dead))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_interleavings_keep_the_invariants(seed):
    rng = random.Random(seed)
    c = SimCluster(mode=rng.choice(["auto", "auto", "disagg", "colocated"]),
                   request_timeout_s=rng.choice([0.0, 0.0, 20.0]), max_queued_requests=rng.choice([0, 3, 100]))
    for wid, role in ROLES:
        c.add_worker(wid, role, num_blocks=rng.choice([6, 64]))
    for _ in range(300):
        random_step(c, rng, chaos=True)
        c.check()
    for _ in range(20_000):            # no new faults: everything must settle
        if c.quiescent():
            break
        random_step(c, rng, chaos=False)
        c.check()
    assert c.quiescent(), {w.worker_id: (list(w.inbox), w.holds) for w in c.workers.values()}
    assert c.states, "the run submitted nothing"
    for rid, state in c.states.items():
        outcome, tokens = c.outcome(rid)
        if rid in c.client_aborted:
            continue
        assert outcome in ("done", "error"), (rid, outcome)
        if outcome == "done":
            assert tokens == [token(rid, i) for i in range(state.sampling.max_tokens)], rid
