"""The worker process around one engine, driven over ZeroMQ by a fake router:
one engine thread, commands between steps, failing steps, epochs, heartbeats."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading

import pytest
import zmq

from pdd.api import SamplingParams
from pdd.config import EXIT_REFUSED, EXIT_WORKER_FAILED
from pdd.engine import model_runner
from pdd.engine.engine import LLMEngine
from pdd.engine.scheduler import Scheduler
from pdd.kv.hashing import ROOT_HASH, block_hashes
from pdd.kv.manager import KVCacheManager
from pdd.protocol import messages as m
from pdd.transfer.base import Handoff
from pdd.transfer.wire import decode_ack, encode_done
from pdd.worker import worker as worker_module
from pdd.worker.engine_thread import MAX_CONSECUTIVE_STEP_FAILURES
from tests.engine.helpers import greedy, random_prompts
from tests.worker.harness import EVENT_TIMEOUT_S, run_worker, run_workers, worker_config

POISON_SEED = 666_666
POISON = SamplingParams(max_tokens=8, seed=POISON_SEED)


def poison_sampler(monkeypatch, error: str = "forced fault in the sampler") -> None:
    """A forced fault: sampling a batch with a row seeded POISON_SEED raises, as a
    sampler bug that one request's values hit would."""
    real = model_runner.sample

    def sample(logits, batch):
        if bool((batch.seeds == POISON_SEED).any()):
            raise RuntimeError(error)
        return real(logits, batch)

    monkeypatch.setattr(model_runner, "sample", sample)


def expected(offline, prompt, max_tokens) -> list[int]:
    return offline.generate([prompt], greedy(max_tokens, ignore_eos=True))[0].token_ids


def test_a_failing_step_fails_its_requests_and_the_worker_serves_on(tiny_model, offline, monkeypatch):
    poison_sampler(monkeypatch)
    prompt = random_prompts([20], seed=1)[0]

    async def scenario(router):
        await router.send(m.Admit("bad", 1, prompt, POISON))
        failed = await router.next(m.RequestFailed)
        await router.send(m.Admit("good", 1, prompt, greedy(8, ignore_eos=True)))
        return failed, await router.tokens("good", 1), await router.idle_heartbeat()

    (failed, tokens, hb), code = run_worker(worker_config(tiny_model), scenario)
    assert (failed.request_id, failed.epoch, failed.retriable) == ("bad", 1, False)
    assert "forced fault in the sampler" in failed.error
    assert tokens == expected(offline, prompt, 8)
    assert hb.free_blocks == hb.total_blocks
    assert code == 0


@pytest.mark.parametrize("fault", ["steps failing in a row", "device error", "recovery raises"])
def test_an_engine_that_cannot_go_on_exits_for_a_restart(tiny_model, monkeypatch, caplog, fault):
    poison_sampler(monkeypatch, "CUDA error: an illegal memory access" if fault == "device error" else "forced")
    if fault == "recovery raises":
        def wait_in_flight(self):  # a forced fault: the device cannot even be synchronised
            raise RuntimeError("forced fault while recovering")
        monkeypatch.setattr(LLMEngine, "wait_in_flight", wait_in_flight)
    failures_before_exit = MAX_CONSECUTIVE_STEP_FAILURES - 1 if fault == "steps failing in a row" else 0
    prompt = random_prompts([20], seed=1)[0]

    async def scenario(router):
        for i in range(failures_before_exit):
            await router.send(m.Admit(f"bad{i}", 1, prompt, POISON))
            await router.next(m.RequestFailed, lambda f: f.request_id == f"bad{i}")
        await router.send(m.Admit("last", 1, prompt, POISON))
        await asyncio.Event().wait()   # until the worker exits

    _, code = run_worker(worker_config(tiny_model), scenario)
    assert code == EXIT_WORKER_FAILED
    assert "the engine cannot go on" in caplog.text


def test_sigterm_drains_then_exits(tiny_model, offline):
    prompt = random_prompts([20], seed=2)[0]

    async def scenario(router):
        await router.send(m.Admit("r", 1, prompt, greedy(60, ignore_eos=True)))
        await router.next(m.TokenBatch)
        os.kill(os.getpid(), signal.SIGTERM)   # the worker's loop handles it
        tokens = await router.tokens("r", 1)
        await router.next(m.Goodbye)
        return tokens

    tokens, code = run_worker(worker_config(tiny_model), scenario)
    assert tokens == expected(offline, prompt, 60)
    assert code == 0


def test_commands_are_applied_between_steps_on_the_engine_thread(tiny_model, monkeypatch):
    events: list[tuple[str, str, str]] = []   # (call, begin|end, thread name)

    def trace(cls, name):
        real = getattr(cls, name)

        def traced(self, *args, **kwargs):
            events.append((name, "begin", threading.current_thread().name))
            try:
                return real(self, *args, **kwargs)
            finally:
                events.append((name, "end", threading.current_thread().name))

        monkeypatch.setattr(cls, name, traced)

    for cls, name in [(LLMEngine, "step"), (LLMEngine, "add_request"), (LLMEngine, "abort_request"),
                      (Scheduler, "num_waiting"), (KVCacheManager, "take_recent_hashes")]:
        trace(cls, name)   # the last two: what heartbeat snapshots read
    prompts = random_prompts([30] * 6, seed=3)

    async def scenario(router):
        for i, prompt in enumerate(prompts):   # each arrives while the earlier ones decode
            await router.send(m.Admit(f"r{i}", 1, prompt, greedy(40, ignore_eos=True)))
            await router.next(m.TokenBatch, lambda b: any(item.request_id == f"r{i}" for item in b.items))
        await router.send(m.Abort(["r0"]))
        await router.idle_heartbeat()

    _, code = run_worker(worker_config(tiny_model), scenario)
    assert code == 0
    assert {thread for _, _, thread in events} == {"pdd-engine"}
    in_step = False
    for name, phase, _ in events:
        if name == "step":
            in_step = phase == "begin"
        else:
            assert not in_step, f"{name} ran inside a step"
    # Commands did arrive while the engine was busy: some came between two steps.
    steps = [i for i, (name, phase, _) in enumerate(events) if name == "step" and phase == "begin"]
    adds = [i for i, (name, phase, _) in enumerate(events) if name == "add_request" and phase == "begin"]
    assert sum(steps[0] < i < steps[-1] for i in adds) >= len(prompts) - 1
    assert any(name == "abort_request" for name, _, _ in events)


def test_heartbeats_lose_no_published_block_hash(tiny_model):
    prompts = random_prompts([100, 70, 129, 40, 64, 90, 33, 120], seed=4)
    block_size = 16

    async def scenario(router):
        for i, prompt in enumerate(prompts):
            await router.send(m.Admit(f"r{i}", 1, prompt, greedy(25, ignore_eos=True)))
        outputs = [await router.tokens(f"r{i}", 1) for i in range(len(prompts))]
        await router.idle_heartbeat()
        heartbeats = [msg for msg in router.received if isinstance(msg, m.Heartbeat)]
        return outputs, [h for hb in heartbeats for h in hb.recent_hashes]

    (outputs, sent), code = run_worker(worker_config(tiny_model), scenario)
    assert code == 0
    published = []
    for prompt, out in zip(prompts, outputs):
        tokens = prompt + out
        computed = len(tokens) - 1   # the last sampled token never gets its KV computed
        published += block_hashes(tokens[:computed // block_size * block_size], block_size, ROOT_HASH, 0)
    assert sorted(sent) == sorted(published)   # each one, once


def test_one_request_id_under_two_epochs(tiny_model, offline):
    a, b = random_prompts([20, 24], seed=5)

    async def scenario(router):
        # Epoch 1 still runs here when the router places the request here again.
        await router.send(m.Admit("r", 1, a, greedy(300, ignore_eos=True)))
        await router.send(m.Admit("r", 2, b, greedy(6, ignore_eos=True)))
        short = await router.tokens("r", 2)
        await router.send(m.Admit("r", 1, b, greedy(6)))   # a placement held here, again: refused
        duplicate = await router.next(m.RequestFailed)
        await router.send(m.Abort(["r"]))
        hb = await router.idle_heartbeat()
        first = [t for item in router.items("r", 1) for t in item.token_ids]
        return short, duplicate, hb, first

    (short, duplicate, hb, first), code = run_worker(worker_config(tiny_model), scenario)
    assert short == expected(offline, b, 6)
    assert first and first == expected(offline, a, 300)[:len(first)]
    assert (duplicate.request_id, duplicate.epoch) == ("r", 1) and "already placed" in duplicate.error
    assert hb.free_blocks == hb.total_blocks   # the abort dropped every epoch
    assert code == 0


def done_message(data_addr: str, eid: str, lease_id: str, first_token: int) -> None:
    """What a prefill worker whose request sent no pages sends last (tcp): the
    done message with the first token. Waits for its ack."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(data_addr)
        sock.send(encode_done(request_id=eid, lease_id=lease_id, seq=0, handoff=Handoff(first_token).to_dict()))
        assert sock.poll(EVENT_TIMEOUT_S * 1000), "no ack to the done message"
        assert decode_ack(sock.recv())["ok"]
    finally:
        sock.close()
        ctx.term()


def test_decode_worker_reservation_epochs_and_a_bad_first_token(tiny_model, offline):
    prompt = random_prompts([40], seed=6)[0]

    async def scenario(router):
        decode = await router.registered("decode-0")
        await router.send(m.Reserve("r", 1, prompt, greedy(5, ignore_eos=True), 30.0))
        reserved = await router.next(m.Reserved)
        # The router fell back to a local prefill and placed the request anew.
        await router.send(m.PrefillLocally("r", 2, reserved.lease_id))
        tokens = await router.tokens("r", 2)
        await router.send(m.Reserve("p", 1, prompt, greedy(5), 30.0))
        second = await router.next(m.Reserved)
        # A first token outside the vocabulary comes with the KV: that request fails alone.
        await asyncio.to_thread(done_message, decode.data_addr, "p#1", second.lease_id, 10**9)
        failed = await router.next(m.RequestFailed)
        return reserved, tokens, failed, await router.idle_heartbeat()

    (reserved, tokens, failed, hb), code = run_worker(worker_config(tiny_model, role="decode"), scenario)
    assert reserved.ok and reserved.epoch == 1
    assert tokens == expected(offline, prompt, 5)
    assert (failed.request_id, failed.epoch, failed.retriable) == ("p", 1, False)
    assert failed.error.startswith("first_token:")
    assert hb.free_blocks == hb.total_blocks and hb.transfer["leases"] == 0
    assert code == 0


def test_a_target_with_too_few_destination_blocks_fails_at_once(tiny_model):
    prompt = random_prompts([40], seed=7)[0]   # 3 blocks of 16

    def target(rid, blocks, skip=0):
        return m.KVTarget(rid, 1, "decode-0", "tcp://127.0.0.1:9", blocks, skip, "lease")

    async def scenario(router):
        for rid in ("short", "skip"):
            await router.send(m.Prefill(rid, 1, prompt, greedy(1)))
        await router.send(target("short", [4, 5]))
        await router.send(target("skip", [4, 5, 6], skip=4))
        failures = [await router.next(m.PrefillFailed) for _ in range(2)]
        return failures, await router.idle_heartbeat()

    (failures, hb), code = run_worker(worker_config(tiny_model, role="prefill"), scenario)
    errors = {f.request_id: f.error for f in failures}
    assert errors["short"].startswith("dst_block_ids:") and "needs 3" in errors["short"]
    assert errors["skip"].startswith("skip_blocks:")
    assert hb.free_blocks == hb.total_blocks   # no block stays held for a target that was refused
    assert code == 0


POISON_MESSAGES = {
    "temperature": dict(sampling=SamplingParams(temperature=float("nan"))),
    "top_k": dict(sampling=SamplingParams(top_k=-7)),
    "stop_token_ids": dict(sampling=SamplingParams(stop_token_ids=[10**9])),
    "logprobs": dict(sampling=SamplingParams(logprobs=10**6)),
    "stop": dict(sampling=SamplingParams(stop=["x"] * 10_000)),
    "prompt": dict(prompt=[1, 2, 10**9]),
    "num_prior_output_tokens": dict(num_prior_output_tokens=-1),
}


def test_poison_values_from_the_router_fail_their_request_only(tiny_model, offline):
    prompt = random_prompts([20], seed=8)[0]

    async def scenario(router):
        for field, poison in POISON_MESSAGES.items():
            await router.send(m.Admit(field, 1, poison.get("prompt", prompt), poison.get("sampling", greedy(4)),
                                      poison.get("num_prior_output_tokens", 0)))
        failures = [await router.next(m.RequestFailed) for _ in POISON_MESSAGES]
        await router.send(m.Admit("good", 1, prompt, greedy(8, ignore_eos=True)))
        return failures, await router.tokens("good", 1)

    (failures, tokens), code = run_worker(worker_config(tiny_model), scenario)
    for f in failures:
        assert f.error.startswith(f"{f.request_id}:") and not f.retriable, f
    assert sorted(f.request_id for f in failures) == sorted(POISON_MESSAGES)
    assert tokens == expected(offline, prompt, 8)
    assert code == 0


@pytest.fixture
def hanging_step(monkeypatch):
    """A forced fault: the first step that runs a request whose id starts with
    "hang" blocks until the test releases it (or the test ends)."""
    release = threading.Event()
    real = LLMEngine.step

    def step(self):
        if not release.is_set() and any(eid.startswith("hang") for eid in self.scheduler.requests):
            release.wait(EVENT_TIMEOUT_S)
        return real(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    yield release
    release.set()


def test_a_hanging_step_shows_in_the_heartbeats(tiny_model, hanging_step):
    prompt = random_prompts([20], seed=9)[0]

    async def scenario(router):
        await router.send(m.Admit("hang", 1, prompt, greedy(4, ignore_eos=True)))
        # The event loop still answers while the engine thread is stuck.
        stuck = await router.next(m.Heartbeat, lambda h: h.step_running_s > 0)
        later = await router.next(m.Heartbeat, lambda h: h.step_running_s > stuck.step_running_s)
        hanging_step.set()
        tokens = await router.tokens("hang", 1)
        done = await router.next(m.Heartbeat, lambda h: h.step_running_s == 0 and h.running == 0)
        return stuck, later, tokens, done

    (stuck, later, tokens, done), code = run_worker(worker_config(tiny_model), scenario)
    assert later.steps_completed == stuck.steps_completed       # no progress while it hangs
    assert len(tokens) == 4 and done.steps_completed > stuck.steps_completed
    assert code == 0


def test_a_second_sigterm_stops_even_a_hanging_worker(tiny_model, hanging_step, monkeypatch):
    monkeypatch.setattr(worker_module, "ENGINE_STOP_TIMEOUT_S", 0.1)
    prompt = random_prompts([20], seed=9)[0]

    async def scenario(router):
        await router.send(m.Admit("hang", 1, prompt, greedy(4)))
        await router.next(m.Heartbeat, lambda h: h.step_running_s > 0)
        os.kill(os.getpid(), signal.SIGTERM)   # drain: it cannot, the step hangs
        await router.next(m.Heartbeat, lambda h: h.draining)
        os.kill(os.getpid(), signal.SIGTERM)   # stop now
        await asyncio.Event().wait()           # until the worker exits

    _, code = run_worker(worker_config(tiny_model), scenario)
    assert code == EXIT_WORKER_FAILED          # it left its engine thread behind


def test_a_data_plane_that_cannot_start_refuses_to_run(tiny_model):
    ctx = zmq.Context()
    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    cfg = worker_config(tiny_model, role="decode")
    cfg = dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker, data_addr=f"tcp://127.0.0.1:{port}"))

    async def scenario(router):
        await asyncio.Event().wait()   # until the worker exits

    try:
        _, code = run_worker(cfg, scenario)
    finally:
        taken.close(0)
        ctx.term()
    assert code == EXIT_REFUSED


def by_position(items: list[m.TokenItem]) -> list[int]:
    """A request's output from items that may repeat tokens (the first token
    comes from both workers): one copy of each position, as the router keeps."""
    out: list[int] = []
    for item in items:
        out += item.token_ids[len(out) - item.position:]
    return out


async def disaggregate(router, rid: str, epoch: int, prompt: list[int], sampling,
                       target_after_first_token: bool = False):
    """As the router does: the prompt to prefill-0 and the reservation to
    decode-0 at once, then the KV target from the Reserved (after the first
    token, if asked). Returns (Reserved, FirstToken or None)."""
    decode = await router.registered("decode-0")
    await router.send(m.Prefill(rid, epoch, prompt, sampling), to="prefill-0")
    await router.send(m.Reserve(rid, epoch, prompt, sampling, 30.0), to="decode-0")
    reserved = await router.next(m.Reserved)
    # The prefill worker's first token may come before or after the decode worker's Reserved.
    first = await router.first(m.FirstToken, lambda f: f.request_id == rid) if target_after_first_token else None
    await router.send(m.KVTarget(rid, epoch, "decode-0", decode.data_addr, reserved.block_ids,
                                 reserved.num_cached_tokens // 16, reserved.lease_id), to="prefill-0")
    return reserved, first


def test_a_disaggregated_request_through_a_prefill_and_a_decode_worker(tiny_model, offline):
    """Real KV transfer (tcp) between two workers: the prefill worker sends under
    the placement's engine id, the decode worker leased its blocks under it, and
    starts when the data plane says the last page landed: the router sends it
    nothing after the Reserve."""
    prompt = random_prompts([40], seed=10)[0]
    sampling = greedy(8, ignore_eos=True)

    async def scenario(router):
        # The target is held back until the prompt is computed: its blocks wait, held, then go.
        _, first = await disaggregate(router, "r", 3, prompt, sampling, target_after_first_token=True)
        tokens = await router.tokens("r", 3)
        await router.until(lambda: any(isinstance(x, m.PrefillDone) for x in router.received))
        done = next(x for x in router.received if isinstance(x, m.PrefillDone))  # a transfer result wakes it
        return first, done, router.items("r", 3), tokens

    cfgs = [worker_config(tiny_model, role="prefill"), worker_config(tiny_model, role="decode")]
    (first, done, items, tokens), codes = run_workers(cfgs, scenario)
    assert (first.request_id, first.epoch, done.epoch) == ("r", 3, 3) and first.token == done.first_token
    assert done.transfer["blocks_sent"] == 3
    assert (items[0].position, items[0].token_ids) == (0, [first.token])   # from the data plane's last message
    assert [item.position for item in items] == list(range(8))
    assert tokens == expected(offline, prompt, 8)
    assert codes == [0, 0]


def test_prefill_locally_after_the_kv_landed_renews_the_epoch_and_runs_on(tiny_model, offline):
    """The router fell back (say the prefill worker's ack was lost) while the
    data plane had already started the request: the decode worker holds it under
    the new epoch and sends nothing more about it (it runs)."""
    prompt = random_prompts([40], seed=11)[0]
    sampling = greedy(120, ignore_eos=True)

    async def scenario(router):
        reserved, _ = await disaggregate(router, "r", 1, prompt, sampling)
        await router.next(m.TokenBatch, lambda b: b.worker_id == "decode-0" and b.items[0].position > 1)
        await router.send(m.PrefillLocally("r", 2, reserved.lease_id, first_token=None), to="decode-0")
        await router.until(lambda: any(item.finished for item in router.items("r", 2)))
        failed = [x for x in router.received if isinstance(x, m.RequestFailed)]
        return router.items("r", 1) + router.items("r", 2), failed, await router.idle_heartbeat()

    cfgs = [worker_config(tiny_model, role="prefill"), worker_config(tiny_model, role="decode")]
    (items, failed, hb), codes = run_workers(cfgs, scenario)
    assert failed == []
    assert by_position(items) == expected(offline, prompt, 120)
    assert hb.free_blocks == hb.total_blocks
    assert codes == [0, 0]


def test_a_prefill_worker_runs_a_request_whole_beside_the_prompts_it_ships(tiny_model, offline):
    """The router's last resort when no decode worker is left: Admit on a
    prefill worker streams tokens like a colocated worker, while a prompt for
    a decode worker computes in the same batches."""
    whole, shipped = random_prompts([30, 40], seed=11)

    async def scenario(router):
        await router.send(m.Admit("w", 2, whole, greedy(10, ignore_eos=True), num_prior_output_tokens=0))
        await router.send(m.Prefill("p", 1, shipped, greedy(8, ignore_eos=True)))
        first = await router.next(m.FirstToken)
        tokens = await router.tokens("w", 2)
        await router.send(m.Abort(["p"]))   # its target never comes: the held blocks go back
        await router.next(m.Heartbeat, lambda h: h.free_blocks == h.total_blocks and h.running == 0)
        return first, tokens, router.items("w", 2)

    (first, tokens, items), code = run_worker(worker_config(tiny_model, role="prefill"), scenario)
    assert tokens == expected(offline, whole, 10)
    assert [i.position for i in items] == list(range(10))
    assert (first.request_id, first.token) == ("p", expected(offline, shipped, 1)[0])
    assert code == 0


def test_told_to_register_again_it_drops_every_request_first(tiny_model):
    """ReRegister: the router restarted, or took this worker for lost and moved
    its requests elsewhere. Nothing held here is anyone's any more."""
    a, b = random_prompts([20, 24], seed=6)

    async def scenario(router):
        await router.send(m.Admit("r1", 1, a, greedy(900, ignore_eos=True)))
        await router.send(m.Admit("r2", 4, b, greedy(900, ignore_eos=True)))
        await router.until(lambda: router.items("r1", 1) and router.items("r2", 4))
        registered = len([x for x in router.received if isinstance(x, m.Register)])
        await router.send(m.ReRegister())
        again = await router.next(m.Register)
        hb = await router.idle_heartbeat()
        finished = [item for rid, ep in (("r1", 1), ("r2", 4)) for item in router.items(rid, ep) if item.finished]
        return registered, again, hb, finished

    (registered, again, hb, finished), code = run_worker(worker_config(tiny_model), scenario)
    assert registered == 1 and again.worker_id == "colocated-0"
    assert finished == []                      # dropped mid-way, not run to their end
    assert hb.free_blocks == hb.total_blocks
    assert code == 0
