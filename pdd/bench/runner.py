"""When `pdd bench serve` sends: arrivals at a rate (gamma gaps; Poisson at
burstiness 1) or all at once, at most --max-concurrency in flight, nothing
new after --duration seconds. A multi-turn item sends its next turn as soon as
the previous answer is complete; under --max-concurrency that turn queues behind
the turns already waiting (the gate is first come, first served), so with all
conversations started at once they go round-robin: every conversation's turn k
before any turn k+1, each conversation's history as far back in the caches'
LRU order as it can be.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import aiohttp

from pdd.bench.serve_client import RequestRecord, Target, build_body, send
from pdd.bench.workloads import Item


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf        # items per second; inf: all at once
    burstiness: float = 1.0               # gamma shape of the gaps: 1 Poisson, <1 burstier, >1 steadier
    max_concurrency: int | None = None    # requests in flight at most
    duration_s: float | None = None       # no request is sent after this
    request_timeout_s: float = 600.0
    ignore_eos: bool = True
    seed: int = 0


@dataclass
class RunOutcome:
    records: list[RequestRecord]   # every request sent, in the order they finished
    duration_s: float              # first send -> last answer
    not_sent: int                  # requests left out by --duration (or after a failed turn)


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times of n arrivals, seconds after the start; the first at 0. Gaps are
    gamma-distributed with mean 1/rate and shape `burstiness` (1: a Poisson process)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals:{seed}")   # apart from the workload's: the same prompts at every rate
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets


async def run_load(target: Target, items: list[Item], load: LoadConfig, on_done=None) -> RunOutcome:
    """Send `items` as `load` says; `on_done(record)` after each request (the progress bar)."""
    offsets = arrival_offsets(len(items), load.request_rate, load.burstiness, load.seed)
    gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    records: list[RequestRecord] = []
    not_sent = 0
    timeout = aiohttp.ClientTimeout(total=load.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=load.max_concurrency or 0)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()

        def past_duration(now: float) -> bool:
            return load.duration_s is not None and now - t0 >= load.duration_s

        async def converse(index: int, item: Item) -> None:
            nonlocal not_sent
            answers: list[RequestRecord] = []
            for k in range(len(item.turns)):
                body, prompt_len = build_body(target, item, k, answers, load.ignore_eos)
                record = RequestRecord(index, k, prompt_len, item.turns[k].output_len)
                if gate is not None:
                    await gate.acquire()
                try:
                    # NOTE: the first turn's send time was checked on schedule; only a
                    # wait for the gate or an earlier turn can push a send past --duration.
                    if (gate is not None or k > 0) and past_duration(time.perf_counter()):
                        not_sent += len(item.turns) - k
                        return
                    await send(session, target, body, record, t0)
                finally:
                    if gate is not None:
                        gate.release()
                records.append(record)
                if on_done is not None:
                    on_done(record)
                if not record.success:
                    not_sent += len(item.turns) - k - 1   # the conversation cannot go on
                    return
                answers.append(record)

        tasks = []
        for index, (item, offset) in enumerate(zip(items, offsets)):
            if load.duration_s is not None and offset >= load.duration_s:
                not_sent += sum(len(it.turns) for it in items[index:])
                break
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(converse(index, item)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return RunOutcome(records, duration, not_sent)
