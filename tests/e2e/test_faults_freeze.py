"""Workers frozen (SIGSTOP) and thawed (SIGCONT) with real processes (`pdd up`
on loopback): a frozen worker is taken for lost; thawed, it is told to
register again, drops what it held and serves. Requests it held continue
elsewhere, and none waits out a deadline for a message that cannot come.
Faults are injected through pdd.faults, at run time over the admin socket."""
from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from pdd import SamplingParams
from tests.e2e.cluster import UpCluster, _wait_for
from tests.e2e.streams import stream_text
from tests.e2e.test_disagg import metric
from tests.e2e.test_disagg_faults import assert_all_free
from tests.engine.helpers import random_prompts


@pytest.fixture(scope="module")
def p1d1(tmp_path_factory, tiny_model):
    """1 prefill + 1 decode, faults at run time. A hung step, a Reserve and a
    lease wait minutes before anything moves: only the freeze moves requests."""
    env = {"PDD_ROUTER__ALLOW_FAULT_INJECTION": "1", "PDD_WORKER__STEP_TIMEOUT_S": "600",
           "PDD_ROUTER__RESERVE_TIMEOUT_S": "600", "PDD_ROUTER__KV_LEASE_TTL_S": "60"}
    with UpCluster(tmp_path_factory.mktemp("p1d1"), tiny_model, "--mode", "disagg", "--prefill", "1",
                   "--decode", "1", env=env) as c:
        yield c


def fallbacks(c, reason: str) -> float:
    return metric(c, "pdd_disagg_fallbacks_total", f'{{reason="{reason}"}}')


def served_disaggregated(c) -> float:
    return metric(c, "pdd_requests_total", '{finish_reason="length",mode="disagg"}')


def test_a_prefill_worker_frozen_and_back_before_the_reservation_gets_the_prompt_again(p1d1, offline):
    """The prompt goes to prefill-0 while decode-0's engine is blocked (its
    Reserve waits); prefill-0 is frozen past its liveness, taken for lost, then
    thawed: it drops what it held (the prompt too) and registers again before
    decode-0 answers. The Reserved then picks prefill-0 again, which must be
    sent the prompt with its KVTarget: the request is prefilled there and
    served disaggregated, not left to wait out its 60 s lease."""
    c = p1d1
    busy, prompt = random_prompts([8, 40], seed=61)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = offline.generate([prompt], sp)[0].text
    timeouts, disagg = fallbacks(c, "prefill_timeout"), served_disaggregated(c)

    async def main():
        loop = asyncio.get_running_loop()

        def wait(cond, what):
            return loop.run_in_executor(None, _wait_for, cond, 60.0, what)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            # A stream keeps decode-0 stepping, so that the hang set next blocks its engine.
            first = asyncio.Event()
            other = asyncio.create_task(stream_text(session, c, busy, SamplingParams(max_tokens=2000), first))
            await first.wait()
            c.admin("faults", "set", "decode.hang_after_steps=1", "decode-0")
            await wait(lambda: c.workers()["decode-0"]["step_running_s"] > 0, "decode-0's step blocked")
            pid = c.workers()["prefill-0"]["pid"]
            os.kill(pid, signal.SIGSTOP)
            try:
                task = asyncio.create_task(stream_text(session, c, prompt, sp))
                await wait(lambda: any(r["phase"] == "reserving" for r in c.admin("requests")), "the Reserve sent")
                await wait(lambda: "prefill-0" not in c.workers(), "prefill-0 taken for lost")
            finally:
                os.kill(pid, signal.SIGCONT)
            await wait(lambda: c.workers().get("prefill-0", {}).get("pid") == pid, "prefill-0 registered again")
            c.admin("faults", "clear", "decode-0")
            result = await task
            other.cancel()
            return result

    assert asyncio.run(main()) == (expected, "length", [])
    assert fallbacks(c, "prefill_timeout") == timeouts
    assert served_disaggregated(c) == disagg + 1     # its KV came from prefill-0
    assert_all_free(c)
