"""The control bus with keys, at the socket level: only the cluster's workers
complete the handshake; strangers' messages never reach the router's recv()."""
from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from pdd import security
from pdd.protocol import messages as m
from pdd.protocol.bus import DealerChannel, RouterChannel
from pdd.security import control_security
from tests.security.conftest import failed_handshake, grows, offer, secure_config, stranger


def forged_register(worker_id: str) -> m.Register:
    """What a forged worker would say: a bogus layout and max_model_len=2."""
    return m.Register(worker_id=worker_id, role="decode", host="evil", pid=1, device="cpu",
                      layout={"model_id": "bogus"}, num_blocks=10**6, max_num_seqs=1, max_model_len=2)


@pytest.mark.parametrize("kind", ["plaintext", "own keys", "wrong router key"])
def test_strangers_cannot_reach_the_router(kind, secure_cfg, stranger_keys):
    async def run():
        ctx = zmq.asyncio.Context()
        router = RouterChannel(ctx, "tcp://127.0.0.1:0", control_security(secure_cfg, "router"))
        theirs = control_security(secure_config(stranger_keys), "decode")
        curve = None if kind == "plaintext" else (theirs.public, theirs.secret)
        server_key = router.security.public if kind == "own keys" else theirs.server_key
        evil = stranger(ctx, curve, server_key)
        before = security.counts()
        watching = asyncio.ensure_future(failed_handshake(evil))
        await asyncio.sleep(0)   # the monitor is on before the connection starts
        evil.connect(router.addr)
        for msg in (forged_register("evil"), m.TokenBatch("evil", [m.TokenItem("r1", 1, 0, [666])])):
            await offer(evil, msg)
        await asyncio.wait_for(watching, 10)
        # The cluster's worker still gets through, and its message is the first the router sees.
        worker = DealerChannel(ctx, router.addr, "decode-0", control_security(secure_cfg, "decode"))
        await worker.send(m.Goodbye("decode-0"))
        peer, msg = await asyncio.wait_for(router.recv(), 10)
        assert (peer, msg) == ("decode-0", m.Goodbye("decode-0"))
        await router.send(peer, m.RegisterReply(ok=True))
        assert await asyncio.wait_for(worker.recv(), 10) == m.RegisterReply(ok=True)
        # The router saw the failed handshake, and the authorized-key check
        # (reached only by a client that knows the router's key) refused it.
        await asyncio.wait_for(grows(before, "control.handshake_failed", "control.handshake_refused"), 10)
        if kind == "own keys":
            assert security.counts().get("control.denied", 0) > before.get("control.denied", 0)
        evil.close(0)
        for chan in (worker, router):
            chan.close()
        ctx.term()

    asyncio.run(run())


def test_a_worker_without_the_router_key_is_told_in_its_log(secure_cfg, stranger_keys, caplog):
    """A worker whose key the router does not accept retries forever; it must
    say why, not wait in silence."""
    async def run():
        ctx = zmq.asyncio.Context()
        router = RouterChannel(ctx, "tcp://127.0.0.1:0", control_security(secure_cfg, "router"))
        theirs = control_security(secure_config(stranger_keys), "decode")
        theirs.server_key = router.security.public    # public knowledge: not enough
        worker = DealerChannel(ctx, router.addr, "decode-9", theirs)
        while not any("CURVE handshake" in r.getMessage() for r in caplog.records):
            # Never blocks, though a refused handshake leaves nowhere to queue: the
            # worker's loops (and its shutdown) must not hang on a send.
            await worker.send(forged_register("decode-9"))
            await asyncio.sleep(0.02)
        while worker.unsent == 0:
            await worker.send(forged_register("decode-9"))
            await asyncio.sleep(0.02)
        worker.close()
        router.close()
        ctx.term()

    with caplog.at_level("ERROR", logger="pdd.security"):
        asyncio.run(asyncio.wait_for(run(), 20))


def test_closing_the_channels_lets_the_context_end(secure_cfg):
    """The ZAP handler thread lives on the router's context: closing the last
    server socket stops it, or ctx.term() would never return."""
    async def run():
        ctx = zmq.asyncio.Context()
        router = RouterChannel(ctx, "tcp://127.0.0.1:0", control_security(secure_cfg, "router"))
        router.close()
        router.close()   # idempotent
        ctx.term()
        ctx2 = zmq.asyncio.Context()   # and a new one can serve again
        again = RouterChannel(ctx2, "tcp://127.0.0.1:0", control_security(secure_cfg, "router"))
        again.close()
        ctx2.term()

    asyncio.run(asyncio.wait_for(run(), 20))
