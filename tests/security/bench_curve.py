"""What CURVE costs: the control bus and the tcp KV data plane, with and without keys.

    python -m tests.security.bench_curve [--messages 20000] [--pings 2000] [--rounds 5]
                                         [--sizes 1,16,64] [--repeats 5] [--json FILE]

Control bus: RouterChannel and DealerChannel on loopback, in one process (the
encryption runs in libzmq's I/O threads either way): a worker streaming
one-token TokenBatch messages as fast as it can (messages/s at the router), and
request/reply round trips (Admit -> TokenBatch, median and p99 latency);
--rounds alternate plaintext and CURVE, and the median round is reported (on
a shared machine one round says little).
Data plane: the raw ZeroMQ ceiling of the tcp backend's bytes as 32 acked
messages, plaintext and with a throw-away cluster's data-plane keys (what the
cipher alone costs on this machine).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import zmq
import zmq.asyncio

from pdd.api import SamplingParams
from pdd.config_loader import load_cluster_config
from pdd.protocol import messages as m
from pdd.protocol.bus import DealerChannel, RouterChannel
from pdd.security import control_security, data_security, generate_keys


def _configs():
    keys = generate_keys(Path(tempfile.mkdtemp()) / "keys")
    return {"plaintext": load_cluster_config(env={}, overrides={"security": {"insecure": True}}),
            "curve": load_cluster_config(env={}, overrides={"security": {"keys_dir": str(keys)}})}


async def _bus(cfg, messages: int, pings: int) -> dict:
    ctx = zmq.asyncio.Context()
    router = RouterChannel(ctx, "tcp://127.0.0.1:0", control_security(cfg, "router"))
    worker = DealerChannel(ctx, router.addr, "w", control_security(cfg, "decode"))
    batch = m.TokenBatch("w", [m.TokenItem("req-0123456789abcdef", 1, 0, [42])])
    await worker.send(batch)          # connected (handshake done) before timing
    await router.recv()

    async def drain(n: int) -> None:
        for _ in range(n):
            await router.recv()

    t0, cpu0 = time.perf_counter(), time.process_time()
    receiving = asyncio.ensure_future(drain(messages))
    for _ in range(messages):
        await worker.send(batch)
    await receiving
    stream_s, stream_cpu = time.perf_counter() - t0, time.process_time() - cpu0

    admit = m.Admit("req-0123456789abcdef", 1, list(range(64)), SamplingParams())
    rtts = []
    for _ in range(pings):
        t = time.perf_counter()
        await router.send("w", admit)
        got = await worker.recv()
        await worker.send(m.TokenBatch("w", [m.TokenItem(got.request_id, got.epoch, 0, [7])]))
        await router.recv()
        rtts.append(time.perf_counter() - t)
    worker.close()
    router.close()
    ctx.term()
    rtts.sort()
    # CPU time of the whole process (event loop and libzmq's I/O threads, where
    # CURVE encrypts) per message: steadier than wall time on a shared machine.
    return {"messages_per_s": messages / stream_s, "cpu_us_per_message": 1e6 * stream_cpu / messages,
            "rtt_p50_us": 1e6 * statistics.median(rtts),
            "rtt_p99_us": 1e6 * rtts[int(0.99 * (len(rtts) - 1))]}


def _transfer(cfg, sizes: str, repeats: int) -> dict:
    """The cipher's cost on the data plane's bytes: raw ZeroMQ, each size as 32
    acked messages (the tcp backend's pattern), with `cfg`'s data-plane keys or
    none. (`python -m benchmarks.transfer` itself runs without keys.)"""
    from benchmarks import transfer

    sec = data_security(cfg)
    out = {}
    for size in sizes.split(","):
        nbytes = int(float(size) * 2**20)
        seconds = statistics.median(transfer.zmq_ceiling(nbytes, repeats, 32, sec))
        out[size] = {"bytes": nbytes, "seconds": seconds, "gb_s": nbytes / seconds / 1e9}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--pings", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", default="1,16,64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = {"date": time.strftime("%Y-%m-%d"), "bus": {}, "bus_rounds": {}, "transfer": {}}
    configs = _configs()
    for _ in range(args.rounds):
        for name, cfg in configs.items():
            results["bus_rounds"].setdefault(name, []).append(asyncio.run(_bus(cfg, args.messages, args.pings)))
    for name, rounds in results["bus_rounds"].items():
        results["bus"][name] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    for name, cfg in configs.items():
        results["transfer"][name] = _transfer(cfg, args.sizes, args.repeats)
    print(f"{'control bus':<12} {'msgs/s':>10} {'CPU us/msg':>11} {'RTT p50 us':>11} {'RTT p99 us':>11}")
    for name, r in results["bus"].items():
        print(f"{name:<12} {r['messages_per_s']:>10.0f} {r['cpu_us_per_message']:>11.1f} {r['rtt_p50_us']:>11.0f} "
              f"{r['rtt_p99_us']:>11.0f}")
    print(f"{'zmq x32':<12} {'MiB':>6} {'ms':>9} {'GB/s':>7}")
    for name, sizes in results["transfer"].items():
        for r in sizes.values():
            print(f"{name:<12} {r['bytes'] / 2**20:>6.0f} {1e3 * r['seconds']:>9.2f} {r['gb_s']:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
