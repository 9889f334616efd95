"""The router's books on the requests in flight, and a new request's refusals
(Unavailable, 503: no worker can take it; Overloaded, 429: too many wait).

Counting is kept apart from deciding: pdd.router.control decides what happens
to each request, and keeps its counts only through this table, so that every
count stays exact (`check_invariants`, which the tests call after every event):

    requests       every request held, by id (an id is in flight at most once:
                   a repeat gets `#2`, `#3`, ...)
    num_queued     those without a token yet: what admission limits
                   (router.max_queued_requests); 429 past it (Overloaded)
    inflight       per worker (WorkerInfo.inflight), the phases it owns, changed
                   in `own` only
    followers      n > 1: the choices waiting on their first (pdd.router.followers)

A request's end gives back what it held here in one place, `release`. What it
leaves elsewhere (its breaker trial, its timeline, its latency figures) is the
control plane's to settle.
"""
from __future__ import annotations

from pdd.config import RouterConfig
from pdd.router.followers import Followers, Place
from pdd.router.metrics import RouterMetrics
from pdd.router.registry import WorkerRegistry
from pdd.router.requests import RequestState


class Unavailable(Exception):
    """No worker can take the request now (HTTP 503)."""


class Overloaded(Unavailable):
    """Not now (HTTP 429 with Retry-After; with retry_after_ms also
    `retry-after-ms`, which OpenAI's SDKs prefer): too many requests wait for
    their first token, or the router itself is saturated (pdd.router.saturation)."""

    def __init__(self, message: str, retry_after_s: int, retry_after_ms: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.retry_after_ms = retry_after_ms


class InFlight:
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics, place_choice: Place):
        """place_choice: places a choice that waited on its first (the control plane's)."""
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}
        self.num_queued = 0          # requests in flight without a token yet (admission control)
        self.released = 0            # requests (choices) let go since the start: the rate they end (saturation)
        self.followers = Followers(place_choice)   # n > 1: the choices waiting on their first

    def unique_id(self, request_id: str) -> str:
        """The id of record: `request_id`, or while it is in flight (two clients
        sent the same X-Request-Id) `request_id#2`, `#3`, ...: unique, and still
        starting with what the client sent."""
        if request_id not in self.requests:
            return request_id
        n = 2
        while f"{request_id}#{n}" in self.requests:
            n += 1
        return f"{request_id}#{n}"

    def unique_choice_ids(self, request_id: str, n: int) -> list[str]:
        """The ids of n choices, "<request_id>-<index>", all suffixed `#2`, `#3`,
        ... while one of them is in flight already (as `unique_id`)."""
        ids = [f"{request_id}-{i}" for i in range(n)]
        repeat = 2
        while any(rid in self.requests for rid in ids):
            ids = [f"{request_id}-{i}#{repeat}" for i in range(n)]
            repeat += 1
        return ids

    def check_admission(self) -> None:
        """Overloaded when router.max_queued_requests requests wait for their first
        token: this router's, or with several routers the cluster's, as the
        workers last said (each counts what every router queued on it)."""
        limit = self.cfg.max_queued_requests
        queued = self.num_queued
        if limit and len(self.cfg.routers) > 1:
            queued = max(queued, sum(w.load.waiting for w in self.registry.workers.values() if w.load))
        if limit and queued >= limit:
            self.metrics.rejected.labels("overloaded").inc()
            raise Overloaded(f"the server is overloaded: {queued} requests wait for their first "
                             f"token (router.max_queued_requests = {limit}); retry later", retry_after_s=1)

    def hold(self, state: RequestState) -> None:
        """A new request taken in: held and counted, on no worker yet."""
        self.requests[state.request_id] = state
        self.num_queued += 1
        self.metrics.prompt_tokens.inc(len(state.prompt_token_ids))
        self.metrics.inflight.inc()

    def first_token(self) -> None:
        """A request's first token reached its client: it waits no more."""
        self.num_queued -= 1

    def own(self, state: RequestState, decode: str | None, prefill: str | None) -> None:
        """Set the phase owners; the only place per-worker inflight counts change."""
        for wid, delta in ((state.decode_worker, -1), (state.prefill_worker, -1), (decode, 1), (prefill, 1)):
            w = self.registry.workers.get(wid) if wid is not None else None
            if w is not None:
                w.inflight += delta
        state.decode_worker, state.prefill_worker = decode, prefill

    def held_by(self, worker_id: str) -> list[RequestState]:
        """The requests `worker_id` owns a phase of."""
        return [s for s in self.requests.values() if worker_id in s.owners]

    def release(self, state: RequestState) -> None:
        """A request ended: its id, its place in the queue if it had no token, its
        owners' counts and, were it a waiting choice, its place among its
        first's followers are given back."""
        del self.requests[state.request_id]
        self.released += 1
        self.followers.forget(state)
        if not state.output_token_ids:
            self.num_queued -= 1
        self.own(state, None, None)
        state.phase, state.timer_seq, state.deadline_seq = "done", 0, 0
        self.metrics.inflight.dec()

    def check_invariants(self) -> None:
        """Every count exact (tests call this after every event)."""
        for w in self.registry.workers.values():
            owned = sum(s.owners.count(w.worker_id) for s in self.requests.values())
            assert w.inflight == owned, f"{w.worker_id}: inflight {w.inflight}, owns {owned}"
        queued = sum(1 for s in self.requests.values() if not s.output_token_ids)
        assert self.num_queued == queued, f"num_queued {self.num_queued}, without a token {queued}"
        for s in self.requests.values():
            assert not s.finished, f"{s.request_id} finished but still held"
            assert all(w in self.registry.workers for w in s.owners), f"{s.request_id}: owner not registered"
