"""The client side of a request in flight: what the router posts reaches the
HTTP handler in order, several events at one wake-up when it lags."""
from __future__ import annotations

import asyncio

import pytest

from pdd.api import SamplingParams
from pdd.router.requests import RequestError, RequestState, TokenEvent


def state() -> RequestState:
    return RequestState("r", [1, 2, 3], SamplingParams(max_tokens=4), [])


def tokens(*ids: int, finished: bool = False) -> TokenEvent:
    return TokenEvent(list(ids), finished, "length" if finished else None, None, 0)


def test_a_lagging_handler_takes_every_event_since_its_last_wake_up_in_order():
    async def go():
        s = state()
        taker = asyncio.create_task(s.take_events())
        await asyncio.sleep(0)                      # the handler waits: nothing posted yet
        assert not taker.done()
        s.deliver(tokens(7))
        assert [e.token_ids for e in await taker] == [[7]]
        s.deliver(tokens(8))
        s.deliver(tokens(9, finished=True))
        got = await s.take_events()
        assert [e.token_ids for e in got] == [[8], [9]] and got[-1].finished
        assert s.output_token_ids == [7, 8, 9] and s.finished
    asyncio.run(go())


def test_a_failure_comes_after_the_tokens_posted_before_it():
    async def go():
        s = state()
        s.deliver(tokens(7))
        s.fail("worker lost")
        first, error = await s.take_events()
        assert first.token_ids == [7] and isinstance(error, RequestError) and str(error) == "worker lost"
        assert s.finish_reason == "error"
    asyncio.run(go())


def test_a_cancelled_wait_loses_nothing():
    async def go():
        s = state()
        taker = asyncio.create_task(s.take_events())
        await asyncio.sleep(0)
        taker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taker
        s.deliver(tokens(7))
        assert [e.token_ids for e in await s.take_events()] == [[7]]
    asyncio.run(go())
