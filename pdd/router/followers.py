"""n > 1: the choices of a request, and those that wait on its first choice.

Choice i of a request samples with seed + i (mod 2**63), as vLLM, so that they
differ and a seeded request still repeats; only the first computes the
prompt's logprobs (the same for all), so that the others may take the prompt
from the prefix cache (`make_choice`).

The first choice is placed as any request; the others are held on no worker
until its decode worker has the shared prompt in its prefix cache (its first
TokenBatch), and are then placed beside it. pdd.router.control says when
(`release` at that batch, or when the first choice ends before it; `take`
when the first choice fails or its client leaves, so that they go with it);
pdd.router.inflight keeps this table beside the requests held, and `forget`s a
waiting choice that ends. The table is only who waits on whom, so that the
state machine reads as one.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pdd.api import INT64_MAX, SamplingParams
from pdd.router.requests import RequestState
from pdd.tracing.context import SpanContext

# Places one waiting choice, `beside` the worker that caches its prompt ("": anywhere).
Place = Callable[[RequestState, str], None]


def make_choice(first: RequestState, sampling: SamplingParams, request_id: str, index: int,
                span: SpanContext | None) -> RequestState:
    """Choice `index` (> 0) of `first`'s request, not placed yet. `sampling`:
    the request's; `span`: its root span when traced (a choice's is a sibling)."""
    seed = None if sampling.seed is None else (sampling.seed + index) & INT64_MAX
    return RequestState(request_id, first.prompt_token_ids,
                        dataclasses.replace(sampling, seed=seed, prompt_logprobs=None), first.block_hashes,
                        arrival=first.arrival, span=span.sibling() if span is not None else None)


class Followers:
    def __init__(self, place: Place):
        self._place = place
        # Keyed by request id: an id is in flight at most once (InFlight.unique_id suffixes a repeat).
        self._waiting: dict[str, list[RequestState]] = {}   # first choice's id -> the choices waiting on it
        self._first: dict[str, RequestState] = {}           # a waiting choice's id -> its first choice

    def follow(self, first: RequestState, choice: RequestState) -> None:
        """`choice` waits on `first`."""
        self._first[choice.request_id] = first
        self._waiting.setdefault(first.request_id, []).append(choice)

    def of(self, first: RequestState) -> list[RequestState]:
        """The choices waiting on `first` now."""
        return list(self._waiting.get(first.request_id, ()))

    def take(self, first: RequestState) -> list[RequestState]:
        """The choices waiting on `first`, waiting no more (to be aborted or failed with it)."""
        choices = self._waiting.pop(first.request_id, [])
        for choice in choices:
            del self._first[choice.request_id]
        return choices

    @property
    def waiting(self) -> bool:
        """Whether any choice waits (n > 1 requests only: most batches find none)."""
        return bool(self._waiting)

    def release(self, first: RequestState, beside: str = "") -> None:
        """`first`'s prompt is cached on `beside` (or `first` ended): its waiting
        choices are placed. Called for every batch of tokens: one lookup when
        none waits."""
        if first.request_id in self._waiting:
            for choice in self.take(first):
                self._place(choice, beside)

    def forget(self, choice: RequestState) -> None:
        """A request ends: if it was a waiting choice, its first choice forgets it."""
        first = self._first.pop(choice.request_id, None)
        if first is not None:
            rest = [c for c in self._waiting[first.request_id] if c is not choice]
            if rest:
                self._waiting[first.request_id] = rest
            else:
                del self._waiting[first.request_id]
