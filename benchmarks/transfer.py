"""KV page transfer of one request, backend by backend, as the data plane sends it.

    python -m benchmarks.transfer [--backends nixl,cuda_ipc,tcp,local] [--tokens 16384,...] [--shape 8b|tiny]
                       [--device cpu|cuda[:N]] [--peer-device cuda:M] [--ucx-tls TLS]
                       [--blocks scattered|contiguous|descending|shuffled] [--nixl-landing on|off] [--repeats 5]
                       [--receiver-thread] [--sizes MiB,... --zmq-ceilings] [--json FILE]

One request of N tokens (default 16,384, in the Llama-3.1-8B KV shape: 32 layers x 8 KV heads x
128, bf16, blocks of 16 tokens: 128 KiB a token, 2 GiB the request) goes out as a prefill worker
sends it: prepare(), one send_layer() per layer over the request's blocks, step_done(), finish(). Time runs from the first send_layer() until the sender reports the
request accepted by the decode side (tcp: its last ack; cuda_ipc and nixl: the commit, answered
once every write landed and was checked; local: at once, its copies are synchronous). prepare()
goes just before, as it goes while a prompt computes: its round trip (the begin of a one-sided
writer) overlaps the first gathers. The decode side (pool, lease table, data socket; with nixl
its pool registered with a NIXL agent) is a process of its own, as a decode worker;
--receiver-thread puts it in a thread of this process. Pages are checked after the timed runs.

    tcp       pages gathered into (pinned) host memory, ZeroMQ over loopback, scattered there
    nixl      one-sided NIXL/UCX writes from registered staging memory. UCX picks the transport
              (shared memory or TCP within a host, cuda_ipc between GPUs, RDMA across hosts);
              --ucx-tls sets UCX_TLS for both ends (tcp: UCX's own TCP on the same loopback as
              the tcp backend). The decode side has a landing region with room for the largest
              request (--nixl-landing on, as a decode worker by default): a layer's pages land
              there as two descriptors (k, v) whatever --blocks says, and the decode side copies
              them into the blocks before it accepts the commit (timed). --nixl-landing off:
              straight into the blocks, two descriptors per run of destination blocks that are
              neighbours in the pool, per layer, in whatever order the request holds them:
              --blocks scattered two per block per layer, the others two per layer.
    cuda_ipc  (GPU) the decode process's pool opened through CUDA IPC, the pages copied into it
              by a kernel once per step (the worker's default, ipc_layers_per_copy = 0)
    local     both ends in this process, the same lease-checked page writer without a socket:
              a gather and a scatter, the device's copy ceiling

--device cuda: the source pool on that GPU and the decode pool on --peer-device (default: the
same GPU, from a second process, as one-GPU `pdd up` runs them): pages then stay in one HBM, so
the figures are the software path and the GPU's copy rate, not a link's.

--blocks: where the pages go in the decode pool (the source blocks are scattered but for
contiguous; their order costs nothing, the gather copies every page).
    scattered   (default) no two blocks neighbours in the pool: every other block of a pool twice
                the request's size, shuffled. A pool that served long outputs hands out about
                this: decode steps take one block at a time for each running request, so their
                blocks interleave, and they come back and go out again least recently freed first
    contiguous  ascending consecutive ids (a fresh pool)
    descending  one range of the pool, highest id first (a pool reusing a request's blocks: it
                frees them tail-first and hands out the least recently freed first)
    shuffled    one range of the pool in random order

--sizes (MiB per request instead of --tokens) with --zmq-ceilings: the loopback sweep of the tcp
backend against plain ZeroMQ. "zmq 1 buffer": one DEALER->ROUTER message of the same bytes and
one ack, receiver in a thread; "zmq xN": the same bytes as N acked messages (the tcp backend's
pattern: one huge message makes the receiver allocate and page-fault the whole buffer).
"""
from __future__ import annotations

import os
import statistics
import threading
import time

import torch
import zmq

from benchmarks.cli import run_as_main
from benchmarks.decode_side import LocalDecode, RemoteDecode, make_pool
from pdd.bench.commands import add_json_arg, write_json
from pdd.kv.layout import KVLayout
from pdd.transfer import make_sender
from pdd.transfer.base import TransferTarget

MiB = 2**20
BACKENDS = ("nixl", "cuda_ipc", "tcp", "local")


def add_args(p) -> None:
    p.add_argument("--backends", "--backend", default="auto",
                   help="comma list of nixl, cuda_ipc (GPU), tcp, local (both ends in this process, no socket: "
                        "on a GPU the copy ceiling); auto: every one that runs here")
    p.add_argument("--tokens", default="16384", help="comma list: tokens of the request")
    p.add_argument("--sizes", default=None, help="comma list: MiB of pages per request, instead of --tokens")
    add_kv_shape_args(p)
    p.add_argument("--device", default="cpu", help="where the source pool lives: cpu, cuda, cuda:N")
    p.add_argument("--peer-device", default=None, help="where the decode pool lives (default: --device)")
    p.add_argument("--ucx-tls", default=None,
                   help="UCX_TLS for both ends of nixl (e.g. tcp: UCX over the same loopback as the tcp backend; "
                        "default: the environment's, else UCX's choice)")
    p.add_argument("--blocks", default="scattered", choices=["scattered", "contiguous", "descending", "shuffled"],
                   help="destination blocks: scattered (no two neighbours in the pool, as after a long churn), "
                        "contiguous (ascending ids), descending or shuffled (one range of the pool, in the "
                        "order a pool that served requests hands it out)")
    p.add_argument("--contiguous", action="store_const", const="contiguous", dest="blocks",
                   help="the same as --blocks contiguous")
    p.add_argument("--nixl-landing", default="on", choices=["on", "off"],
                   help="nixl: the decode side's landing region (on: a layer's pages land contiguously, two "
                        "descriptors, and are copied into the blocks there; off: written straight into the "
                        "blocks, two descriptors per run of neighbouring blocks)")
    p.add_argument("--repeats", type=int, default=5, help="timed transfers per size")
    p.add_argument("--receiver-thread", action="store_true",
                   help="the decode side in a thread of this process instead of its own (not for cuda_ipc)")
    p.add_argument("--zmq-ceilings", action="store_true",
                   help="also time plain ZeroMQ on the same loopback (tcp rows): one buffer, and N acked messages")
    add_json_arg(p)


def add_kv_shape_args(p) -> None:
    """The KV layout pages move in (kv_layout): a named shape, any dimension overridden."""
    p.add_argument("--shape", default="8b", choices=["8b", "tiny"],
                   help="KV shape: 8b = Llama-3.1-8B (32 layers x 8 KV heads x 128, bf16); tiny = the built-in "
                        "model (4 x 2 x 32, float32 as on a CPU worker)")
    p.add_argument("--layers", type=int, default=None, help="instead of the shape's")
    p.add_argument("--kv-heads", type=int, default=None, help="instead of the shape's")
    p.add_argument("--head-dim", type=int, default=None, help="instead of the shape's")
    p.add_argument("--dtype", default=None, help="instead of the shape's")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")


def _shape(name: str) -> tuple[int, int, int, str]:
    """(layers, KV heads, head dim, dtype) of a named KV shape."""
    if name == "tiny":   # the built-in model, in float32 as a CPU worker runs it
        from pdd.model.make_presets import PRESETS
        p = PRESETS["tiny"]
        return p["num_hidden_layers"], p["num_key_value_heads"], p["head_dim"], "float32"
    if name == "8b":     # conf/models/llama-3.1-8b
        return 32, 8, 128, "bfloat16"
    raise ValueError(f"--shape {name!r}: want 8b or tiny")


def kv_layout(args) -> KVLayout:
    """The KV layout of --shape, each of --layers/--kv-heads/--head-dim/--dtype given overriding it."""
    layers, heads, dim, dtype = _shape(getattr(args, "shape", None) or "8b")

    def pick(value, default):
        return default if value is None else value

    return KVLayout(model_id="bench", weights_hash="bench", dtype=pick(args.dtype, dtype),
                    block_size=args.block_size, num_layers=pick(args.layers, layers),
                    num_kv_heads=pick(args.kv_heads, heads), head_dim=pick(args.head_dim, dim))


def _device(name: str) -> str:
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: want cpu or cuda[:N]") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no GPU here")
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    if dev.type != "cpu":
        raise ValueError(f"--device {name}: want cpu or cuda[:N]")
    return "cpu"


def backends_for(text: str, device: str) -> list[str]:
    """The comma list of backends to measure ("auto": every one that runs on `device`)."""
    from pdd.transfer.nixl_agent import unavailable

    if text == "auto":
        return [b for b in BACKENDS
                if not (b == "nixl" and unavailable()) and not (b == "cuda_ipc" and device == "cpu")]
    names = [b.strip() for b in text.split(",") if b.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--backends {text!r}: want a comma list of distinct backends ({', '.join(BACKENDS)})")
    for b in names:
        if b not in BACKENDS:
            raise ValueError(f"--backends: unknown backend {b!r} (choices: {', '.join(BACKENDS)}, or auto)")
        if b == "cuda_ipc" and device == "cpu":
            raise ValueError("--backends cuda_ipc needs --device cuda")
        if b == "nixl" and (why := unavailable()):
            raise ValueError(f"--backends nixl: {why}")
    return names


def _counts(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} {text!r}: want a comma list of positive numbers")
    return values


class _Rig:
    """One backend's sender and decode side, reused across request sizes."""

    def __init__(self, backend: str, layout: KVLayout, src: torch.Tensor, peer_device: str,
                 receiver_thread: bool, blocks: int, landing_bytes: int = 0):
        """blocks: of the decode pool; landing_bytes: its nixl landing region."""
        self.backend, self.src = backend, src
        # A CUDA IPC handle cannot be opened in the process that exported it.
        in_process = backend == "local" or (receiver_thread and backend != "cuda_ipc")
        self.decode = (LocalDecode if in_process else RemoteDecode)(
            layout, blocks, peer_device, backend, landing_bytes if backend == "nixl" else 0)
        self.receiver = "this process" if in_process else "own process"
        try:
            kw = {"device": src.device} if backend == "cuda_ipc" else {}
            self.sender = make_sender(backend, layout, timeout_s=120, **kw)
        except BaseException:
            self.decode.close()
            raise
        self.done = threading.Event()
        self.sender.set_wakeup(self.done.set)
        self.n = 0

    def transfer(self, src_ids: list[int], dst_ids: list[int]) -> tuple[float, float, int, int]:
        """(seconds until accepted, seconds spent in send_layer, bytes, descriptors) of one request."""
        self.n += 1
        rid = f"bench-{self.n}"
        target = TransferTarget(rid, self.decode.grant(rid, dst_ids), "d", self.decode.address, tuple(dst_ids),
                                backend=self.backend)
        idx = list(range(len(dst_ids)))
        self.done.clear()
        if self.src.is_cuda:
            torch.cuda.synchronize(self.src.device)
        self.sender.prepare(target)
        t0 = time.perf_counter()
        for layer in range(self.src.shape[0]):
            self.sender.send_layer(target, layer, self.src[layer], src_ids, idx)
        self.sender.step_done()
        t_engine = time.perf_counter() - t0
        self.sender.finish(rid)
        res = self.sender.poll()
        while not res:
            self.done.wait(0.05)
            self.done.clear()
            res = self.sender.poll()
        if self.src.is_cuda:   # the local backend's copies are queued, not done, when it reports
            torch.cuda.synchronize(self.src.device)
        elapsed = time.perf_counter() - t0
        if not res[0].ok:
            raise RuntimeError(f"{self.backend} transfer failed: {res[0].error}")
        return elapsed, t_engine, res[0].bytes, res[0].descriptors

    def close(self) -> None:
        try:
            self.sender.close()
        finally:
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


def dst_pool_blocks(blocks: int, order: str) -> int:
    """Blocks of a decode pool that holds a request of `blocks` blocks laid out as `order`."""
    return 2 * blocks + 1 if order == "scattered" else blocks + 1


def block_ids(blocks: int, src_total: int, order: str) -> tuple[list[int], list[int]]:
    """(source, destination) block ids of one request of `blocks` blocks (--blocks)."""
    if order == "contiguous":
        return list(range(blocks)), list(range(blocks))
    g = torch.Generator().manual_seed(blocks)
    src = torch.randperm(src_total, generator=g)[:blocks].tolist()
    if order == "descending":
        return src, list(range(blocks - 1, -1, -1))
    if order == "shuffled":
        return src, torch.randperm(blocks, generator=g).tolist()
    if order == "scattered":
        return src, [2 * i for i in torch.randperm(blocks, generator=g).tolist()]
    raise ValueError(f"--blocks {order!r}: want scattered, contiguous, descending or shuffled")


def landing_bytes(layout: KVLayout, blocks: int, setting: str) -> int:
    """The decode side's nixl landing region for requests of up to `blocks` blocks (--nixl-landing)."""
    if setting not in ("on", "off"):
        raise ValueError(f"--nixl-landing {setting!r}: want on or off")
    return _bytes_per_token(layout) * layout.block_size * blocks + 4096 if setting == "on" else 0


def measure(rig: _Rig, blocks: int, repeats: int, order: str = "scattered", ceilings: bool = False) -> dict:
    """One request of `blocks` blocks, `repeats` times after a warm-up; the pages checked after."""
    src_ids, dst_ids = block_ids(blocks, rig.src.shape[2], order)
    rig.decode.clear()
    rig.transfer(src_ids, dst_ids)  # warm-up: opens the pool, connects, allocates staging
    runs = [rig.transfer(src_ids, dst_ids) for _ in range(repeats)]
    if not rig.decode.intact(rig.src, src_ids, dst_ids):
        raise RuntimeError(f"{rig.backend}: pages did not arrive intact")
    lay = rig.src
    nbytes = lay.shape[0] * 2 * blocks * lay[0, 0, 0].numel() * lay.element_size()
    t = statistics.median(r[0] for r in runs)
    out = {"backend": rig.backend, "receiver": rig.receiver, "blocks": blocks, "bytes": nbytes,
           "bytes_reported": runs[0][2], "descriptors": runs[0][3], "messages": lay.shape[0], "seconds": t,
           "gb_s": nbytes / t / 1e9, "send_layer_ms": 1e3 * statistics.median(r[1] for r in runs),
           "all_seconds": [r[0] for r in runs]}
    if ceilings:
        one, chunked = zmq_ceiling(nbytes, repeats), zmq_ceiling(nbytes, repeats, lay.shape[0])
        t_one, t_chunked = statistics.median(one), statistics.median(chunked)
        out.update(zmq_seconds=t_one, zmq_gb_s=nbytes / t_one / 1e9, fraction_of_zmq=t_one / t,
                   zmq_chunked_seconds=t_chunked, zmq_chunked_gb_s=nbytes / t_chunked / 1e9,
                   all_zmq_seconds=one, all_zmq_chunked_seconds=chunked)
    return out


def _bytes_per_token(layout: KVLayout) -> int:
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * getattr(torch, layout.kv_cache_dtype).itemsize


def _request_blocks(args, layout: KVLayout) -> list[tuple[int, int]]:
    """(tokens, blocks) of each request size asked for: --sizes in MiB, else --tokens."""
    if args.sizes:
        per_block = layout.block_size * _bytes_per_token(layout)
        blocks = [max(1, round(s * MiB / per_block)) for s in _counts(args.sizes, "--sizes")]
        return [(b * layout.block_size, b) for b in blocks]
    return [(int(t), -(-int(t) // layout.block_size)) for t in _counts(args.tokens, "--tokens")]


def main(args) -> int:
    device = _device(args.device)
    peer = _device(args.peer_device) if args.peer_device else device
    if (peer == "cpu") != (device == "cpu"):
        raise ValueError(f"--device {device} and --peer-device {peer}: both ends on the CPU or both on GPUs")
    if args.repeats < 1:
        raise ValueError("--repeats: want at least 1")
    backends = backends_for(args.backends, device)
    layout = kv_layout(args)
    sizes = _request_blocks(args, layout)
    if args.ucx_tls:   # before any NIXL agent starts, here or in the decode process (which inherits it)
        os.environ["UCX_TLS"] = args.ucx_tls
    order = getattr(args, "blocks", None) or "scattered"
    block_ids(1, 2, order)   # an unknown order is refused before any pool is made
    most = max(b for _, b in sizes)
    landing = getattr(args, "nixl_landing", None) or "on"
    landing_size = landing_bytes(layout, most, landing)
    src = make_pool(layout, most + 1, device, 1)
    results = {"date": time.strftime("%Y-%m-%d"), "device": device, "peer_device": peer,
               "layout": layout.to_dict(), "shape": args.shape, "ucx_tls": os.environ.get("UCX_TLS", ""),
               "blocks": order, "nixl_landing": landing, "threads": torch.get_num_threads(),
               "repeats": args.repeats,
               "runs": []}
    for backend in backends:
        rig = _Rig(backend, layout, src, peer, args.receiver_thread, dst_pool_blocks(most, order), landing_size)
        try:
            for tokens, blocks in sizes:
                r = measure(rig, blocks, args.repeats, order, args.zmq_ceilings and backend == "tcp")
                results["runs"].append({"tokens": tokens, **r})
        finally:
            rig.close()
    print(_report(results, layout))
    write_json(args.json, results)
    return 0


def _report(results: dict, layout: KVLayout) -> str:
    per_token = _bytes_per_token(layout)
    ceilings = any("zmq_gb_s" in r for r in results["runs"])
    lines = [f"KV layout {layout.num_layers} layers x {layout.num_kv_heads} KV heads x {layout.head_dim}, "
             f"{layout.kv_cache_dtype}, block {layout.block_size}: {per_token / 1024:g} KiB a token; "
             f"{results['device']} -> {results['peer_device']}; UCX_TLS={results['ucx_tls'] or '(UCX default)'}; "
             f"{results['blocks']} blocks; nixl landing region {results['nixl_landing']}; "
             f"median of {results['repeats']}",
             f"{'backend':<9} {'decode side':<13} {'tokens':>7} {'MiB':>7} {'descs':>6} {'ms/request':>11} "
             f"{'GB/s':>7} {'send_layer ms':>14}"
             + (f" {'zmq 1 buf GB/s':>15} {'zmq xN GB/s':>12}" if ceilings else "")]
    for r in results["runs"]:
        descs = r["descriptors"] if r["backend"] == "nixl" else "-"
        line = (f"{r['backend']:<9} {r['receiver']:<13} {r['tokens']:>7} {r['bytes'] / MiB:>7.1f} {descs:>6} "
                f"{1e3 * r['seconds']:>11.2f} {r['gb_s']:>7.2f} {r['send_layer_ms']:>14.2f}")
        if "zmq_gb_s" in r:
            line += f" {r['zmq_gb_s']:>15.2f} {r['zmq_chunked_gb_s']:>12.2f}"
        lines.append(line)
    lines.append("ms/request: first send_layer -> the decode side accepted the request (tcp: last ack; nixl, "
                 "cuda_ipc: commit; local: synchronous); send_layer ms: engine-thread time; "
                 "descs: NIXL descriptors one request named.")
    return "\n".join(lines)


if __name__ == "__main__":
    run_as_main(__name__)
