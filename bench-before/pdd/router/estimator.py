"""What placement knows about the cluster, measured online.

Fed by the router's events — heartbeats (step latencies and tokens, queues),
placements (prompt tokens sent somewhere), finished transfers — it keeps one
record per worker (`workers`: its step-cost fit and its load) and, for the
cluster, the prefill demand and the KV transfer rate per backend. The parts,
one concern each, are in pdd.router.cost: the step-cost fit (step.py), queues
and demand (load.py), transfer cost (transfer.py), the role balance adaptive
placement sets from the demand (balance.py), their constants (constants.py).
`snapshot()` hands it all to placement as frozen values (cost/estimates.py):
placement stays a pure function of its inputs.

The model and what it assumes: docs/design.md, "Adaptive disaggregation".
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdd.config import AdaptiveConfig
from pdd.kv.layout import KVLayout
from pdd.protocol import messages as m
from pdd.router.cost.balance import balance
from pdd.router.cost.constants import COSTS, CostModelConstants
from pdd.router.cost.estimates import LEAN_DECODE, LEAN_PREFILL, Estimates, WorkerEstimate
from pdd.router.cost.load import Demand, WorkerLoad
from pdd.router.cost.step import StepFit
from pdd.router.cost.transfer import TransferRates
from pdd.router.registry import WorkerInfo

__all__ = ["LEAN_DECODE", "LEAN_PREFILL", "Estimates", "Estimator", "WorkerEstimate"]

SharedCost = dict[str, tuple[float, float, float]]   # device type -> (b, e, prefill evidence)


@dataclass
class _Worker:
    """Everything measured of one worker."""
    fit: StepFit
    load: WorkerLoad = field(default_factory=WorkerLoad)


class Estimator:
    def __init__(self, cfg: AdaptiveConfig, costs: CostModelConstants = COSTS):
        self.cfg = cfg
        self.costs = costs
        self.workers: dict[str, _Worker] = {}
        self.transfer = TransferRates(costs)
        self.prefill_leaning: set[str] = set()              # colocated workers steered to prefill
        self._demand = Demand(costs.demand_window_s)

    def _worker(self, worker_id: str) -> _Worker:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = _Worker(StepFit(self.costs))
        return w

    # ------------------------------------------------------------ events

    def observe(self, hb: m.Heartbeat) -> None:
        w = self._worker(hb.worker_id)
        w.fit.observe(hb.steps)
        w.load.observe(hb, self.costs.smooth)

    def placed(self, prefill_worker: str, decode_worker: str, prompt_tokens: int, now: float) -> None:
        """A request placed: its prompt tokens queue on the worker that computes
        them. A short prompt prefilled where it decodes is no demand on the
        prefill side (one sent to a prefill worker is)."""
        self._worker(prefill_worker).load.placed.append(prompt_tokens)
        self._worker(decode_worker).load.placed_decodes += 1
        if prompt_tokens > self.cfg.local_prefill_tokens or prefill_worker != decode_worker:
            self._demand.add(prompt_tokens, now)

    def transferred(self, backend: str, stats: dict) -> None:
        """A finished transfer's bytes and seconds (PrefillDone): the backend's rate."""
        self.transfer.observe(backend, stats)

    def demand(self, now: float) -> float:
        """Prompt tokens/s placed, averaged over the last demand_window_s (decays while none come)."""
        return self._demand.rate(now)

    # ------------------------------------------------------------ state for placement

    def snapshot(self, workers: Iterable[WorkerInfo], layout: KVLayout | None, now: float) -> Estimates:
        """The role balance brought up to date, then every worker's estimate."""
        workers = list(workers)
        self.rebalance(workers, now)
        return self.estimates(workers, layout, now)

    def rebalance(self, workers: Iterable[WorkerInfo], now: float) -> None:
        """The role balance brought up to date with the registered workers and the demand."""
        workers = list(workers)
        shared = self._shared_token_cost(workers)
        self.prefill_leaning = balance(self.prefill_leaning, workers, lambda w: self._estimate(w, shared).prefill_rate,
                                       lambda wid: self._worker(wid).load.decoding, self.demand(now), self.costs)

    def left(self, worker_id: str) -> None:
        """A worker unregistered: its queue went with it (its requests were placed
        again); its step-time fit stays for its return (restarted under its id,
        it is the same GPU)."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.load.clear()

    def forget(self, worker_id: str) -> None:
        """A worker that left for good: its measurements go."""
        self.workers.pop(worker_id, None)
        self.prefill_leaning.discard(worker_id)

    def estimates(self, workers: Iterable[WorkerInfo], layout: KVLayout | None, now: float) -> Estimates:
        """Every worker's estimate as things stand (the balance as last set)."""
        workers = list(workers)
        shared = self._shared_token_cost(workers)
        return Estimates({w.worker_id: self._estimate(w, shared) for w in workers},
                         self.transfer.seconds_per_token(layout), self.demand(now))

    def _shared_token_cost(self, workers: list[WorkerInfo]) -> SharedCost:
        """Per device type, the prefill costs (per token, per query-key pair) of
        the worker that measured them best, and how much evidence it has."""
        best: SharedCost = {}
        for info in workers:
            fit = self._worker(info.worker_id).fit
            kind = _device_type(info)
            if fit.prefill_evidence > best.get(kind, (0.0, 0.0, 0.0))[2]:
                _, _, b, e = fit.solve()
                best[kind] = (b, e, fit.prefill_evidence)
        return best

    def _estimate(self, info: WorkerInfo, shared: SharedCost) -> WorkerEstimate:
        w = self._worker(info.worker_id)
        a, c, b, e = w.fit.solve()
        # A worker that has hardly prefilled (one leaning to decode) takes the
        # prefill costs another worker of its kind measured: a prompt token
        # costs the same on the same GPU, and its own slopes would still be the
        # prior (twice an H200's measured cost: local prefills would look too
        # slow to ever take).
        b_best, e_best, evidence = shared.get(_device_type(info), (b, e, 0.0))
        if w.fit.prefill_evidence < self.costs.shared_evidence * evidence:
            b, e = b_best, e_best
        if info.role == "prefill" or info.worker_id in self.prefill_leaning:
            leaning = LEAN_PREFILL
        else:
            leaning = LEAN_DECODE
        load, limits = w.load, info.step
        long_tokens, long_prompts = load.long_pending(limits.long_threshold)
        return WorkerEstimate(
            step_base_s=a, step_token_s=b, step_decode_s=c, step_pair_s=e, pending_tokens=load.pending_tokens,
            pending_long_tokens=long_tokens, pending_long=long_prompts, decoding=load.decodes,
            prefill_per_step=load.prefill_per_step, prefill_depth=load.prefill_depth,
            budget=limits.budget or self.costs.unreported_budget, chunk=limits.chunk or self.costs.unreported_chunk,
            beside=limits.prefill_beside_decodes, chunk_alone=not limits.chunk_only_beside_decodes,
            long_threshold=limits.long_threshold, long_partial=limits.long_partial or 1,
            long_share=limits.long_share, leaning=leaning, samples=w.fit.n)

    def view(self, estimates: Estimates) -> dict[str, dict]:
        """Per worker, for `pdd admin status`: the fitted model, queue and leaning."""
        return {wid: {"leaning": e.leaning, "prefill_tokens_per_s": round(e.prefill_rate, 1),
                      "step_base_ms": round(e.step_base_s * 1e3, 3), "step_token_us": round(e.step_token_s * 1e6, 3),
                      "step_decode_us": round(e.step_decode_s * 1e6, 3),
                      "step_pair_ps": round(e.step_pair_s * 1e12, 3),
                      "prefill_depth_tokens": round(e.prefill_depth, 1),
                      "pending_prefill_tokens": e.pending_tokens,
                      "pending_long_prefill_tokens": e.pending_long_tokens, "decoding": e.decoding,
                      "prefill_tokens_per_step": round(e.prefill_per_step, 1), "step_groups_measured": e.samples}
                for wid, e in estimates.workers.items()}


def _device_type(info: WorkerInfo) -> str:
    """"cuda:1" -> "cuda": workers that share a prefill cost (a homogeneous cluster per type)."""
    return (info.device or "").split(":")[0]
