"""A worker's drain is bounded by worker.drain_timeout_s: past it, the worker
stops as a second signal would, says goodbye, and the router moves what still
runs (systemd's TimeoutStopSec would otherwise kill it mid-request)."""
from __future__ import annotations

import dataclasses

import pytest

from pdd import faults
from pdd.protocol import messages as m
from tests.engine.helpers import greedy, random_prompts
from tests.worker.harness import run_worker, worker_config


@pytest.fixture(autouse=True)
def no_faults():
    faults.load_env({})   # the worker here shares this process's settings
    yield
    faults.load_env({})


def test_a_drain_that_outlasts_its_deadline_stops_the_worker(tiny_model):
    cfg = worker_config(tiny_model)
    cfg = dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker, drain_timeout_s=0.5))
    prompt = random_prompts([20], seed=51)[0]

    async def scenario(router):
        # Slowed steps: the request would take over a minute to finish.
        await router.send(m.SetFaults({"colocated.step_delay_s": 0.2}))
        await router.send(m.Admit("r", 1, prompt, greedy(500, ignore_eos=True)))
        await router.next(m.TokenBatch, lambda b: any(item.request_id == "r" for item in b.items))
        await router.send(m.Shutdown(drain=True))
        await router.next(m.Goodbye)
        return router.items("r", 1)

    items, code = run_worker(cfg, scenario)
    assert items and not any(item.finished for item in items)   # it said goodbye mid-request
    assert code == 0
