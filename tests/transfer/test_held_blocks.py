"""The decode worker's side of one-sided (cuda_ipc) writes, on CPU: a request
aborted while a writer is registered keeps its blocks out of the pool until the
writer says its copies have ended, and gets them back then. Real DecodeSide,
real engine, real data socket; the "writer" is a DEALER speaking the control
protocol (no GPU is needed for the bookkeeping)."""
from __future__ import annotations

import pytest
import zmq

from pdd.api import SamplingParams
from pdd.config import EngineConfig, WorkerConfig
from pdd.engine.engine import LLMEngine
from pdd.kv.layout import KVLayout
from pdd.protocol import messages as m
from pdd.transfer.wire import decode_reply, encode_control
from pdd.worker.disagg import DecodeSide
from pdd.worker.records import PlacementTable, engine_id
from tests.engine.helpers import random_prompts


@pytest.fixture
def decode(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=64))
    mc = engine.model_config
    layout = KVLayout("tiny", "w", str(engine.dtype).removeprefix("torch."), engine.cfg.block_size,
                      mc.num_layers, mc.num_kv_heads, mc.head_dim)
    side = DecodeSide(engine, "decode-0", WorkerConfig(role="decode"), layout, PlacementTable(engine), lambda: None)
    yield side
    side.close()


@pytest.fixture
def writer(decode):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(decode.data_addr)

    def ask(kind: str, **fields) -> dict:
        sock.send(encode_control(kind, 1, pool_id=decode.receiver.ipc.pool_id, **fields))
        assert sock.poll(5000), f"no reply to {kind}"
        return decode_reply(sock.recv())

    yield ask
    sock.close()
    ctx.term()


def test_aborted_reservation_is_held_until_the_writer_ends(decode, writer):
    kv = decode.engine.kv
    total = kv.pool.num_usable_blocks
    reply = decode.handle(m.Reserve("r", 1, random_prompts([50], seed=1)[0], SamplingParams(), 30.0))[0]
    assert reply.ok and kv.num_free_blocks == total - len(reply.block_ids)
    eid = engine_id("r", 1)   # what the prefill worker of this placement sends under
    assert writer("ipc_begin", request_id=eid, lease_id=reply.lease_id)["ok"]
    # The router aborts the request while the prefill worker's copies may still run.
    decode.placements.release(eid)
    assert kv.num_free_blocks == total - len(reply.block_ids)     # held, not reusable
    assert decode.expire() == [] and decode.stats()["held_leases"] == 1 and decode.stats()["ipc_writers"] == 1
    assert kv.num_free_blocks == total - len(reply.block_ids)
    assert writer("ipc_end", request_id=eid, lease_id=reply.lease_id)["ok"]
    decode.expire()                                                # the engine loop's next pass
    assert kv.num_free_blocks == total and decode.stats()["held_leases"] == 0


def test_committed_transfer_frees_normally(decode, writer):
    kv = decode.engine.kv
    total = kv.pool.num_usable_blocks
    reply = decode.handle(m.Reserve("q", 1, random_prompts([40], seed=2)[0], SamplingParams(), 30.0))[0]
    eid = engine_id("q", 1)
    assert writer("ipc_begin", request_id=eid, lease_id=reply.lease_id)["ok"]
    assert writer("ipc_commit", request_id=eid, lease_id=reply.lease_id, handoff=None)["ok"]
    decode.placements.release(eid)
    assert kv.num_free_blocks == total and decode.stats()["held_leases"] == 0
