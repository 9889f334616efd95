"""A bystander stream on a throw-away colocated cluster: one long completion
whose chunk gaps show whether something sent beside it (huge prompts, slow
grammars) stalls the streams already flowing. Shared by `bench stall` and
`bench grammar-stall`, which differ only in what they send beside it."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdd.bench.load import start_cluster


@contextmanager
def colocated_cluster(run_dir: str | Path, model: str | None, engine: dict | None = None) -> Iterator:
    """One colocated worker behind a router, ready; stopped on the way out.
    The cluster carries `headers`: what a client must send to be let in."""
    cluster = start_cluster(run_dir, [("colocated", "colocated-0", None)], model, "colocated", engine=engine)
    try:
        keys = cluster.cfg.security.api_keys
        cluster.headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        yield cluster
    finally:
        cluster.stop()


class Bystander:
    """One greedy `ignore_eos` stream; `marks` holds the arrival time of each
    of its chunks, from which the gaps of any window are read."""

    def __init__(self, session, url: str, model: str, max_tokens: int = 4000, flowing_after: int = 50):
        # max_tokens: as long as the context allows (the built-in model's is
        # 4,096 tokens), since the stream must outlast what is sent beside it.
        self.body = {"model": model, "prompt": "tell me a story", "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": True, "temperature": 0}
        self.session, self.url, self.flowing_after = session, url, flowing_after
        self.marks: list[float] = []
        self.error: str | None = None   # why the stream broke off, if it did
        self._flowing = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        async with self.session.post(self.url + "/v1/completions", json=self.body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the bystander stream was refused: {resp.status} {await resp.text()}")
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    self.marks.append(time.perf_counter())
                    if len(self.marks) >= self.flowing_after:
                        self._flowing.set()

    async def start(self) -> None:
        """Returns once the stream flows (its first chunks are in): a refusal,
        or an end before that, is raised."""
        self._task = asyncio.create_task(self._run())
        flows = asyncio.create_task(self._flowing.wait())
        await asyncio.wait([self._task, flows], return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            flows.cancel()
            self._task.result()
            raise RuntimeError("the bystander stream ended before it flowed")

    @property
    def ended(self) -> bool:
        return self._task is not None and self._task.done()

    def gaps(self, start: float, end: float) -> list[float]:
        """The gaps between chunks that overlap [start, end], seconds: a gap
        that began before the window and ended inside it counts."""
        return [b - a for a, b in zip(self.marks, self.marks[1:]) if b >= start and a <= end]

    def gaps_before(self, t: float) -> list[float]:
        """The gaps between chunks that had both landed by t: the stream alone."""
        return [b - a for a, b in zip(self.marks, self.marks[1:]) if b < t]

    async def stop(self, linger_s: float = 0.5) -> None:
        """Let the chunks of the window's last gap land, then hang up."""
        await asyncio.sleep(linger_s)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        except Exception as e:   # kept for the report: the figures of the window still stand
            self.error = f"{type(e).__name__}: {e}"
