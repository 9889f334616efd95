"""Adaptive placement: each way to run a request priced by the cost model.

Per request, each (prefill worker, decode worker) option — local prefill
included — is priced from the estimates of pdd.router.estimator: TTFT, the
new request's TPOT, the ITL hit and delay its prefill adds to requests
decoding where it computes. The option that meets the SLOs ([router.adaptive])
at least cost wins; which colocated workers lean to prefill follows the demand
(pdd.router.cost.balance). The model and the measurements behind each rule:
docs/design.md, "Adaptive disaggregation".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdd.api import query_key_pairs
from pdd.config import AdaptiveConfig
from pdd.router.cost.constants import COSTS
from pdd.router.cost.estimates import LEAN_PREFILL, Estimates, WorkerEstimate
from pdd.router.placement.base import (DISAGG, LOCAL_PREFILL, NO_PREFILL_WORKER, ClusterView, Plan, PlaceRequest,
                                       Policy, last_resort, pick_worker, prefills_for_others, takes_kv)
from pdd.router.registry import WorkerInfo


class AdaptivePolicy(Policy):
    name = "adaptive"
    needs_estimates = True
    balances_roles = True

    def __init__(self, slo: AdaptiveConfig):
        self.slo = slo

    def place(self, request: PlaceRequest, view: ClusterView) -> Plan | None:
        return _adaptive(request, view, self.slo) or last_resort(view, request)

    def settings(self) -> dict:
        return dataclasses.asdict(self.slo)

    def estimates(self, view: ClusterView) -> dict[str, dict]:
        """What it prices each worker with: leaning, prefill rate, queue, decodes."""
        if view.estimates is None:
            return {}
        ests = view.estimates.workers
        return {w.worker_id: {"leaning": e.leaning, "prefill_tokens_per_s": round(e.prefill_rate, 1),
                              "pending_prefill_tokens": e.pending_tokens, "decoding": e.decoding}
                for w in view.workers if (e := ests.get(w.worker_id)) is not None}


@dataclass(frozen=True)
class _Option:
    """One way to run the request, priced."""
    decode: WorkerInfo
    prefill: WorkerInfo | None     # None: prefilled where it decodes
    backend: str
    new_tokens: int                # prompt tokens the computing worker computes
    ttft_s: float                  # queue wait + prefill + the transfer's tail
    tpot_s: float                  # the new request's decode step
    itl_s: float                   # the gap its prefill chunks give requests decoding where it computes
    harm_s: float                  # request-seconds its prefill adds to those requests
    decode_leans_prefill: bool
    wait_s: float = 0.0            # of ttft_s, the wait behind prompts queued before it
    chunk: int = 0                 # local: its own chunk beside the decodes (0: the worker's)

    def excess(self, slo: AdaptiveConfig) -> float:
        """How far past the SLO targets, relative; 0 when it meets them all."""
        return (max(0.0, self.ttft_s / slo.ttft_slo_s - 1) + max(0.0, self.tpot_s / slo.tpot_slo_s - 1)
                + max(0.0, self.itl_s / slo.itl_slo_s - 1))

    def cost(self, max_tokens: int) -> float:
        """Request-seconds: the new request's latency and what it adds to others'."""
        return self.ttft_s + max_tokens * self.tpot_s + self.harm_s

    def queued(self, slo: AdaptiveConfig) -> bool:
        """A prefill worker whose queue alone takes more than the share of the
        TTFT target placement plans for (the rest is the margin that keeps the
        tail within it). The prompt's own compute is not counted: a long prompt
        takes as long on either worker."""
        return self.prefill is not None and self.wait_s > slo.ttft_headroom * slo.ttft_slo_s

    def rank(self, slo: AdaptiveConfig, max_tokens: int) -> tuple:
        """Options that meet the SLOs first, ordered by three preferences, then
        cheapest first; if none meets them, the least excess (ties by worker id)."""
        excess = self.excess(slo)
        if excess != 0.0:
            return 1, excess, self.cost(max_tokens), self.decode.worker_id
        avoid = (self.decode_leans_prefill,    # 1. decoding on a prefill-leaning worker
                 self.queued(slo),             # 2. waiting in a prefill worker past its TTFT headroom
                 self.itl_s > 0)               # 3. prefill chunks beside running decodes
        return 0, *avoid, self.cost(max_tokens), self.decode.worker_id


def _adaptive(request: PlaceRequest, view: ClusterView, slo: AdaptiveConfig) -> Plan | None:
    est, block_size = view.estimates, view.block_size
    serving = view.serving
    n = request.tokens(block_size)
    # A decode worker must hold the prompt's blocks; if none can, the least bad is
    # left to queue (the worker refuses and the request is placed again).
    roomy = [d for d in serving if d.free_blocks * block_size >= n - request.cached_on(d, block_size)]
    prefillers = [w for w in view.workers
                  if prefills_for_others(w) and est.workers[w.worker_id].leaning == LEAN_PREFILL]
    options, why_local = [], {}
    for d in roomy or serving:
        local = _local_option(d, request, est, slo, block_size, n)
        options.append(local)
        if local.new_tokens <= slo.local_prefill_tokens:
            cached = 2 * (n - local.new_tokens) >= n
            # A mostly cached prompt stays: elsewhere it is computed or sent whole.
            # A short one stays only where nothing decodes: measured on 2×H200
            # (short-only prompts, 40 req/s), short chunks beside the decodes took
            # ITL p99 from 9 ms (all disaggregated) to 27 ms, colocated's level.
            if cached or not local.itl_s:
                why_local[d.worker_id] = "cached" if cached else "short_prompt"
                continue
        remote, why = _remote_options(d, prefillers, request, view, n)
        options += remote
        if why:
            why_local[d.worker_id] = why
    if not options:
        return None
    best = min(options, key=lambda o: o.rank(slo, request.max_tokens))
    if best.excess(slo) > 0:
        # Nothing meets the targets: run as colocated, the least loaded worker
        # prefilling its own request. Past saturation that degrades most gently:
        # taking the least excess instead leaves a prefill side that only queues
        # and one decode side holding every decode (2xH200 at 20 req/s: 0.45x
        # colocated's goodput; docs/benchmarks.md, "Adaptive disaggregation on 2xH200").
        worker = pick_worker(roomy or serving, request.block_hashes)
        return Plan(worker.worker_id, kind=LOCAL_PREFILL, reason="overloaded",
                    prefill_tokens=n - request.cached_on(worker, block_size))
    reason = why_local.get(best.decode.worker_id) if best.prefill is None else None
    if reason is None:
        reason = _why(best, options, slo)
    if best.prefill is None:
        return Plan(best.decode.worker_id, kind=LOCAL_PREFILL, reason=reason, prefill_tokens=best.new_tokens,
                    prefill_chunk=best.chunk)
    return Plan(best.decode.worker_id, best.prefill.worker_id, best.backend, kind=DISAGG, reason=reason,
                prefill_tokens=best.new_tokens)


def _why(best: _Option, options: list[_Option], slo: AdaptiveConfig) -> str:
    """slo: only this kind of option (remote or local) meets the targets;
    prefill_queue: a prefill worker would too, but its queue is past the
    planned share of the TTFT target; cost: both do and this one is cheaper."""
    others = [o for o in options if (o.prefill is None) != (best.prefill is None) and o.excess(slo) == 0]
    if not others:
        return "slo"
    if best.prefill is None and all(o.queued(slo) for o in others):
        return "prefill_queue"
    return "cost"


def _local_option(d: WorkerInfo, request: PlaceRequest, est: Estimates, slo: AdaptiveConfig, block_size: int,
                  n: int) -> _Option:
    e = est.workers[d.worker_id]
    cached = request.cached_on(d, block_size)
    new = n - cached
    chunk = _local_chunk(e, slo, cached, new) if e.decoding else 0
    # The gap its deepest chunk (its last) gives the requests decoding here.
    own = min(chunk or e.chunk, new)
    itl = e.chunk_step_s(own, n - own) if e.decoding else 0.0
    return _Option(d, None, "", new, e.prefill_s(new, queued=True, cached=cached, chunk=chunk),
                   e.tpot_s(), itl, e.harm_s(new, cached), e.leaning == LEAN_PREFILL, chunk=chunk)


def _local_chunk(e: WorkerEstimate, slo: AdaptiveConfig, cached: int, new: int) -> int:
    """The chunk a prompt prefilled beside this worker's decodes gets: the
    largest (in steps of COSTS.local_chunk_step tokens) whose deepest step, beside the
    decodes alone, stays within the ITL target (itl_slo_s) while the prompt's predicted
    TTFT stays within the planned share of its target (ttft_headroom: the rest
    is the tail's margin; on one H200 at saturation, sizing up to the whole
    target took TTFT p99 from 1.8 to 2.5 s); 0 (the worker's chunk) when its own
    chunk already keeps the gap, or none does within that share. A chunk of a
    long prompt costs more the deeper it is (docs/design.md). Prompts already
    riding there are left out: they end, and the chunk holds for the whole
    prompt (whether to take it while they ride is the option's ITL hit, which
    counts them)."""
    top = min(e.chunk, max(0, e.prefill_room))
    step = COSTS.local_chunk_step
    for chunk in sorted({top, *range(step, top, step)}, reverse=True):
        own = min(chunk, new)
        if e.step_s(e.decoding, own, query_key_pairs(cached + new - own, own)) > slo.itl_slo_s:
            continue
        if e.prefill_s(new, queued=True, cached=cached, chunk=chunk) > slo.ttft_headroom * slo.ttft_slo_s:
            return 0
        return 0 if chunk >= top or own == new else chunk
    return 0


def _remote_options(d: WorkerInfo, prefillers: list[WorkerInfo], request: PlaceRequest, view: ClusterView,
                    n: int) -> tuple[list[_Option], str | None]:
    """Disaggregated options for decoding on `d`, or none and why."""
    if not takes_kv(d):
        return [], NO_PREFILL_WORKER       # a colocated worker that takes no KV
    candidates = [p for p in prefillers if p.worker_id != d.worker_id]
    if not candidates:
        return [], NO_PREFILL_WORKER
    allowed, why = view.senders(d, candidates)
    if why:
        return [], why
    est, block_size = view.estimates, view.block_size
    e_d = est.workers[d.worker_id]
    # The first token leaves before the pages; decoding starts once the pages
    # of the last chunk (those the decode worker lacks) have landed.
    to_send = n - request.cached_on(d, block_size)
    options = []
    for p, backend in allowed:
        e = est.workers[p.worker_id]
        new = n - request.cached_on(p, block_size)
        tail = est.transfer_s(backend, min(to_send, e.chunk))
        # Every P here leans to prefill: the gaps its prompts give its own few
        # decodes count in the cost (harm), not as a target (itl 0): they are why
        # it leans so, and the engine computes prompts for others at full speed.
        cached = n - new
        ttft = e.prefill_s(new, queued=True, for_others=True, cached=cached) + tail
        options.append(_Option(d, p, backend, new, ttft, e_d.tpot_s(), 0.0, e.harm_s(new, cached),
                               e_d.leaning == LEAN_PREFILL,
                               ttft - tail - e.prefill_s(new, for_others=True, cached=cached)))
    return options, None
