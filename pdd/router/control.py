"""Every request's state machine, and the worker events that drive it.

All that can happen to a request in flight is in this file. Each method is
one event — a submission, a client leaving, a worker's message, a timer, a
worker lost — and runs to completion without awaiting: it changes state and
queues messages through `send` (which never blocks; pdd.router.router
delivers them in order and reports an unreachable peer back as a lost
worker). Nothing here runs on its own: no task per request.

Placement (pdd.router.placement.place) decides where a request goes. Each
placement starts a new epoch: every message to a worker carries it, and a
worker's message about an older epoch, or from a worker that does not own the
phase it speaks of, is dropped. Epochs are numbered across all requests, not
per request: a client may send a request id again (X-Request-Id) once the
request that had it ended, and what the workers still send about that one
must not pass for the new one's. Before a request is placed again its old
owners are sent an Abort, ahead of anything of the new epoch on the same
socket, so a stale copy never outlives its placement.

Disaggregated (docs/design.md, "Request lifecycle"):

    reserving   decode <- Reserve and prefill <- Prefill, at once (the prompt
                computes while the decode worker reserves); timer reserve_timeout_s
                   FirstToken   -> streamed at once
                   Reserved ok  -> prefill <- KVTarget (block ids, lease), prefilling
                   refused / no answer / PrefillFailed -> placed again, prefilled where it decodes
    prefilling  timer kv_lease_ttl_s (the decode worker's lease)
                   FirstToken   -> streamed at once (the pages may still be in flight)
                   TokenBatch from the decode worker -> decoding: the data plane's last
                                message (after the last page) started it, with the
                                first token; no message from here is needed
                   PrefillDone  -> decoding (it came first; the decode worker runs
                                anyway); after the decode worker's tokens: its figures only
                   PrefillFailed, prefill worker lost -> decode <- PrefillLocally, decoding
                   no answer    -> placed again
    decoding    TokenBatch      -> streamed; the last one retires the request. Each item
                says where its tokens stand in the output: a token the client has
                is dropped (the first token can come from both workers); a gap
                places the request again from what the client has.
Any phase: its decode worker lost -> placed again with prompt + tokens so far
(same seed: it continues exactly); a retriable RequestFailed -> placed again;
otherwise -> failed.

Which workers are registered, and when one is lost or hung, is
pdd.router.membership's; what that does to the requests it held is here
(`_orphaned`, `_hung`).

n > 1 (submit_choices): n requests share the prompt. The first is placed as
any; the others stay queued, on no worker, until a TokenBatch of the first
comes from its decode worker — which then holds the prompt's full blocks in
its prefix cache — and are placed beside it, where they compute only the
block holding the prompt's last token. The first failing fails them; its client leaving
drops them; its ending otherwise (a stop string in the first token) places
them as any request (who waits on whom: pdd.router.followers).

What a worker sends reaches the handlers here through
pdd.router.worker_messages, which checks its sender, says whether it is
current and what of a TokenBatch is new. The requests held and every count of
them (the queue admission limits, the phases each worker owns, the choices
waiting on their first) are pdd.router.inflight's, kept exact there: this
module changes them through it.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from pdd import security
from pdd.api import SamplingParams
from pdd.config import RouterConfig
from pdd.kv.hashing import block_hashes
from pdd.router.metrics import RouterMetrics
from pdd.protocol import messages as m
from pdd.router.breaker import ADMIN, Breakers
from pdd.router.estimator import Estimator
from pdd.router.followers import make_choice
from pdd.router.inflight import InFlight, Unavailable
from pdd.router.membership import Membership
from pdd.router.placement import (ClusterView, PlaceRequest, Plan, pick_worker, place, policy_for, prefills_for_others,
                                  transfer_backend)
from pdd.router.registry import WorkerRegistry
from pdd.router.requests import DECODING, PREFILLING, RESERVING, RequestState, TokenEvent, TraceEvent
from pdd.router.timers import Timers
from pdd.router.traces import TraceStore, is_choice_of, matches
from pdd.router.worker_messages import TokenGap, WorkerMessages, transfer_note, unseen
from pdd.router import spans
from pdd.tracing.context import SpanContext

log = logging.getLogger(__name__)


ABORTED_BY_OPERATOR = "aborted by the operator (pdd admin abort)"

Send = Callable[[str, m.Message], None]


class ControlPlane:
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics, send: Send,
                 clock: Callable[[], float] = time.monotonic, step_timeout_s: float = 60.0,
                 traces: TraceStore | None = None):
        self.cfg = cfg
        self.step_timeout_s = step_timeout_s
        self.registry = registry
        self.metrics = metrics
        self.send = send
        self.clock = clock
        self.inflight = InFlight(cfg, registry, metrics, self._place_choice)   # the requests held, counted
        self.traces = traces if traces is not None else TraceStore()   # timelines of finished requests
        self.breakers = Breakers(cfg.breaker, self._breaker_moved)
        self.estimator = Estimator(cfg.adaptive)     # measured state the cost model prices with
        self.policy = policy_for(cfg)                # what place() decides by (router.mode)
        self._timers = Timers()
        self._epochs = itertools.count(1)
        self.on_timer_change: Callable[[], None] = lambda: None   # the router's timer loop re-arms
        self.membership = Membership(cfg, registry, metrics, self.estimator, self.breakers, self.policy, send, clock,
                                     step_timeout_s, orphaned=self._orphaned, hung=self._hung)
        self.messages = WorkerMessages(registry, self.membership, self.inflight.requests, send, {
            m.TokenBatch: self.on_tokens, m.RequestFailed: self.on_request_failed,
            m.Reserved: self.on_reserved, m.FirstToken: self.on_first_token,
            m.PrefillDone: self.on_prefill_done, m.PrefillFailed: self.on_prefill_failed,
        })
        # What a worker sent (the router's one entry for it): checked and dispatched
        # there, bound here once, so a TokenBatch takes no call more on its way.
        self.handle = self.messages.handle

    # ------------------------------------------------------------------ from HTTP

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
               hashes: list[int] | None = None, span: SpanContext | None = None) -> RequestState:
        """`hashes`: the prompt's block hashes if the caller computed them (off the event loop).
        An id already in flight (two clients sent the same X-Request-Id) gets `#2`, `#3`, ...:
        the id of record is unique, and still starts with what the client sent.
        `span`: its root span's context when traced (pdd.tracing.incoming)."""
        request_id = self.inflight.unique_id(request_id)
        self.inflight.check_admission()
        if hashes is None:
            hashes = self.prompt_hashes(prompt_token_ids)
        now = self.clock()
        state = RequestState(request_id, list(prompt_token_ids), sampling, hashes, arrival=now, span=span)
        state.mark("queued", f"{len(prompt_token_ids)} prompt tokens", at=now)
        plan = self._first_plan(state)
        if plan is None:
            self.metrics.rejected.labels("no_worker").inc()
            raise Unavailable("no worker is available" if self.cfg.mode != "disagg"
                              else "no prefill + decode pair is available (router.mode = disagg)")
        self._hold(state)
        # A policy that reads estimates prefills locally by choice; for the static ones it is a fallback.
        if plan.kind == "local_prefill" and not self.policy.needs_estimates or plan.reason == "no_decode_worker":
            log.info("request %s prefills on %s, where it decodes: %s", request_id, plan.decode,
                     plan.note or plan.reason)
        if plan.reason == "breaker_open":
            self.metrics.fallbacks.labels("breaker_open").inc()
        self._start(state, plan)
        return state

    def submit_choices(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str, n: int,
                       hashes: list[int] | None = None, span: SpanContext | None = None) -> list[RequestState]:
        """The n choices of one request (n > 1), ids "<request_id>-<index>" (all
        suffixed `#2`, `#3`, ... while one of them is in flight already, as
        `submit` suffixes a repeated id), each sampling with its own seed
        (pdd.router.followers.make_choice). The first is placed now, the
        others follow it (see the module's docstring)."""
        if n == 1:
            return [self.submit(prompt_token_ids, sampling, request_id, hashes, span)]
        ids = self.inflight.unique_choice_ids(request_id, n)
        first = self.submit(prompt_token_ids, sampling, ids[0], hashes, span)
        followers = self.inflight.followers
        for i, rid in enumerate(ids[1:], 1):
            follower = make_choice(first, sampling, rid, i, span)
            self._hold(follower)
            followers.follow(first, follower)
        return [first, *followers.of(first)]

    def _hold(self, state: RequestState) -> None:
        """Take a new request in: counted, timed; not placed yet."""
        self.inflight.hold(state)
        if self.cfg.request_timeout_s:
            state.deadline_seq = self._add_timer(state.arrival + self.cfg.request_timeout_s, state.request_id)

    def _first_plan(self, state: RequestState, beside: str = "") -> Plan | None:
        """Where a request not placed before goes (`beside`: see PlaceRequest)."""
        now = self.clock()
        request = PlaceRequest(state.block_hashes, num_tokens=len(state.prompt_token_ids),
                               max_tokens=state.sampling.max_tokens,
                               prompt_logits=state.sampling.prompt_logprobs is not None, beside=beside)
        return self._place(request, pair_allowed=lambda p, d: self.breakers.allows(p, d, now))

    def _place_choice(self, choice: RequestState, beside: str) -> None:
        """A choice that waited on its first (pdd.router.followers), placed now."""
        plan = self._first_plan(choice, beside)
        if plan is None:
            self._fail(choice, "no worker is available")
        else:
            self._start(choice, plan)

    def _place(self, request: PlaceRequest, exclude: frozenset[str] = frozenset(), **kw) -> Plan | None:
        workers, layout = self.registry.workers.values(), self.registry.layout
        estimates = None
        if self.policy.needs_estimates and not (request.colocated_only or request.prompt_logits):
            now = self.clock()
            if self.policy.balances_roles:
                self.estimator.rebalance(workers, now)
            estimates = self.estimator.estimates(workers, layout, now)
        view = ClusterView.of(workers, exclude, estimates=estimates, block_size=layout.block_size if layout else 16,
                              **kw)
        return place(request, view, self.policy)

    def prompt_hashes(self, prompt_token_ids: list[int]) -> list[int]:
        layout = self.registry.layout
        return block_hashes(prompt_token_ids, layout.block_size) if layout else []

    def abort(self, state: RequestState, reason: str = "abort") -> None:
        """The client went away (or a stop string matched: `reason` "stop"): stop
        the work, free its blocks. A client gone takes the choices waiting on it."""
        if self.inflight.requests.get(state.request_id) is not state:
            return
        if reason == "abort":
            for follower in self.inflight.followers.take(state):
                self.abort(follower)
        if not state.finished:
            state.finished, state.finish_reason = True, reason
        self._abort_owners(state)
        self._retire(state)

    def operator_abort(self, request_id: str) -> list[str]:
        """`pdd admin abort ID`: the request with this id (an id sent twice: each;
        n > 1: its choices, ID-0, ID-1, ...) ends with an error that says the
        operator aborted it, and its workers free its blocks. The ids ended."""
        requests = self.inflight.requests
        found = [s for rid, s in requests.items() if matches(rid, request_id)]
        if not found:
            found = [s for rid, s in requests.items() if is_choice_of(rid, request_id)]
        ended = []
        for state in found:
            if requests.get(state.request_id) is state:   # not gone with its first choice
                ended.append(state.request_id)
                self._fail(state, ABORTED_BY_OPERATOR)
        return ended

    def can_place(self) -> bool:
        """Whether a new request would be placed now, read only: the policy, the
        workers that take work and the breakers `submit` places by, asked for a
        one-token prompt (`/ready`)."""
        now, workers, layout = self.clock(), self.registry.workers.values(), self.registry.layout
        estimates = self.estimator.estimates(workers, layout, now) if self.policy.needs_estimates else None
        view = ClusterView.of(workers, estimates=estimates, block_size=layout.block_size if layout else 16,
                              pair_allowed=lambda p, d: self.breakers.would_allow(p, d, now))
        return place(PlaceRequest([], num_tokens=1, max_tokens=1), view, self.policy) is not None

    def fail_all(self, why: str) -> None:
        requests = self.inflight.requests
        for state in list(requests.values()):
            if requests.get(state.request_id) is state:   # a waiting choice fails with its first
                self._fail(state, why)

    # ------------------------------------------------------------------ from workers

    def on_tokens(self, peer: str, msg: m.TokenBatch) -> None:
        now = self.clock()   # the step's tokens all arrived now
        followers, current, requests = self.inflight.followers, self.messages.current, self.inflight.requests
        for item in msg.items:
            # Most items are current and all new: tested inline (once per stream per step),
            # the rest by current() (which tells a worker to drop what is nobody's) and unseen().
            state = requests.get(item.request_id)
            if state is None or state.decode_worker != peer or state.epoch != item.epoch:
                state = current(peer, item.request_id, item.epoch, None, owner="decode")
                if state is None:
                    continue
            phase = state.phase
            if phase != DECODING:
                if phase == RESERVING:   # no KV target yet: nothing it could decode
                    continue
                if phase == PREFILLING:   # it started on the KV before PrefillDone reached us
                    self._kv_landed(state)
            if followers.waiting:   # its decode worker has run the prompt: its cache holds it
                followers.release(state, peer)
            if len(state.output_token_ids) == item.position:
                self._deliver(state, item, now)   # an item is an event's shape
                continue
            try:
                event = unseen(state, item)
            except TokenGap:   # a worker lost tokens: the request goes on elsewhere from what the client has
                log.error("tokens of %s from %s start at %d, but the client has %d", state.request_id,
                          state.decode_worker, item.position, len(state.output_token_ids))
                self._place_again(state, "token_gap", f"{state.decode_worker} skipped tokens")
                continue
            if event is not None:
                self._deliver(state, event, now)

    def on_request_failed(self, peer: str, msg: m.RequestFailed) -> None:
        state = self.messages.current(peer, msg.request_id, msg.epoch, None, owner="any")
        if state is None:
            return
        log.warning("worker %s failed request %s: %s", peer, msg.request_id, msg.error)
        if msg.retriable:  # not the request's fault (lease expired, no room): another try
            self._place_again(state, "worker_refused", f"{peer}: {msg.error}")
        else:
            self._fail(state, msg.error, status=400 if msg.invalid else 500)

    def on_reserved(self, peer: str, msg: m.Reserved) -> None:
        state = self.messages.current(peer, msg.request_id, msg.epoch, RESERVING, owner="decode")
        if state is None:
            return
        if not msg.ok:
            reason = "no_decode_room" if "KV blocks" in msg.error else "reserve_refused"
            self._place_again(state, reason, f"{peer} refused the reservation: {msg.error}")
            return
        self.metrics.disagg_phase.labels("reserve").observe(self.clock() - state.placed_at)
        state.lease_id, state.num_cached_tokens = msg.lease_id, msg.num_cached_tokens
        prefill = self._prefill_for(state)
        if prefill is None:
            self._prefill_locally(state, "prefill_worker_lost")
            return
        if state.prompt_at != prefill:   # the planned prefill worker left: another one computes it
            self._send_prompt(state, prefill)
        decode = self.registry.workers[peer]
        skip = msg.num_cached_tokens // self.registry.layout.block_size
        self._enter(state, PREFILLING, self.cfg.kv_lease_ttl_s)
        self.send(prefill, m.KVTarget(state.request_id, state.epoch, peer, decode.data_addr, msg.block_ids, skip,
                                      msg.lease_id, decode.public_key, spans.phase_traceparent(state)))

    def on_first_token(self, peer: str, msg: m.FirstToken) -> None:
        # Often while the decode worker still reserves: the prompt went to both at once.
        state = self.messages.current(peer, msg.request_id, msg.epoch, None, owner="prefill")
        if state is None or state.output_token_ids or state.phase not in (RESERVING, PREFILLING):
            return
        self.metrics.disagg_phase.labels("first_token").observe(self.clock() - state.placed_at)
        self._deliver(state, TokenEvent([msg.token], False, None, msg.logprobs, msg.num_cached_tokens))

    def on_prefill_done(self, peer: str, msg: m.PrefillDone) -> None:
        landed = self.inflight.requests.get(msg.request_id)
        if landed is None:   # the decode worker, started by the data plane, has streamed it all
            ended = self.traces.late(msg.request_id, TraceEvent(self.clock(), "transfer", msg.epoch, None, peer,
                                                                transfer_note(peer, msg.transfer)))
            if ended is not None:   # its last placement's transfer: counted as any other
                self.metrics.observe_transfer(peer, ended.served_by()[1] or "", msg.transfer)
            return
        if (landed is not None and landed.epoch == msg.epoch and landed.phase == DECODING
                and landed.prompt_at == peer and landed.prefill_worker is None):
            # The decode worker started on the KV (and told us) before this came.
            self._mark(landed, "transfer", transfer_note(peer, msg.transfer))
            self.metrics.observe_transfer(peer, landed.decode_worker or "", msg.transfer)
            self.estimator.transferred(landed.transfer_backend, msg.transfer)
            return
        state = self.messages.current(peer, msg.request_id, msg.epoch, PREFILLING, owner="prefill")
        if state is None:
            return
        self._mark(state, "transfer", transfer_note(peer, msg.transfer))
        self.metrics.observe_transfer(peer, state.decode_worker or "", msg.transfer)
        self.estimator.transferred(state.transfer_backend, msg.transfer)
        self._kv_landed(state)
        if not state.output_token_ids:  # no FirstToken came ahead of it
            self._deliver(state, TokenEvent([msg.first_token], False, None, msg.logprobs, msg.num_cached_tokens))
        # (The decode worker started on the data plane's last message: nothing to send it.)

    def _kv_landed(self, state: RequestState) -> None:
        """The prompt's KV is on the decode worker: the prefill phase is over."""
        self.metrics.disagg_phase.labels("prefill").observe(self.clock() - state.placed_at)
        self.breakers.record(state.prefill_worker, state.decode_worker, True, self.clock())
        self.registry.workers[state.prefill_worker].note_hashes(state.block_hashes)
        self._mark(state, "kv_landed")
        self.inflight.own(state, state.decode_worker, None)
        self._enter(state, DECODING)

    def on_prefill_failed(self, peer: str, msg: m.PrefillFailed) -> None:
        state = self.messages.current(peer, msg.request_id, msg.epoch, None, owner="prefill")
        if state is None or state.phase not in (RESERVING, PREFILLING):
            return
        if state.phase == RESERVING:   # before any reservation: nothing for the decode worker to fill
            self._place_again(state, "prefill_failed", f"prefill on {peer} failed: {msg.error}")
            return
        log.warning("prefill of %s on %s failed (%s); its decode worker prefills it", msg.request_id, peer,
                    msg.error)
        self.metrics.transfer_failures.inc()
        self.breakers.record(peer, state.decode_worker, False, self.clock())
        self._prefill_locally(state, "transfer_failed")

    # ------------------------------------------------------------------ workers lost or hung

    def _orphaned(self, worker_id: str, why: str) -> None:
        """The process registered as `worker_id` is gone (a new one may hold the
        id already): each request it held a phase of continues elsewhere, or
        fails, now. Its inflight count went with its registry entry."""
        held = self.inflight.held_by(worker_id)
        log.warning("worker %s lost (%s); %d request(s) to move", worker_id, why, len(held))
        for state in held:
            lost_decode = state.decode_worker == worker_id
            if lost_decode:
                state.decode_worker = None
            if state.prefill_worker == worker_id:
                state.prefill_worker = None
            if lost_decode:
                self.metrics.migrations.inc()
                self._place_again(state, None, f"worker {worker_id} was lost ({why})")
            elif state.phase == PREFILLING:
                self._prefill_locally(state, "prefill_worker_lost")
            elif state.prompt_at == worker_id:
                # reserving: a prefill worker is picked at Reserved. The prompt sent
                # here went with that process: the one registered under the id by
                # then (restarted, or re-registered after dropping all it held)
                # must be sent it again, or it ignores the KVTarget.
                state.prompt_at = None

    def _hung(self, worker_id: str, running_s: float) -> None:
        """An engine step that never ends, while the worker's loop still answers:
        its requests move as for a lost worker."""
        held = self.inflight.held_by(worker_id)
        log.error("worker %s is hung: its engine step has run %.1fs (worker.step_timeout_s = %g); "
                  "%d request(s) move", worker_id, running_s, self.step_timeout_s, len(held))
        for state in held:
            if state.decode_worker == worker_id:
                self.metrics.migrations.inc()
                self._place_again(state, None, f"worker {worker_id} is hung", exclude=frozenset([worker_id]))
            elif state.phase == PREFILLING:
                self._prefill_locally(state, "prefill_worker_hung")
            else:
                self.inflight.own(state, state.decode_worker, None)   # reserving: another prefill worker at Reserved

    # ------------------------------------------------------------------ timers

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    def router_stalled(self, seconds: float) -> None:
        """The router itself did not run for `seconds` (stopped, starved, swapped
        out, a long GC): what the workers sent meanwhile waits unread, so that
        time counts against no worker's liveness, no request's timer and no
        departed worker's time to be forgotten."""
        self._timers.postpone(seconds)
        self.membership.router_stalled(seconds)

    def fire_timers(self) -> None:
        now = self.clock()
        for seq, rid in self._timers.due(now):
            state = self.inflight.requests.get(rid)
            if state is not None and state.deadline_seq == seq:
                self.metrics.rejected.labels("deadline").inc()
                self._fail(state, f"the request did not finish within router.request_timeout_s = "
                                  f"{self.cfg.request_timeout_s:g}s")
                continue
            if state is None or state.timer_seq != seq:
                continue  # its phase is over
            state.timer_seq = 0
            if state.prefill_worker is not None:   # the pair failed to get the KV across in time
                self.breakers.record(state.prefill_worker, state.decode_worker, False, now)
            if state.phase == RESERVING:
                self._place_again(state, "reserve_timeout", f"no answer to Reserve from {state.decode_worker} "
                                                            f"in {self.cfg.reserve_timeout_s:g}s",
                                  exclude=frozenset([state.decode_worker]))
            elif state.phase == PREFILLING:
                self._place_again(state, "prefill_timeout", f"no PrefillDone from {state.prefill_worker} "
                                                            f"in {self.cfg.kv_lease_ttl_s:g}s")

    # ------------------------------------------------------------------ transitions

    def _start(self, state: RequestState, plan: Plan) -> None:
        """A new placement: a new epoch, its owners, its first message."""
        state.epoch = next(self._epochs)
        state.mode, state.transfer_backend, state.lease_id = plan.mode, plan.backend, ""
        self.inflight.own(state, plan.decode, plan.prefill)
        state.placed_at, state.prompt_at = self.clock(), None
        self._mark(state, "placed", f"{plan.kind} ({plan.reason})" + (f" over {plan.backend}" if plan.backend else ""))
        self.metrics.placements.labels(plan.kind, plan.reason).inc()
        self.estimator.placed(plan.prefill or plan.decode, plan.decode,
                              plan.prefill_tokens or len(state.prompt_token_ids) + len(state.output_token_ids),
                              state.placed_at)
        if plan.disaggregated:
            # Both at once: the prompt computes while the decode worker reserves;
            # the block ids follow in KVTarget, long before the first page is due.
            self.breakers.placed(plan.prefill, plan.decode, state.placed_at, state.request_id)
            self._enter(state, RESERVING, self.cfg.reserve_timeout_s)
            self.send(plan.decode, m.Reserve(state.request_id, state.epoch, state.prompt_token_ids,
                                             state.sampling, self.cfg.kv_lease_ttl_s, state.block_hashes,
                                             spans.phase_traceparent(state)))
            self._send_prompt(state, plan.prefill)
            return
        self._enter(state, DECODING)
        tokens = state.prompt_token_ids + state.output_token_ids
        hashes = state.hashes_of(tokens, self.registry.layout.block_size) if self.registry.layout else []
        self.send(plan.decode, m.Admit(state.request_id, state.epoch, tokens, state.sampling,
                                       len(state.output_token_ids), hashes, plan.prefill_chunk,
                                       spans.phase_traceparent(state)))

    def _place_again(self, state: RequestState, reason: str | None, why: str,
                     exclude: frozenset[str] = frozenset()) -> None:
        """Its current placement cannot go on: stop it, then prefill (prompt +
        tokens so far) and decode on one worker."""
        if reason is not None:
            self.metrics.fallbacks.labels(reason).inc()
        self._mark(state, "fallback", f"{reason or 'migrated'}: {why}")
        self.breakers.release(state.request_id)
        self._abort_owners(state)
        self.inflight.own(state, None, None)
        plan = self._place(PlaceRequest(state.block_hashes, colocated_only=True), exclude)
        if plan is None:
            self._fail(state, f"{why}, and no other worker can take the request")
            return
        state.num_migrations += 1
        log.info("request %s placed again on %s after %d tokens: %s", state.request_id, plan.decode,
                 len(state.output_token_ids), why)
        self._start(state, plan)

    def _send_prompt(self, state: RequestState, prefill: str) -> None:
        state.prompt_at = prefill
        self.send(prefill, m.Prefill(state.request_id, state.epoch, state.prompt_token_ids, state.sampling,
                                     state.transfer_backend, state.block_hashes, spans.phase_traceparent(state)))

    def _prefill_locally(self, state: RequestState, reason: str) -> None:
        """The KV will not come: the decode worker computes the prompt in the
        blocks it holds, after the first token if the client already has it."""
        self.metrics.fallbacks.labels(reason).inc()
        self._mark(state, "fallback", f"{reason}: its decode worker prefills it")
        self.breakers.release(state.request_id)
        if state.prefill_worker in self.registry.workers:
            self.send(state.prefill_worker, m.Abort([state.request_id]))
        self.inflight.own(state, state.decode_worker, None)
        self._enter(state, DECODING)
        first = state.output_token_ids[0] if state.output_token_ids else None
        self.send(state.decode_worker, m.PrefillLocally(state.request_id, state.epoch, state.lease_id, first,
                                                        spans.phase_traceparent(state)))

    def _prefill_for(self, state: RequestState) -> str | None:
        """The prefill worker planned at placement, or another one if it left meanwhile."""
        workers = self.registry.workers
        planned = workers.get(state.prefill_worker) if state.prefill_worker else None
        if planned is not None and planned.serving:   # a suspect one computes the prompt it was sent
            return planned.worker_id
        decode = workers[state.decode_worker]
        now = self.clock()
        choices = [w for w in workers.values() if prefills_for_others(w) and w.accepting and w is not decode
                   and transfer_backend(w, decode) is not None
                   and self.breakers.allows(w.worker_id, decode.worker_id, now)]
        chosen = pick_worker(choices, state.block_hashes)
        self.inflight.own(state, state.decode_worker, chosen.worker_id if chosen else None)
        if chosen is not None:
            state.transfer_backend = transfer_backend(chosen, decode)
            self.breakers.placed(chosen.worker_id, decode.worker_id, now, state.request_id)
        return state.prefill_worker

    def _deliver(self, state: RequestState, event: TokenEvent, now: float | None = None) -> None:
        if now is None:
            now = self.clock()
        if state.last_token_at is not None or event.token_ids:
            self.metrics.observe_tokens(state, now)
        self.metrics.streamed_tokens += len(event.token_ids)
        if event.token_ids and not state.output_token_ids:
            self.inflight.first_token()
            self._mark(state, "first_token")
        state.deliver(event, now)
        if event.finished:
            self.metrics.cached_tokens.inc(state.num_cached_tokens)
            self._retire(state)
        elif state.buffered_tokens > self.cfg.max_buffered_tokens:   # its client is not reading
            self.metrics.rejected.labels("client_not_reading").inc()
            security.count("http.buffer_limit")
            self._fail(state, f"the client did not read its stream: {state.buffered_tokens} tokens waited for "
                              f"it (router.max_buffered_tokens = {self.cfg.max_buffered_tokens})")

    def _fail(self, state: RequestState, error: str, status: int = 500) -> None:
        """`status`: 400 when the request itself is at fault, else 500."""
        log.warning("request %s failed: %s", state.request_id, error)
        self._mark(state, "error", error)
        for follower in self.inflight.followers.take(state):     # the same request: it fails whole
            self._fail(follower, error, status)
        self._abort_owners(state)
        state.fail(error, status)
        self._retire(state)

    def _retire(self, state: RequestState) -> None:
        """It ended (its last event posted): its timeline and figures kept, what it held given back."""
        self._mark(state, "end", state.finish_reason or "")
        self.breakers.release(state.request_id)
        decode = self.registry.workers.get(state.decode_worker)
        if decode is not None and state.output_token_ids and self.registry.layout is not None:
            # That worker now caches this conversation: its next turn should go there.
            decode.note_hashes(state.cached_block_hashes(self.registry.layout.block_size))
        self.metrics.observe_finished(state)   # (while decode_worker still names its last worker)
        self.inflight.release(state)
        spans.export(state.span, self.traces.finished(state, self.clock()))
        # Still waited on: it ended before its decode worker said a word (a stop string in the first token).
        self.inflight.followers.release(state)

    def _abort_owners(self, state: RequestState) -> None:
        for wid in state.owners:
            if wid in self.registry.workers:
                self.send(wid, m.Abort([state.request_id]))

    # ------------------------------------------------------------------ breakers seen, phases, marks, timers

    def _breaker_moved(self, key: tuple[str, str], old: str, new: str, cause: str) -> None:
        prefill, decode = key
        (log.warning if new == "open" else log.info)("circuit breaker %s -> %s: %s -> %s%s", prefill, decode,
                                                     old, new, " (by an operator)" if cause == ADMIN else "")
        self.metrics.breaker_moved(prefill, decode, new, cause)

    def show_breakers(self) -> None:
        """pdd_breaker_state as placement reads it now: an open breaker past its
        cool-down is half-open without a transition (until a request tries it)."""
        now = self.clock()
        for (prefill, decode), b in self.breakers.breakers.items():
            self.metrics.show_breaker(prefill, decode, b.effective(now))

    def _enter(self, state: RequestState, phase: str, timeout_s: float | None = None) -> None:
        state.phase, state.phase_since, state.timer_seq = phase, self.clock(), 0
        state.mark(phase, at=state.phase_since)
        if timeout_s is not None:
            state.timer_seq = self._add_timer(state.phase_since + timeout_s, state.request_id)

    def _mark(self, state: RequestState, what: str, note: str = "") -> None:
        state.mark(what, note, at=self.clock())

    def _add_timer(self, deadline: float, request_id: str) -> int:
        seq = self._timers.add(deadline, request_id)
        self.on_timer_change()
        return seq
