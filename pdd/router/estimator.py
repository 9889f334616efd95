"""What adaptive placement knows about the cluster, measured online.

Fed by the router's events — heartbeats (step latencies and tokens, queues),
placements (prompt tokens sent somewhere), finished transfers — it keeps per
worker a step-time model `step ≈ a + c·decodes + b·prefill tokens + e·prefill
query-key pairs` (the last: a chunk deep in a long prompt attends to all of it
and costs more per token), the prompt tokens it has yet to compute, how many
requests it decodes, and how many prefill tokens its steps carry; for the
cluster, the prefill demand (prompt tokens/s) and the KV transfer rate per
backend. From the demand it sets which colocated workers that prefill for
others lean to prefill (the role balance). `snapshot()` hands all of it to
pdd.router.placement.place as frozen values: placement stays a pure function
of its inputs.

The model and what it assumes: docs/design.md, "Adaptive disaggregation".
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pdd.config import AdaptiveConfig
from pdd.engine.request import query_key_pairs
from pdd.kv.layout import KVLayout
from pdd.protocol import messages as m
from pdd.router.registry import WorkerInfo

# Before a worker's steps are measured: a GPU-class step (the fit moves off it
# within a few heartbeats of work).
PRIOR_BASE_S = 0.01
PRIOR_TOKEN_S = 5e-5      # a prefill token
PRIOR_DECODE_S = 5e-5     # a decode token (its attention reads the request's whole context)
# A prompt token's query against one key (H200, Llama-3.1-8B shape: ~2e-9 s;
# docs/benchmarks.md, "A prompt chunk beside decodes"). Fitted per million pairs.
PRIOR_PAIR_S = 2e-9
MEGA = 1e6
PRIOR_WEIGHT = 0.1        # the prior counts as this many measured groups (see _StepFit)
PRIOR_AT = 512            # ... of prefill tokens
PRIOR_DECODES_AT = 64     # ... of decodes
PRIOR_MPAIRS_AT = 2.0     # ... of a million query-key pairs (512 tokens 4k deep)
# ... and the pair cost's prior counts as this many groups: prompt tokens and
# their pairs rise together, and held as weakly as the others, the fit traded
# one for the other (on one H200 at 4 req/s: 2 ps a pair and 41 us a token,
# where 1.6 ns and 20 us fit the same steps). On simulated noisy steps 3 keeps
# e within ~30% of the truth and b within ~10%; 10 pinned e to the prior.
PRIOR_PAIR_WEIGHT = 3.0
# A group measured more than this many times its prediction counts as this
# many times it: a step that compiled kernels (seconds, once) must not become
# the worker's cost, while a worker really slower than the fit still pulls it
# up threefold per group.
OUTLIER = 3.0
# A worker whose prefill evidence is below this share of the best-measured
# worker of its device type uses that worker's prefill token cost.
SHARED_EVIDENCE = 0.1
# Consecutive steps fitted as one sample: with async scheduling a step's
# latency is mostly the wait for the step before, so one step's pair of
# (tokens, latency) is off by one; a group of them is not, but at its edges.
GROUP = 4
FORGET = 0.99             # weight kept per new group: the fit follows the last few hundred groups
SMOOTH = 0.3              # heartbeat-to-heartbeat smoothing of prefill tokens per step
# Bytes per second of each KV transfer backend until transfers are measured
# (cuda_ipc: DESIGN.md's measured peer copy; tcp: a conservative loopback figure).
PRIOR_TRANSFER_RATE = {"cuda_ipc": 3e11, "tcp": 1e9, "local": 1e10}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}

LEAN_PREFILL, LEAN_DECODE = "prefill", "decode"


@dataclass(frozen=True)
class WorkerEstimate:
    """One worker as placement sees it; times in seconds, work in tokens."""
    step_base_s: float              # a: a step's cost whatever it holds
    step_token_s: float             # b: each prefill token it computes
    step_decode_s: float = PRIOR_DECODE_S   # c: each request it decodes
    step_pair_s: float = PRIOR_PAIR_S       # e: each query-key pair of its prompt chunks
    pending_tokens: int = 0         # prompt tokens admitted here and not computed yet
    decoding: int = 0               # requests decoding here (each a decode token per step)
    prefill_per_step: float = 0.0   # prefill tokens its recent steps carried, on average
    prefill_depth: float = 0.0      # query-key pairs per prefill token of its recent steps
    budget: int = 2048              # max_num_batched_tokens
    chunk: int = 512                # the most prompt tokens of one request per step
    beside: int = 0                 # the most prompt tokens per step beside decodes (0: the budget)
    chunk_alone: bool = False       # a prompt gets `chunk` even in a step where nothing decodes
    leaning: str = LEAN_DECODE      # which work the router steers here first
    samples: int = 0                # step groups measured so far

    def step_s(self, decodes: float, prefill: float = 0.0, pairs: float = 0.0) -> float:
        return self.step_base_s + self.step_decode_s * decodes + self.step_token_s * prefill + self.step_pair_s * pairs

    def prefill_s(self, tokens: int, behind: int = 0, for_others: bool = False, cached: int = 0,
                  chunk: int = 0) -> float:
        """Until `tokens` more prompt tokens are computed here, after `cached`
        ones of the same prompt, queued behind `behind` others (FIFO; the
        running decodes ride in every step; queued prompts at the depth this
        worker's prompts lately had). `for_others`: prompts computed for other
        workers, which the engine schedules as if nothing decoded here.
        `chunk`: the request's own chunk beside decodes (0: the worker's)."""
        if tokens <= 0 and behind <= 0:
            return 0.0
        beside = self.decoding and not for_others
        room = max(1, self.prefill_room if beside else self.budget - self.decoding)   # prefill tokens a step takes
        # ... of one request: a chunk beside decodes; alone, the whole step
        # (EngineConfig.chunk_only_beside_decodes) unless the worker chunks always
        own = min(self.chunk, chunk) if chunk and beside else self.chunk
        own = max(1, min(own, room) if beside or self.chunk_alone else room)
        steps = math.ceil(behind / room) + math.ceil(tokens / own)
        pairs = behind * self.prefill_depth + query_key_pairs(cached, tokens)
        return steps * self.step_s(self.decoding) + self.step_token_s * (behind + tokens) + self.step_pair_s * pairs

    @property
    def prefill_room(self) -> int:
        """Prompt tokens one of its steps can take beside its decodes."""
        room = self.budget - self.decoding
        return min(room, self.beside) if self.beside and self.decoding else room

    @property
    def riding(self) -> float:
        """Prefill tokens its steps carry now: lately, or a chunk of what is pending."""
        return min(max(self.prefill_per_step, min(self.pending_tokens, self.chunk)),
                   max(0, self.prefill_room))

    def harm_s(self, tokens: int, cached: int = 0) -> float:
        """Request-seconds that computing `tokens` prompt tokens (after `cached`
        ones) here adds to the requests decoding here."""
        return self.decoding * (self.step_token_s * tokens + self.step_pair_s * query_key_pairs(cached, tokens))

    def chunk_step_s(self, chunk: int = 0, start: int = 0) -> float:
        """A step that carries one more prefill chunk (`chunk` tokens, 0: the
        worker's; `start` tokens of its prompt before it) beside this worker's
        decodes and the prefill already riding: the gap its running requests see."""
        room = max(0, self.prefill_room)
        riding = self.riding
        own = max(0, min(room, riding + max(1, min(chunk or self.chunk, room))) - riding)
        return self.step_s(self.decoding, riding + own,
                           riding * self.prefill_depth + query_key_pairs(start, int(own)))

    def tpot_s(self) -> float:
        """A step of this worker with one more request decoding, beside the prefill it carries."""
        return self.step_s(self.decoding + 1, self.riding, self.riding * self.prefill_depth)

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens per second in full prefill steps (at the depth its
        prompts lately had, or a whole-budget prompt's)."""
        depth = max(self.prefill_depth, query_key_pairs(0, self.budget) / self.budget)
        return self.budget / self.step_s(0, self.budget, self.budget * depth)


@dataclass(frozen=True)
class Estimates:
    workers: Mapping[str, WorkerEstimate]
    transfer_s_per_token: Mapping[str, float]     # by backend
    demand_tokens_s: float = 0.0

    def transfer_s(self, backend: str, tokens: int) -> float:
        return tokens * self.transfer_s_per_token.get(backend, 0.0)


class _StepFit:
    """Weighted least squares of y = a + c·decodes + b·prefill + e·pairs with
    exponential forgetting, held toward the prior by a ridge worth PRIOR_WEIGHT
    samples. A worker that only decodes fits a and c and keeps the prior b and
    e; one that only prefills keeps the prior c; prompts all at one depth leave
    e near its prior (held harder than the others: see PRIOR_PAIR_WEIGHT): a
    slope is never invented from noise. Pairs are fitted in
    millions (the features stay within a few orders of magnitude of each other)."""

    PRIOR = (PRIOR_BASE_S, PRIOR_DECODE_S, PRIOR_TOKEN_S, PRIOR_PAIR_S * MEGA)
    RIDGE = (PRIOR_WEIGHT, PRIOR_WEIGHT * PRIOR_DECODES_AT ** 2, PRIOR_WEIGHT * PRIOR_AT ** 2,
             PRIOR_PAIR_WEIGHT * PRIOR_MPAIRS_AT ** 2)
    N = len(PRIOR)

    def __init__(self):
        self.xx = [[0.0] * self.N for _ in range(self.N)]     # Σw·x·xᵀ, x = (1, decodes, prefill, Mpairs)
        self.xy = [0.0] * self.N                               # Σw·x·y
        self.n = 0

    @property
    def prefill_evidence(self) -> float:
        """Σw·prefill²: how much its prefill slopes rest on measurements."""
        return self.xx[2][2]

    def predict(self, decodes: float, prefill: float, pairs: float = 0.0) -> float:
        a, c, b, e = self.solve()
        return a + c * decodes + b * prefill + e * pairs

    def add(self, decodes: float, prefill: float, pairs: float, y: float) -> None:
        y = min(y, OUTLIER * self.predict(decodes, prefill, pairs))
        x = (1.0, decodes, prefill, pairs / MEGA)
        for i in range(self.N):
            self.xy[i] = self.xy[i] * FORGET + x[i] * y
            for j in range(self.N):
                self.xx[i][j] = self.xx[i][j] * FORGET + x[i] * x[j]
        self.n += 1

    def solve(self) -> tuple[float, float, float, float]:
        """(a, c, b, e), e per pair."""
        n = self.N
        m = [row[:] + [self.xy[i] + self.RIDGE[i] * self.PRIOR[i]] for i, row in enumerate(self.xx)]
        for i in range(n):
            m[i][i] += self.RIDGE[i]
        # Gaussian elimination; the ridge keeps the matrix positive definite.
        for i in range(n):
            for k in range(i + 1, n):
                f = m[k][i] / m[i][i]
                for j in range(i, n + 1):
                    m[k][j] -= f * m[i][j]
        sol = [0.0] * n
        for i in reversed(range(n)):
            sol[i] = (m[i][n] - sum(m[i][j] * sol[j] for j in range(i + 1, n))) / m[i][i]
        a, c, b, e = sol
        # Noise must not make a token free, or a step cost less than nothing.
        return (max(a, 0.0), max(c, PRIOR_DECODE_S * 1e-3), max(b, PRIOR_TOKEN_S * 1e-3),
                max(e / MEGA, PRIOR_PAIR_S * 1e-3))


@dataclass
class _Worker:
    fit: _StepFit = field(default_factory=_StepFit)
    group: list = field(default_factory=list)     # (decodes, prefill tokens, pairs, latency) of steps not yet a group
    pending: int = 0                  # from the last heartbeat ...
    decoding: int = 0
    placed_tokens: int = 0            # ... plus what was placed here since
    placed_decodes: int = 0
    prefill_per_step: float = 0.0
    prefill_depth: float = 0.0       # query-key pairs per prefill token, smoothed


class Estimator:
    def __init__(self, cfg: AdaptiveConfig):
        self.cfg = cfg
        self.workers: dict[str, _Worker] = {}
        self.transfer_rate = dict(PRIOR_TRANSFER_RATE)     # bytes/s by backend
        self.prefill_leaning: set[str] = set()              # colocated workers steered to prefill
        self._demand = 0.0                                  # tokens/s at _demand_at
        self._demand_at: float | None = None

    # ------------------------------------------------------------ events

    def observe(self, hb: m.Heartbeat) -> None:
        w = self.workers.setdefault(hb.worker_id, _Worker())
        # A worker that does not say which tokens decoded counts them all as prefill.
        steps = len(hb.step_tokens)
        decodes = hb.step_decodes if len(hb.step_decodes) == steps else [0] * steps
        pairs = hb.step_prefill_pairs if len(hb.step_prefill_pairs) == steps else [0] * steps
        for d, t, p, latency in zip(decodes, hb.step_tokens, pairs, hb.step_latencies):
            w.group.append((d, t - d, p, latency))
            if len(w.group) == GROUP:
                w.fit.add(*(sum(g[i] for g in w.group) / GROUP for i in range(4)))
                w.group.clear()
        steps = len(hb.step_latencies)
        recent = sum(hb.prefill_chunks) / steps if steps else 0.0     # an idle worker carries none
        w.prefill_per_step += SMOOTH * (recent - w.prefill_per_step)
        prefill = sum(t - d for d, t in zip(decodes, hb.step_tokens))
        if prefill > 0:      # no prompt computed: the depth of its last ones stands
            w.prefill_depth += SMOOTH * (sum(pairs) / prefill - w.prefill_depth)
        # The heartbeat counts what reached the worker before it; what was
        # placed since counts again from here (a placement in flight at that
        # moment is missed until the next one, 0.5 s later).
        w.pending, w.decoding = hb.prefill_tokens_pending, hb.decoding
        w.placed_tokens = w.placed_decodes = 0

    def placed(self, prefill_worker: str, decode_worker: str, prompt_tokens: int, now: float) -> None:
        """A request placed: its prompt tokens queue on the worker that computes
        them. A short prompt prefilled where it decodes is no demand on the
        prefill side (one sent to a prefill worker is)."""
        p = self.workers.setdefault(prefill_worker, _Worker())
        p.placed_tokens += prompt_tokens
        self.workers.setdefault(decode_worker, _Worker()).placed_decodes += 1
        if prompt_tokens > self.cfg.local_prefill_tokens or prefill_worker != decode_worker:
            self._demand = self.demand(now) + prompt_tokens / self.cfg.demand_window_s
            self._demand_at = now

    def transferred(self, backend: str, stats: dict) -> None:
        """A finished transfer's bytes and seconds (PrefillDone): the backend's rate.
        Its seconds span the prompt's compute too, so the rate errs low (safe)."""
        nbytes, seconds = float(stats.get("bytes", 0)), float(stats.get("seconds", 0.0))
        if backend and nbytes > 0 and seconds > 0:
            old = self.transfer_rate.get(backend, nbytes / seconds)
            self.transfer_rate[backend] = old + SMOOTH * (nbytes / seconds - old)

    def demand(self, now: float) -> float:
        """Prompt tokens/s placed, averaged over the last demand_window_s (decays while none come)."""
        if self._demand_at is None:
            return 0.0
        return self._demand * math.exp(-max(0.0, now - self._demand_at) / self.cfg.demand_window_s)

    # ------------------------------------------------------------ state for placement

    def snapshot(self, workers: Iterable[WorkerInfo], layout: KVLayout | None, now: float) -> Estimates:
        """The role balance brought up to date, then every worker's estimate."""
        workers = list(workers)
        self.rebalance(workers, now)
        return self.estimates(workers, layout, now)

    def rebalance(self, workers: Iterable[WorkerInfo], now: float) -> None:
        """The role balance brought up to date with the registered workers and the demand."""
        self._balance(list(workers), now)

    def left(self, worker_id: str) -> None:
        """A worker unregistered: its queue went with it (its requests were placed
        again); its step-time fit stays for its return (restarted under its id,
        it is the same GPU)."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.pending = w.decoding = w.placed_tokens = w.placed_decodes = 0

    def forget(self, worker_id: str) -> None:
        """A worker that left for good: its measurements go."""
        self.workers.pop(worker_id, None)
        self.prefill_leaning.discard(worker_id)

    def estimates(self, workers: Iterable[WorkerInfo], layout: KVLayout | None, now: float) -> Estimates:
        """Every worker's estimate as things stand (the balance as last set)."""
        per_token = _bytes_per_token(layout)
        workers = list(workers)
        shared = self._shared_token_cost(workers)
        return Estimates({w.worker_id: self._estimate(w, shared) for w in workers},
                         {b: per_token / rate for b, rate in self.transfer_rate.items()}, self.demand(now))

    def _shared_token_cost(self, workers: list[WorkerInfo]) -> dict[str, tuple[float, float, float]]:
        """Per device type, the prefill costs (per token, per query-key pair) of
        the worker that measured them best, and how much evidence it has."""
        best: dict[str, tuple[float, float, float]] = {}
        for info in workers:
            fit = self.workers.setdefault(info.worker_id, _Worker()).fit
            kind = _device_type(info)
            if fit.prefill_evidence > best.get(kind, (0.0, 0.0, 0.0))[2]:
                _, _, b, e = fit.solve()
                best[kind] = (b, e, fit.prefill_evidence)
        return best

    def _estimate(self, info: WorkerInfo, shared: dict[str, tuple[float, float, float]] | None = None
                  ) -> WorkerEstimate:
        w = self.workers.setdefault(info.worker_id, _Worker())
        a, c, b, e = w.fit.solve()
        # A worker that has hardly prefilled (one leaning to decode) takes the
        # prefill costs another worker of its kind measured: a prompt token
        # costs the same on the same GPU, and its own slopes would still be the
        # prior (50 us, twice an H200's, on the first sweep: local prefills then
        # looked too slow to ever take).
        b_best, e_best, evidence = (shared or {}).get(_device_type(info), (b, e, 0.0))
        if w.fit.prefill_evidence < SHARED_EVIDENCE * evidence:
            b, e = b_best, e_best
        if info.role == "prefill" or info.worker_id in self.prefill_leaning:
            leaning = LEAN_PREFILL
        else:
            leaning = LEAN_DECODE
        return WorkerEstimate(
            step_base_s=a, step_token_s=b, step_decode_s=c, step_pair_s=e, pending_tokens=w.pending + w.placed_tokens,
            decoding=w.decoding + w.placed_decodes, prefill_per_step=w.prefill_per_step,
            prefill_depth=w.prefill_depth,
            budget=info.step.budget or 2048, chunk=info.step.chunk or 512,
            beside=info.step.prefill_beside_decodes, chunk_alone=not info.step.chunk_only_beside_decodes,
            leaning=leaning, samples=w.fit.n)

    def _balance(self, workers: list[WorkerInfo], now: float) -> None:
        """Lean as many colocated workers to prefill as the demand needs, at
        prefill_utilization of their measured rate, beside any prefill workers;
        at least one when there are two or more and no prefill worker; never all
        when no decode worker is left to decode. Grows at once, shrinks with
        hysteresis; a worker that joins the prefill side is the one decoding least."""
        flex = sorted((w for w in workers if w.prefills_for_others and w.accepting), key=lambda w: w.worker_id)
        self.prefill_leaning &= {w.worker_id for w in flex}
        if not flex:
            return
        shared = self._shared_token_cost(workers)
        rate = {w.worker_id: self._estimate(w, shared).prefill_rate for w in workers}
        fixed = sum(rate[w.worker_id] for w in workers if w.role == "prefill" and w.accepting)
        has_decoders = any(w.role == "decode" and w.accepting for w in workers)
        k_min = 1 if len(flex) >= 2 and not fixed else 0
        k_max = len(flex) if has_decoders else len(flex) - 1
        need = self.demand(now) / self.cfg.prefill_utilization - fixed
        decoding = {w.worker_id: self.workers[w.worker_id].decoding for w in flex}

        def capacity(ids) -> float:
            return sum(rate[i] for i in ids)

        while len(self.prefill_leaning) < k_max and (len(self.prefill_leaning) < k_min
                                                    or need > capacity(self.prefill_leaning)):
            joiner = min((i for i in decoding if i not in self.prefill_leaning), key=lambda i: (decoding[i], i))
            self.prefill_leaning.add(joiner)
        while len(self.prefill_leaning) > k_min:
            leaver = max(self.prefill_leaning, key=lambda i: (decoding[i], i))
            if need >= (1.0 - self.cfg.hysteresis) * capacity(self.prefill_leaning - {leaver}):
                break
            self.prefill_leaning.discard(leaver)

    def view(self, estimates: Estimates) -> dict[str, dict]:
        """Per worker, for `pdd admin status`: the fitted model, queue and leaning."""
        return {wid: {"leaning": e.leaning, "prefill_tokens_per_s": round(e.prefill_rate, 1),
                      "step_base_ms": round(e.step_base_s * 1e3, 3), "step_token_us": round(e.step_token_s * 1e6, 3),
                      "step_decode_us": round(e.step_decode_s * 1e6, 3),
                      "step_pair_ps": round(e.step_pair_s * 1e12, 3),
                      "prefill_depth_tokens": round(e.prefill_depth, 1),
                      "pending_prefill_tokens": e.pending_tokens, "decoding": e.decoding,
                      "prefill_tokens_per_step": round(e.prefill_per_step, 1), "step_groups_measured": e.samples}
                for wid, e in estimates.workers.items()}


def _device_type(info: WorkerInfo) -> str:
    """"cuda:1" -> "cuda": workers that share a prefill cost (a homogeneous cluster per type)."""
    return (info.device or "").split(":")[0]


def _bytes_per_token(layout: KVLayout | None) -> float:
    """K and V of every layer of one token."""
    if layout is None:
        return 0.0
    return 2.0 * layout.num_layers * layout.num_kv_heads * layout.head_dim * _DTYPE_BYTES.get(layout.dtype, 2)
