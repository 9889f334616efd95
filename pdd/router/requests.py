"""A request in flight, as the router holds it: the state of record.

The router keeps each request's prompt, sampling parameters (seed included)
and every token streamed so far, so a request whose worker dies can be placed
again with prompt + streamed tokens and continue exactly. Which worker owns
which phase, and the epoch of the current placement, are here too; only
pdd.router.control changes them (the owners through pdd.router.inflight,
which counts them).

    queued ──▶ reserving ──▶ prefilling ──▶ decoding ──▶ done
       │            (disaggregated)             ▲
       └────────────── colocated ───────────────┘
    any phase ──▶ placed again (a new epoch) on a failure, or done with an error

Each request keeps its timeline (`trace`): the events the state machine marks
— queued, placed, each phase entered, first token, KV landed, fallbacks, end —
with the epoch and the workers that owned it then (pdd.router.traces keeps
those of finished requests).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pdd.api import SamplingParams
from pdd.kv.hashing import ROOT_HASH, block_hashes
from pdd.tracing.context import SpanContext


class RequestError(Exception):
    """The request cannot complete (worker lost with no replacement, worker refused it).
    `status`: the HTTP status it is answered with (400: the request's own fault)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status

    @property
    def error_type(self) -> str:
        return "invalid_request_error" if self.status == 400 else "server_error"


@dataclass(slots=True)
class TokenEvent:
    """Tokens for the client. A worker's TokenItem has these fields too, and one
    that is all new goes to the client as it is (one object less a token)."""
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list | None
    num_cached_tokens: int
    prompt_logprobs: list | None = None   # with the first token, when asked (pdd.engine.prompt_logprobs)


QUEUED, RESERVING, PREFILLING, DECODING, DONE = "queued", "reserving", "prefilling", "decoding", "done"
MAX_TRACE_EVENTS = 64   # a request placed again and again keeps its first events and its end


class TraceEvent(NamedTuple):
    at: float                # monotonic
    what: str                # queued | placed | a phase | first_token | kv_landed | transfer | fallback | end
    epoch: int
    decode: str | None       # the phase owners at that moment
    prefill: str | None
    note: str = ""


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_hashes: list[int]
    # The current placement. `epoch` changes at every (re-)placement, numbered
    # across all of the router's requests; a worker's message about another
    # epoch is stale and dropped.
    epoch: int = 0
    phase: str = QUEUED
    decode_worker: str | None = None    # decodes and streams (colocated: does everything)
    prefill_worker: str | None = None   # owns the prefill phase (reserving/prefilling) when disaggregated
    mode: str = "colocated"             # colocated | disagg: how the current placement runs
    lease_id: str = ""
    transfer_backend: str = ""
    phase_since: float = 0.0            # when the current phase began (monotonic)
    placed_at: float = 0.0              # when the current placement began
    prompt_at: str | None = None        # the prefill worker that was sent the prompt in this epoch
    timer_seq: int = 0                  # the live phase timer; older ones are ignored when they fire
    deadline_seq: int = 0               # its request_timeout_s timer, if any
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None   # as they came with the first token, when asked for
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_migrations: int = 0
    trace: list[TraceEvent] = field(default_factory=list)
    span: SpanContext | None = None     # its root span when traced (pdd.router.spans)
    # What the router produced and the client's handler has not taken yet
    # (TokenEvents, then at most one RequestError); see take_events. A handler
    # blocked on a client that does not read takes nothing: pdd.router.control
    # bounds `buffered_tokens` (router.max_buffered_tokens).
    events: list = field(default_factory=list)
    buffered_tokens: int = 0            # tokens in `events`
    # Told of each posted event instead of waking the handler, when set:
    # pdd.http.app's relay, which writes the chunks of every stream with events
    # in one callback per loop iteration (take_now) rather than waking each
    # stream's handler; it nudges the handler for what it leaves.
    listener: Callable[[RequestState], None] | None = field(default=None, repr=False, compare=False)
    _waiter: asyncio.Future | None = field(default=None, repr=False)
    _nudged: bool = field(default=False, repr=False)

    @property
    def owners(self) -> tuple[str, ...]:
        return tuple(w for w in (self.decode_worker, self.prefill_worker) if w is not None)

    def mark(self, what: str, note: str = "", at: float | None = None) -> None:
        """One event of its timeline, with the current epoch and owners."""
        if len(self.trace) >= MAX_TRACE_EVENTS - 1 and what != "end":
            return
        self.trace.append(TraceEvent(time.monotonic() if at is None else at, what, self.epoch,
                                     self.decode_worker, self.prefill_worker, note))

    def deliver(self, event: TokenEvent, now: float | None = None) -> None:
        """`now`: when it arrived (monotonic; the caller's clock reading for a whole step's tokens)."""
        tokens = event.token_ids
        self.output_token_ids += tokens
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = event.num_cached_tokens
        if now is None:
            now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        if event.finished:
            self.finished, self.finish_reason = True, event.finish_reason
        self.buffered_tokens += len(tokens)
        self.events.append(event)   # _post's, inline: once per stream per step
        if self.listener is not None:
            self.listener(self)
        else:
            self.nudge()

    def fail(self, error: str, status: int = 500) -> None:
        self.finished, self.finish_reason = True, "error"
        self._post(RequestError(error, status))

    def _post(self, event) -> None:
        self.events.append(event)
        if self.listener is not None:
            self.listener(self)
        else:
            self.nudge()

    def nudge(self) -> None:
        """Wake the handler waiting in take_events, with or without events (the relay ended its stream)."""
        self._nudged = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take_events(self) -> list:
        """Every event posted since the last call, in order, waiting for one if
        there is none (or for a nudge: then the list may be empty). Under load a
        handler wakes once for several tokens and writes them to its client at once."""
        while not self.events and not self._nudged:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._nudged = False
        return self.take_now()

    def take_now(self) -> list:
        """Every event posted since the last take, without waiting."""
        taken, self.events, self.buffered_tokens = self.events, [], 0
        return taken

    def cached_block_hashes(self, block_size: int) -> list[int]:
        """Blocks whose KV the decoding worker holds at the end: the prompt and
        every output token but the last (never fed back)."""
        return self.hashes_of(self.prompt_token_ids + self.output_token_ids[:-1], block_size)

    def hashes_of(self, tokens: list[int], block_size: int) -> list[int]:
        """The block hashes of `tokens`, the prompt followed by output tokens.
        Only the output part is hashed here; the prompt's hashes were computed
        once, at submission."""
        done = len(self.block_hashes)
        parent = self.block_hashes[-1] if done else ROOT_HASH
        return self.block_hashes + block_hashes(tokens, block_size, parent, start=done * block_size)

    def summary(self) -> dict:
        now = time.monotonic()
        return {"request_id": self.request_id, "epoch": self.epoch, "phase": self.phase,
                "worker_id": self.decode_worker, "prefill_worker": self.prefill_worker, "mode": self.mode,
                "transfer_backend": self.transfer_backend,
                "prompt_tokens": len(self.prompt_token_ids), "output_tokens": len(self.output_token_ids),
                "buffered_tokens": self.buffered_tokens, "age_s": round(now - self.arrival, 3),
                "migrations": self.num_migrations}
