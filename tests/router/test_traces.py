"""Each request's timeline, as the state machine marks it (tests/router/sim.py: no sockets),
and the store of finished ones behind `pdd admin trace` and `pdd admin requests --slow`."""
from __future__ import annotations

from pdd.api import SamplingParams
from pdd.router.requests import RequestState, TraceEvent
from pdd.router.traces import TraceStore
from tests.router.sim import SimCluster
from tests.router.test_control import prefilling, run_to_end


def events(t) -> list[tuple]:
    return [(e["event"], e["epoch"], e["prefill"], e["decode"]) for e in t.to_dict(0.0)["events"]]


def test_a_disaggregated_request_has_every_phase_in_order_with_its_workers():
    c = SimCluster()
    p, d = c.add_worker("p0", "prefill"), c.add_worker("d0", "decode")
    s = c.submit(max_tokens=3)
    c.advance(0.5)
    run_to_end(c)
    t, = c.control.traces.find(s.request_id)
    # PrefillDone came first: its figures, the KV landed, decoding, and its first token.
    assert [e[0] for e in events(t)] == ["queued", "placed", "reserving", "prefilling", "transfer", "kv_landed",
                                         "decoding", "first_token", "end"]
    ev = {e[0]: e for e in events(t)}
    assert ev["queued"] == ("queued", 0, None, None)
    for name in ("placed", "reserving", "prefilling", "kv_landed"):
        assert ev[name][1:] == (1, "p0", "d0"), ev[name]
    assert ev["decoding"] == ("decoding", 1, None, "d0") and ev["end"] == ("end", 1, None, "d0")
    assert t.to_dict(0.0)["events"][-1]["note"] == "length"
    summary = t.summary(c.clock.now)
    assert (summary["mode"], summary["prefill_worker"], summary["decode_worker"]) == ("disagg", "p0", "d0")
    assert summary["finish_reason"] == "length" and summary["fallbacks"] == "" and summary["ttft_s"] == 0.5
    # The time in each phase adds up to the request's (half a second reserving: the clock moved there).
    assert summary["reserving_s"] == 0.5
    assert abs(sum(summary[f"{p}_s"] for p in ("queued", "reserving", "prefilling", "decoding"))
               - summary["duration_s"]) < 1e-9


def test_a_failed_transfer_shows_its_fallback_in_the_same_epoch():
    c, p0, d0, s = prefilling()
    c.act(p0, (s.request_id, s.epoch), "first")
    c.act(p0, (s.request_id, s.epoch), "fail")
    run_to_end(c)
    t, = c.control.traces.find(s.request_id)
    names = [e[0] for e in events(t)]
    assert names == ["queued", "placed", "reserving", "prefilling", "first_token", "fallback", "decoding", "end"]
    fallback = t.to_dict(0.0)["events"][names.index("fallback")]
    assert fallback["note"].startswith("transfer_failed:") and fallback["prefill"] == "p0"
    assert t.summary(0.0)["fallbacks"] == "transfer_failed"
    assert t.served_by() == ("p0", "d0")


def test_a_migration_is_a_new_epoch_on_the_new_worker():
    c = SimCluster()
    c0, c1 = c.add_worker("c0", "colocated"), c.add_worker("c1", "colocated", num_blocks=8)
    s = c.submit(max_tokens=4)
    c.step_inbox(c0)
    c.act(c0, (s.request_id, 1))
    c.kill("c0")
    run_to_end(c)
    t, = c.control.traces.find(s.request_id)
    assert [e[:2] for e in events(t)] == [("queued", 0), ("placed", 1), ("decoding", 1), ("first_token", 1),
                                          ("fallback", 1), ("placed", 2), ("decoding", 2), ("end", 2)]
    assert t.to_dict(0.0)["events"][4]["note"].startswith("migrated: worker c0 was lost")
    assert t.served_by() == (None, "c1") and t.migrations == 1


def test_the_same_id_twice_in_flight_is_suffixed_and_found_by_the_client_id():
    c = SimCluster()
    c.add_worker("c0", "colocated")
    sp = SamplingParams(max_tokens=2, seed=1)
    first = c.control.submit([1, 2, 3], sp, "client-id")
    second = c.control.submit([1, 2, 3], sp, "client-id")
    third = c.control.submit([1, 2, 3], sp, "client-id")
    assert (first.request_id, second.request_id, third.request_id) == ("client-id", "client-id#2", "client-id#3")
    c.states.update({s.request_id: s for s in (first, second, third)})
    run_to_end(c)
    assert [t.request_id for t in c.control.traces.find("client-id")] == ["client-id", "client-id#2",
                                                                         "client-id#3"]
    assert c.control.traces.find("client") == []


def test_the_store_keeps_the_recent_ring_and_the_slowest_apart():
    c = SimCluster()
    c.control.traces = TraceStore(recent=3, slowest=2)
    c0 = c.add_worker("c0", "colocated")
    durations = [5.0, 0.1, 0.2, 7.0, 0.3, 0.4, 0.5]
    ids = []
    for seconds in durations:
        s = c.submit(max_tokens=1)
        c.step_inbox(c0)
        c.advance(seconds)
        c.act(c0, (s.request_id, s.epoch))
        ids.append(s.request_id)
    store = c.control.traces
    assert [t.request_id for t in store.recent] == ids[-3:]
    assert [t.request_id for t in store.slowest()] == [ids[3], ids[0]]
    assert [t.duration(0.0) for t in store.slowest(1)] == [7.0]
    assert store.find(ids[1]) == []           # neither recent nor slow: gone
    assert [t.request_id for t in store.find(ids[0])] == [ids[0]]


def test_a_transfer_reported_after_the_request_ended_joins_its_timeline():
    """PrefillDone may come after the decode worker, started by the data plane,
    streamed the whole answer: its figures still join the finished timeline."""
    store = TraceStore()
    state = RequestState("r", [1, 2, 3], SamplingParams(max_tokens=2), [], epoch=1)
    state.mark("queued", at=1.0)
    state.mark("end", "length", at=2.0)
    store.finished(state, 2.0)
    store.late("r", TraceEvent(3.0, "transfer", 1, None, "prefill-0", "1 KiB"))
    store.late("r", TraceEvent(3.5, "transfer", 0, None, "prefill-0", "an older placement's"))
    events = store.find("r")[0].events
    assert [(e.what, e.note) for e in events] == [("queued", ""), ("end", "length"), ("transfer", "1 KiB")]
