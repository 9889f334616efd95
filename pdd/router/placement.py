"""Where a request runs: the one function that decides.

`place(request, workers, mode)` returns a Plan — a prefill worker, a decode
worker and the KV transfer backend between them (disaggregated), or one
worker that prefills and decodes — or None when nobody can take the request.
It is pure: it reads the workers' state (and, adaptive, the estimates of
pdd.router.estimator) and changes nothing, so routing policy, the circuit
breaker (`pair_allowed`) and adaptive disaggregation are inputs here and it is
tested on constructed states.

Roles differ by capability:
    prefill    computes prompts and ships their KV; runs requests whole only
               when no decode-capable worker is left (a request moved off a
               dead decode worker continues there rather than fail)
    decode     decodes KV that prefill workers send; prefills locally as a
               fallback, or (adaptive) when that is the better choice
    colocated  prefills and decodes its own requests; with
               worker.prefill_for_others it also computes prompts for other
               workers and, in adaptive mode, receives KV from them
Router modes:
    auto       a decode-capable worker is chosen by load and affinity; on a
               decode worker the request is disaggregated when a prefill worker
               and a common transfer backend exist, else prefilled there
    colocated  never disaggregate (prefill workers stay idle)
    disagg     new requests only disaggregated; none possible -> no placement
               (the client gets 503). Requests already running still fall
               back locally when their transfer fails: nothing is lost.
    adaptive   per request, each (prefill worker, decode worker) option —
               local prefill included — is priced by a model measured online
               (TTFT, the new request's TPOT, the ITL hit and delay its prefill
               adds to requests decoding where it computes); the option that
               meets the SLOs ([router.adaptive]) at least cost wins. Which
               colocated workers lean to prefill follows the demand
               (pdd.router.estimator). Model: docs/design.md.
Every plan says its kind (disagg | local_prefill | colocated) and why
(`reason`): the router counts them (pdd_placement_total).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdd.api import query_key_pairs
from pdd.config import AdaptiveConfig
from pdd.router.estimator import LEAN_PREFILL, Estimates, WorkerEstimate
from pdd.router.registry import WorkerInfo

PREFIX_WEIGHT = 0.5   # a fully cached prompt is worth this much extra load
SERVING_ROLES = ("colocated", "decode")
DISAGG, LOCAL_PREFILL, COLOCATED = "disagg", "local_prefill", "colocated"
LOCAL_CHUNK_STEP = 64  # local prefill chunks are sized in steps of this many tokens (and never smaller)


@dataclass(frozen=True)
class Plan:
    decode: str                  # the worker that decodes and streams (colocated: does it all)
    prefill: str | None = None   # set: disaggregated through `backend`
    backend: str = ""
    kind: str = COLOCATED        # disagg | local_prefill (a decode-capable worker prefills it) | colocated
    reason: str = ""             # why, as a short label (a metric label; place() always sets one)
    note: str = ""               # more words, for the log
    prefill_tokens: int = 0      # prompt tokens the computing worker computes (0: not estimated)
    prefill_chunk: int = 0       # local prefill: its most prompt tokens per step beside decodes (0: the worker's)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    @property
    def mode(self) -> str:
        return "disagg" if self.disaggregated else "colocated"


@dataclass(frozen=True)
class PlaceRequest:
    block_hashes: list[int]
    colocated_only: bool = False     # a re-placement after a failure: prefill where it decodes
    num_tokens: int = 0              # prompt tokens (adaptive prices them)
    max_tokens: int = 16             # output tokens it may decode (adaptive: the TPOT it is exposed to)


def load_of(w: WorkerInfo) -> float:
    """Requests in flight against sequence slots, plus the share of KV blocks in use."""
    seq_load = w.inflight / max(1, w.max_num_seqs)
    kv_load = 1.0 - w.free_blocks / max(1, w.num_blocks)
    return seq_load + kv_load


def pick_worker(candidates: Iterable[WorkerInfo], block_hashes: list[int]) -> WorkerInfo | None:
    """Least loaded, less a bonus for the share of the prompt it caches; ties by id."""
    def cost(w: WorkerInfo) -> tuple[float, str]:
        affinity = w.prefix_match(block_hashes) / len(block_hashes) if block_hashes else 0.0
        return load_of(w) - PREFIX_WEIGHT * affinity, w.worker_id

    return min(candidates, key=cost, default=None)


def transfer_backend(prefill: WorkerInfo, decode: WorkerInfo) -> str | None:
    """The prefill worker's first choice the decode worker also takes; cuda_ipc only within one host."""
    for b in prefill.transfer_backends or ["tcp"]:
        if b in (decode.transfer_backends or ["tcp"]) and (
                b != "cuda_ipc" or (prefill.host_id and prefill.host_id == decode.host_id)):
            return b
    return None


def prefills_for_others(w: WorkerInfo) -> bool:
    return w.role == "prefill" or w.prefills_for_others


PairAllowed = Callable[[str, str], bool]   # (prefill id, decode id): its circuit breaker lets it through


def place(request: PlaceRequest, workers: Iterable[WorkerInfo], mode: str,
          exclude: frozenset[str] = frozenset(), pair_allowed: PairAllowed = lambda p, d: True,
          estimates: Estimates | None = None, slo: AdaptiveConfig | None = None,
          block_size: int = 16) -> Plan | None:
    """`estimates` and `slo` are needed in adaptive mode (pdd.router.estimator.Estimator.snapshot)."""
    pool = [w for w in workers if w.accepting and w.worker_id not in exclude]
    prefills = [w for w in pool if w.role == "prefill"]
    if mode == "disagg" and not request.colocated_only:
        decodes = [w for w in pool if w.role == "decode" and w.data_addr]
        decode = pick_worker(decodes, request.block_hashes)
        if decode is None:
            return None
        pair = _prefill_for(decode, prefills, request.block_hashes, pair_allowed)
        return pair if pair.disaggregated else None
    if mode == "adaptive" and not request.colocated_only:
        return (_adaptive(request, pool, estimates, slo, pair_allowed, block_size)
                or _last_resort(prefills, request.block_hashes))
    worker = pick_worker((w for w in pool if w.role in SERVING_ROLES), request.block_hashes)
    if worker is None:
        return _last_resort(prefills, request.block_hashes)
    if request.colocated_only:
        return Plan(worker.worker_id, reason="placed_again")
    if worker.role == "colocated" or mode == "colocated":
        return Plan(worker.worker_id, reason="mode" if mode == "colocated" else "colocated_worker")
    return _prefill_for(worker, prefills, request.block_hashes, pair_allowed)


def _last_resort(prefills: list[WorkerInfo], block_hashes: list[int]) -> Plan | None:
    """No decode-capable worker is left: a prefill worker runs the same engine
    and can decode (a request moved off a dead decode worker continues there)."""
    worker = pick_worker(prefills, block_hashes)
    return Plan(worker.worker_id, reason="no_decode_worker") if worker is not None else None


def _prefill_for(decode: WorkerInfo, prefills: list[WorkerInfo], block_hashes: list[int],
                 pair_allowed: PairAllowed) -> Plan:
    """The best prefill worker for `decode`, or a plan to prefill on it (and why)."""
    if not prefills:
        return Plan(decode.worker_id, kind=LOCAL_PREFILL, reason="no_prefill_worker")
    usable = [p for p in prefills if decode.data_addr and transfer_backend(p, decode)]
    if not usable:
        return Plan(decode.worker_id, kind=LOCAL_PREFILL, reason="no_backend",
                    note=f"no KV transfer backend common to {decode.worker_id} {decode.transfer_backends} "
                         f"and any prefill worker")
    allowed = [p for p in usable if pair_allowed(p.worker_id, decode.worker_id)]
    prefill = pick_worker(allowed, block_hashes)
    if prefill is None:
        return Plan(decode.worker_id, kind=LOCAL_PREFILL, reason="breaker_open")
    return Plan(decode.worker_id, prefill.worker_id, transfer_backend(prefill, decode), kind=DISAGG, reason="static")


# ---------------------------------------------------------------- adaptive


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
        """Options that meet the SLOs first; among them decoding on a
        decode-leaning worker first, then not waiting in a queued prefill
        worker, then not putting prefill chunks beside running decodes,
        cheapest first; if none meets them, the least excess."""
        excess = self.excess(slo)
        if excess == 0.0:
            return (0, self.decode_leans_prefill, self.queued(slo), self.itl_s > 0, self.cost(max_tokens),
                    self.decode.worker_id)
        return 1, excess, self.cost(max_tokens), self.decode.worker_id


def _adaptive(request: PlaceRequest, pool: list[WorkerInfo], est: Estimates, slo: AdaptiveConfig,
              pair_allowed: PairAllowed, block_size: int) -> Plan | None:
    serving = [w for w in pool if w.role in SERVING_ROLES]
    n = max(request.num_tokens, len(request.block_hashes) * block_size, 1)
    # A decode worker must hold the prompt's blocks; if none can, the least bad is
    # left to queue (the worker refuses and the request is placed again).
    roomy = [d for d in serving if d.free_blocks * block_size >= n - _cached(d, request, block_size, n)]
    prefillers = [w for w in pool if prefills_for_others(w) and est.workers[w.worker_id].leaning == LEAN_PREFILL]
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
        remote, why = _remote_options(d, prefillers, request, est, pair_allowed, block_size, n)
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
                    prefill_tokens=n - _cached(worker, request, block_size, n))
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


def _cached(w: WorkerInfo, request: PlaceRequest, block_size: int, n: int) -> int:
    """Prompt tokens `w` probably caches (the last token is computed anyway)."""
    return min(w.prefix_match(request.block_hashes) * block_size, n - 1)


def _local_option(d: WorkerInfo, request: PlaceRequest, est: Estimates, slo: AdaptiveConfig, block_size: int,
                  n: int) -> _Option:
    e = est.workers[d.worker_id]
    cached = _cached(d, request, block_size, n)
    new = n - cached
    chunk = _local_chunk(e, slo, cached, new) if e.decoding else 0
    # The gap its deepest chunk (its last) gives the requests decoding here.
    own = min(chunk or e.chunk, new)
    itl = e.chunk_step_s(own, n - own) if e.decoding else 0.0
    return _Option(d, None, "", new, e.prefill_s(new, behind=e.pending_tokens, cached=cached, chunk=chunk),
                   e.tpot_s(), itl, e.harm_s(new, cached), e.leaning == LEAN_PREFILL, chunk=chunk)


def _local_chunk(e: WorkerEstimate, slo: AdaptiveConfig, cached: int, new: int) -> int:
    """The chunk a prompt prefilled beside this worker's decodes gets: the
    largest (in steps of LOCAL_CHUNK_STEP tokens) whose deepest step, beside the
    decodes alone, stays within local_chunk_gap_s while the prompt's predicted
    TTFT stays within the planned share of its target (ttft_headroom: the rest
    is the tail's margin; on one H200 at saturation, sizing up to the whole
    target took TTFT p99 from 1.8 to 2.5 s); 0 (the worker's chunk) when its own
    chunk already keeps the gap, or none does within that share. A chunk of a
    long prompt costs more the deeper it is (docs/design.md). Prompts already
    riding there are left out: they end, and the chunk holds for the whole
    prompt (whether to take it while they ride is the option's ITL hit, which
    counts them)."""
    if not slo.local_chunk_gap_s:
        return 0
    top = min(e.chunk, max(0, e.prefill_room))
    for chunk in sorted({top, *range(LOCAL_CHUNK_STEP, top, LOCAL_CHUNK_STEP)}, reverse=True):
        own = min(chunk, new)
        if e.step_s(e.decoding, own, query_key_pairs(cached + new - own, own)) > slo.local_chunk_gap_s:
            continue
        if e.prefill_s(new, behind=e.pending_tokens, cached=cached, chunk=chunk) > slo.ttft_headroom * slo.ttft_slo_s:
            return 0
        return 0 if chunk >= top or own == new else chunk
    return 0


def _remote_options(d: WorkerInfo, prefillers: list[WorkerInfo], request: PlaceRequest, est: Estimates,
                    pair_allowed: PairAllowed, block_size: int, n: int) -> tuple[list[_Option], str | None]:
    """Disaggregated options for decoding on `d`, or none and why."""
    if not (d.data_addr and (d.role == "decode" or d.prefills_for_others)):
        return [], "no_prefill_worker"       # a colocated worker that takes no KV
    candidates = [p for p in prefillers if p.worker_id != d.worker_id]
    if not candidates:
        return [], "no_prefill_worker"
    with_backend = [(p, transfer_backend(p, d)) for p in candidates]
    with_backend = [(p, b) for p, b in with_backend if b]
    if not with_backend:
        return [], "no_backend"
    allowed = [(p, b) for p, b in with_backend if pair_allowed(p.worker_id, d.worker_id)]
    if not allowed:
        return [], "breaker_open"
    e_d = est.workers[d.worker_id]
    # The first token leaves before the pages; decoding starts once the pages
    # of the last chunk (those the decode worker lacks) have landed.
    to_send = n - _cached(d, request, block_size, n)
    options = []
    for p, backend in allowed:
        e = est.workers[p.worker_id]
        new = n - _cached(p, request, block_size, n)
        tail = est.transfer_s(backend, min(to_send, e.chunk))
        # Every P here leans to prefill: the gaps its prompts give its own few
        # decodes count in the cost (harm), not as a target (itl 0): they are why
        # it leans so, and the engine computes prompts for others at full speed.
        cached = n - new
        ttft = e.prefill_s(new, behind=e.pending_tokens, for_others=True, cached=cached) + tail
        options.append(_Option(d, p, backend, new, ttft, e_d.tpot_s(), 0.0, e.harm_s(new, cached),
                               e_d.leaning == LEAN_PREFILL,
                               ttft - tail - e.prefill_s(new, for_others=True, cached=cached)))
    return options, None
