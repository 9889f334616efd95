"""Injected faults in a real worker (pdd.faults), set at run time over the
control bus as the router forwards them (SetFaults)."""
from __future__ import annotations

import pytest

from pdd import faults
from pdd.protocol import messages as m
from tests.engine.helpers import greedy, random_prompts
from tests.worker.harness import run_worker, run_workers, worker_config


@pytest.fixture(autouse=True)
def no_faults():
    faults.load_env({})   # the workers here share this process's settings
    yield
    faults.load_env({})


def expected(offline, prompt, n):
    return offline.generate([prompt], greedy(n, ignore_eos=True))[0].token_ids


def test_a_hang_set_at_run_time_blocks_steps_while_heartbeats_go_on(tiny_model, offline):
    prompt = random_prompts([20], seed=31)[0]

    async def scenario(router):
        await router.send(m.SetFaults({"colocated.hang_after_steps": 2}))
        await router.send(m.Admit("r", 1, prompt, greedy(6, ignore_eos=True)))
        stuck = await router.next(m.Heartbeat, lambda h: h.step_running_s > 0)
        later = await router.next(m.Heartbeat, lambda h: h.step_running_s > stuck.step_running_s)
        await router.send(m.SetFaults(clear=True))
        return stuck, later, await router.tokens("r", 1)

    (stuck, later, tokens), code = run_worker(worker_config(tiny_model), scenario)
    assert stuck.faults == {"colocated.hang_after_steps": 2.0}
    assert later.steps_completed == stuck.steps_completed   # no step ends while it hangs
    assert tokens == expected(offline, prompt, 6)
    assert code == 0


def test_a_hung_worker_still_stops(tiny_model):
    async def scenario(router):
        await router.send(m.SetFaults({"colocated.hang_after_steps": 1}))
        await router.send(m.Admit("r", 1, [5, 6, 7], greedy(4)))
        await router.next(m.Heartbeat, lambda h: h.step_running_s > 0)

    _, code = run_worker(worker_config(tiny_model), scenario)   # then Shutdown: the hang is released
    assert code == 0


def test_injected_transfer_failures_and_dropped_reserves(tiny_model, offline):
    prompt = random_prompts([40], seed=32)[0]
    sampling = greedy(5, ignore_eos=True)

    async def disaggregated(router, rid, decode):
        await router.send(m.Prefill(rid, 1, prompt, sampling), to="prefill-0")
        await router.send(m.Reserve(rid, 1, prompt, sampling, 30.0), to="decode-0")
        reserved = await router.next(m.Reserved, lambda r: r.request_id == rid)
        await router.send(m.KVTarget(rid, 1, "decode-0", decode.data_addr, reserved.block_ids,
                                     reserved.num_cached_tokens // 16, reserved.lease_id), to="prefill-0")
        return reserved

    async def scenario(router):
        decode = await router.registered("decode-0")
        await router.send(m.SetFaults({"transfer.fail_rate": 1}), to="prefill-0")
        reserved = await disaggregated(router, "a", decode)
        failed = await router.next(m.PrefillFailed, lambda f: f.request_id == "a")
        # As the router falls back: the decode worker prefills in the blocks it holds.
        await router.send(m.PrefillLocally("a", 1, reserved.lease_id), to="decode-0")
        fallback = await router.tokens("a", 1)
        # Dropped: no Reserved ever comes for "b"; "c", sent after the fault is
        # cleared, is answered (and would be answered after "b", in order).
        await router.send(m.SetFaults({"reserve.drop_rate": 1}), to="decode-0")
        await router.send(m.Reserve("b", 1, prompt, sampling, 30.0), to="decode-0")
        await router.send(m.SetFaults(clear=True), to="decode-0")
        await router.send(m.Reserve("c", 1, prompt, sampling, 30.0), to="decode-0")
        await router.next(m.Reserved, lambda r: r.request_id == "c")
        # Only now: both workers share this process's fault settings, and the
        # prefill worker could clear them before the decode worker read "b".
        await router.send(m.SetFaults(clear=True), to="prefill-0")
        reserved_for = [r.request_id for r in router.received if isinstance(r, m.Reserved)]
        await router.send(m.Abort(["c"]), to="decode-0")
        await disaggregated(router, "d", decode)
        await router.next(m.PrefillDone, lambda d: d.request_id == "d")   # the decode worker started on its own
        return failed, fallback, reserved_for, await router.tokens("d", 1)

    cfgs = [worker_config(tiny_model, role="prefill"), worker_config(tiny_model, role="decode")]
    (failed, fallback, reserved_for, ok), codes = run_workers(cfgs, scenario)
    assert failed.error == "KV transfer failed: injected fault (transfer.fail_rate=1)"
    assert fallback == expected(offline, prompt, 5) == ok
    assert reserved_for == ["a", "c"]
    assert codes == [0, 0]
