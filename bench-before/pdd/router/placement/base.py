"""What every placement policy shares: the request, the cluster view, the plan,
the interface, and the rules every policy applies the same way.

The view is built in one place (`ClusterView.of`): a drained, hung or
excluded worker is not in it, whatever the policy. A prefill worker is
offered for a decode worker only through `ClusterView.senders`, which applies
the transfer backends (`transfer_choice`) and the circuit breaker for every
policy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdd.router.cost.constants import COSTS
from pdd.router.cost.estimates import Estimates
from pdd.router.registry import WorkerInfo

SERVING_ROLES = ("colocated", "decode")
DISAGG, LOCAL_PREFILL, COLOCATED = "disagg", "local_prefill", "colocated"
# Why a decode worker prefills a request itself when no prefill worker can take it.
NO_PREFILL_WORKER, NO_BACKEND, BREAKER_OPEN = "no_prefill_worker", "no_backend", "breaker_open"

PairAllowed = Callable[[str, str], bool]   # (prefill id, decode id): its circuit breaker lets it through


def _any_pair(prefill: str, decode: str) -> bool:
    return True


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
    # Its prompt's logprobs are asked for: the logits of every prompt position
    # are computed where it decodes (the prompt is not shipped from elsewhere).
    prompt_logits: bool = False
    # A choice of an n > 1 request after the first: the worker that decodes the
    # first choice, whose prefix cache holds the shared prompt ("" : none).
    beside: str = ""
    num_tokens: int = 0              # prompt tokens (adaptive and threshold count them)
    max_tokens: int = 16             # output tokens it may decode (adaptive: the TPOT it is exposed to)

    def tokens(self, block_size: int) -> int:
        """Its prompt tokens, at least what its blocks hold (and at least one)."""
        return max(self.num_tokens, len(self.block_hashes) * block_size, 1)

    def cached_on(self, w: WorkerInfo, block_size: int) -> int:
        """Prompt tokens `w` probably caches (the last token is computed anyway)."""
        return min(w.prefix_match(self.block_hashes) * block_size, self.tokens(block_size) - 1)


@dataclass(frozen=True)
class ClusterView:
    """What a policy reads: the workers that may take new work, whether a
    prefill -> decode pair's breaker lets it through, and the cost model's
    estimates (for the policies that read them; None otherwise)."""
    workers: tuple[WorkerInfo, ...]
    pair_allowed: PairAllowed = _any_pair
    estimates: Estimates | None = None
    block_size: int = 16

    @classmethod
    def of(cls, workers: Iterable[WorkerInfo], exclude: frozenset[str] = frozenset(),
           pair_allowed: PairAllowed = _any_pair, estimates: Estimates | None = None,
           block_size: int = 16) -> ClusterView:
        return cls(tuple(w for w in workers if w.accepting and w.worker_id not in exclude), pair_allowed,
                   estimates, block_size)

    @property
    def serving(self) -> list[WorkerInfo]:
        """The workers that decode (colocated and decode workers)."""
        return [w for w in self.workers if w.role in SERVING_ROLES]

    @property
    def prefills(self) -> list[WorkerInfo]:
        return [w for w in self.workers if w.role == "prefill"]

    def senders(self, decode: WorkerInfo, prefillers: Iterable[WorkerInfo]) -> tuple[list[tuple[WorkerInfo, str]],
                                                                                       str | None]:
        """Of `prefillers`, those that can ship KV to `decode` — a transfer
        backend both take, the pair's breaker closed — each with its backend;
        or none and why (no_backend, breaker_open)."""
        usable = [(p, b) for p in prefillers if decode.data_addr and (b := transfer_backend(p, decode))]
        if not usable:
            return [], NO_BACKEND
        allowed = [(p, b) for p, b in usable if self.pair_allowed(p.worker_id, decode.worker_id)]
        return (allowed, None) if allowed else ([], BREAKER_OPEN)


class Policy(ABC):
    """Decides where a request runs, reading only the view (pure)."""
    name: str = ""
    needs_estimates: bool = False    # place() reads view.estimates
    balances_roles: bool = False     # it reads the leaning of colocated workers: keep the role balance up to date

    @abstractmethod
    def place(self, request: PlaceRequest, view: ClusterView) -> Plan | None:
        """A plan, or None when nobody can take the request."""

    def settings(self) -> dict:
        """Its settings, for `pdd admin status`."""
        return {}

    def estimates(self, view: ClusterView) -> dict[str, dict]:
        """Per worker, what it reads of it now (`pdd admin status`): by default the load it picks by."""
        return {w.worker_id: {"load": round(load_of(w), 3)} for w in view.workers}


def load_of(w: WorkerInfo) -> float:
    """Requests on it (every router's) against sequence slots, plus the share of KV blocks in use."""
    seq_load = w.busy / max(1, w.max_num_seqs)
    kv_load = 1.0 - w.free_blocks / max(1, w.num_blocks)
    return seq_load + kv_load


def pick_worker(candidates: Iterable[WorkerInfo], block_hashes: list[int]) -> WorkerInfo | None:
    """Least loaded, less a bonus for the share of the prompt it caches; ties by id."""
    def cost(w: WorkerInfo) -> tuple[float, str]:
        affinity = w.prefix_match(block_hashes) / len(block_hashes) if block_hashes else 0.0
        return load_of(w) - COSTS.prefix_weight * affinity, w.worker_id

    return min(candidates, key=cost, default=None)


def transfer_backend(prefill: WorkerInfo, decode: WorkerInfo) -> str | None:
    """The backend a prefill -> decode pair uses (transfer_choice), or None."""
    return transfer_choice(prefill, decode)[0]


def transfer_choice(prefill: WorkerInfo, decode: WorkerInfo) -> tuple[str | None, str]:
    """The backend a prefill -> decode pair uses, or None, and why. The
    prefill worker's first choice the decode worker also takes, where cuda_ipc
    is only for one host and nixl only for two (on one host tcp or cuda_ipc
    costs no agent); nixl on one host only when the pair takes nothing else.
    A worker that registered no backends takes tcp."""
    theirs = decode.transfer_backends or ["tcp"]
    same_host = bool(prefill.host_id) and prefill.host_id == decode.host_id
    passed, deferred = [], None
    for b in prefill.transfer_backends or ["tcp"]:
        if b not in theirs:
            passed.append(f"{decode.worker_id} does not take {b}")
        elif b == "cuda_ipc" and not same_host:
            passed.append("cuda_ipc needs one host")
        elif b == "nixl" and same_host:
            passed.append("nixl is for two hosts")
            deferred = deferred or b
        else:
            where = {"cuda_ipc": ", one host", "nixl": ", two hosts"}.get(b, "")
            return b, "; ".join([f"both take {b}{where}"] + passed)
    if deferred:
        return deferred, "; ".join(["both take nixl, and nothing else both take"] + passed)
    ours = prefill.transfer_backends or ["tcp"]
    return None, f"no backend in common: {prefill.worker_id} offers {', '.join(ours)}, " \
                 f"{decode.worker_id} takes {', '.join(theirs)}"


def transfer_pairs(workers: Iterable[WorkerInfo]) -> dict[str, dict[str, dict]]:
    """For each worker that prefills for others, each worker it may ship KV
    to: {"backend": the pair's (None: none), "reason": why} (`pdd admin workers`)."""
    workers = list(workers)
    pairs: dict[str, dict[str, dict]] = {}
    for p in workers:
        if prefills_for_others(p):
            for d in workers:
                if d is not p and takes_kv(d):
                    backend, reason = transfer_choice(p, d)
                    pairs.setdefault(p.worker_id, {})[d.worker_id] = {"backend": backend, "reason": reason}
    return pairs


def prefills_for_others(w: WorkerInfo) -> bool:
    return w.role == "prefill" or w.prefills_for_others


def takes_kv(w: WorkerInfo) -> bool:
    """A worker prefill workers can ship KV to: a decode worker, or a colocated one that prefills for others."""
    return bool(w.data_addr) and (w.role == "decode" or w.prefills_for_others)


def last_resort(view: ClusterView, request: PlaceRequest) -> Plan | None:
    """No decode-capable worker is left: a prefill worker runs the same engine
    and can decode (a request moved off a dead decode worker continues there)."""
    worker = pick_worker(view.prefills, request.block_hashes)
    return Plan(worker.worker_id, reason="no_decode_worker") if worker is not None else None


def on_serving_worker(view: ClusterView, request: PlaceRequest,
                      plan_on: Callable[[WorkerInfo], Plan]) -> Plan | None:
    """`plan_on` the decode-capable worker pick_worker prefers for `request`;
    with none left, last_resort's plan."""
    worker = pick_worker(view.serving, request.block_hashes)
    return plan_on(worker) if worker is not None else last_resort(view, request)
