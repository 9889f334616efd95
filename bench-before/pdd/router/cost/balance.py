"""Adaptive placement's role balance: which colocated workers lean to prefill.

Only workers that prefill for others take part. As many lean to prefill as the
demand needs at `prefill_utilization` of their measured prefill rates, beside
any prefill workers'; at least one when there are two or more and no prefill
worker; never all when no decode worker is left to decode. It grows at once
(the joiner: the worker decoding least) and shrinks with hysteresis (the
leaver: the one decoding most), so the split does not flap at a boundary.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from pdd.router.cost.constants import COSTS, CostModelConstants
from pdd.router.registry import WorkerInfo


def flexible(workers: Iterable[WorkerInfo]) -> list[WorkerInfo]:
    """The workers whose leaning the balance sets, by id."""
    return sorted((w for w in workers if w.prefills_for_others and w.accepting), key=lambda w: w.worker_id)


def balance(leaning: set[str], workers: list[WorkerInfo], rate: Callable[[WorkerInfo], float],
            decoding: Callable[[str], int], demand_tokens_s: float,
            cfg: CostModelConstants = COSTS) -> set[str]:
    """The workers to lean to prefill now, from those that do (`leaning`);
    `rate(w)`: w's prefill tokens/s; `decoding(id)`: requests decoding there."""
    flex = flexible(workers)
    leaning = leaning & {w.worker_id for w in flex}
    if not flex:
        return leaning
    rates = {w.worker_id: rate(w) for w in workers}
    fixed = sum(rates[w.worker_id] for w in workers if w.role == "prefill" and w.accepting)
    has_decoders = any(w.role == "decode" and w.accepting for w in workers)
    k_min = 1 if len(flex) >= 2 and not fixed else 0
    k_max = len(flex) if has_decoders else len(flex) - 1
    need = demand_tokens_s / cfg.prefill_utilization - fixed
    busy = {w.worker_id: decoding(w.worker_id) for w in flex}

    def capacity(ids) -> float:
        return sum(rates[i] for i in ids)

    while len(leaning) < k_max and (len(leaning) < k_min or need > capacity(leaning)):
        leaning.add(min((i for i in busy if i not in leaning), key=lambda i: (busy[i], i)))
    while len(leaning) > k_min:
        leaver = max(leaning, key=lambda i: (busy[i], i))
        if need >= (1.0 - cfg.hysteresis) * capacity(leaning - {leaver}):
            break
        leaning.discard(leaver)
    return leaning
