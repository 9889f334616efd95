"""KV transfer throughput: the tcp (or nixl) backend against plain ZeroMQ on the same loopback.

One request per measurement, its pages sent as the engine sends them: one
send_layer() per layer (default 32 layers; the KV shape of Llama-3-8B at TP=2,
4 KV heads x 128 x block 16 in bf16, so one block of all layers is 1 MiB).
Time runs from the first send_layer() to the result reporting the last ack;
the ceiling is one DEALER->ROUTER send of a buffer of the same size with one
ack, receiver in a thread of the same process, as for the data socket. A
second ceiling sends the same bytes as N messages, each acked, the pattern
the tcp backend uses: one huge zmq message makes the receiver allocate (and
page-fault) the whole buffer, which per-layer messages avoid.

With --backend nixl the pages go as one-sided NIXL writes through UCX
(whatever transport UCX_TLS leaves it), and each size reports how many
descriptors one request named: scattered blocks (the default) cost two per
block per layer, --contiguous ones two per layer.

    pdd bench transfer [--backend tcp|nixl] [--contiguous] [--sizes 1,4,16,64,256] [--repeats 5]
                       [--device cpu|cuda] [--receiver-process] [--json FILE]
"""
from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path

import torch
import zmq

from pdd.kv.layout import KVLayout
from pdd.transfer import make_sender
from pdd.transfer.base import TransferTarget
from pdd.transfer.leases import LeaseTable
from pdd.transfer.receiver import DataSocket

MiB = 2**20


def _layout(args) -> KVLayout:
    return KVLayout(model_id="bench", weights_hash="bench", dtype=args.dtype, block_size=args.block_size,
                    num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim)


def _pool(layout: KVLayout, blocks: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return (torch.rand(shape, generator=g) + 1).to(getattr(torch, layout.kv_cache_dtype)).to(device)


class _LocalDecode:
    """The decode side in a thread of this process (the layout the brief's ceiling uses)."""

    def __init__(self, layout: KVLayout, blocks: int, device: str, nixl: bool = False):
        self.dst = _pool(layout, blocks, device, 2)
        self.leases = LeaseTable()
        self.receiver = DataSocket(self.dst, layout, self.leases, nixl=nixl)
        self.receiver.start()
        self.address = self.receiver.address

    def grant(self, rid: str, dst_ids: list[int]) -> str:
        return self.leases.grant(rid, dst_ids, 600)

    def intact(self, src: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> bool:
        return torch.equal(self.dst[:, :, dst_ids], src[:, :, src_ids])

    def close(self) -> None:
        self.receiver.close()


def _decode_process(conn, layout: dict, blocks: int, device: str, nixl: bool = False) -> None:
    side = _LocalDecode(KVLayout.from_dict(layout), blocks, device, nixl)
    src = _pool(KVLayout.from_dict(layout), blocks, device, 1)  # same seed as the sender's pool
    conn.send(side.address)
    while True:
        cmd, *rest = conn.recv()
        if cmd == "grant":
            conn.send(side.grant(*rest))
        elif cmd == "intact":
            conn.send(side.intact(src, *rest))
        else:
            side.close()
            return


class _RemoteDecode:
    """The decode side in its own process, as deployed: no GIL shared with the sender."""

    def __init__(self, layout: KVLayout, blocks: int, device: str, nixl: bool = False):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_process, args=(child, layout.to_dict(), blocks, device, nixl))
        self.proc.start()
        self.address = self.conn.recv()

    def grant(self, rid: str, dst_ids: list[int]) -> str:
        self.conn.send(("grant", rid, dst_ids))
        return self.conn.recv()

    def intact(self, src: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> bool:
        self.conn.send(("intact", src_ids, dst_ids))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("close",))
        self.proc.join(30)


class _Rig:
    """A source pool and sender, a decode side, reused across measurements."""

    def __init__(self, layout: KVLayout, blocks: int, device: str, receiver_process: bool = False,
                 backend: str = "tcp"):
        self.src = _pool(layout, blocks, device, 1)
        self.backend = backend
        self.decode = (_RemoteDecode if receiver_process else _LocalDecode)(layout, blocks, device, backend == "nixl")
        self.sender = make_sender(backend, layout, timeout_s=120)
        self.done = threading.Event()
        self.sender.set_wakeup(self.done.set)
        self.n = 0

    def transfer(self, src_ids: list[int], dst_ids: list[int]) -> tuple[float, float, int, int]:
        """(seconds to last ack, seconds spent in send_layer, bytes, descriptors)."""
        self.n += 1
        rid = f"bench-{self.n}"
        target = TransferTarget(rid, self.decode.grant(rid, dst_ids), "d", self.decode.address, tuple(dst_ids),
                                backend=self.backend)
        idx = list(range(len(dst_ids)))
        self.done.clear()
        t0 = time.perf_counter()
        for layer in range(self.src.shape[0]):
            self.sender.send_layer(target, layer, self.src[layer], src_ids, idx)
        t_engine = time.perf_counter() - t0
        self.sender.finish(rid)
        res = self.sender.poll()
        while not res:
            self.done.wait(60)
            self.done.clear()
            res = self.sender.poll()
        elapsed = time.perf_counter() - t0
        if not res[0].ok:
            raise RuntimeError(f"transfer failed: {res[0].error}")
        return elapsed, t_engine, res[0].bytes, res[0].descriptors

    def close(self) -> None:
        self.sender.close()
        self.decode.close()


def zmq_ceiling(nbytes: int, repeats: int, messages: int = 1, security=None) -> list[float]:
    """Seconds for `nbytes` DEALER->ROUTER in `messages` equal messages, each
    acked, all in flight at once; receiver in a thread. `security`: a
    pdd.security.Curve for both ends (None: plaintext)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    if security is not None:
        security.serve(router)
        security.dial(dealer, security.public_key)
    router.bind("tcp://127.0.0.1:0")
    addr = router.getsockopt_string(zmq.LAST_ENDPOINT)

    def serve() -> None:
        while True:
            ident, body = router.recv_multipart(copy=False)
            router.send_multipart([ident, b"ok"])
            if len(body) == 0:  # the stop message
                return

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    dealer.connect(addr)
    chunk = nbytes // messages
    bufs = [torch.randint(0, 255, (chunk,), dtype=torch.uint8).numpy() for _ in range(messages)]
    times = []
    for _ in range(repeats + 1):  # the first one warms the connection up
        t0 = time.perf_counter()
        for b in bufs:
            dealer.send(b, copy=False)
        for _ in bufs:
            dealer.recv()
        times.append(time.perf_counter() - t0)
    dealer.send(b"")
    dealer.recv()
    th.join()
    dealer.close(0)
    router.close(0)
    if security is not None:
        security.release(router)
    ctx.term()
    return times[1:]


def _check(rig: _Rig, src_ids: list[int], dst_ids: list[int]) -> None:
    if not rig.decode.intact(rig.src, src_ids, dst_ids):
        raise RuntimeError("pages did not arrive intact")


def measure(rig: _Rig, blocks: int, repeats: int, total_blocks: int, contiguous: bool = False) -> dict:
    g = torch.Generator().manual_seed(blocks)
    if contiguous:
        src_ids = dst_ids = list(range(blocks))
    else:   # scattered blocks, as a long-running pool hands them out
        src_ids = torch.randperm(total_blocks, generator=g)[:blocks].tolist()
        dst_ids = torch.randperm(total_blocks, generator=g)[:blocks].tolist()
    rig.transfer(src_ids, dst_ids)  # warm-up
    _check(rig, src_ids, dst_ids)
    runs = [rig.transfer(src_ids, dst_ids) for _ in range(repeats)]
    nbytes = runs[0][2]
    msgs = rig.src.shape[0]
    ceiling, chunked = zmq_ceiling(nbytes, repeats), zmq_ceiling(nbytes, repeats, msgs)
    t, t_zmq, t_chunked = (statistics.median(x) for x in ([r[0] for r in runs], ceiling, chunked))
    return {"bytes": nbytes, "blocks": blocks, "messages": msgs, "descriptors": runs[0][3], "seconds": t,
            "gb_s": nbytes / t / 1e9, "send_layer_ms": 1e3 * statistics.median(r[1] for r in runs),
            "zmq_seconds": t_zmq, "zmq_gb_s": nbytes / t_zmq / 1e9, "fraction_of_zmq": t_zmq / t,
            "zmq_chunked_seconds": t_chunked, "zmq_chunked_gb_s": nbytes / t_chunked / 1e9,
            "all_seconds": [r[0] for r in runs], "all_zmq_seconds": ceiling, "all_zmq_chunked_seconds": chunked}


def main(args) -> int:
    layout = _layout(args)
    sizes = [float(s) for s in args.sizes.split(",")]
    per_block = 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * \
        getattr(torch, layout.kv_cache_dtype).itemsize * layout.num_layers
    want = {s: max(1, round(s * MiB / per_block)) for s in sizes}
    total_blocks = max(want.values()) + 1
    rig = _Rig(layout, total_blocks, args.device, args.receiver_process, args.backend)
    results = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "layout": layout.to_dict(),
               "backend": args.backend, "contiguous": args.contiguous,
               "receiver": "process" if args.receiver_process else "thread",
               "threads": torch.get_num_threads(), "repeats": args.repeats, "sizes": {}}
    try:
        for s in sizes:
            results["sizes"][str(s)] = measure(rig, want[s], args.repeats, total_blocks, args.contiguous)
    finally:
        rig.close()
    print(f"{'MiB':>6} {'msgs':>5} {'descs':>6} {'pdd ms':>8} {'pdd GB/s':>9} {'zmq ms':>8} {'zmq GB/s':>9} "
          f"{'pdd/zmq':>8} {'zmq xN GB/s':>12} {'send_layer ms':>14}")
    for r in results["sizes"].values():
        print(f"{r['bytes'] / MiB:>6.0f} {r['messages']:>5} {r['descriptors']:>6} {1e3 * r['seconds']:>8.2f} "
              f"{r['gb_s']:>9.2f} {1e3 * r['zmq_seconds']:>8.2f} {r['zmq_gb_s']:>9.2f} {r['fraction_of_zmq']:>8.0%} "
              f"{r['zmq_chunked_gb_s']:>12.2f} {r['send_layer_ms']:>14.2f}")
    print("pdd: send_layer per layer -> last ack (gather, send, check, scatter, ack); zmq: one buffer, one ack; "
          "zmq xN: the same bytes in N=msgs messages, each acked; send_layer ms: engine-thread time.")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
