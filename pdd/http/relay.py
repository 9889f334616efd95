"""Streams written by the router in one callback per loop iteration.

Waking each stream's handler for its tokens at every engine step (a future, a
task step, its async generators, an awaited aiohttp write) would cost the
router more than the tokens. A stream on the Relay has its request's events
(RequestState.listener) marked due instead; once per loop
iteration, after the step's TokenBatch was delivered, the Relay runs each due
stream's flush, which turns its events into chunks and writes them to its
connection at once (DirectWriter). Its handler wakes only to end the stream,
for an error, or when its client fell behind (then its awaited write drains).

The send system call is most of what a streamed token costs the router, and
it costs about as much for several tokens as for one. So when the router is
busy the flushes are spaced: with the loop's thread on a CPU more than
COALESCE_FROM of the time (pdd.router.saturation's reading) the relay runs at
most once per interval, growing with the load up to router.stream_interval_ms
at FULL_LOAD; each write then carries the tokens of the steps between. An idle
router writes every step's tokens at once (nothing to save, latency to lose);
a loaded one trades the smoothness of its streams for the CPU that keeps all
of them at pace, instead of falling behind on every one.

DirectWriter writes the chunked-encoding frame aiohttp's writer would write,
to the same transport, and only when the bytes can go out at once: not when
the client is behind (the transport's buffer at its high-water mark, where
aiohttp would wait in drain), the connection is closing, the handler is itself
writing (`busy`: its bytes go first), aiohttp's writer would transform the
body (compression, a declared length, hooks) or the headers are still unsent.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

log = logging.getLogger(__name__)


class DirectWriter:
    def __init__(self, resp: web.StreamResponse):
        self.writer = w = getattr(resp, "_payload_writer", None)
        self.busy = False
        self.usable = (w is not None and getattr(w, "chunked", False) is True
                       and getattr(w, "_compress", None) is None and getattr(w, "length", None) is None
                       and getattr(w, "_on_chunk_sent", None) is None and getattr(w, "on_body_write", None) is None
                       and not getattr(w, "_headers_buf", None) and not getattr(w, "_eof", False))
        self.transport = w.transport if self.usable else None
        self.usable = self.transport is not None
        # Where aiohttp's writer would wait in drain (the protocol pauses writing).
        self.high_water = self.transport.get_write_buffer_limits()[1] if self.usable else 0

    def can_write(self) -> bool:
        t = self.transport
        return (self.usable and not self.busy and not t.is_closing()
                and t.get_write_buffer_size() < self.high_water)

    def write(self, data: bytes) -> None:
        """One chunk of the body (can_write() said so just before; nothing awaited since)."""
        frame = b"%x\r\n%b\r\n" % (len(data), data)
        self.writer.output_size += len(frame)
        self.transport.write(frame)


class _Stream:
    __slots__ = ("relay", "flush", "due")

    def __init__(self, relay: Relay, flush: Callable[[], None]):
        self.relay, self.flush, self.due = relay, flush, False

    def __call__(self, _state) -> None:   # RequestState.listener: an event was posted
        if not self.due:
            self.due = True
            self.relay._mark(self)


COALESCE_FROM = 0.5   # the loop's busy share from which flushes are spaced
FULL_LOAD = 0.9       # ... and at which they are max_interval_s apart


class Relay:
    """Runs the due streams' flushes once per loop iteration, or, while
    `load()` (the loop's busy share, 0..1) is over COALESCE_FROM, at most once
    per interval, up to `max_interval_s` at FULL_LOAD (the tokens of the
    steps between then go out in one write per stream)."""

    def __init__(self, max_interval_s: float = 0.0, load: Callable[[], float] = lambda: 0.0):
        self._due: list[_Stream] = []
        self.max_interval_s = max_interval_s
        self.load = load
        self._next_run = 0.0   # loop time before which the relay does not run again

    @property
    def interval_s(self) -> float:
        """How far apart the flushes are now."""
        share = (self.load() - COALESCE_FROM) / (FULL_LOAD - COALESCE_FROM)
        return self.max_interval_s * min(1.0, share) if share > 0 else 0.0

    def listener(self, flush: Callable[[], None]) -> Callable:
        """A RequestState.listener that has `flush` run once in the loop iteration its events come in."""
        return _Stream(self, flush)

    def _mark(self, stream: _Stream) -> None:
        if not self._due:
            loop = asyncio.get_running_loop()
            wait = self._next_run - loop.time()   # never > 0 while the interval is 0
            if wait > 0:
                loop.call_later(wait, self._run)
            else:
                loop.call_soon(self._run)
        self._due.append(stream)

    def _run(self) -> None:
        self._next_run = asyncio.get_running_loop().time() + self.interval_s
        due, self._due = self._due, []
        for stream in due:
            stream.due = False
            try:
                stream.flush()
            except Exception:   # a flush catches its own; one that does not must not stop the others
                log.exception("relay: a stream's flush failed")
