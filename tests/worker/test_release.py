"""One release path: a placement ended in any worker-side state leaves nothing
held — no engine request, no block, no lease, no record, nothing in the
connector. What an Abort does to each placement of its request
(PlacementTable.release) is done here in each state.

Real engines, a real DecodeSide and PrefillSide joined by a real tcp data
plane on loopback, driven between steps as the engine thread drives them
(one thread does all). A one-sided (cuda_ipc) writer that outlives its
reservation is tests/transfer/test_held_blocks.py's; `done` lasts no longer
than the pass that reads the transfer's result, so no Abort can find it."""
from __future__ import annotations

import time

import pytest

from pdd.config import EngineConfig, WorkerConfig
from pdd.engine.engine import LLMEngine
from pdd.kv.layout import KVLayout
from pdd.protocol import messages as m
from pdd.worker.disagg import DecodeSide, PrefillSide, admit, step_messages
from pdd.worker.records import PlacementState, PlacementTable
from tests.engine.helpers import greedy, random_prompts

# A 100-token prompt takes four steps of this budget: there is a step at which it is half computed.
STEP_TOKENS = 32
PROMPT = random_prompts([100], seed=21)[0]
SAMPLING = greedy(20, ignore_eos=True)
# Generous: only a broken data plane takes this long on loopback.
EVENT_TIMEOUT_S = 60.0


class Worker:
    def __init__(self, model_dir, role: str):
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=64,
                                             max_num_batched_tokens=STEP_TOKENS))
        mc = self.engine.model_config
        layout = KVLayout("tiny", "w", str(self.engine.dtype).removeprefix("torch."), self.engine.cfg.block_size,
                          mc.num_layers, mc.num_kv_heads, mc.head_dim)
        wc = WorkerConfig(role=role, data_addr="tcp://127.0.0.1:0", transfer_backend="tcp")
        self.placements = PlacementTable(self.engine)
        side = DecodeSide if role == "decode" else PrefillSide
        self.side = side(self.engine, f"{role}-0", wc, layout, self.placements, lambda: None)
        self.replies: list[m.Message] = []

    def send(self, msg: m.Message) -> None:
        if isinstance(msg, m.Admit):
            self.replies += admit(self.engine, "w", self.placements, msg)
        else:
            self.replies += self.side.handle(msg)

    def step(self) -> None:
        """One pass of the engine thread: the side's poll, then a step."""
        self.replies += self.side.poll()
        if self.engine.has_unfinished():
            prefill = self.side if isinstance(self.side, PrefillSide) else None
            self.replies += step_messages("w", self.placements, prefill, self.engine.step())

    def until(self, condition, what: str) -> None:
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not condition():
            assert time.monotonic() < deadline, f"no {what}"
            self.step()
            if not self.engine.has_unfinished():
                time.sleep(0.005)   # waiting on the data plane, not on a step

    def got(self, kind: type) -> bool:
        return any(isinstance(r, kind) for r in self.replies)

    def state(self, request_id: str) -> PlacementState:
        (p,) = self.placements.of_request(request_id)
        return p.state

    def abort(self, request_id: str) -> None:
        """What an Abort does here (EngineThread: each placement of the request)."""
        for p in self.placements.of_request(request_id):
            self.placements.release(p.engine_id)

    def held(self) -> dict:
        """Whatever this worker still holds, by kind (empty: nothing)."""
        e, out = self.engine, {}
        if e.scheduler.requests or e.scheduler.waiting_for_kv:
            out["engine requests"] = sorted(e.scheduler.requests)
        if e.kv.num_free_blocks != e.kv.pool.num_usable_blocks:
            out["blocks"] = e.kv.pool.num_usable_blocks - e.kv.num_free_blocks
        if len(self.placements):
            out["records"] = [p.engine_id for p in self.placements.all()]
        if isinstance(self.side, DecodeSide):
            if len(self.side.leases) or self.side.leases.num_held:
                out["leases"] = (len(self.side.leases), self.side.leases.num_held)
        elif self.side.connector.requests:
            out["connector"] = sorted(self.side.connector.requests)
        return out

    def close(self) -> None:
        self.side.close()


@pytest.fixture
def decode(tiny_model):
    w = Worker(tiny_model, "decode")
    yield w
    w.close()


@pytest.fixture
def prefill(tiny_model):
    w = Worker(tiny_model, "prefill")
    yield w
    w.close()


def reserve(decode: Worker, rid: str) -> m.Reserved:
    decode.send(m.Reserve(rid, 1, PROMPT, SAMPLING, 30.0))
    (reserved,) = [r for r in decode.replies if isinstance(r, m.Reserved)]
    assert reserved.ok, reserved.error
    return reserved


def disaggregate(decode: Worker, prefill: Worker, rid: str) -> None:
    """As the router does: the prompt to the prefill worker and the reservation
    to the decode worker, then the KV target from the Reserved."""
    prefill.send(m.Prefill(rid, 1, PROMPT, SAMPLING))
    reserved = reserve(decode, rid)
    prefill.send(m.KVTarget(rid, 1, "decode-0", decode.side.data_addr, reserved.block_ids,
                            reserved.num_cached_tokens // 16, reserved.lease_id))


def test_decode_side_reserved(decode):
    reserve(decode, "r")
    assert decode.state("r") is PlacementState.RESERVED and decode.held()["leases"] == (1, 0)
    decode.abort("r")
    assert decode.held() == {}


def test_decode_side_running_a_local_prefill(decode):
    reserved = reserve(decode, "r")
    decode.send(m.PrefillLocally("r", 2, reserved.lease_id))
    decode.step()                                      # its prompt partly computed here
    assert decode.state("r") is PlacementState.RUNNING and decode.engine.scheduler.requests["r#1"].num_computed_tokens
    decode.abort("r")
    assert decode.held() == {}


def test_whole_request_running(decode):
    decode.send(m.Admit("r", 1, PROMPT, SAMPLING))
    decode.step()
    assert decode.state("r") is PlacementState.RUNNING
    decode.abort("r")
    assert decode.held() == {}


def test_decode_side_landed_and_prefill_side_done(decode, prefill):
    disaggregate(decode, prefill, "r")
    prefill.until(lambda: prefill.got(m.PrefillDone), "PrefillDone")
    assert prefill.held() == {}                        # done: the transfer's end released it
    decode.until(lambda: decode.got(m.TokenBatch), "start on the KV that landed")
    assert decode.state("r") is PlacementState.LANDED
    decode.step()                                      # decoding
    decode.abort("r")
    assert decode.held() == {}


def test_prefill_side_computing_before_its_target(prefill):
    prefill.send(m.Prefill("r", 1, PROMPT, SAMPLING))
    prefill.step()
    assert prefill.state("r") is PlacementState.COMPUTING and "r#1" in prefill.side.connector
    prefill.abort("r")
    assert prefill.held() == {}


def test_prefill_side_computing_with_pages_in_flight(decode, prefill):
    disaggregate(decode, prefill, "r")
    prefill.step()
    prefill.step()                                     # some chunks shipped, more to come
    assert prefill.state("r") is PlacementState.COMPUTING and not prefill.got(m.FirstToken)
    prefill.abort("r")
    decode.abort("r")
    assert prefill.held() == {}
    decode.step()                                      # pages still arriving are refused
    assert decode.held() == {}


def test_prefill_side_shipping_with_no_target_yet(prefill):
    """Computed before its target came: its blocks are held for the transfer."""
    prefill.send(m.Prefill("r", 1, PROMPT, SAMPLING))
    prefill.until(lambda: prefill.got(m.FirstToken), "first token")
    assert prefill.state("r") is PlacementState.SHIPPING and prefill.held()["blocks"] > 0
    prefill.abort("r")
    assert prefill.held() == {}


def test_prefill_side_shipping_with_its_transfer_in_flight(decode, prefill):
    disaggregate(decode, prefill, "r")
    prefill.until(lambda: prefill.got(m.FirstToken), "first token")
    assert prefill.state("r") is PlacementState.SHIPPING
    prefill.abort("r")
    decode.abort("r")
    assert prefill.held() == {}
    prefill.step()                                     # a result that comes after is nobody's
    decode.step()
    assert prefill.held() == decode.held() == {} and not prefill.got(m.PrefillDone)
