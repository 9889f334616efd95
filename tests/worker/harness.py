"""Real Workers driven over a real ZeroMQ control socket by a fake router.

`run_workers(cfgs, scenario)` starts `Worker.serve()` for each config on an
event loop next to a `FakeRouter` bound on a loopback port, runs
`await scenario(router)`, then stops the workers (Shutdown, no drain) and
returns (scenario's result, the workers' exit statuses). The fake router
accepts every registration and keeps every message it receives, so a test
waits for events, never for time.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import zmq.asyncio

from pdd.config import ClusterConfig, EngineConfig, RouterConfig, SecurityConfig, WorkerConfig
from pdd.protocol import messages as m
from pdd.protocol.bus import RouterChannel
from pdd.worker.worker import Worker

# Generous: only a broken worker takes this long to say what a test waits for.
EVENT_TIMEOUT_S = 60.0


def worker_config(model_dir, role: str = "colocated", **engine_kw) -> ClusterConfig:
    return ClusterConfig(
        engine=EngineConfig(model=str(model_dir), device="cpu", num_blocks=64, **engine_kw),
        router=RouterConfig(heartbeat_interval_s=0.02),
        worker=WorkerConfig(role=role, worker_id=f"{role}-0", data_addr="tcp://127.0.0.1:0",
                            transfer_backend="tcp"),
        security=SecurityConfig(insecure=True))


class FakeRouter:
    def __init__(self, ctx: zmq.asyncio.Context, worker_ids: list[str]):
        self.worker_ids = worker_ids
        self.chan = RouterChannel(ctx, "tcp://127.0.0.1:0")
        self.addr = self.chan.addr
        self.registrations: dict[str, m.Register] = {}   # by worker id
        self.connections: dict[str, str] = {}           # worker id -> its process's socket identity
        # The answer to every Register (a test may change it).
        self.register_reply = m.RegisterReply(ok=True, heartbeat_interval_s=0.02)
        self.received: list[m.Message] = []     # everything, in arrival order
        self._seen = 0                          # how far next() has looked

    async def next(self, kind: type, match: Callable[[m.Message], bool] = lambda _: True):
        """The first message of `kind` satisfying `match` among those that
        next() has not returned or passed over yet, and until() not awaited."""
        return await asyncio.wait_for(self._next(kind, match), EVENT_TIMEOUT_S)

    async def _next(self, kind, match):
        while True:
            while self._seen < len(self.received):
                msg = self.received[self._seen]
                self._seen += 1
                if isinstance(msg, kind) and match(msg):
                    return msg
            await self._receive()

    async def first(self, kind: type, match: Callable[[m.Message], bool] = lambda _: True):
        """The first message of `kind` satisfying `match` ever received, waiting
        for it if none came yet; next()'s place does not move. For a message
        from another worker than the one just awaited: their order is not fixed."""
        async def wait():
            while True:
                found = next((x for x in self.received if isinstance(x, kind) and match(x)), None)
                if found is not None:
                    return found
                await self._receive()
        return await asyncio.wait_for(wait(), EVENT_TIMEOUT_S)

    async def _receive(self) -> None:
        peer, msg = await self.chan.recv()
        if isinstance(msg, m.Register):
            self.registrations[msg.worker_id] = msg
            self.connections[msg.worker_id] = peer
            await self.chan.send(peer, self.register_reply)
        self.received.append(msg)

    async def registered(self, worker_id: str) -> m.Register:
        async def wait():
            while worker_id not in self.registrations:
                await self._receive()
        await asyncio.wait_for(wait(), EVENT_TIMEOUT_S)
        return self.registrations[worker_id]

    async def send(self, msg: m.Message, to: str | None = None) -> None:
        """To worker `to`, by default the only one."""
        if to is None:
            (to,) = self.worker_ids
        await self.registered(to)
        assert await self.chan.send(self.connections[to], msg)

    async def until(self, condition: Callable[[], bool]) -> None:
        """Receive until `condition()` (which looks at self.received) holds;
        next() then looks only at what arrives after."""
        async def wait():
            while not condition():
                await self._receive()
        await asyncio.wait_for(wait(), EVENT_TIMEOUT_S)
        self._seen = len(self.received)

    def items(self, request_id: str, epoch: int) -> list[m.TokenItem]:
        """What the worker said about (request_id, epoch) in its TokenBatches so far."""
        return [item for msg in self.received if isinstance(msg, m.TokenBatch) for item in msg.items
                if (item.request_id, item.epoch) == (request_id, epoch)]

    async def tokens(self, request_id: str, epoch: int) -> list[int]:
        """Every token of (request_id, epoch), once it has finished."""
        await self.until(lambda: any(item.finished for item in self.items(request_id, epoch)))
        return [t for item in self.items(request_id, epoch) for t in item.token_ids]

    async def idle_heartbeat(self) -> m.Heartbeat:
        """The next heartbeat from an engine with nothing running or waiting."""
        return await self.next(m.Heartbeat, lambda h: h.running == 0 and h.waiting == 0)

    def close(self) -> None:
        self.chan.close()


def run_workers(cfgs: list[ClusterConfig], scenario: Callable[[FakeRouter], Awaitable]) -> tuple[object, list[int]]:
    async def main():
        ctx = zmq.asyncio.Context()
        router = FakeRouter(ctx, [cfg.worker.worker_id for cfg in cfgs])
        serving = {cfg.worker.worker_id: asyncio.create_task(Worker(dataclasses.replace(
            cfg, worker=dataclasses.replace(cfg.worker, router_addr=router.addr))).serve()) for cfg in cfgs}
        try:
            result = await _unless_one_exits(list(serving.values()), scenario(router))
            for worker_id, task in serving.items():
                if not task.done():
                    await router.send(m.Shutdown(drain=False), to=worker_id)
            return result, [await asyncio.wait_for(task, EVENT_TIMEOUT_S) for task in serving.values()]
        finally:
            for task in serving.values():
                task.cancel()
            router.close()
            ctx.term()

    return asyncio.run(main())


def run_worker(cfg: ClusterConfig, scenario: Callable[[FakeRouter], Awaitable]) -> tuple[object, int]:
    result, (code,) = run_workers([cfg], scenario)
    return result, code


async def _unless_one_exits(serving: list[asyncio.Task], scenario: Awaitable):
    """The scenario's result; if a worker exits first, the scenario is cut short (None)."""
    task = asyncio.ensure_future(scenario)
    await asyncio.wait([task, *serving], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    return None
