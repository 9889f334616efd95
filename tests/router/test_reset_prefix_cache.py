"""The router's side of a prefix-cache reset (POST /reset_prefix_cache, `pdd
admin cache flush`): a ResetPrefixCache to every worker over the control bus,
the answer once all have said PrefixCacheReset, or at the deadline one that
names who did not. A real router on loopback sockets; the workers are
stand-ins on real DEALER sockets, one of which never answers (the fault)."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgpack

from pdd import logs
from pdd.admin.client import call
from pdd.admin.server import AdminServer
from pdd.config_loader import load_cluster_config
from pdd.http.app import build_app, serve_http
from pdd.protocol import messages as m
from pdd.protocol.bus import DealerChannel
from pdd.router import router as router_module
from pdd.router.router import Router

TOKEN = "0123456789abcdef-admin-token"
LAYOUT = dict(model_id="m", weights_hash="w", dtype="float32", block_size=16, num_layers=2, num_kv_heads=2,
              head_dim=8)


class NoTokenizer:
    vocab_size = 1000


class StandIn:
    """A registered worker that answers a reset with `dropped` blocks, or never (None)."""

    def __init__(self, router: Router, worker_id: str, dropped: int | None):
        self.worker_id, self.dropped = worker_id, dropped
        self.chan = DealerChannel(router.ctx, router.chan.addr, worker_id)
        self.asked: list[m.ResetPrefixCache] = []
        self.task: asyncio.Task | None = None

    async def start(self) -> "StandIn":
        await self.chan.send(m.Register(worker_id=self.worker_id, role="colocated", host="h", pid=1, device="cpu",
                                        layout=LAYOUT, num_blocks=64, max_num_seqs=8, max_model_len=256))
        reply = await self.chan.recv()
        assert isinstance(reply, m.RegisterReply) and reply.ok, reply
        self.task = asyncio.create_task(self._serve())
        return self

    async def _serve(self) -> None:
        while True:
            msg = await self.chan.recv()
            if isinstance(msg, m.ResetPrefixCache):
                self.asked.append(msg)
                if self.dropped is not None:
                    await self.chan.send(m.PrefixCacheReset(self.worker_id, msg.reset_id, self.dropped))

    def stop(self) -> None:
        self.task.cancel()
        self.chan.close()


async def router_with(*workers: tuple[str, int | None], **router_cfg) -> tuple[Router, list[StandIn]]:
    """A started router (`router_cfg`: more of its settings) and a stand-in for each of `workers`."""
    # Heartbeats are not sent here: the stand-ins must not expire while a test runs.
    cfg = load_cluster_config(env={}, overrides={"router": {"control_addr": "tcp://127.0.0.1:0",
                                                            "heartbeat_interval_s": 600, **router_cfg},
                                                 "security": {"insecure": True}})
    router = Router(cfg)
    await router.start()
    return router, [await StandIn(router, wid, dropped).start() for wid, dropped in workers]


async def stop(router: Router, stand_ins: list[StandIn]) -> None:
    for s in stand_ins:
        s.stop()
    await router.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_every_worker_answers_or_is_named():
    async def main():
        router, (a, b) = await router_with(("a", 7), ("b", None))
        router.registry.workers["a"].cached_hashes[123] = None
        result = await router.reset_prefix_cache(timeout_s=1.0)
        assert result == {"reset": {"a": 7}, "no_answer": ["b"], "timeout_s": 1.0}
        assert len(a.asked) == len(b.asked) == 1
        # Placement's picture of a's cache is empty now: it answered.
        assert not router.registry.workers["a"].cached_hashes
        # One worker only.
        assert await router.reset_prefix_cache("a") == {"reset": {"a": 7}, "no_answer": [], "timeout_s": 15.0}
        assert len(a.asked) == 2 and len(b.asked) == 1
        # b's answers, late or never asked for, are dropped; nothing waits for them.
        late = m.PrefixCacheReset("b", b.asked[0].reset_id, 3)
        await b.chan.send(late)
        await b.chan.send(m.PrefixCacheReset("b", "never-asked", 3))
        # The control loop still serves: a's next answer is taken.
        assert (await router.reset_prefix_cache("a"))["reset"] == {"a": 7}
        try:
            await router.reset_prefix_cache("nobody")
        except KeyError as e:
            assert "no worker 'nobody'" in str(e) and "'a', 'b'" in str(e)
        else:
            raise AssertionError("an unknown worker was accepted")
        await stop(router, [a, b])

    run(main())


def test_http_answers_after_every_worker_or_504_naming_the_silent(monkeypatch):
    monkeypatch.setattr(router_module, "RESET_TIMEOUT_S", 1.0)

    async def main():
        router, stand_ins = await router_with(("a", 4), ("c", 5))
        server = await serve_http(build_app(router, NoTokenizer(), "m"), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}/reset_prefix_cache"
        async with aiohttp.ClientSession() as s:
            async with s.post(url) as r:    # as clients send it: no body, no Content-Type
                assert r.status == 200, await r.text()
                assert (await r.json())["reset"] == {"a": 4, "c": 5}
            async with s.post(url + "?reset_running_requests=true") as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == "reset_running_requests", body
            silent = await StandIn(router, "b", None).start()
            stand_ins.append(silent)
            async with s.post(url) as r:
                body = await r.json()
                assert r.status == 504 and body["error"]["code"] == "reset_incomplete", body
                assert "from b (reset: a, c)" in body["error"]["message"], body
        await server.cleanup()
        await stop(router, stand_ins)

    run(main())


def test_admin_cache_flush_takes_the_same_path(caplog):
    async def main():
        router, stand_ins = await router_with(("a", 2), ("b", 9))
        admin = AdminServer(router, "tcp://127.0.0.1:0", TOKEN)
        await admin.start(router.ctx)

        def flush(*args):
            return call(admin.addr, TOKEN, "cache", *args, timeout_s=30)

        assert await asyncio.to_thread(flush, "flush") == {"reset": {"a": 2, "b": 9}, "no_answer": [],
                                                           "timeout_s": 15.0}
        assert (await asyncio.to_thread(flush, "flush", "b"))["reset"] == {"b": 9}
        # Errors come back as any admin command's: named, and the socket serves on.
        def ask(*args):
            return admin.handle(msgpack.packb({"token": TOKEN, "cmd": "cache", "args": list(args)}))

        reply = await ask("flush", "zz")    # found out while it is awaited
        assert not reply["ok"] and "cache: no worker 'zz'" in reply["error"], reply
        for args in ((), ("drop",), ("flush", "a", "b")):
            reply = ask(*args)
            assert not reply["ok"] and "expected: pdd admin cache flush [WORKER]" in reply["error"], reply
        assert (await asyncio.to_thread(call, admin.addr, TOKEN, "workers"))[0]["worker_id"] == "a"
        await admin.stop()
        await stop(router, stand_ins)

    with caplog.at_level(logging.DEBUG, logger=logs.AUDIT_LOGGER):
        run(main())
    # Audited once answered, as a command that changes something; refusals too.
    audited = [(r.levelno, r.arguments, r.ok) for r in caplog.records
               if r.name == logs.AUDIT_LOGGER and r.command == "cache"]
    assert audited[:3] == [(logging.INFO, ["flush"], True), (logging.INFO, ["flush", "b"], True),
                           (logging.INFO, ["flush", "zz"], False)], audited
