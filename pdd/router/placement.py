"""Where a request runs: the one function that decides.

`place(request, workers, mode)` returns a Plan — a prefill worker, a decode
worker and the KV transfer backend between them (disaggregated), or one
worker that prefills and decodes (colocated) — or None when nobody can take
the request. It is pure: it reads the workers' state and changes nothing, so
routing policy, and later the circuit breaker, adaptive disaggregation and
admission control, are inputs here and it is tested on constructed states.

Roles differ by capability:
    prefill    computes prompts and ships their KV; runs requests whole only
               when no decode-capable worker is left (a request moved off a
               dead decode worker continues there rather than fail)
    decode     decodes KV that prefill workers send; prefills locally only as
               a fallback (no prefill worker, transfer failed, migration)
    colocated  prefills and decodes its own requests; never receives KV
Router modes:
    auto       a decode-capable worker is chosen by load and affinity; on a
               decode worker the request is disaggregated when a prefill worker
               and a common transfer backend exist, else prefilled there
    colocated  never disaggregate (prefill workers stay idle)
    disagg     new requests only disaggregated; none possible -> no placement
               (the client gets 503). Requests already running still fall
               back locally when their transfer fails: nothing is lost.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdd.router.registry import WorkerInfo

PREFIX_WEIGHT = 0.5   # a fully cached prompt is worth this much extra load
SERVING_ROLES = ("colocated", "decode")


@dataclass(frozen=True)
class Plan:
    decode: str                  # the worker that decodes and streams (colocated: does it all)
    prefill: str | None = None   # set: disaggregated through `backend`
    backend: str = ""
    note: str = ""               # why a decode worker prefills locally, if it does

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


PairAllowed = Callable[[str, str], bool]   # (prefill id, decode id): its circuit breaker lets it through


def place(request: PlaceRequest, workers: Iterable[WorkerInfo], mode: str,
          exclude: frozenset[str] = frozenset(), pair_allowed: PairAllowed = lambda p, d: True) -> Plan | None:
    pool = [w for w in workers if w.accepting and w.worker_id not in exclude]
    prefills = [w for w in pool if w.role == "prefill"]
    if mode == "disagg" and not request.colocated_only:
        decodes = [w for w in pool if w.role == "decode" and w.data_addr]
        decode = pick_worker(decodes, request.block_hashes)
        if decode is None:
            return None
        pair = _prefill_for(decode, prefills, request.block_hashes, pair_allowed)
        return pair if pair.disaggregated else None
    worker = pick_worker((w for w in pool if w.role in SERVING_ROLES), request.block_hashes)
    if worker is None:   # the last resort: a prefill worker runs the same engine and can decode
        last = pick_worker(prefills, request.block_hashes)
        return Plan(last.worker_id, note="no decode worker") if last is not None else None
    if worker.role == "colocated" or mode == "colocated" or request.colocated_only:
        return Plan(worker.worker_id)
    return _prefill_for(worker, prefills, request.block_hashes, pair_allowed)


def _prefill_for(decode: WorkerInfo, prefills: list[WorkerInfo], block_hashes: list[int],
                 pair_allowed: PairAllowed) -> Plan:
    """The best prefill worker for `decode`, or a plan to prefill on it (and why)."""
    if not prefills:
        return Plan(decode.worker_id, note="no prefill worker")
    usable = [p for p in prefills if decode.data_addr and transfer_backend(p, decode)]
    if not usable:
        return Plan(decode.worker_id, note=f"no KV transfer backend common to {decode.worker_id} "
                                           f"{decode.transfer_backends} and any prefill worker")
    allowed = [p for p in usable if pair_allowed(p.worker_id, decode.worker_id)]
    prefill = pick_worker(allowed, block_hashes)
    if prefill is None:
        return Plan(decode.worker_id, note="breaker_open")
    return Plan(decode.worker_id, prefill.worker_id, transfer_backend(prefill, decode))
