"""Worker processes and their control connections, at a real router over real
ZeroMQ sockets (in one process): two processes under one worker id are two
connections; the one registered last is the worker, and the other is told it
was replaced at its first word and heard no further, registration included."""
from __future__ import annotations

import asyncio
import os
import uuid

import zmq.asyncio

from pdd.config import ClusterConfig, RouterConfig, SecurityConfig
from pdd.protocol import messages as m
from pdd.protocol.bus import DealerChannel
from pdd.router.router import Router
from tests.router.sim import LAYOUT

EVENT_TIMEOUT_S = 60.0


class Process:
    """One worker process as the router sees it: its own connection, its Register."""

    def __init__(self, ctx, addr: str, worker_id: str, **register):
        self.worker_id, self.incarnation = worker_id, uuid.uuid4().hex
        self.chan = DealerChannel(ctx, addr, f"{worker_id}/{self.incarnation}")
        fields = dict(role="colocated", host="h", pid=os.getpid(), device="cpu", layout=LAYOUT.to_dict(),
                      num_blocks=64, max_num_seqs=8, max_model_len=4096, incarnation=self.incarnation)
        self.register_message = m.Register(worker_id, **{**fields, **register})

    async def ask(self, msg: m.Message) -> m.Message:
        """Send `msg`, return the router's next message (every one here is answered)."""
        await self.chan.send(msg)
        return await asyncio.wait_for(self.chan.recv(), EVENT_TIMEOUT_S)

    async def register(self) -> m.RegisterReply:
        return await self.ask(self.register_message)

    async def heartbeat(self) -> m.Message:
        return await self.ask(m.Heartbeat(self.worker_id, 0, 0, 64, 64))


def with_router(scenario):
    async def main():
        cfg = ClusterConfig(router=RouterConfig(control_addr="tcp://127.0.0.1:0"),
                            security=SecurityConfig(insecure=True))
        router = Router(cfg)
        await router.start()
        ctx = zmq.asyncio.Context()
        try:
            return await scenario(router, lambda wid, **kw: Process(ctx, router.chan.addr, wid, **kw))
        finally:
            await router.stop()
            ctx.destroy(linger=0)
    return asyncio.run(main())


def test_a_process_registered_later_under_an_id_is_the_worker_and_the_first_is_told_to_exit():
    async def scenario(router, process):
        old, new = process("w0"), process("w0")
        first = await old.register()
        before = await old.heartbeat()
        second = await new.register()
        answers = [await old.heartbeat(), await old.register(), await old.ask(m.Goodbye("w0"))]
        after = await new.heartbeat()
        return first, before, second, answers, after, router.registry.workers["w0"].incarnation, new

    first, before, second, answers, after, incarnation, new = with_router(scenario)
    assert first.ok and first.liveness_s == 6.5    # heartbeat_interval_s x heartbeat_misses + liveness_grace_s
    assert before == m.HeartbeatAck() and second.ok
    # Heartbeat, Register, Goodbye: the old process is heard no further (its
    # Register does not take the id back, its Goodbye does not take the new
    # one's registration with it).
    assert answers == [m.Replaced()] * 3
    assert after == m.HeartbeatAck() and incarnation == new.incarnation


def test_a_registration_refused_takes_no_worker_over():
    """A process under a live worker's id that the router refuses (another
    model) is not the worker: the live one is told to register again, not to exit."""
    async def scenario(router, process):
        live, other = process("w0"), process("w1")
        await live.register()
        await other.register()     # the cluster's layout stays with w1 while w0 changes hands
        stranger = process("w0", layout={**LAYOUT.to_dict(), "model_id": "another"})
        refused = await stranger.register()
        answer = await live.heartbeat()
        back = await live.register()
        return refused, answer, back, await live.heartbeat()

    refused, answer, back, ack = with_router(scenario)
    assert not refused.ok and "model_id" in refused.error
    assert answer == m.ReRegister() and back.ok and ack == m.HeartbeatAck()


def test_an_unknown_workers_heartbeat_is_told_to_register_then_answered():
    async def scenario(router, process):
        p = process("w0")
        return await p.heartbeat(), await p.register(), await p.heartbeat()

    unknown, reply, ack = with_router(scenario)
    assert unknown == m.ReRegister() and reply.ok and ack == m.HeartbeatAck()
