"""The router's spans of a request, from its timeline, and the traceparents its
control messages carry (tests/router/sim.py: the state machine without sockets).
The process's exporter is replaced by a list: what would be posted is kept."""
from __future__ import annotations

import pytest

from pdd import tracing
from pdd.api import SamplingParams
from pdd.protocol import messages as m
from pdd.tracing.context import SpanContext, phase_span_id
from tests.router.sim import SimCluster
from tests.router.test_control import run_to_end

TRACE, CLIENT_SPAN, ROOT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "1122334455667788"


class Emitted(list):
    def emit(self, span) -> None:
        self.append(span)


@pytest.fixture
def emitted(monkeypatch):
    out = Emitted()
    monkeypatch.setattr(tracing, "_exporter", out)
    return out


def traced_cluster(*workers: tuple[str, str]) -> tuple[SimCluster, list[m.Message]]:
    c = SimCluster()
    for wid, role in workers:
        c.add_worker(wid, role)
    sent = []
    send = c.control.send
    c.control.send = lambda peer, msg: (sent.append(msg), send(peer, msg))
    return c, sent


def submit(c: SimCluster, sampled: bool = True):
    span = SpanContext(TRACE, ROOT, sampled, CLIENT_SPAN)
    state, = c.control.submit_choices(list(range(1, 11)), SamplingParams(max_tokens=3, seed=1), "r0", 1, span=span)
    c.states[state.request_id] = state
    return state


def tp(epoch: int, phase: str) -> str:
    return f"00-{TRACE}-{phase_span_id(ROOT, epoch, phase)}-01"


def test_a_disaggregated_request_exports_a_root_and_a_span_per_phase_that_its_messages_name(emitted):
    c, sent = traced_cluster(("p0", "prefill"), ("d0", "decode"))
    submit(c)
    run_to_end(c)
    by_type = {type(msg): msg for msg in sent}
    # The prompt and the reservation go in the reserving phase; the KV target in prefilling.
    assert by_type[m.Reserve].traceparent == by_type[m.Prefill].traceparent == tp(1, "reserving")
    assert by_type[m.KVTarget].traceparent == tp(1, "prefilling")
    root, *phases = emitted
    assert (root.name, root.kind, root.context.span_id, root.context.parent_id) == ("request", 2, ROOT, CLIENT_SPAN)
    assert [s.name for s in phases] == ["queued", "reserving", "prefilling", "decoding"]
    assert all(s.context.trace_id == TRACE and s.context.parent_id == ROOT for s in phases)
    assert [s.context.span_id for s in phases[1:]] == [phase_span_id(ROOT, 1, p)
                                                     for p in ("reserving", "prefilling", "decoding")]
    # Each phase runs from its start to the next one's; the root spans them all.
    assert phases[0].start_ns == root.start_ns and phases[-1].end_ns == root.end_ns
    assert all(a.end_ns == b.start_ns for a, b in zip(phases, phases[1:]))
    assert {"placed", "first_token", "kv_landed", "transfer"} <= {e.name for e in root.events}
    assert root.attributes["pdd.request_id"] == "r0" and root.attributes["pdd.prefill_worker"] == "p0"
    assert root.attributes["pdd.finish_reason"] == "length" and root.error is None


def test_a_fallback_is_a_span_and_the_local_prefill_is_sent_under_the_decoding_span(emitted):
    c, sent = traced_cluster(("p0", "prefill"), ("d0", "decode"))
    submit(c)
    d, p = c.workers["d0"], c.workers["p0"]
    while d.inbox or p.inbox:
        c.step_inbox(d if d.inbox else p)
    c.act(p, ("r0", 1), "first")
    c.act(p, ("r0", 1), "fail")       # the transfer fails: the decode worker prefills it itself
    run_to_end(c)
    local, = [msg for msg in sent if isinstance(msg, m.PrefillLocally)]
    assert local.traceparent == tp(1, "decoding")
    names = [s.name for s in emitted]
    assert names == ["request", "queued", "reserving", "prefilling", "fallback", "decoding"]
    fallback = emitted[4]
    assert fallback.attributes["pdd.fallback.reason"] == "transfer_failed" and fallback.context.parent_id == ROOT
    assert emitted[3].end_ns == fallback.start_ns and fallback.end_ns == emitted[5].start_ns
    assert emitted[5].context.span_id == phase_span_id(ROOT, 1, "decoding")


def test_a_colocated_request_is_admitted_under_its_decoding_span(emitted):
    c, sent = traced_cluster(("c0", "colocated"))
    submit(c)
    run_to_end(c)
    admit, = [msg for msg in sent if isinstance(msg, m.Admit)]
    assert admit.traceparent == tp(1, "decoding")
    assert [s.name for s in emitted] == ["request", "queued", "decoding"]


def test_an_unsampled_request_sends_no_traceparent_and_exports_nothing(emitted):
    c, sent = traced_cluster(("c0", "colocated"))
    submit(c, sampled=False)
    run_to_end(c)
    admit, = [msg for msg in sent if isinstance(msg, m.Admit)]
    assert admit.traceparent == "" and emitted == []
