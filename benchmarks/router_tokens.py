"""What a streamed token costs one router, with no engine in the way: the real
router process (`pdd serve --role router`, the built-in tiny model's tokenizer)
and real HTTP clients (`pdd bench frontdoor`'s), but workers that are token
sources: processes that speak the worker protocol over the real control bus
(register, heartbeat, take Admits and Aborts) and, every --step-ms, send one
TokenBatch with a token for each request they hold. So the router's CPU per
token can be measured on any machine, a CPU box included, at any token rate.

    python -m benchmarks.router_tokens --streams 64,256 --workers 2 --step-ms 4
    python -m benchmarks.router_tokens --streams 256 --server-path DIR   # an older router, same sitting
    python -m benchmarks.router_tokens --routers 4 --streams 1024,2048   # 4 routers on one port

With --routers N the routers share the HTTP port (SO_REUSEPORT, as `pdd up
--routers N`), and each token source registers with every router and answers
each on its own connection, as a worker does: the sources are never what limits.

The token sources' ids are the tiny tokenizer's for plain words, so the
detokenizer and the chunks see text as a model's would. The control bus is
insecure (loopback only).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from benchmarks.cli import run_as_main
from benchmarks.profile import py_spy_exe, recording

from pdd.bench.frontdoor import run_point
from pdd.bench.serve_client import Target, first_model
from pdd.config_loader import toml_value
from pdd.kv.layout import KVLayout
from pdd.model.make_model import make_model
from pdd.model.tokenizer import Tokenizer
from pdd.protocol import messages as m

TEXT = "the quick brown fox jumps over the lazy dog and then it runs far away into the hills "


def add_args(p) -> None:
    p.add_argument("--streams", default="64,256", help="comma list of streams in flight")
    p.add_argument("--routers", type=int, default=1, help="routers sharing the HTTP port")
    p.add_argument("--workers", type=int, default=2, help="token-source processes")
    p.add_argument("--step-ms", type=float, default=4.0, help="each source's step: a token per request this often")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--client-procs", type=int, default=2, help="client processes")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--port", type=int, default=0,
                   help="the HTTP port, the control and admin ports above it (0: a free base port: another run "
                        "on the box must not be the router measured)")
    p.add_argument("--run-dir", default="/tmp/pdd-router-tokens")
    p.add_argument("--server-path", default=None, metavar="DIR",
                   help="run the router from the pdd package under DIR (an older commit's, for a before/after)")
    p.add_argument("--py-spy", default=None, metavar="DIR", help="also record the router with py-spy over each window")
    p.add_argument("--json", default=None, help="write the points here")


# ---------------------------------------------------------------- a token source (a process of its own)

def token_source(control_addrs: list[str], worker_id: str, step_s: float, token_ids: list[int]) -> None:
    asyncio.run(_source(control_addrs, worker_id, step_s, token_ids))


async def _source(control_addrs: list[str], worker_id: str, step_s: float, token_ids: list[int]) -> None:
    import zmq.asyncio

    from pdd.protocol.bus import DealerChannel
    ctx = zmq.asyncio.Context()
    incarnation = uuid.uuid4().hex
    # Per router: its connection, and the requests it placed here: id -> [epoch, next position, tokens left].
    links = [(DealerChannel(ctx, addr, f"{worker_id}-{uuid.uuid4().hex[:8]}"), {}) for addr in control_addrs]
    layout = KVLayout("tiny", "synthetic", "float32", 16, 4, 2, 32)
    register = m.Register(worker_id, "colocated", socket.gethostname(), os.getpid(), "cpu", layout.to_dict(),
                          num_blocks=1 << 20, max_num_seqs=1 << 16, max_model_len=1 << 16, incarnation=incarnation)
    for chan, _ in links:
        await chan.send(register)

    async def receive(chan, held: dict) -> None:
        while True:
            msg = await chan.recv()
            if isinstance(msg, m.Admit):
                left = msg.sampling.max_tokens - msg.num_prior_output_tokens
                held[msg.request_id] = [msg.epoch, msg.num_prior_output_tokens, left]
            elif isinstance(msg, m.Abort):
                for rid in msg.request_ids:
                    held.pop(rid, None)
            elif isinstance(msg, m.Shutdown):
                return

    async def beat() -> None:
        while True:
            running = sum(len(held) for _, held in links)
            for chan, _ in links:
                await chan.send(m.Heartbeat(worker_id, running, 0, 1 << 20, 1 << 20, decoding=running))
            await asyncio.sleep(0.2)

    async def steps() -> None:
        n = 0
        while True:
            await asyncio.sleep(step_s)
            for chan, held in links:
                items = []
                for rid, h in list(held.items()):
                    epoch, position, left = h
                    done = left <= 1
                    items.append(m.TokenItem(rid, epoch, position, [token_ids[(position + n) % len(token_ids)]],
                                             done, "length" if done else None))
                    h[1], h[2] = position + 1, left - 1
                    if done:
                        del held[rid]
                if items:
                    await chan.send(m.TokenBatch(worker_id, items))
            n += 1

    tasks = [asyncio.create_task(t()) for t in (beat, steps)]
    await asyncio.gather(*(receive(chan, held) for chan, held in links))
    for t in tasks:
        t.cancel()


# ---------------------------------------------------------------- the router

def _free_base(count: int) -> int:
    """A port p with p .. p+count-1 free on loopback now. With a fixed port, a
    second run on the same box had its router fail to bind while the first
    run's router answered its clients and health checks: it measured the
    other run's router (its own CPU read 0)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} free consecutive ports on 127.0.0.1")


def _alive(routers: list[subprocess.Popen], run_dir: Path) -> None:
    gone = [i for i, r in enumerate(routers) if r.poll() is not None]
    if gone:
        raise RuntimeError(f"router(s) {gone} exited (a port taken?); see {run_dir}/router-*.log")


def _routers(a, run_dir: Path) -> tuple[list[subprocess.Popen], str, list[str], list[str]]:
    """The routers started: (processes, the shared URL, each one's own URL, their control addresses)."""
    if not a.port:
        a.port = _free_base(1 + 3 * a.routers)
    model = run_dir / "tiny"
    if not (model / "config.json").is_file():
        make_model(model)
    control = [f"tcp://127.0.0.1:{a.port + 1 + 3 * i}" for i in range(a.routers)]
    admin = [f"tcp://127.0.0.1:{a.port + 2 + 3 * i}" for i in range(a.routers)]
    own = [a.port + 3 + 3 * i for i in range(a.routers)] if a.routers > 1 else []
    # Only the keys this needs, the rest each tree's defaults: an older pdd (--server-path)
    # refuses keys it does not know.
    router = {"port": a.port, "host": "127.0.0.1", "control_addr": control[0], "admin_addr": admin[0],
              "state_dir": str((run_dir / f"state-{a.port}").resolve()), "admin_token": uuid.uuid4().hex}
    if a.routers > 1:
        router.update(control_addrs=control, admin_addrs=admin, http_ports=own)
    config = run_dir / f"cluster-{a.port}.toml"   # one file a run: runs may share the run dir
    config.write_text(_toml({"engine": {"model": str(model)}, "router": router, "security": {"insecure": True}}))
    env = dict(os.environ)
    if a.server_path:
        env["PYTHONPATH"] = str(Path(a.server_path).resolve()) + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    for i in range(a.routers):
        log = open(run_dir / f"router-{i}.log", "ab")
        # -P: not the working directory first on sys.path (`-m` puts it there), so that
        # --server-path decides which pdd serves.
        procs.append(subprocess.Popen([sys.executable, *(["-P"] if a.server_path else []), "-m", "pdd.cli",
                                       "serve", "--role", "router", "--config",
                                       str(config), "--set", f"router.index={i}"],
                                      stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    url = f"http://127.0.0.1:{a.port}"
    return procs, url, [f"http://127.0.0.1:{p}" for p in own] or [url], control


def _toml(tables: dict[str, dict]) -> str:
    return "".join(f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()) + "\n"
                   for name, keys in tables.items())


def _workers_seen(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return json.loads(r.read()).get("workers", 0)
    except OSError:
        return -1


def main(a) -> int:
    if a.py_spy:
        py_spy_exe()   # refused before any router starts
    run_dir = Path(a.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    routers, url, own_urls, control = _routers(a, run_dir)
    token_ids = Tokenizer(run_dir / "tiny").encode(TEXT, add_special_tokens=False)
    ctx = multiprocessing.get_context("spawn")
    sources = [ctx.Process(target=token_source, args=(control, f"source-{i}", a.step_ms / 1000, token_ids),
                           daemon=True) for i in range(a.workers)]
    results = []
    try:
        for s in sources:
            s.start()
        deadline = time.monotonic() + 60
        while min(_workers_seen(u) for u in own_urls) < a.workers:
            if any(r.poll() is not None for r in routers) or time.monotonic() > deadline:
                raise RuntimeError(f"the routers did not all see {a.workers} token sources; see {run_dir}/router-*.log")
            time.sleep(0.2)
        _alive(routers, run_dir)
        model = first_model(Target(url))
        pids = [r.pid for r in routers]
        for streams in (int(x) for x in a.streams.split(",")):
            watch = contextlib.nullcontext
            if a.py_spy:
                watch = functools.partial(recording, pids, Path(a.py_spy) / f"routers-{a.routers}-streams-{streams}",
                                          f"router profile, {streams} streams", 45)
            r = run_point(url, model, streams, a.client_procs, a.max_tokens, 24, a.warmup, a.duration,
                          pids, own_urls[0], router_urls=tuple(own_urls), watch=watch)
            _alive(routers, run_dir)   # else what was measured was not these routers
            r.update(routers=a.routers, workers=a.workers, step_ms=a.step_ms, server=a.server_path or "this pdd")
            results.append(r)
            print(f"routers {a.routers}  streams {streams:5d}  {r['tokens_s']:>9,.0f} tok/s  "
                  f"router {r['router_us_per_token']} us/token ({r['router_cpu_cores']} cores)  "
                  f"ITL p50/p99 {r['itl_p50_ms']}/{r['itl_p99_ms']} ms  TTFT p50 {r['ttft_p50_ms']} ms  "
                  f"429s {r.get('429', 0)} (Retry-After {r['retry_after_mean_s']} s)  resets {r['connection_errors']}",
                  flush=True)
    finally:
        for r in routers:
            r.terminate()
        for r in routers:
            r.wait(30)
        for s in sources:
            s.kill()
        (run_dir / f"cluster-{a.port}.toml").unlink(missing_ok=True)
    # Past saturation (issue 36): each point's tokens/s as a share of the sitting's
    # best point, beside what its clients got instead (429s, resets).
    peak = max((r["tokens_s"] for r in results), default=0)
    for r in results:
        r["share_of_peak"] = round(r["tokens_s"] / peak, 3) if peak else None
        r["refused_429"] = r.get("429", 0)
        r["resets"] = r["connection_errors"]
    if results:
        print("share of peak: " + "  ".join(f"{r['concurrency']} streams {r['share_of_peak']}" for r in results), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "peak_tokens_s": peak,
                                            "points": results}, indent=1))
    return 0


if __name__ == "__main__":
    run_as_main(__name__)
