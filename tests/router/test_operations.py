"""What the admin and the load balancer ask of the control plane, on a
simulated cluster (tests/router/sim.py): whether a new request would be placed
(`/ready`), an operator's abort, and drained ids kept for workers that register
later. The processes and the state file: tests/e2e/test_admin.py."""
from __future__ import annotations

from pdd.api import SamplingParams
from pdd.router.control import ABORTED_BY_OPERATOR
from pdd.router.requests import RequestError
from tests.router.sim import SimCluster
from tests.router.test_control import run_to_end


def p_and_d(mode: str = "auto") -> SimCluster:
    c = SimCluster(mode=mode)
    c.add_worker("p0", "prefill")
    c.add_worker("d0", "decode")
    return c


def test_a_drained_decode_worker_leaves_the_cluster_ready_while_the_prefill_worker_serves():
    c = p_and_d()
    assert c.control.can_place()
    c.registry.workers["d0"].draining = True
    assert c.control.can_place()                 # placement runs it whole on p0 (last resort)
    assert c.submit().decode_worker == "p0"
    c.registry.workers["p0"].draining = True
    assert not c.control.can_place()


def test_in_disagg_mode_a_drained_decode_worker_or_open_breakers_leave_nothing_to_serve():
    c = p_and_d("disagg")
    assert c.control.can_place()
    c.control.breakers.force("open", [("p0", "d0")], c.clock())
    assert not c.control.can_place()
    c.control.breakers.force(None, [("p0", "d0")], c.clock())
    c.registry.workers["d0"].draining = True
    assert not c.control.can_place()


def test_asking_changes_nothing():
    c = p_and_d()
    c.control.can_place()
    assert c.control.breakers.breakers == {} and not c.control.inflight.requests


def test_no_worker_or_a_hung_one_cannot_serve():
    c = SimCluster(mode="colocated")
    assert not c.control.can_place()
    c.add_worker("c0", "colocated")
    assert c.control.can_place()
    c.registry.workers["c0"].hung = True
    assert not c.control.can_place()


def test_an_operator_abort_ends_the_request_with_its_reason_and_its_workers_free_it():
    c = p_and_d()
    state = c.submit(max_tokens=50)
    c.step_inbox(c.workers["d0"])                 # the decode worker reserves
    assert c.workers["d0"].holds
    assert c.control.operator_abort(state.request_id) == [state.request_id]
    events = state.events
    assert isinstance(events[-1], RequestError) and str(events[-1]) == ABORTED_BY_OPERATOR
    assert not c.control.inflight.requests
    run_to_end(c)                                 # the Aborts reach the workers
    assert not any(w.holds for w in c.workers.values())
    assert c.control.operator_abort(state.request_id) == []


def test_an_abort_by_the_clients_id_takes_every_choice_and_every_repeat():
    c = SimCluster(mode="colocated")
    c.add_worker("c0", "colocated")
    first = c.submit(max_tokens=50, n=3)
    assert sorted(c.control.operator_abort(first.request_id.rsplit("-", 1)[0])) == [first.request_id]
    assert not c.control.inflight.requests                 # the waiting choices failed with the first
    a = c.control.submit([1, 2, 3], first.sampling, "same")
    b = c.control.submit([1, 2, 3], first.sampling, "same")
    assert (a.request_id, b.request_id) == ("same", "same#2")
    assert sorted(c.control.operator_abort("same")) == ["same", "same#2"]


def test_choices_of_an_id_in_flight_already_are_suffixed_as_a_repeated_request_is():
    """Two clients (or one retrying) send the same X-Request-Id with n > 1: both are served."""
    c = SimCluster(mode="colocated")
    c.add_worker("c0", "colocated")
    sampling = SamplingParams(max_tokens=50, seed=1)
    first = c.control.submit_choices([1, 2, 3], sampling, "same", 2)
    second = c.control.submit_choices([1, 2, 3], sampling, "same", 2)
    third = c.control.submit_choices([1, 2, 3], sampling, "same", 3)
    assert [s.request_id for s in first] == ["same-0", "same-1"]
    assert [s.request_id for s in second] == ["same-0#2", "same-1#2"]
    assert [s.request_id for s in third] == ["same-0#3", "same-1#3", "same-2#3"]
    assert [s.sampling.seed for s in third] == [1, 2, 3]
    # Each first choice, whose waiting choices fail with it.
    assert sorted(c.control.operator_abort("same")) == ["same-0", "same-0#2", "same-0#3"]
    assert not c.control.inflight.requests
    assert [t.request_id for t in c.control.traces.find("same-0")] == ["same-0", "same-0#2", "same-0#3"]


def test_a_drained_id_is_drained_whenever_it_registers():
    c = SimCluster()
    c.registry.drained.add("d0")
    c.add_worker("d0", "decode")
    assert not c.registry.workers["d0"].accepting
    c.add_worker("c0", "colocated")
    assert c.registry.workers["c0"].accepting
    c.registry.drained.discard("d0")
    c.restart("d0")                               # a new process under the id: undrained now
    assert c.registry.workers["d0"].accepting
