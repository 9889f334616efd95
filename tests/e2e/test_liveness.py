"""Liveness with real processes (`pdd up`, 1 prefill + 1 decode on loopback):
a worker is lost when it is silent while both it and the router could run.
The router stopped, a worker stopped within the grace, both workers holding
their interpreter (the fault `<role>.gil_hold_s`, as a first grammar compile
did): every stream ends with its fault-free text, no worker is lost and no
request moves. A worker killed is lost without waiting out the grace (a
worker stopped past the grace is lost as ever: tests/e2e/test_faults_freeze.py,
test_control_plane.py)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from pdd import SamplingParams
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.streams import stream_all
from tests.e2e.test_disagg import metric
from tests.e2e.test_disagg_faults import assert_all_free
from tests.e2e.test_worker_ids import START_S, registered, serve
from tests.engine.helpers import random_prompts


@pytest.fixture(scope="module")
def p1d1(tmp_path_factory, tiny_model):
    with UpCluster(tmp_path_factory.mktemp("p1d1"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "1", env={"PDD_ROUTER__ALLOW_FAULT_INJECTION": "1"}) as c:
        yield c


def liveness(c, event: str) -> float:
    return metric(c, "pdd_worker_liveness_events_total", f'{{event="{event}"}}')


def moved(c) -> tuple[float, float]:
    """(workers lost, requests migrated) so far."""
    return liveness(c, "lost"), metric(c, "pdd_request_migrations_total")


def streams(offline, seed: int, max_tokens: int = 300):
    prompts = random_prompts([9, 30], seed=seed)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * len(prompts)
    return prompts, params, [(e.text, "length", []) for e in offline.generate(prompts, params)]


def test_a_router_stopped_for_3s_mid_stream_loses_no_worker(p1d1, offline):
    c = p1d1
    router, router_log = c.child_pid("router"), c.run_dir / "router.log"
    prompts, params, expected = streams(offline, seed=71)
    before, stalls = moved(c), router_log.read_text().count("its loop stalled")

    def stop_router():
        assert c.admin("requests"), "the streams ended before the router was stopped"
        os.kill(router, signal.SIGSTOP)
        try:
            time.sleep(3.0)    # the fault's length, not a bound on anything
        finally:
            os.kill(router, signal.SIGCONT)
    assert stream_all(c, prompts, params, while_running=stop_router) == expected
    assert router_log.read_text().count("its loop stalled") > stalls     # it saw its own stall
    assert moved(c) == before
    assert_all_free(c)


def test_a_worker_stopped_within_the_grace_keeps_its_stream(p1d1, offline):
    """decode-0 stopped until the router takes it for suspect (silent past the
    window), then continued: it is heard again and its streams go on there."""
    c = p1d1
    worker = c.workers()["decode-0"]["pid"]
    prompts, params, expected = streams(offline, seed=72)
    before, suspected, back = moved(c), liveness(c, "suspect"), liveness(c, "back")

    def suspect_or_gone() -> bool:
        w = c.workers().get("decode-0")
        return w is None or w.get("suspect", False)

    def stop_worker():
        os.kill(worker, signal.SIGSTOP)
        try:
            _wait_for(suspect_or_gone, 60.0, "decode-0 taken for suspect")
        finally:
            os.kill(worker, signal.SIGCONT)
    assert stream_all(c, prompts, params, while_running=stop_worker) == expected
    assert moved(c) == before
    # decode-0's at least (on a busy box prefill-0 may turn suspect for a moment too).
    assert liveness(c, "suspect") >= suspected + 1 and liveness(c, "back") >= back + 1
    assert c.workers()["decode-0"]["pid"] == worker
    assert_all_free(c)


def test_workers_holding_their_interpreter_lose_no_request(p1d1, offline):
    """Both workers' first step of a request holds the GIL 4 s (longer than the
    1.5 s window, within the 5 s grace), as a grammar compiler built on first
    use did: their heartbeats wait, the router takes them for suspect, and
    nothing is lost or moved."""
    c = p1d1
    prompts, params, expected = streams(offline, seed=73, max_tokens=20)
    before, suspected = moved(c), liveness(c, "suspect")
    c.admin("faults", "set", "prefill.gil_hold_s=4", "prefill-0")
    c.admin("faults", "set", "decode.gil_hold_s=4", "decode-0")
    try:
        assert stream_all(c, prompts, params) == expected
    finally:
        c.admin("faults", "clear")
    assert liveness(c, "suspect") >= suspected + 1    # their heartbeats did wait past the window
    assert moved(c) == before
    assert_all_free(c)


def test_a_worker_killed_is_lost_when_found_silent_without_the_grace(p1d1, tmp_path):
    """Its connection closed with it: the probe sent when it turns suspect
    cannot be delivered, and it is lost then (the reason says so), not after
    router.liveness_grace_s. (Started by hand: `pdd up` would restart it.)"""
    c = p1d1
    extra = serve(c, "decode", "extra-0", tmp_path / "extra-0.log")
    try:
        _wait_for(lambda: registered(c, "extra-0", extra.pid), START_S, "extra-0 registered")
        extra.kill()
        extra.wait(60)
        _wait_for(lambda: "extra-0" not in c.workers(), 60.0, "extra-0 counted lost")
    finally:
        if extra.poll() is None:
            extra.kill()
    assert "worker extra-0 lost (unreachable (sending heartbeat_ack))" in (c.run_dir / "router.log").read_text()
