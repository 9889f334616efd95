"""Requests in flight, as the router holds them: the state of record.

The router keeps each request's prompt, sampling parameters (seed included)
and every token streamed so far, so a request whose worker dies can be
re-admitted elsewhere with prompt + streamed tokens and continue exactly.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdd.engine.sampling_params import SamplingParams


class RequestError(Exception):
    """The request cannot complete (worker lost with no replacement, worker refused it)."""


@dataclass
class TokenEvent:
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list | None
    num_cached_tokens: int


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_hashes: list[int]
    worker_id: str | None = None        # the worker that decodes (and streams) it
    mode: str = "colocated"             # colocated | disagg
    # Disaggregated only: reserving -> prefilling -> decoding.
    phase: str = "decoding"
    prefill_worker: str | None = None
    lease_id: str = ""
    transfer_backend: str = ""          # the KV data plane chosen for its prefill -> decode pair
    phase_since: float = 0.0            # when the current disaggregated phase began (monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_migrations: int = 0
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def deliver(self, event: TokenEvent) -> None:
        self.output_token_ids.extend(event.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        if event.finished:
            self.finished, self.finish_reason = True, event.finish_reason
        self.events.put_nowait(event)

    def fail(self, error: str) -> None:
        self.finished, self.finish_reason = True, "error"
        self.events.put_nowait(RequestError(error))

    async def stream(self):
        """Token events until the request finishes; raises RequestError on failure."""
        while True:
            event = await self.events.get()
            if isinstance(event, RequestError):
                raise event
            yield event
            if event.finished:
                return

    def summary(self) -> dict:
        now = time.monotonic()
        return {"request_id": self.request_id, "worker_id": self.worker_id, "mode": self.mode,
                "phase": self.phase, "prefill_worker": self.prefill_worker,
                "transfer_backend": self.transfer_backend,
                "prompt_tokens": len(self.prompt_token_ids), "output_tokens": len(self.output_token_ids),
                "age_s": round(now - self.arrival, 3), "migrations": self.num_migrations}
