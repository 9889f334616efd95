"""The router process's core: sockets and loops around the control plane.

pdd.router.control holds every request's state machine and decides; this
module feeds it events — control messages, timer expiries, lost workers — and
delivers what it sends, in order, from one task (a peer found unreachable is
a lost worker, fed back as an event). Between the two, worker ids and the
connections of worker processes are translated (pdd.router.connections): a
process replaced under its id is told so here and heard no further. The HTTP
layer calls `submit` and iterates the returned request's events. It runs no
model. The operator's commands that change the cluster are pdd.router.operations'.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque

import zmq.asyncio

from pdd import build_info
from pdd.api import SamplingParams
from pdd.config import ClusterConfig
from pdd.router.metrics import RouterMetrics
from pdd.protocol import messages as m
from pdd.protocol.bus import RouterChannel
from pdd.router.connections import Connections
from pdd.router.control import ControlPlane
from pdd.router.inflight import Overloaded, Unavailable
from pdd.router.operations import Operations
from pdd.router.placement import ClusterView, transfer_pairs
from pdd.router.registry import WorkerRegistry
from pdd.router.requests import RequestState
from pdd.router.saturation import Saturation
from pdd.router.traces import TraceStore
from pdd.security import control_security
from pdd.tracing.context import SpanContext

__all__ = ["Overloaded", "Router", "Unavailable"]

log = logging.getLogger(__name__)

_HASH_INLINE_TOKENS = 16_384  # longer prompts are hashed in a thread
# How long a prefix-cache reset waits for the workers' answers: an engine
# applies it between steps, and a busy GPU step takes well under a second.
RESET_TIMEOUT_S = 15.0
# The timer loop woken later than this was stalled (the rest is the loop's
# own jitter); the stall counts against no worker and no timer.
STALL_TOLERANCE_S = 0.1


class Router:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.served_names: tuple[str, ...] = ()   # what clients put in "model" (set by the HTTP side)
        rc = cfg.router
        self.registry = WorkerRegistry(rc.heartbeat_interval_s, rc.heartbeat_misses, rc.liveness_grace_s)
        self.metrics = RouterMetrics(self.registry)
        self.control = ControlPlane(rc, self.registry, self.metrics, self._post,
                                    step_timeout_s=cfg.worker.step_timeout_s,
                                    traces=TraceStore(cfg.log.trace_recent_requests, cfg.log.trace_slow_requests))
        self.control.on_timer_change = self._rearm
        self.saturation = Saturation(rc.max_loop_lag_s, rc.max_buffered_bytes, self.metrics.rejected,
                                     rc.max_loop_busy, max_inbound_lag_s=rc.max_inbound_lag_s,
                                     in_flight=lambda: len(self.control.inflight.requests),
                                     ended=lambda: self.control.inflight.released)
        self.operations = Operations(cfg, self.registry, self.control, self._post)
        self.accepting = True
        self.started_at = time.time()
        self.connections = Connections()
        # (worker id, connection) while a message from that connection is handled:
        # what the control plane sends that worker meanwhile answers that connection
        # (a registration in progress, or one not registered at all).
        self._speaking: tuple[str, str] | None = None
        self._outbox: deque[tuple[str, str | None, m.Message]] = deque()   # (connection, worker id, message)
        self._outbox_ready = asyncio.Event()
        self._timers_changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # Prefix-cache resets awaiting answers: reset id -> worker id -> its answer (dropped blocks).
        self._resets: dict[str, dict[str, asyncio.Future]] = {}
        self.ctx: zmq.asyncio.Context | None = None
        self.chan: RouterChannel | None = None

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.control.inflight.requests

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.chan = RouterChannel(self.ctx, self.cfg.router.own_control_addr, control_security(self.cfg, "router"))
        log.info("router control bus on %s", self.chan.addr)
        self._tasks = [asyncio.create_task(loop()) for loop in (self._recv_loop, self._send_loop, self._timer_loop,
                                                                self.saturation.run)]

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait (bounded) for those in flight."""
        self.accepting = False
        deadline = time.monotonic() + timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self, shutdown_workers: bool = False) -> None:
        self.control.fail_all("the router is shutting down")
        if shutdown_workers:
            for wid in list(self.registry.workers):
                self._post(wid, m.Shutdown(drain=False))
        await self._flush()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.chan is not None:
            self.chan.close()
        if self.ctx is not None:
            self.ctx.term()

    @property
    def ready(self) -> bool:
        """A new request would be placed now (ControlPlane.can_place: the placement
        policy on the workers that take work), and the router takes requests."""
        return self.accepting and self.control.can_place()

    def max_model_len(self) -> int | None:
        return self.registry.max_model_len()

    # ------------------------------------------------------------------ requests

    async def submit(self, prompt_token_ids: list[int], sampling: SamplingParams,
                     request_id: str | None = None) -> RequestState:
        return (await self.submit_choices(prompt_token_ids, sampling, request_id or uuid.uuid4().hex, 1))[0]

    async def submit_choices(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
                             n: int, span: SpanContext | None = None) -> list[RequestState]:
        """The n choices of one request (pdd.router.control.ControlPlane.submit_choices);
        `span`: its root span when traced (pdd.tracing.incoming)."""
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        hashes = None
        if len(prompt_token_ids) > _HASH_INLINE_TOKENS:
            # ~3.6 us a block (measured): a 1M-token prompt would hold the loop, and every stream, 0.2 s.
            hashes = await asyncio.get_running_loop().run_in_executor(
                None, self.control.prompt_hashes, prompt_token_ids)
        return self.control.submit_choices(prompt_token_ids, sampling, request_id, n, hashes, span)

    def check_admission(self, choices: int = 1) -> None:
        """Overloaded (429) when a request submitted now would be: asked before the
        work that precedes submission (tokenizing a large prompt): the router
        itself saturated (a request of `choices` held requests: its prompts x n),
        or too many requests waiting for a first token."""
        self.saturation.check(choices)
        self.control.inflight.check_admission()

    async def abort(self, state: RequestState, reason: str = "abort") -> None:
        """The client went away ("abort"), or its answer is complete ("stop": a stop
        string matched): no-op once it finished."""
        self.control.abort(state, reason)

    async def reset_prefix_cache(self, worker: str | None = None, timeout_s: float | None = None) -> dict:
        """Every worker (or `worker`) forgets the cached blocks no request holds.
        Returns once each has answered or `timeout_s` (RESET_TIMEOUT_S) has passed:
        {"reset": {worker: blocks dropped}, "no_answer": [workers], "timeout_s": timeout_s}."""
        timeout_s = RESET_TIMEOUT_S if timeout_s is None else timeout_s
        workers = self.registry.workers
        if worker is not None and worker not in workers:
            raise KeyError(f"no worker {worker!r}; known: {sorted(workers)}")
        targets = [worker] if worker is not None else sorted(workers)
        reset_id = uuid.uuid4().hex
        answers = {wid: asyncio.get_running_loop().create_future() for wid in targets}
        self._resets[reset_id] = answers
        for wid in targets:
            self._post(wid, m.ResetPrefixCache(reset_id))
        try:
            if answers:
                await asyncio.wait(answers.values(), timeout=timeout_s)
        finally:
            del self._resets[reset_id]
        reset = {wid: f.result() for wid, f in answers.items() if f.done()}
        no_answer = [wid for wid in targets if wid not in reset]
        log.info("prefix cache reset on %s%s", ", ".join(reset) or "no worker",
                 f"; no answer from {', '.join(no_answer)}" if no_answer else "")
        return {"reset": reset, "no_answer": no_answer, "timeout_s": timeout_s}

    def _on_prefix_cache_reset(self, worker_id: str, msg: m.PrefixCacheReset) -> None:
        answer = self._resets.get(msg.reset_id, {}).get(worker_id)
        if answer is None or answer.done():
            log.debug("router: dropped a prefix-cache reset answer from %s (late or not asked)", worker_id)
            return
        worker = self.registry.workers.get(worker_id)
        if worker is not None:
            worker.cached_hashes.clear()   # placement's picture of its cache: empty now
        answer.set_result(msg.dropped_blocks)

    # ------------------------------------------------------------------ loops

    def _post(self, worker_id: str, msg: m.Message) -> None:
        speaking = self._speaking
        conn = speaking[1] if speaking and speaking[0] == worker_id else self.connections.of(worker_id)
        if conn is None:
            log.warning("router: no connection of worker %s; %s not sent", worker_id, msg.TYPE)
            return
        self._queue(conn, worker_id, msg)

    def _queue(self, conn: str, worker_id: str | None, msg: m.Message) -> None:
        self._outbox.append((conn, worker_id, msg))
        self._outbox_ready.set()

    def _rearm(self) -> None:
        self._timers_changed.set()

    async def _send_loop(self) -> None:
        """Deliver in order; a peer that is not connected is a lost worker."""
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            while self._outbox:
                conn, worker_id, msg = self._outbox.popleft()
                try:
                    delivered = await self.chan.send(conn, msg)
                except Exception:
                    log.exception("router: cannot send %s to %s", msg.TYPE, conn)
                    continue
                if (not delivered and worker_id in self.registry.workers
                        and self.connections.of(worker_id) == conn):
                    self.control.membership.worker_lost(worker_id, f"unreachable (sending {msg.TYPE})")

    async def _flush(self, timeout_s: float = 2.0) -> None:
        """Let the send loop deliver what is queued (bounded: a stuck peer must not stop a shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._outbox and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _recv_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, msg = await self.chan.recv()
            try:
                self._received(conn, msg)
            except Exception:
                log.exception("router: error handling %s from %s", msg.TYPE, conn)
            if self.chan.waiting():   # how long the workers' messages have waited (saturation)
                self.saturation.behind(loop.time())
            else:
                self.saturation.caught_up()
            # A receive that finds a message waiting completes without yielding to
            # the loop: while the workers send faster than this loop handles (a
            # step's TokenBatch of a thousand streams costs milliseconds), it would
            # never yield, and the streams' handlers — the writes to the clients —
            # and the timers would wait for seconds. One message, then their turn.
            await asyncio.sleep(0)

    def _received(self, conn: str, msg: m.Message) -> None:
        """A message from connection `conn`, to the control plane as its worker's."""
        worker_id = getattr(msg, "worker_id", None)
        if worker_id is None:
            log.warning("router: ignoring %s from %s: it names no worker", msg.TYPE, conn)
            return
        registering = isinstance(msg, m.Register)
        if not self.connections.speaks_for(worker_id, conn, registering):
            log.info("router: %s from %s, a process replaced as worker %s: told to exit", msg.TYPE, conn,
                     worker_id)
            self._queue(conn, None, m.Replaced())
            return
        if isinstance(msg, m.PrefixCacheReset):   # an answer to reset_prefix_cache, not a request's
            self._on_prefix_cache_reset(worker_id, msg)
            return
        self._speaking = (worker_id, conn)
        try:
            self.control.handle(worker_id, msg)
        finally:
            self._speaking = None
        if registering and worker_id in self.registry.workers and not self.registry.is_new_incarnation(msg):
            old = self.connections.registered(worker_id, conn)
            if old is not None:
                log.warning("worker %s: a new process registered from %s; the old one (%s) is told to exit "
                            "when it next speaks", worker_id, conn, old)

    async def _timer_loop(self) -> None:
        """Request timers and worker liveness, one loop."""
        interval = self.cfg.router.heartbeat_interval_s
        next_liveness = time.monotonic() + interval
        while True:
            due = self.control.next_deadline()
            wake = min(next_liveness, due) if due is not None else next_liveness
            self._timers_changed.clear()
            try:
                await asyncio.wait_for(self._timers_changed.wait(), max(0.0, wake - time.monotonic()))
            except asyncio.TimeoutError:
                pass
            late = time.monotonic() - wake
            if late > STALL_TOLERANCE_S:
                # Woken late: the router itself did not run meanwhile.
                (log.warning if late > interval else log.debug)(
                    "router: its loop stalled for %.2fs; liveness and timers are moved on by it", late)
                self.control.router_stalled(late)
                next_liveness += late
            try:
                self.control.fire_timers()
                if time.monotonic() >= next_liveness:
                    next_liveness = time.monotonic() + interval
                    self.control.membership.check_liveness()
                    for worker_id in self.control.membership.forget_departed():
                        self.connections.forget(worker_id)
                    self.control.show_breakers()
            except Exception:
                log.exception("router: error in the timer loop")

    # ------------------------------------------------------------------ admin view

    def status(self) -> dict:
        return {
            "router": self.cfg.router.router_id, "routers_in_cluster": len(self.cfg.router.routers),
            "model": self.registry.layout.model_id if self.registry.layout else None,
            "served_model_names": list(self.served_names),
            "mode": self.cfg.router.mode,
            "accepting": self.accepting, "ready": self.ready,
            "uptime_s": round(time.time() - self.started_at, 1),
            "requests_in_flight": len(self.requests),
            "queued_requests": self.control.inflight.num_queued,
            "max_queued_requests": self.cfg.router.max_queued_requests,
            "overloaded": self.overloaded,
            "saturated": self.saturation.reason,
            "retry_after_s": round(self.saturation.retry_after_s, 2),
            "workers": self.worker_summaries(),
            "departed": self.departed(),
            "breakers": self.breakers(),
            "placement": self.placement_status(),
        }

    def worker_summaries(self) -> list[dict]:
        """Each worker as registered, with what placement estimates of it and,
        where it prefills for others, the backend to each worker it may ship
        KV to and why (`transfer_to`)."""
        view = self.control.estimator.view(self._estimates())
        pairs = transfer_pairs(self.registry.workers.values())
        return [{**w.summary(), "estimate": view.get(w.worker_id, {}), "transfer_to": pairs.get(w.worker_id, {})}
                for w in self.registry.workers.values()]

    def placement_status(self) -> dict:
        """The policy that places requests, its settings and what it reads of
        each worker now; decisions so far by kind and reason, the prefill demand
        and the role balance."""
        counts: dict[str, dict[str, int]] = {}
        for metric in self.metrics.placements.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    kind, reason = sample.labels["kind"], sample.labels["reason"]
                    counts.setdefault(kind, {})[reason] = int(sample.value)
        policy, estimates = self.control.policy, self._estimates()
        view = ClusterView(tuple(self.registry.workers.values()), estimates=estimates)   # drained ones too
        return {"policy": policy.name, "settings": policy.settings(), "estimates": policy.estimates(view),
                "decisions": counts, "prefill_demand_tokens_s": round(estimates.demand_tokens_s, 1),
                "prefill_leaning": sorted(self.control.estimator.prefill_leaning)}

    def _estimates(self):
        """What placement estimates now, read only (the balance as the last event set it)."""
        return self.control.estimator.estimates(self.registry.workers.values(), self.registry.layout,
                                                time.monotonic())

    def departed(self) -> list[dict]:
        """Workers gone and not forgotten yet: back under their id before then, they
        find their breakers and estimates again."""
        now, after = time.monotonic(), self.cfg.router.forget_after_s
        return [{"worker_id": wid, "gone_s": round(now - at, 1), "forget_in_s": round(max(0.0, at + after - now), 1)}
                for wid, at in sorted(self.control.membership.departed.items())]

    @property
    def overloaded(self) -> bool:
        """New requests get 429 now: the router saturated, or its queue full."""
        limit = self.cfg.router.max_queued_requests
        return self.saturation.reason is not None or (bool(limit) and self.control.inflight.num_queued >= limit)

    def breakers(self) -> list[dict]:
        """`pdd admin breaker`: every pair's state, failures in the window, time to the next trial."""
        return self.control.breakers.snapshot(time.monotonic())

    def versions(self) -> dict:
        """`pdd admin version`: the router's build and each registered worker's."""
        return {"router": build_info(),
                "workers": {wid: w.build for wid, w in sorted(self.registry.workers.items())}}
