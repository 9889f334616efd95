"""Iteration-level scheduler: continuous batching with chunked prefill.

There is no prefill phase and no decode phase: a request has
`num_computed_tokens` (KV written) and `num_tokens` (prompt + output), and each
step gives it some of the difference under one token budget. Running requests
go first (their decodes keep TPOT steady), then waiting requests are admitted
while budget, sequence slots and blocks last. A prompt longer than
`chunk_size` is spread over several steps (with `chunk_only_beside_decodes`,
only while requests decode in the step). A prompt computed for another worker
(prefill-only) is scheduled as if nothing decoded here: the router sent it to
this worker to be computed at full speed, and it prices the gap that gives the
few requests decoding here. A request may carry its own, smaller chunk beside
decodes (`prefill_chunk`: the router sizes a long prompt's chunks where others
decode). When blocks run out, the newest
running request is preempted: its blocks are freed (they stay in the prefix
cache) and it is recomputed later. Before that, a waiting request holding
blocks (a reservation prefilled here after all: compute_locally) gives them
up: it has computed nothing beyond its cached prefix, which stays cached, and
held while it waits they could keep the requests ahead of it from ever fitting.

Long prompts (`long_prefill_token_threshold`: more than that many prompt
tokens still to compute) do not hold the short ones: a step gives the short
prompts' chunks (running, then waiting, also those queued behind a long one)
before a long prompt's, but first sets aside each long prompt's floor (its
part of `long_prefill_min_share` of the step's prompt tokens) and takes the
blocks for it at the long prompt's place in line, so the prompts it lets pass
can neither take its tokens nor its blocks. At most
`max_long_partial_prefills` long prompts are in partial prefill at once; one
beyond them waits in its place while the short prompts behind it go on.

Scheduling runs one step ahead of the GPU (async scheduling): `schedule()`
advances each request's `num_computed_tokens` as it schedules it, and a step
that samples leaves a token "in flight" (`num_in_flight`), which the next step
may already compute (the runner feeds it from the GPU). `update_from_output`
later appends the sampled tokens; a result for a request that was aborted,
finished or preempted since it was scheduled is dropped.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from pdd.config import EngineConfig
from pdd.engine.request import Request, RequestStatus
from pdd.kv.manager import KVCacheManager

log = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    # (request, number of its tokens computed this step), in schedule order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Per scheduled request: its num_computed_tokens before this step, whether
    # this step samples its next token, and its preemption count (a result is
    # stale once the request was preempted after being scheduled).
    starts: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager):
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Decode role: blocks reserved, KV arriving from a prefill worker. Not
        # scheduled (and never preempted) until the KV is there.
        self.waiting_for_kv: dict[str, Request] = {}
        self.num_preemptions = 0
        self._chunk = cfg.chunk_size    # this step's longest prompt chunk of one request
        self._chunk_alone = cfg.chunk_size  # ... of a prompt computed for another worker
        self._decoding = False          # this step holds decodes (a request's own prefill_chunk applies)
        self._prefill_left = 0          # prompt tokens beside decodes this step may still take
        # Running long prompts -> the tokens set aside for each this step (its
        # floor, or less when its chunk is smaller), in admission order; their
        # sum, which short prompts' chunks may not take.
        self._long: dict[str, tuple[Request, int]] = {}
        self._held = 0
        self._long_floor = 0            # tokens each long prompt is guaranteed in a step

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        """Work to step on (a reservation waiting for its KV is not)."""
        return bool(self.waiting or self.running)

    def reserve(self, req: Request) -> list[int] | None:
        """Hold blocks for the whole prompt, reusing cached prefix blocks. The
        request waits for its KV; None (and no change) if blocks are short."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        looked_up = self._takes_cached_blocks(req)
        computed, num_cached = self.kv.get_computed_blocks(req) if looked_up else ([], 0)
        blocks = self.kv.allocate_slots(req, req.num_tokens - num_cached, computed)
        if blocks is None:
            return None
        if looked_up:
            self.kv.count_lookup(req, num_cached)
        req.num_computed_tokens = num_cached
        req.num_cached_tokens = num_cached
        req.status = RequestStatus.WAITING_FOR_KV
        self.requests[req.request_id] = req
        self.waiting_for_kv[req.request_id] = req
        return blocks

    def kv_ready(self, request_id: str, first_token: int) -> Request:
        """The prompt's KV is in the reserved blocks: publish them in the prefix
        cache (only now are they valid), take the first token, start decoding."""
        req = self.waiting_for_kv.pop(request_id)
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.append_token(first_token)
        if req.check_stop():
            self.kv.free(req)
            del self.requests[request_id]
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        return req

    def compute_locally(self, request_id: str, first_token: int | None = None) -> Request:
        """The KV will not arrive: queue the reserved request for a local prefill
        (it keeps its blocks; the cached prefix stays computed). A first token
        the client already has is taken as the first output: the prefill then
        covers it too, and the request continues after it (as after a preemption)."""
        req = self.waiting_for_kv.pop(request_id)
        if first_token is not None:
            req.append_token(first_token)
            if req.check_stop():
                self.kv.free(req)
                del self.requests[request_id]
                return req
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        return req

    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        decoding = self._decoding = any(r.decoding for r in self.running)
        # A prompt alone (or computed for another worker) has no decode gap to bound.
        self._chunk_alone = budget if self.cfg.chunk_only_beside_decodes else self.cfg.chunk_size
        self._chunk = self.cfg.chunk_size if decoding else self._chunk_alone
        self._prefill_left = budget
        if decoding and self.cfg.prefill_tokens_beside_decodes is not None:
            self._prefill_left = self.cfg.prefill_tokens_beside_decodes
        self._long_floor = max(1, int(self.cfg.long_prefill_min_share * self._prefill_left
                                      / self.cfg.max_long_partial_prefills))
        self._hold_for_long_prompts(budget)
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_waiting(out, budget)
        self._schedule_long_prompts(out, budget)
        return out

    def _takes_cached_blocks(self, req: Request) -> bool:
        """Whether a request being admitted (or reserved) looks its prefix up in
        the cache. Only one holding no blocks does: a reserved request computed
        here after all (compute_locally) has its blocks, and cached blocks
        appended after them would be attended and written as its own. One
        collecting prompt logprobs computes every prompt position, also when
        reserved and then prefilled here after all."""
        return req.num_computed_tokens == 0 and not self.kv.block_ids(req) and req.prompt_logprobs is None

    def _is_long(self, wanted: int) -> bool:
        """A prompt with `wanted` tokens still to compute is long (a decode never is)."""
        threshold = self.cfg.long_prefill_token_threshold
        return bool(threshold) and wanted > threshold

    def _hold_for_long_prompts(self, budget: int) -> None:
        """Set aside each running long prompt's floor before anything is scheduled."""
        self._long, self._held = {}, 0
        for req in self.running:
            wanted = req.num_tokens_with_in_flight - req.num_computed_tokens
            if self._is_long(wanted):
                self._hold(req, min(self._long_floor, self._chunk_of(req, wanted, budget)))

    def _hold(self, req: Request, n: int) -> None:
        self._long[req.request_id] = (req, max(n, 0))
        self._held += max(n, 0)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            i += 1
            if req.awaiting_grammar:
                continue   # its KV landed before its grammar compiled: it decodes once that is there
            held = self._long.get(req.request_id)
            wanted = req.num_tokens_with_in_flight - req.num_computed_tokens
            n = held[1] if held else self._chunk_of(req, wanted, budget)
            if n <= 0 or req.stops_after_in_flight():
                continue  # no prompt room left this step, or its last token is in flight (it ends when that lands)
            while not self._allocate(req, n):
                victim = self.running.pop()  # newest admitted; never one already scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            if held:
                continue  # a long prompt: the blocks of its floor are its now; its tokens come after the short ones'
            self._take(out, req, n)
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[i]
            if req.awaiting_grammar:
                i += 1
                continue   # its grammar compiles: the requests behind it go on
            computed, num_cached = [], 0
            looked_up = self._takes_cached_blocks(req)
            if looked_up:
                computed, num_cached = self.kv.get_computed_blocks(req)
            wanted = req.num_tokens - req.num_computed_tokens - num_cached
            long = self._is_long(wanted)
            if long and len(self._long) >= self.cfg.max_long_partial_prefills:
                i += 1
                continue  # waits in its place for a long prompt to finish; the short ones behind it go on
            n = self._chunk_of(req, wanted, budget)
            if long:
                n = min(n, self._long_floor)
            # NOTE: nothing passes a prompt that lacks blocks (or room), a long one
            # included: the blocks freed meanwhile go to it, never to those behind.
            if n <= 0 or not self._allocate(req, n, computed):
                break
            del self.waiting[i]
            if looked_up:
                self.kv.count_lookup(req, num_cached)
            if num_cached:
                req.num_computed_tokens += num_cached
                req.num_cached_tokens = max(req.num_cached_tokens, min(num_cached, req.num_prompt_tokens))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if long:
                self._hold(req, n)   # its floor's blocks are taken; its tokens come last
            else:
                self._take(out, req, n)
                budget -= n
        return budget

    def _allocate(self, req: Request, n: int, computed: list[int] = ()) -> bool:
        """Room for n more tokens of `req` (kv.allocate_slots), taking the blocks
        of waiting requests that hold some when the free ones are short."""
        while self.kv.allocate_slots(req, n, computed) is None:
            holder = next((r for r in reversed(self.waiting) if r is not req and self.kv.block_ids(r)), None)
            if holder is None:
                return False
            log.debug("taking the blocks of waiting %s", holder.request_id)
            # Cached blocks among them (its prefix; maybe `computed`) stay findable.
            self.kv.free(holder)
            holder.num_computed_tokens = 0
        return True

    def _schedule_long_prompts(self, out: SchedulerOutput, budget: int) -> None:
        """The long prompts, oldest first: each its floor, set aside for it, and
        what the short prompts left (less the floors of the long ones after it).
        Tokens beyond its floor take free blocks, never a preemption."""
        for req, floor in self._long.values():
            self._held -= floor
            n = self._chunk_of(req, req.num_tokens_with_in_flight - req.num_computed_tokens, budget)
            if n > 0 and self.kv.allocate_slots(req, n) is None:
                covered = len(self.kv.block_ids(req)) * self.kv.block_size - req.num_computed_tokens
                n = min(n, covered)   # what its blocks hold: its floor's at least, taken in line
            if n > 0:
                self._take(out, req, n)
                budget -= n
        self._long, self._held = {}, 0

    def _chunk_of(self, req: Request, wanted: int, budget: int) -> int:
        """Tokens `req`, wanting `wanted` more, gets this step: a decode its
        one; a prompt at most a chunk (beside decodes, its own prefill_chunk if
        smaller), within the budget and what is left of the prompt tokens
        allowed beside decodes, less the tokens set aside for long prompts; a
        prompt computed for another worker as if nothing decoded here. (A
        prompt's last single token is scheduled like a decode, outside that
        allowance.)"""
        if wanted <= 1:
            return min(wanted, budget)
        if req.prefill_only:
            return min(wanted, self._chunk_alone, budget - self._held)
        chunk = min(self._chunk, req.prefill_chunk) if req.prefill_chunk and self._decoding else self._chunk
        return min(wanted, chunk, budget - self._held, self._prefill_left - self._held)

    def _take(self, out: SchedulerOutput, req: Request, n: int) -> None:
        """Put n of req's tokens in this step, and count them as computed."""
        if n > 1 and not req.prefill_only:
            self._prefill_left -= n
        start = req.num_computed_tokens
        samples = start + n == req.num_tokens_with_in_flight
        out.scheduled.append((req, n))
        out.starts.append(start)
        out.samples.append(samples)
        out.preemptions.append(req.num_preemptions)
        req.num_computed_tokens = start + n
        if samples:
            req.num_in_flight += 1

    def _preempt(self, req: Request) -> None:
        log.debug("preempting %s (%d tokens computed)", req.request_id, req.num_computed_tokens)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_in_flight = 0  # dropped; the recompute samples that position again
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.request_id in self._long:   # set aside no more: it waits again
            self._held -= self._long.pop(req.request_id)[1]
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None],
                           prompt_logprobs: list[tuple[int, list] | None] | None = None) -> list[Request]:
        """Take a finished step's results: publish the blocks it completed, append
        the sampled tokens, keep the prompt logprobs of its chunks
        (pdd.engine.prompt_logprobs). Returns the requests that got a new token
        (finished ones included, already freed)."""
        updated = []
        for j, ((req, n), start, samples, preemptions, token) in enumerate(zip(
                out.scheduled, out.starts, out.samples, out.preemptions, sampled)):
            if req.status.finished or req.num_preemptions != preemptions:
                continue  # aborted, finished or preempted since it was scheduled: stale
            self.kv.cache_blocks(req, start + n)
            if prompt_logprobs and prompt_logprobs[j] is not None and req.prompt_logprobs is not None:
                first, entries = prompt_logprobs[j]
                del req.prompt_logprobs[first:]   # a recompute writes its positions again
                req.prompt_logprobs.extend(entries)
            if not samples:
                continue  # a prefill chunk that is not the prompt's last: nothing sampled
            req.num_in_flight -= 1
            req.append_token(token)
            updated.append(req)
            if req.check_stop() or req.prefill_only:
                if req.prefill_only and not req.status.finished:
                    req.status = RequestStatus.FINISHED_STOPPED
                self._finish(req)
        return updated

    def finish(self, req: Request) -> None:
        """A request ended between steps (Request.check_stop set its status)."""
        status = req.status
        self.abort(req.request_id)
        req.status = status

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        del self.requests[req.request_id]

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif self.waiting_for_kv.pop(request_id, None) is None:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED_ABORTED
        return req
