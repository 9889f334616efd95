"""The router's CPU per streamed token.

A colocated cluster on the built-in tiny model (or --model); at each
concurrency C, C clients stream /v1/completions at once (a prompt of
--prompt-words words, --max-tokens tokens, ignore_eos), --rounds times over.
The router process's CPU time (utime + stime, /proc/PID/stat) over those
rounds, divided by the tokens delivered, is its cost per token; tokens/s is
the relay rate (on a small CPU box the worker may be what limits it). The
clients read raw bytes and count SSE events, so they take little of the CPU
they share with the router.

    pdd bench router-cost [--streams 64,256] [--max-tokens 256] [--rounds 2] [--py-spy DIR]

--py-spy DIR records the router with py-spy over each level's rounds (raw
folded stacks, DIR/router-C.txt, and the top of them printed).
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import aiohttp

from pdd.bench.load import start_cluster

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above "
         "an old quiet harbor town near green rolling hills and deep blue water").split()


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of process `pid`, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    """One stream; the SSE data events it carried (the [DONE] one not counted)."""
    events = 0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        tail = b""
        async for data in resp.content.iter_any():
            data = tail + data
            events += data.count(b"data: {")
            tail = data[-8:]   # an event split over two reads is counted once
            events -= tail.count(b"data: {")
        events += tail.count(b"data: {")
    return events


async def _rounds(url: str, model: str, headers: dict, streams: int, rounds: int, max_tokens: int,
                  prompt: str) -> int:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True, "temperature": 0}).encode()
    conn = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=conn, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        events = 0
        for _ in range(rounds):
            events += sum(await asyncio.gather(*(_one(session, url + "/v1/completions", body)
                                                 for _ in range(streams))))
        return events


def _py_spy(pid: int, out: Path) -> subprocess.Popen | None:
    exe = shutil.which("py-spy") or str(Path(os.sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise SystemExit("--py-spy: py-spy is not installed (pip install py-spy)")
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                             "--nonblocking", "-o", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def top_functions(folded: Path, n: int = 15) -> list[tuple[str, float, float]]:
    """(function, share of samples it is on the stack of, share it is the leaf of), the most inclusive first."""
    inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = [f.split(" (", 1)[0] + " (" + f.rsplit("/", 1)[-1].split(":")[0] for f in stack.split(";")]
        frames = [f.rstrip("(") + ")" if "(" in f else f for f in frames]
        c = int(count)
        total += c
        for f in set(frames):
            inclusive[f] += c
        leaf[frames[-1]] += c
    return [(f, c / total, leaf[f] / total) for f, c in inclusive.most_common(n)] if total else []


def measure(url: str, model: str, headers: dict, router_pid: int, streams: int, rounds: int,
            max_tokens: int, prompt_words: int, spy_dir: Path | None = None) -> dict:
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(prompt_words))
    spy = _py_spy(router_pid, spy_dir / f"router-{streams}.txt") if spy_dir else None
    (user0, sys0), t0 = cpu_seconds(router_pid), time.perf_counter()
    events = asyncio.run(_rounds(url, model, headers, streams, rounds, max_tokens, prompt))
    wall, (user1, sys1) = time.perf_counter() - t0, cpu_seconds(router_pid)
    cpu, system = user1 - user0 + sys1 - sys0, sys1 - sys0
    if spy is not None:
        spy.send_signal(signal.SIGINT)   # it writes its file on SIGINT
        spy.wait(30)
    tokens = streams * rounds * max_tokens   # ignore_eos: every request runs to max_tokens
    return {"streams": streams, "tokens": tokens, "events": events, "wall_s": wall, "router_cpu_s": cpu,
            "router_sys_share": system / cpu if cpu else 0.0,
            "router_us_per_token": 1e6 * cpu / tokens, "tok_s": tokens / wall}


def main(args) -> int:
    levels = [int(x) for x in args.streams.split(",")]
    engine = {"max_num_seqs": max(levels), "max_num_batched_tokens": max(2048, max(levels) * 32)}
    cluster = start_cluster(args.run_dir, [("colocated", "colocated-0", None)], args.model, "colocated", engine)
    spy_dir = Path(args.py_spy) if args.py_spy else None
    if spy_dir:
        spy_dir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        pid = next(c.proc.pid for c in cluster.children if c.name == "router")
        keys = cluster.cfg.security.api_keys
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        measure(cluster.url, cluster.model_name, headers, pid, 8, 1, 16, args.prompt_words)   # warm-up
        for c in levels:
            results.append(measure(cluster.url, cluster.model_name, headers, pid, c, args.rounds,
                                   args.max_tokens, args.prompt_words, spy_dir))
    finally:
        cluster.stop()
    print(f"{'streams':>8} {'tokens':>8} {'events':>8} {'wall s':>7} {'router cpu s':>13} "
          f"{'of it system':>13} {'router us/token':>16} {'tokens/s':>9}")
    for r in results:
        print(f"{r['streams']:>8} {r['tokens']:>8} {r['events']:>8} {r['wall_s']:>7.2f} {r['router_cpu_s']:>13.2f} "
              f"{r['router_sys_share']:>13.0%} {r['router_us_per_token']:>16.2f} {r['tok_s']:>9.0f}")
    if spy_dir:
        for r in results:
            print(f"\nrouter profile, {r['streams']} streams (inclusive, leaf share of samples):")
            for f, inc, leaf in top_functions(spy_dir / f"router-{r['streams']}.txt", args.top):
                print(f"  {inc:6.1%} {leaf:6.1%}  {f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "levels": results}, indent=2))
    return 0
