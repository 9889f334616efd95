"""The router's core: workers in, requests out, tokens relayed.

It owns the control socket, the worker registry and the request table (the
state of record). The HTTP layer calls `submit` and iterates the returned
request's events; everything else here is driven by control messages and a
liveness timer. It runs no model.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import zmq.asyncio

from pdd.config import ClusterConfig
from pdd.engine.sampling_params import SamplingParams
from pdd.kv.hashing import block_hashes
from pdd.metrics import RouterMetrics
from pdd.protocol import messages as m
from pdd.protocol.bus import RouterChannel
from pdd.router.disagg import DisaggFlow, output_hashes
from pdd.router.policy import pick_worker
from pdd.router.registry import WorkerInfo, WorkerRegistry
from pdd.router.requests import RequestState, TokenEvent

log = logging.getLogger(__name__)

SERVING_ROLES = ("colocated", "decode")


class Unavailable(Exception):
    """No worker can take the request now (HTTP 503)."""


class Router:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        rc = cfg.router
        self.registry = WorkerRegistry(rc.heartbeat_interval_s, rc.heartbeat_misses)
        self.requests: dict[str, RequestState] = {}
        self.metrics = RouterMetrics(self.registry)
        self.accepting = True
        self.started_at = time.time()
        self._tasks: list[asyncio.Task] = []
        self.ctx: zmq.asyncio.Context | None = None
        self.chan: RouterChannel | None = None
        self.disagg = DisaggFlow(self)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.chan = RouterChannel(self.ctx, self.cfg.router.control_addr)
        log.info("router control bus on %s", self.chan.addr)
        self._tasks = [asyncio.create_task(self._control_loop()), asyncio.create_task(self._liveness_loop())]

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait (bounded) for those in flight."""
        self.accepting = False
        deadline = time.monotonic() + timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self, shutdown_workers: bool = False) -> None:
        if shutdown_workers and self.chan is not None:
            for wid in list(self.registry.workers):
                await self.chan.send(wid, m.Shutdown(drain=False))
        for state in list(self.requests.values()):
            state.fail("the router is shutting down")
        self.requests.clear()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.chan is not None:
            self.chan.close()
        if self.ctx is not None:
            self.ctx.term()

    @property
    def ready(self) -> bool:
        return bool(self.registry.candidates(SERVING_ROLES))

    def max_model_len(self) -> int | None:
        return self.registry.max_model_len()

    # ------------------------------------------------------------------ requests

    async def submit(self, prompt_token_ids: list[int], sampling: SamplingParams,
                     request_id: str | None = None) -> RequestState:
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        hashes = self._hashes(prompt_token_ids)
        disagg = self.cfg.router.mode != "colocated" and self.disagg.available()
        if not disagg and not self.registry.candidates(SERVING_ROLES):
            raise Unavailable("no worker is available")
        state = RequestState(request_id or uuid.uuid4().hex, list(prompt_token_ids), sampling, hashes)
        self.requests[state.request_id] = state
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        self.metrics.inflight.inc()
        if disagg:
            task = asyncio.create_task(self.disagg.start(state))
            task.add_done_callback(self._report_task_error)
        else:
            await self.admit_colocated(state)
        return state

    @staticmethod
    def _report_task_error(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("request flow failed", exc_info=task.exception())

    async def admit_colocated(self, state: RequestState, exclude: set[str] = frozenset()) -> bool:
        """Prefill and decode on one worker. False if no worker can take it."""
        candidates = [w for w in self.registry.candidates(SERVING_ROLES) if w.worker_id not in exclude]
        worker = pick_worker(candidates, state.block_hashes)
        if worker is None:
            return False
        await self._admit(state, worker)
        return True

    def _hashes(self, tokens: list[int]) -> list[int]:
        layout = self.registry.layout
        return block_hashes(tokens, layout.block_size) if layout else []

    async def _admit(self, state: RequestState, worker: WorkerInfo) -> None:
        state.worker_id = worker.worker_id
        worker.inflight += 1
        k = len(state.output_token_ids)
        msg = m.Admit(state.request_id, state.prompt_token_ids + state.output_token_ids,
                      vars(state.sampling), num_prior_output_tokens=k)
        if not await self.chan.send(worker.worker_id, msg):
            await self._on_worker_lost(worker.worker_id, "unreachable")

    async def abort(self, state: RequestState) -> None:
        """The client went away (or a stop string matched): stop the work, free its blocks."""
        if state.request_id not in self.requests:
            return
        if not state.finished:
            state.finished, state.finish_reason = True, "abort"
        self.retire(state)
        await self.disagg.release_prefill(state)
        if state.worker_id is not None:
            await self.chan.send(state.worker_id, m.Abort([state.request_id]))

    def retire(self, state: RequestState) -> None:
        if self.requests.pop(state.request_id, None) is None:
            return
        worker = self.registry.workers.get(state.worker_id)
        if worker is not None:
            worker.inflight = max(0, worker.inflight - 1)
            if state.output_token_ids and self.registry.layout is not None:
                # The worker now caches this conversation: the next turn should go there.
                worker.note_hashes(output_hashes(state, self.registry.layout.block_size))
        self.metrics.inflight.dec()
        self.metrics.observe_finished(state)

    def deliver(self, state: RequestState, event: TokenEvent) -> None:
        """Tokens for a request: to its stream, into the metrics; retire it when finished."""
        now = time.monotonic()
        if state.last_token_at is not None:
            self.metrics.itl.observe(now - state.last_token_at)
        elif event.token_ids:
            self.metrics.ttft.labels(state.mode).observe(now - state.arrival)
        self.metrics.generation_tokens.inc(len(event.token_ids))
        state.deliver(event)
        if event.finished:
            self.retire(state)
            self.metrics.cached_tokens.inc(state.num_cached_tokens)

    # ------------------------------------------------------------------ control plane

    async def _control_loop(self) -> None:
        handlers = {
            m.Register: self._on_register, m.Heartbeat: self._on_heartbeat, m.TokenBatch: self._on_tokens,
            m.RequestFailed: self._on_request_failed, m.Goodbye: self._on_goodbye,
            m.Reserved: self._on_reserved, m.FirstToken: self.disagg.on_first_token,
            m.PrefillDone: self.disagg.on_prefill_done,
            m.PrefillFailed: self.disagg.on_prefill_failed,
        }
        while True:
            peer, msg = await self.chan.recv()
            handler = handlers.get(type(msg))
            if handler is None:
                log.warning("router: ignoring %s from %s", msg.TYPE, peer)
                continue
            if getattr(msg, "worker_id", peer) != peer:
                log.warning("router: %s from %s claims to be %s; dropped", msg.TYPE, peer, msg.worker_id)
                continue
            try:
                await handler(peer, msg)
            except Exception:
                log.exception("router: error handling %s from %s", msg.TYPE, peer)

    async def _on_register(self, peer: str, msg: m.Register) -> None:
        error = self.registry.register(msg)
        if error:
            log.error("refused worker %s: %s", peer, error)
        else:
            log.info("worker %s registered (%s on %s, %d blocks)", peer, msg.role, msg.device, msg.num_blocks)
        await self.chan.send(peer, m.RegisterReply(ok=error is None, error=error or "",
                                                   heartbeat_interval_s=self.cfg.router.heartbeat_interval_s))

    async def _on_heartbeat(self, peer: str, msg: m.Heartbeat) -> None:
        if not self.registry.heartbeat(msg):
            await self.chan.send(peer, m.ReRegister())
            return
        self.metrics.observe_heartbeat(msg)

    async def _on_tokens(self, peer: str, msg: m.TokenBatch) -> None:
        self.registry.touch(peer)
        unknown = []
        for item in msg.items:
            try:
                rid, token_ids, finished, reason, logprobs, cached = item
            except (TypeError, ValueError):
                log.warning("router: malformed token item from %s: %r", peer, item)
                continue
            state = self.requests.get(rid)
            if state is None or state.worker_id != peer:
                if state is None:
                    unknown.append(rid)
                continue
            self.deliver(state, TokenEvent(token_ids, finished, reason, logprobs, cached))
        if unknown:
            # Tokens for requests we do not hold (aborted, or from before a router
            # restart): tell the worker to drop them and free their blocks.
            await self.chan.send(peer, m.Abort(unknown))

    async def _on_request_failed(self, peer: str, msg: m.RequestFailed) -> None:
        state = self.requests.get(msg.request_id)
        if state is None or state.worker_id != peer:
            return
        log.warning("worker %s failed request %s: %s", peer, msg.request_id, msg.error)
        # Retriable failures (lease expired, no room) are not the worker's fault:
        # it may be picked again.
        if msg.retriable and await self._migrate(state, exclude=set()):
            return
        state.fail(msg.error)
        self.retire(state)

    async def _on_reserved(self, peer: str, msg: m.Reserved) -> None:
        if not self.disagg.on_reserved(peer, msg) and msg.ok:
            await self.chan.send(peer, m.Abort([msg.request_id]))  # nobody wants it any more

    async def _on_goodbye(self, peer: str, msg: m.Goodbye) -> None:
        await self._on_worker_lost(peer, "said goodbye")

    async def _liveness_loop(self) -> None:
        interval = self.cfg.router.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            for wid in self.registry.expired():
                await self._on_worker_lost(wid, "missed heartbeats")

    async def _on_worker_lost(self, worker_id: str, why: str) -> None:
        lost = self.registry.remove(worker_id)
        if lost is None:
            return
        if lost.role == "prefill":
            log.warning("prefill worker %s lost (%s)", worker_id, why)
            await self.disagg.on_prefill_worker_lost(worker_id)
            return
        orphans = [s for s in self.requests.values() if s.worker_id == worker_id]
        log.warning("worker %s lost (%s); %d request(s) to move", worker_id, why, len(orphans))
        for state in orphans:
            if not await self._migrate(state, exclude={worker_id}):
                state.fail(f"worker {worker_id} was lost ({why}) and no other worker can take the request")
                self.retire(state)

    async def _migrate(self, state: RequestState, exclude: set[str]) -> bool:
        """Re-admit a request elsewhere with prompt + tokens streamed so far. The
        same seed and positions make it continue exactly where it stopped."""
        candidates = [w for w in self.registry.candidates(SERVING_ROLES) if w.worker_id not in exclude]
        worker = pick_worker(candidates, state.block_hashes)
        if worker is None:
            return False
        old = self.registry.workers.get(state.worker_id)
        if old is not None:
            old.inflight = max(0, old.inflight - 1)
        await self.disagg.release_prefill(state)
        state.mode = "colocated"
        state.num_migrations += 1
        self.metrics.migrations.inc()
        log.info("request %s moves %s -> %s after %d tokens", state.request_id, state.worker_id,
                 worker.worker_id, len(state.output_token_ids))
        await self._admit(state, worker)
        return True

    # ------------------------------------------------------------------ admin view

    def status(self) -> dict:
        return {
            "model": self.registry.layout.model_id if self.registry.layout else None,
            "accepting": self.accepting, "ready": self.ready,
            "uptime_s": round(time.time() - self.started_at, 1),
            "requests_in_flight": len(self.requests),
            "workers": [w.summary() for w in self.registry.workers.values()],
        }

    def set_draining(self, worker_id: str, draining: bool) -> dict:
        worker = self.registry.workers.get(worker_id)
        if worker is None:
            raise KeyError(f"no worker {worker_id!r}; known: {sorted(self.registry.workers)}")
        worker.draining = draining
        return worker.summary()
