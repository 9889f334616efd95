"""The router's receive turn: what is waiting is taken without waiting, in
order, malformed frames dropped on the way (pdd.protocol.bus.recv_nowait)."""
from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from pdd.protocol import messages as m
from pdd.protocol.bus import DealerChannel, RouterChannel


def test_recv_nowait_takes_what_is_waiting_in_order():
    async def run():
        ctx = zmq.asyncio.Context()
        router = RouterChannel(ctx, "tcp://127.0.0.1:0")
        worker = DealerChannel(ctx, router.addr, "decode-0")
        assert router.recv_nowait() is None   # nothing sent yet: None, at once
        batches = [m.TokenBatch("decode-0", [m.TokenItem(f"r{i}", i, 0, [i])]) for i in range(3)]
        await worker.send(batches[0])
        await worker.sock.send(b"not msgpack")          # a malformed message between them
        for b in batches[1:]:
            await worker.send(b)
        await worker.send(m.Goodbye("decode-0"))
        # The first comes by the awaited recv (it waits for the bytes to arrive) ...
        assert await asyncio.wait_for(router.recv(), 10) == ("decode-0", batches[0])
        # ... the rest, once they are all here, without waiting.
        got = []
        while not got or got[-1] != ("decode-0", m.Goodbye("decode-0")):
            item = router.recv_nowait()
            if item is None:
                await asyncio.sleep(0.01)   # not all arrived yet
                continue
            got.append(item)
        assert got == [("decode-0", b) for b in batches[1:]] + [("decode-0", m.Goodbye("decode-0"))]
        assert router.dropped == 1
        assert router.recv_nowait() is None
        worker.close()
        router.close()
        ctx.term()

    asyncio.run(run())
