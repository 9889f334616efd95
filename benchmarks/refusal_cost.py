"""What a refused request (429) costs the router's loop: a router held
saturated (its loop-lag verdict on, no worker needed) and its HTTP server on
loopback, a client process that posts `pdd bench frontdoor`'s kind of body
(a 24-word prompt, max_tokens 256, stream) over --connections keep-alive
connections until each has had --requests answers. Reported: the loop
thread's CPU time per answer (time.thread_time, so other processes on a busy
host do not count), which is the CPU a router past saturation spends on each
client that comes back after Retry-After instead of on its streams.

    python -m benchmarks.refusal_cost
    PYTHONPATH=DIR:$PWD python -P -m benchmarks.refusal_cost   # the pdd under DIR (an older commit's)
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from pathlib import Path

from benchmarks.cli import run_as_main
from pdd.bench.frontdoor import WORDS


def add_args(p) -> None:
    p.add_argument("--connections", type=int, default=64, help="client connections, each one request at a time")
    p.add_argument("--requests", type=int, default=200, help="requests per connection")


def _client(port: int, connections: int, requests: int, out) -> None:
    import aiohttp

    body = json.dumps({"model": "m", "prompt": " ".join(WORDS[:24]), "max_tokens": 256, "ignore_eos": True,
                       "stream": True}).encode()

    async def one(s) -> dict:
        statuses: dict[int, int] = {}
        for _ in range(requests):
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
        return statuses

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            total: dict[int, int] = {}
            for statuses in await asyncio.gather(*(one(s) for _ in range(connections))):
                for k, v in statuses.items():
                    total[k] = total.get(k, 0) + v
            out.put(total)
    asyncio.run(main())


async def _measure(a) -> dict:
    import pdd
    from pdd.config_loader import load_cluster_config
    from pdd.http.app import build_app, serve_http
    from pdd.model.make_model import ensure_builtin_model
    from pdd.model.tokenizer import Tokenizer
    from pdd.router.router import Router
    from pdd.router.saturation import PROBES

    model = ensure_builtin_model()
    cfg = load_cluster_config(env={}, overrides={"router": {"control_addr": "tcp://127.0.0.1:0",
                                                            "max_loop_lag_s": 0.5},
                                                 "security": {"insecure": True}})
    router = Router(cfg)   # not started: no probe to lift the verdict, no worker to place on
    for _ in range(PROBES):
        router.saturation.probe(1.0)   # late at every probe: saturated
    server = await serve_http(build_app(router, Tokenizer(model), "m"), "127.0.0.1", 0)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    client = ctx.Process(target=_client, args=(server.port, a.connections, a.requests, out))
    client.start()
    await asyncio.sleep(0)
    cpu0, wall0 = time.thread_time(), time.monotonic()
    while out.empty():
        await asyncio.sleep(0.01)
    statuses = out.get()
    cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
    client.join()
    await server.cleanup()
    n = sum(statuses.values())
    return {"pdd": str(Path(pdd.__file__).parent), "answers": statuses, "loop_us_per_answer": round(1e6 * cpu / n),
            "wall_s": round(wall, 2)}


def main(a) -> int:
    r = asyncio.run(_measure(a))
    print(f"{r['pdd']}: {r['answers']} answers, {r['loop_us_per_answer']} us of the loop's CPU each "
          f"({r['wall_s']} s)", flush=True)
    return 0


if __name__ == "__main__":
    run_as_main(__name__)
