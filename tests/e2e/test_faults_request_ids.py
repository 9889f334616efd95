"""A client's request id (X-Request-Id) used again, with real processes (`pdd
up` on loopback): what the workers still send about the request that had the
id before is never taken for the new one's. Faults are injected through
pdd.faults, at run time over the admin socket."""
from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import torch

from pdd import SamplingParams
from pdd.admin.client import call_with_config
from benchmarks.load import start_cluster
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.test_disagg_faults import assert_all_free
from tests.engine.helpers import random_prompts


def test_an_id_sent_again_gets_its_own_answer_not_the_one_that_left(tmp_path, tiny_model, offline):
    """Request A ("dup") is inside its first engine step (held there by an
    injected hang) when its client leaves; request B, another prompt, comes as
    "dup" and is placed on the same worker. The held step then ends and hands
    back A's first token, which the worker sends before it reads A's Abort: B's
    answer must be B's alone. (Without async scheduling a step's tokens come
    back from that step, so the stale token is sure to be sent; with it, the
    same message is one still on its way when B is placed.)"""
    env = {"PDD_ROUTER__ALLOW_FAULT_INJECTION": "1", "PDD_ENGINE__ASYNC_SCHEDULING": "false"}
    c = UpCluster(tmp_path / "run", tiny_model, "--mode", "colocated", "--workers", "1", env=env).start()
    try:
        prompt_a, prompt_b = random_prompts([20, 30], seed=71)
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        expected = offline.generate([prompt_b], sp)[0].text

        async def main():
            loop = asyncio.get_running_loop()

            def wait(cond, what):
                return loop.run_in_executor(None, _wait_for, cond, 60.0, what)

            c.admin("faults", "set", "colocated.hang_after_steps=1")
            await wait(lambda: c.admin("faults")["workers"]["colocated-0"], "the fault set")
            headers = {"X-Request-Id": "dup"}
            body = {"model": c.model_name, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
                a = await session.post(c.url + "/v1/completions", json={**body, "prompt": prompt_a, "stream": True},
                                       headers=headers)
                await wait(lambda: c.workers()["colocated-0"]["step_running_s"] > 0, "A's first step held")
                a.close()
                await wait(lambda: not c.admin("requests"), "A ended at the router")
                b = asyncio.create_task(session.post(c.url + "/v1/completions", json={**body, "prompt": prompt_b},
                                                     headers=headers))
                await wait(lambda: c.admin("requests"), "B placed")
                c.admin("faults", "clear")
                async with await b as resp:
                    assert resp.status == 200
                    return (await resp.json())["choices"][0]["text"]

        assert asyncio.run(main()) == expected
        assert_all_free(c)
    finally:
        assert c.stop() == 0, c.logs()


def test_after_a_router_restart_an_id_sent_again_gets_its_own_answer(tmp_path, tiny_model, offline, monkeypatch):
    """As above across a router restart (kill -9, restarted on the same
    addresses: no `pdd up`, which stops the cluster when its router dies). The
    worker, told to register again, registers at once while its engine is still
    held in A's first step; B ("dup" again) is placed on it by the new router,
    whose epochs start again. Released, the step hands back A's first token:
    the worker, which has dropped all it held, must not send it."""
    monkeypatch.setenv("PDD_ROUTER__ALLOW_FAULT_INJECTION", "1")
    monkeypatch.setenv("PDD_ENGINE__ASYNC_SCHEDULING", "false")
    if not torch.cuda.is_available():
        monkeypatch.setenv("PDD_ENGINE__DEVICE", "cpu")
    cluster = start_cluster(tmp_path / "run", [("colocated", "colocated-0", None)], str(tiny_model), "colocated")
    try:
        router = next(c for c in cluster.children if c.name == "router")
        prompt_a, prompt_b = random_prompts([20, 30], seed=72)
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        expected = offline.generate([prompt_b], sp)[0].text

        def admin(*args):
            return call_with_config(cluster.cfg, *args)

        async def main():
            loop = asyncio.get_running_loop()

            def wait(cond, what):
                return loop.run_in_executor(None, _wait_for, cond, 120.0, what)

            admin("faults", "set", "colocated.hang_after_steps=1")
            await wait(lambda: admin("faults")["workers"]["colocated-0"], "the fault set")
            headers = {"X-Request-Id": "dup"}
            body = {"model": cluster.model_name, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
                a = asyncio.create_task(session.post(cluster.url + "/v1/completions",
                                                     json={**body, "prompt": prompt_a}, headers=headers))
                await wait(lambda: admin("workers")[0]["step_running_s"] > 0, "A's first step held")
                os.kill(router.proc.pid, signal.SIGKILL)
                await asyncio.gather(a, return_exceptions=True)   # its connection went with the router
                router.proc.wait()
                cluster.restart(router)
                await loop.run_in_executor(None, cluster.wait_ready, 120)   # the worker registered again
                b = asyncio.create_task(session.post(cluster.url + "/v1/completions",
                                                     json={**body, "prompt": prompt_b}, headers=headers))
                await wait(lambda: admin("requests"), "B placed")
                admin("faults", "clear")
                async with await b as resp:
                    assert resp.status == 200
                    return (await resp.json())["choices"][0]["text"]

        assert asyncio.run(main()) == expected
        workers = _wait_for(lambda: [w for w in admin("workers") if w["free_blocks"] == w["num_blocks"]
                                     and w["running"] == 0 and w["waiting"] == 0], 60.0, "every block free")
        assert [w["worker_id"] for w in workers] == ["colocated-0"]
    finally:
        cluster.stop()
