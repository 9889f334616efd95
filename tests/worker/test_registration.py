"""A worker's registration as the router answers it, over a real ZeroMQ
socket (fake router): told it was replaced, it exits for good; unanswered for
the router's liveness window, it says so and goes on."""
from __future__ import annotations

import logging

from pdd.config import EXIT_REPLACED
from pdd.protocol import messages as m
from tests.engine.helpers import greedy, random_prompts
from tests.worker.harness import run_worker, worker_config


def test_a_process_told_it_was_replaced_exits_not_to_be_restarted(tiny_model, caplog):
    async def scenario(router):
        await router.send(m.Replaced())
        await router.next(m.Heartbeat)    # the worker goes on until the exit ends the scenario

    with caplog.at_level(logging.ERROR, logger="pdd.worker.worker"):
        _, code = run_worker(worker_config(tiny_model), scenario)
    assert code == EXIT_REPLACED
    assert "another process registered under this worker id" in caplog.text


def test_its_connection_is_its_own_per_process(tiny_model):
    """Two processes under one worker id never share a connection (the router
    could not tell the old one it was replaced)."""
    async def scenario(router):
        register = await router.registered("colocated-0")
        return router.connections["colocated-0"], register.incarnation

    (conn, incarnation), code = run_worker(worker_config(tiny_model), scenario)
    assert conn == f"colocated-0/{incarnation}" and code == 0


def test_a_router_that_does_not_answer_is_told_in_the_log_and_the_worker_goes_on(tiny_model, offline, caplog):
    """This router answers Registers only, never a heartbeat: past its
    liveness window the worker says so, once, and goes on (a router restart
    or stall must not end the workers): it heartbeats on, and a reservation it
    holds is still there to compute when the router speaks again."""
    prompt = random_prompts([40], seed=8)[0]

    def said(text: str) -> int:
        return sum(text in r.getMessage() for r in caplog.records)

    async def scenario(router):
        router.register_reply = m.RegisterReply(ok=True, heartbeat_interval_s=0.02, liveness_s=0.3)
        await router.registered("decode-0")
        await router.send(m.Reserve("r", 1, prompt, greedy(5, ignore_eos=True), 600.0))
        reserved = await router.next(m.Reserved)
        await router.until(lambda: said("no answer from the router"))
        await router.next(m.Heartbeat)
        await router.next(m.Heartbeat)             # heartbeats go on, and the warning is not repeated
        warnings = said("no answer from the router")
        await router.send(m.PrefillLocally("r", 2, reserved.lease_id))
        return warnings, await router.tokens("r", 2)

    with caplog.at_level(logging.WARNING, logger="pdd.worker.worker"):
        (warnings, tokens), code = run_worker(worker_config(tiny_model, role="decode"), scenario)
    assert code == 0 and warnings == 1
    assert tokens == offline.generate([prompt], greedy(5, ignore_eos=True))[0].token_ids
    assert said("the router answers again") >= 1


def test_a_worker_registers_how_its_scheduler_orders_long_prompts(tiny_model):
    """The router predicts a prompt's wait in the order this worker's scheduler
    keeps (short prompts before long ones): the worker's own settings travel in
    its Register, an unset threshold as 0 (first come, first served)."""
    async def scenario(router):
        return (await router.registered("prefill-0")).step

    shape = dict(long_prefill_token_threshold=300, max_long_partial_prefills=2, long_prefill_min_share=0.5)
    step, code = run_worker(worker_config(tiny_model, role="prefill", **shape), scenario)
    assert code == 0 and (step.long_threshold, step.long_partial, step.long_share) == (300, 2, 0.5)
    step, code = run_worker(worker_config(tiny_model, role="prefill", long_prefill_token_threshold=None), scenario)
    assert code == 0 and step.long_threshold == 0
