"""nixl's landing region as real workers reserve it (pdd.transfer.nixl_landing.
landing_size), each with its NIXL agent, driven over a real control socket: a
prefill worker that offers only nixl ships a request to a decode worker on one
host, as the router pairs them (nixl, the one backend both take). An "auto"
decode worker on loopback reserved no region: the pages go straight into its
blocks. One set to nixl, or given a size, reserved one: the pages land there."""
from __future__ import annotations

import dataclasses
import logging

import pytest

from pdd.protocol import messages as m
from pdd.transfer.nixl_agent import unavailable
from tests.engine.helpers import greedy, random_prompts
from tests.worker.harness import run_workers, worker_config

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

SET_SIZE = 16 << 20   # ample for the tiny model's 40-token request


def with_worker(cfg, **worker):
    return dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker, **worker))


@pytest.mark.parametrize("backend, setting, region", [
    ("auto", None, False),        # loopback: no other host reaches it
    ("nixl", None, True),         # nixl chosen: the default region
    ("auto", SET_SIZE, True)],    # a size set wins
    ids=["auto-loopback", "nixl", "auto-sized"])
def test_a_same_host_nixl_request_lands_where_the_decode_worker_reserved(tiny_model, offline, caplog, backend,
                                                                        setting, region):
    prompt = random_prompts([40], seed=12)[0]
    sampling = greedy(8, ignore_eos=True)

    async def scenario(router):
        decode = await router.registered("decode-0")
        await router.send(m.Prefill("r", 1, prompt, sampling, transfer_backend="nixl"), to="prefill-0")
        await router.send(m.Reserve("r", 1, prompt, sampling, 30.0), to="decode-0")
        reserved = await router.next(m.Reserved)
        await router.send(m.KVTarget("r", 1, "decode-0", decode.data_addr, reserved.block_ids,
                                     reserved.num_cached_tokens // 16, reserved.lease_id), to="prefill-0")
        tokens = await router.tokens("r", 1)
        # The decode worker's data-plane stats come with its heartbeats.
        beat = await router.next(m.Heartbeat, lambda h: h.worker_id == "decode-0" and h.running == 0
                                 and h.transfer.get("nixl_writers", 0) >= 1 and h.transfer["held_leases"] == 0)
        return tokens, beat.transfer

    cfgs = [with_worker(worker_config(tiny_model, role="prefill"), transfer_backend="nixl"),
            with_worker(worker_config(tiny_model, role="decode"), transfer_backend=backend,
                        nixl_landing_bytes=setting)]
    with caplog.at_level(logging.INFO, logger="pdd.worker.engine_thread"):
        (tokens, transfer), codes = run_workers(cfgs, scenario)
    assert tokens == offline.generate([prompt], sampling)[0].token_ids
    assert transfer["nixl_landed"] == int(region)          # copied in from the region, or written into the blocks
    assert (transfer["nixl_landing_bytes"] > 0) == region and transfer["nixl_landing_ranges"] == 0
    if setting is not None:
        assert transfer["nixl_landing_bytes"] == setting
    said = [r.getMessage() for r in caplog.records if "nixl landing region" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("worker decode-0: nixl landing region")   # none from prefill-0
    assert ("loopback" in said[0]) == (not region)
    assert codes == [0, 0]
