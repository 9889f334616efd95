"""The static layouts: a fixed rule from the workers' roles, load and prefix affinity.

    auto       a decode-capable worker is chosen by load and affinity; on a
               decode worker the request is disaggregated when a prefill worker
               and a common transfer backend exist, else prefilled there
    colocated  never disaggregate (prefill workers stay idle)
    disagg     new requests only disaggregated; none possible -> no placement
               (the client gets 503). Requests already running still fall
               back locally when their transfer fails: nothing is lost.
"""
from __future__ import annotations

from pdd.router.placement.base import (DISAGG, LOCAL_PREFILL, NO_BACKEND, NO_PREFILL_WORKER, ClusterView, Plan,
                                       PlaceRequest, Policy, on_serving_worker, pick_worker)
from pdd.router.registry import WorkerInfo


class AutoPolicy(Policy):
    name = "auto"

    def place(self, request: PlaceRequest, view: ClusterView) -> Plan | None:
        def plan_on(worker: WorkerInfo) -> Plan:
            if worker.role == "colocated":
                return Plan(worker.worker_id, reason="colocated_worker")
            return prefill_for(worker, view, request)
        return on_serving_worker(view, request, plan_on)


class ColocatedPolicy(Policy):
    name = "colocated"

    def place(self, request: PlaceRequest, view: ClusterView) -> Plan | None:
        return on_serving_worker(view, request, lambda worker: Plan(worker.worker_id, reason="mode"))


class DisaggPolicy(Policy):
    name = "disagg"

    def place(self, request: PlaceRequest, view: ClusterView) -> Plan | None:
        decode = pick_worker((w for w in view.workers if w.role == "decode" and w.data_addr), request.block_hashes)
        if decode is None:
            return None
        plan = prefill_for(decode, view, request)
        return plan if plan.disaggregated else None


def prefill_for(decode: WorkerInfo, view: ClusterView, request: PlaceRequest) -> Plan:
    """The best prefill worker for `decode`, or a plan to prefill on it (and why)."""
    if not view.prefills:
        return Plan(decode.worker_id, kind=LOCAL_PREFILL, reason=NO_PREFILL_WORKER)
    senders, why = view.senders(decode, view.prefills)
    if why == NO_BACKEND:
        return Plan(decode.worker_id, kind=LOCAL_PREFILL, reason=why,
                    note=f"no KV transfer backend common to {decode.worker_id} {decode.transfer_backends} "
                         f"and any prefill worker")
    if why:
        return Plan(decode.worker_id, kind=LOCAL_PREFILL, reason=why)
    backends = {p.worker_id: b for p, b in senders}
    prefill = pick_worker((p for p, _ in senders), request.block_hashes)
    return Plan(decode.worker_id, prefill.worker_id, backends[prefill.worker_id], kind=DISAGG, reason="static")
