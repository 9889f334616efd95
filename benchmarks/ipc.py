"""KV page transfer over cuda_ipc: one request's pages, all layers, from this
process's GPU into a decode pool owned by another process on the peer GPU.

The request is sent as a one-chunk prefill sends it: one send_layer() per
layer, scattered source and destination blocks. Two figures, as GB/s and as a
fraction of the measured cross-process CUDA IPC copy ceiling (391 GB/s on the
lent H200s):

  copy      GPU time of the copies back to back, for each --copy-ctas (0:
            one program per page chunk, else that many looping programs). In
            a prefill they are queued while the forward pass runs; here the
            compute stream is held by a sleep kernel while they are queued, so
            the figure is the data plane's and not this loop's Python.
  transfer  as the prefill worker sees it with nothing else running: first
            send_layer() -> commit acknowledged by the decode worker.

    python -m benchmarks.ipc [--tokens 16384] [--layers 32 --kv-heads 8 --head-dim 128]
                  [--device cuda:0 --peer-device cuda:1] [--repeats 10] [--json FILE]

--overlap-model DIR (a config-only checkpoint, dummy weights) adds the other
half of the claim: is the transfer hidden behind the prefill? A prefill
engine on --device runs prompts of --overlap-tokens as prefill-only requests,
first alone, then with its pages streamed layer by layer to a decode pool on
the peer GPU; reported: prefill time alone, prefill time while sending, and
the time until the decode worker acknowledged the last page.
"""
from __future__ import annotations

import statistics
import time

import torch

from benchmarks.cli import run_as_main
from benchmarks.decode_side import RemoteDecode, make_pool
from benchmarks.transfer import add_kv_shape_args, kv_layout
from pdd.bench.commands import add_json_arg, write_json
from pdd.transfer.base import TransferTarget
from pdd.transfer.cuda_ipc import CudaIpcSender

IPC_CEILING_GB_S = 391.0


def add_args(p) -> None:
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the request whose KV moves")
    add_kv_shape_args(p)
    p.add_argument("--device", default="cuda:0", help="the prefill side (sender)")
    p.add_argument("--peer-device", default=None, help="the decode pool (default: cuda:1 if present)")
    p.add_argument("--repeats", type=int, default=10, help="timed transfers")
    p.add_argument("--layer-group", type=int, default=0, help="layers per copy launch during the forward (0: all, after the step)")
    p.add_argument("--copy-ctas", default="0", help="comma list of programs per copy launch (0: one per page chunk)")
    p.add_argument("--overlap-ctas", type=int, default=0, help="programs per copy launch in the overlap run")
    p.add_argument("--overlap-model", default=None, help="config-only checkpoint: also measure prefill overlap")
    p.add_argument("--overlap-tokens", type=int, default=8192, help="prompt tokens of the overlap run")
    p.add_argument("--overlap-chunk", type=int, default=512, help="prefill chunk of the overlap run")
    p.add_argument("--overlap-repeats", type=int, default=5, help="timed prefills of the overlap run")
    p.add_argument("--overlap-kv-bytes", type=int, default=8 << 30, help="KV cache bytes of the overlap run's engine")
    add_json_arg(p)


def main(args) -> int:
    layout = kv_layout(args)
    blocks = -(-args.tokens // layout.block_size)
    total = 2 * blocks + 1
    peer = args.peer_device or ("cuda:1" if torch.cuda.device_count() > 1 else args.device)
    src = make_pool(layout, total, args.device, 1)
    decode = RemoteDecode(layout, total, peer)
    sender = CudaIpcSender(layout, timeout_s=120, device=args.device, layer_group=args.layer_group)
    g = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(total, generator=g)[:blocks].tolist()
    dst_ids = torch.randperm(total, generator=g)[:blocks].tolist()
    idx = list(range(blocks))
    n = 0

    def once(timed_on_gpu: bool) -> tuple[float, float, int]:
        """(seconds, engine-thread seconds, bytes) of one request's transfer."""
        nonlocal n
        n += 1
        rid = f"bench-{n}"
        target = TransferTarget(rid, decode.grant(rid, dst_ids), "d", decode.address, tuple(dst_ids),
                                backend="cuda_ipc")
        sender.prepare(target)
        torch.cuda.synchronize(args.device)
        if timed_on_gpu:  # queued behind a held compute stream, timed with events
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(50_000_000)
            start.record()
        t0 = time.perf_counter()
        for layer in range(layout.num_layers):
            sender.send_layer(target, layer, src[layer], src_ids, idx)
        sender.step_done()
        t_enqueue = time.perf_counter() - t0
        if timed_on_gpu:
            with torch.cuda.stream(sender.copy_stream):
                end.record()
        sender.finish(rid)
        res = []
        while not res:
            res = sender.poll()
            time.sleep(0.0001)
        t_all = time.perf_counter() - t0
        if not res[0].ok:
            raise RuntimeError(f"transfer failed: {res[0].error}")
        return (start.elapsed_time(end) / 1e3 if timed_on_gpu else t_all), t_enqueue, res[0].bytes

    per_ctas = {}
    try:
        once(False)  # opens the pool, compiles the kernels
        for ctas in [int(c) for c in args.copy_ctas.split(",")]:
            sender.copy_ctas = ctas or None
            once(True)
            runs = [once(True) for _ in range(args.repeats)]
            per_ctas[ctas] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        sender.copy_ctas = None
        whole = [once(False)[0] for _ in range(args.repeats)]
        nbytes = once(False)[2]
        if not decode.intact(src, src_ids, dst_ids):
            raise RuntimeError("pages did not arrive intact")
    finally:
        sender.close()
        decode.close()
    t_all = statistics.median(whole)
    out = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "peer_device": peer,
           "gpu": torch.cuda.get_device_name(args.device), "layout": layout.to_dict(), "tokens": args.tokens,
           "blocks": blocks, "bytes": nbytes, "layer_group": args.layer_group,
           "copy": {c: {"s": t, "gb_s": nbytes / t / 1e9, "fraction_of_ceiling": nbytes / t / 1e9 / IPC_CEILING_GB_S,
                        "engine_thread_s": e} for c, (t, e) in per_ctas.items()},
           "transfer_s": t_all, "transfer_gb_s": nbytes / t_all / 1e9,
           "transfer_fraction_of_ceiling": nbytes / t_all / 1e9 / IPC_CEILING_GB_S, "all_transfer_s": whole}
    print(f"{args.tokens} tokens, {blocks} blocks x {layout.num_layers} layers = {nbytes / 2**30:.2f} GiB, "
          f"{args.device} -> {peer}, {args.layer_group or 'all'} layers per launch")
    for c, r in out["copy"].items():
        print(f"copies ({c or 'all'} CTAs): {1e3 * r['s']:7.2f} ms  {r['gb_s']:6.1f} GB/s  "
              f"{r['fraction_of_ceiling']:.0%} of {IPC_CEILING_GB_S:g} GB/s; engine thread "
              f"{1e3 * r['engine_thread_s']:.2f} ms")
    print(f"transfer: {1e3 * t_all:8.2f} ms  {out['transfer_gb_s']:7.1f} GB/s  "
          f"{out['transfer_fraction_of_ceiling']:.0%} (first send_layer -> commit acknowledged)")
    if args.overlap_model:
        out["overlap"] = prefill_overlap(args)
    write_json(args.json, out)
    return 0


def prefill_overlap(args) -> dict:
    from pdd.config import EngineConfig
    from pdd.engine.engine import LLMEngine
    from pdd.api import SamplingParams
    from pdd.kv.layout import KVLayout
    from pdd.transfer.connector import PrefillConnector

    tokens, reps = args.overlap_tokens, args.overlap_repeats
    out = {"tokens": tokens, "chunk_size": args.overlap_chunk}
    engine = LLMEngine(EngineConfig(
        model=args.overlap_model, load_format="dummy", dtype="bfloat16", device=args.device,
        kv_cache_bytes=args.overlap_kv_bytes, chunk_size=args.overlap_chunk,
        max_num_batched_tokens=max(2048, args.overlap_chunk), max_model_len=tokens + 16, cuda_graphs=False))
    mc = engine.model_config
    layout = KVLayout("bench", "bench", "bfloat16", engine.cfg.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim)
    blocks = -(-tokens // engine.cfg.block_size)
    peer = args.peer_device or ("cuda:1" if torch.cuda.device_count() > 1 else args.device)
    decode = RemoteDecode(layout, blocks + 1, peer)
    sender = CudaIpcSender(layout, timeout_s=120, device=args.device, layer_group=args.layer_group,
                           copy_ctas=args.overlap_ctas or None)
    g = torch.Generator().manual_seed(1)
    n = 0

    def prefill(connector: PrefillConnector | None) -> tuple[float, float]:
        nonlocal n
        n += 1
        rid = f"overlap-{n}"
        prompt = torch.randint(0, 32000, (tokens,), generator=g).tolist()  # fresh: no prefix hits
        if connector is not None:
            dst = torch.randperm(blocks + 1, generator=g)[:blocks].tolist()
            connector.add(TransferTarget(rid, decode.grant(rid, dst), "d", decode.address, tuple(dst),
                                         backend="cuda_ipc"))
        torch.cuda.synchronize(args.device)
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1), prefill_only=True)
        while engine.has_unfinished():
            engine.step()
        t_prefill = time.perf_counter() - t0
        if connector is None:
            return t_prefill, t_prefill
        connector.finish(rid)
        res = []
        while not res:
            res = sender.poll()
            time.sleep(0.0001)
        if not res[0].ok:
            raise RuntimeError(f"transfer failed: {res[0].error}")
        return t_prefill, time.perf_counter() - t0

    try:
        for _ in range(2):
            prefill(None)  # warm-up (kernel compilation)
        alone = [prefill(None)[0] for _ in range(reps)]
        connector = PrefillConnector(sender, engine.runner.kv_cache, engine.cfg.block_size)
        engine.attach_connector(connector)
        prefill(connector)  # warm-up: opens the pool
        sending = [prefill(connector) for _ in range(reps)]
    finally:
        sender.close()
        decode.close()
    a, p, d = statistics.median(alone), statistics.median(s[0] for s in sending), \
        statistics.median(s[1] for s in sending)
    out.update(prefill_alone_s=a, prefill_sending_s=p, transfer_done_s=d, all_alone_s=alone,
               all_sending=sending, layer_group=args.layer_group, copy_ctas=args.overlap_ctas)
    print(f"prefill of {tokens} tokens (chunk {args.overlap_chunk}, copies on {args.overlap_ctas or 'all'} CTAs): alone {1e3 * a:.1f} ms, "
          f"while sending its KV {1e3 * p:.1f} ms ({p / a - 1:+.1%}), "
          f"last page acknowledged at {1e3 * d:.1f} ms ({d / a - 1:+.1%})")
    return out


if __name__ == "__main__":
    run_as_main(__name__)
