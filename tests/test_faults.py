"""pdd.faults: names and values checked with errors that name them; the queries
the call sites make; run-time settings; a hang that a clear releases."""
from __future__ import annotations

import threading

import msgpack
import pytest

from pdd import faults
from pdd.admin.server import AdminServer
from pdd.config import ClusterConfig, RouterConfig
from pdd.router.router import Router
from pdd.transfer.base import TransferResult


@pytest.fixture(autouse=True)
def no_faults():
    faults.load_env({})
    yield
    faults.load_env({})


def test_parse_reads_every_kind_of_fault():
    assert faults.parse(" transfer.fail_rate=0.3, transfer.delay_s=1.5,reserve.drop_rate=1,"
                        "decode.hang_after_steps=50,prefill.step_delay_s=0,transfer.reject=1,seed=-4,") == {
        "transfer.fail_rate": 0.3, "transfer.delay_s": 1.5, "reserve.drop_rate": 1.0,
        "decode.hang_after_steps": 50.0, "prefill.step_delay_s": 0.0, "transfer.reject": 1.0, "seed": -4.0}
    assert faults.parse("") == {}


@pytest.mark.parametrize("text, error", [
    ("transfer.fail_rte=1", "unknown fault 'transfer.fail_rte'; known: "),
    ("router.hang_after_steps=3", "unknown fault 'router.hang_after_steps'"),
    ("transfer.fail_rate", "'transfer.fail_rate': expected NAME=VALUE"),
    ("transfer.fail_rate=1.5", "transfer.fail_rate: a rate must be in [0, 1], got '1.5'"),
    ("reserve.drop_rate=-0.1", "reserve.drop_rate: a rate must be in [0, 1]"),
    ("transfer.delay_s=soon", "transfer.delay_s: expected a number, got 'soon'"),
    ("transfer.delay_s=-1", "transfer.delay_s: seconds must be >= 0"),
    ("transfer.delay_s=nan", "transfer.delay_s: expected a number"),
    ("decode.hang_after_steps=0", "decode.hang_after_steps: must be >= 1"),
    ("decode.hang_after_steps=2.5", "decode.hang_after_steps: expected a whole number, got '2.5'"),
    ("transfer.reject=2", "transfer.reject: expected 0 or 1"),
    ("seed=1,seed=2", "seed: set twice"),
])
def test_bad_settings_are_refused_naming_what_is_wrong(text, error):
    with pytest.raises(faults.FaultError) as e:
        faults.parse(text)
    assert error in str(e.value)


def test_pdd_faults_is_read_at_start_and_a_bad_one_is_an_error():
    assert faults.load_env({"PDD_FAULTS": "transfer.fail_rate=1"}) == {"transfer.fail_rate": 1.0}
    assert faults.get("transfer.fail_rate") == 1.0 and faults.get("transfer.delay_s") == 0.0
    with pytest.raises(faults.FaultError, match="PDD_FAULTS: unknown fault 'x'"):
        faults.load_env({"PDD_FAULTS": "x=1"})


def test_rates_draw_from_a_seeded_rng():
    def draws(seed):
        faults.load_env({"PDD_FAULTS": f"transfer.fail_rate=0.3,seed={seed}"})
        return [faults.should_fail("transfer") for _ in range(400)]
    first = draws(1)
    assert first == draws(1) and first != draws(2)
    assert 80 <= sum(first) <= 160
    assert not faults.should_fail("reserve")   # drop_rate unset
    faults.apply({"reserve.drop_rate": 1})
    assert all(faults.should_fail("reserve") for _ in range(10))


def test_apply_sets_and_clears_at_run_time():
    faults.load_env({"PDD_FAULTS": "transfer.delay_s=2"})
    assert faults.apply({"transfer.fail_rate": 1}) == {"transfer.delay_s": 2.0, "transfer.fail_rate": 1.0}
    assert faults.apply({}, clear=True) == {} and faults.current() == {}
    with pytest.raises(faults.FaultError, match="unknown fault"):
        faults.apply({"nope": 1})
    assert faults.acts_in("decode.hang_after_steps", "decode")
    assert not faults.acts_in("decode.hang_after_steps", "prefill")
    assert faults.acts_in("transfer.fail_rate", "prefill") and not faults.acts_in("transfer.fail_rate", "decode")


def result(rid, ok=True):
    return TransferResult(rid, ok, "" if ok else "real failure", bytes=10)


def test_transfer_results_fail_and_delay_as_set():
    batch = [result("a"), result("b", ok=False)]
    assert faults.transfer_results(batch) is batch          # nothing set: untouched
    faults.apply({"transfer.fail_rate": 1})
    assert faults.fail_transfer("a")                         # doomed at its finish...
    out = faults.transfer_results([result("a"), result("b", ok=False)])
    assert [(r.request_id, r.ok) for r in out] == [("a", False), ("b", False)]   # ...failed at its result
    assert out[0].error == "injected fault (transfer.fail_rate=1)" and out[1].error == "real failure"
    faults.apply({"transfer.fail_rate": 0, "transfer.delay_s": 3600})
    assert faults.transfer_results([result("c")]) == []     # held back...
    faults.apply({}, clear=True)
    assert [r.request_id for r in faults.transfer_results([])] == []   # ...for its delay, set when it came
    faults.load_env({})
    assert faults.transfer_results([result("d")])[0].ok


def test_a_hang_blocks_from_the_nth_step_until_cleared():
    faults.apply({"decode.hang_after_steps": 3})
    faults.hang("decode", 1)                     # step 2: runs
    faults.hang("prefill", 10)                   # another role: runs
    entered, left = threading.Event(), threading.Event()

    def step():
        entered.set()
        faults.hang("decode", 2)                 # step 3: blocks
        left.set()

    t = threading.Thread(target=step, daemon=True)
    t.start()
    assert entered.wait(10)
    assert not left.is_set()
    faults.apply({"decode.hang_after_steps": 100})   # set again, to a later step: step 3 may run
    assert left.wait(10)
    t.join(10)
    faults.apply({"decode.hang_after_steps": 1})
    left.clear()
    t = threading.Thread(target=step, daemon=True)
    t.start()
    faults.release_hangs()                        # the worker stops
    assert left.wait(10) and faults.current() == {}


def admin_call(server: AdminServer, cmd: str, *args) -> dict:
    return server.handle(msgpack.packb({"token": "t" * 20, "cmd": cmd, "args": list(args)}))


def test_run_time_faults_are_refused_unless_the_router_allows_them():
    server = AdminServer(Router(ClusterConfig()), "tcp://127.0.0.1:0", "t" * 20)
    reply = admin_call(server, "faults", "set", "transfer.fail_rate=1")
    assert not reply["ok"] and "router.allow_fault_injection = true" in reply["error"], reply
    assert not admin_call(server, "faults", "clear")["ok"]
    shown = admin_call(server, "faults")
    assert shown == {"ok": True, "result": {"allow_fault_injection": False, "workers": {}}}


def test_run_time_fault_commands_name_what_is_wrong():
    router = Router(ClusterConfig(router=RouterConfig(allow_fault_injection=True)))
    server = AdminServer(router, "tcp://127.0.0.1:0", "t" * 20)
    assert "unknown fault 'transfer.fail'" in admin_call(server, "faults", "set", "transfer.fail=1")["error"]
    assert "no worker 'decode-9'" in admin_call(server, "faults", "set", "transfer.fail_rate=1", "decode-9")["error"]
    assert "expected set or clear" in admin_call(server, "faults", "reset")["error"]
    assert "acts in prefill workers only" in admin_call(server, "faults", "set", "transfer.fail_rate=1")["error"]
    reply = admin_call(server, "faults", "clear")
    assert reply == {"ok": True, "result": {"sent_to": [], "cleared": {}}}
