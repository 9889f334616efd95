"""Where a request spent its time: the timelines the router keeps of finished requests.

pdd.router.control marks each request's events on its state (RequestState.mark:
queued, placed, each phase entered, first token, KV landed, the transfer's
figures, fallbacks, end) with the epoch and the phase owners at that moment.
When a request retires, its timeline is kept here — without its prompt or
tokens — in a ring of the most recent ones and, apart, among the slowest
(`log.trace_recent_requests`, `log.trace_slow_requests`). `pdd admin trace ID`
and `pdd admin requests --slow` read them (an in-flight request is read live).

Time in a phase runs from its event to the next phase's (or the end): queued
(until placed), reserving (the decode worker reserves while the prefill worker
computes), prefilling (the KV target is known: prefill and transfer until the
KV lands), decoding (colocated: the whole run at the worker, its queue and
prefill included).
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone

from pdd.router.requests import DECODING, PREFILLING, QUEUED, RESERVING, RequestState, TraceEvent

PHASES = (QUEUED, RESERVING, PREFILLING, DECODING)


@dataclass
class Timeline:
    """A request's timeline and the figures around it (no prompt, no tokens).
    Only `TraceStore.late` changes one, once it is stored."""
    request_id: str
    started_at: float              # wall clock (time.time()) at arrival
    arrival: float                 # monotonic, as the events
    ended: float | None            # monotonic; None while in flight
    mode: str
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    migrations: int
    events: list[TraceEvent]

    @classmethod
    def of(cls, state: RequestState, now: float, ended: bool) -> Timeline:
        return cls(state.request_id, time.time() - (now - state.arrival), state.arrival, now if ended else None,
                   state.mode, state.finish_reason, len(state.prompt_token_ids), len(state.output_token_ids),
                   state.num_cached_tokens, state.num_migrations, list(state.trace))

    def ttft(self) -> float | None:
        return next((e.at - self.arrival for e in self.events if e.what == "first_token"), None)

    def duration(self, now: float) -> float:
        return (self.ended if self.ended is not None else now) - self.arrival

    def phases(self, now: float) -> dict[str, float]:
        """Seconds spent in each phase of the state machine (summed over re-placements)."""
        out = dict.fromkeys(PHASES, 0.0)
        current, since = None, self.arrival
        for e in self.events:
            if e.what in PHASES or e.what == "end":
                if current is not None:
                    out[current] += e.at - since
                current, since = (e.what if e.what != "end" else None), e.at
        if current is not None:
            out[current] += (self.ended if self.ended is not None else now) - since
        return out

    def served_by(self) -> tuple[str | None, str | None]:
        """(prefill worker, decode worker) of its last placement (None where there was none)."""
        last = [e for e in self.events if e.epoch == self.events[-1].epoch] if self.events else []
        prefill = next((e.prefill for e in reversed(last) if e.prefill), None)
        decode = next((e.decode for e in reversed(self.events) if e.decode), None)
        return prefill, decode

    def fallbacks(self) -> list[str]:
        return [e.note.partition(":")[0] for e in self.events if e.what == "fallback"]

    def summary(self, now: float) -> dict:
        """The one-line figures of `pdd admin requests --slow` (and the access line's)."""
        prefill, decode = self.served_by()
        ttft = self.ttft()
        return {"request_id": self.request_id, "mode": self.mode, "finish_reason": self.finish_reason,
                "duration_s": round(self.duration(now), 4), "ttft_s": None if ttft is None else round(ttft, 4),
                **{f"{p}_s": round(s, 4) for p, s in self.phases(now).items()},
                "prefill_worker": prefill, "decode_worker": decode, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "fallbacks": ",".join(self.fallbacks()),
                "migrations": self.migrations}

    def to_dict(self, now: float) -> dict:
        """All of it (`pdd admin trace`): the summary, when it began, and each event."""
        return {**self.summary(now), "in_flight": self.ended is None,
                "started_at": datetime.fromtimestamp(self.started_at, timezone.utc).isoformat(timespec="milliseconds"),
                "cached_tokens": self.cached_tokens,
                "events": [{"t_s": round(e.at - self.arrival, 4), "event": e.what, "epoch": e.epoch,
                            "decode": e.decode, "prefill": e.prefill, "note": e.note} for e in self.events]}


class TraceStore:
    """The timelines of the `recent` last finished requests, and of the `slowest` apart."""

    def __init__(self, recent: int = 1000, slowest: int = 100):
        self.recent: deque[Timeline] = deque(maxlen=recent)
        self.num_slowest = slowest
        self._slow: list[tuple[float, int, Timeline]] = []   # min-heap on duration: the fastest kept goes first
        self._seq = 0

    def finished(self, state: RequestState, now: float) -> Timeline:
        t = Timeline.of(state, now, ended=True)
        self.recent.append(t)
        if self.num_slowest:
            self._seq += 1
            item = (t.duration(now), self._seq, t)
            if len(self._slow) < self.num_slowest:
                heapq.heappush(self._slow, item)
            elif item[0] > self._slow[0][0]:
                heapq.heapreplace(self._slow, item)
        return t

    def late(self, request_id: str, event: TraceEvent) -> Timeline | None:
        """An event about a request that already ended: a prefill worker's
        `PrefillDone` (the transfer's figures) may come after the decode worker,
        started by the data plane, streamed the whole answer. The timeline it
        joined (None: no finished request of that id and epoch is kept)."""
        t = next((t for t in reversed(self.recent) if t.request_id == request_id), None)
        if t is None or not t.events or t.events[-1].epoch != event.epoch:
            return None
        t.events.append(event)
        t.events.sort(key=lambda e: e.at)
        return t

    def find(self, request_id: str) -> list[Timeline]:
        """Finished requests with this id (a client's id reused while in flight: `ID#2`, ... too), oldest first."""
        seen, out = set(), []
        for t in [*self.recent, *(t for _, _, t in sorted(self._slow, key=lambda i: i[1]))]:
            if id(t) not in seen and matches(t.request_id, request_id):
                seen.add(id(t))
                out.append(t)
        return sorted(out, key=lambda t: t.arrival)

    def slowest(self, n: int | None = None) -> list[Timeline]:
        ranked = [t for _, _, t in sorted(self._slow, reverse=True)]
        return ranked[:n] if n is not None else ranked


def matches(request_id: str, wanted: str) -> bool:
    """`request_id` is `wanted`, or `wanted` suffixed because that id was in flight already."""
    return request_id == wanted or (request_id.startswith(wanted + "#") and request_id[len(wanted) + 1:].isdigit())


def is_choice_of(request_id: str, wanted: str) -> bool:
    """`request_id` is a choice of the request `wanted` (n > 1: `wanted-<i>`, suffixed as
    `matches` says when that id was in flight already)."""
    choice = request_id[len(wanted) + 1:].partition("#")[0]
    return request_id.startswith(wanted + "-") and choice.isdigit() and matches(request_id, f"{wanted}-{choice}")
