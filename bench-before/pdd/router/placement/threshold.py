"""The peers' rule: remote prefill for long uncached prompts while a prefill queue has room.

As Dynamo's conditional disaggregation decides (and, with the uncached
length alone, llm-d's and TensorRT-LLM's): the decode worker is chosen as
`auto` chooses it (load and prefix affinity); it prefills the prompt itself
when at most `max_local_prefill_tokens` of it are uncached there, or when
every prefill worker it can pair with has `max_prefill_queue_tokens` or more
prompt tokens queued; else the least loaded of those with room computes it.
Two settings, no model: the baseline the adaptive policy's cost model has to
beat ([router.threshold]).

Reasons counted: short_prompt, cached (long, but at most the threshold
uncached on the decode worker), long_prompt (disaggregated), prefill_queue,
and the shared ones (no_prefill_worker, no_backend, breaker_open,
colocated_worker, no_decode_worker).
"""
from __future__ import annotations

from pdd.config import ThresholdConfig
from pdd.router.placement.base import (DISAGG, LOCAL_PREFILL, NO_PREFILL_WORKER, ClusterView, Plan, PlaceRequest,
                                       Policy, last_resort, load_of, pick_worker, takes_kv)
from pdd.router.registry import WorkerInfo


class ThresholdPolicy(Policy):
    name = "threshold"
    needs_estimates = True     # the prefill queues: prompt tokens pending per worker

    def __init__(self, cfg: ThresholdConfig):
        self.cfg = cfg

    def place(self, request: PlaceRequest, view: ClusterView) -> Plan | None:
        decode = pick_worker(view.serving, request.block_hashes)
        if decode is None:
            return last_resort(view, request)
        if not takes_kv(decode):
            return Plan(decode.worker_id, reason="colocated_worker")
        n = request.tokens(view.block_size)
        uncached = n - request.cached_on(decode, view.block_size)
        if uncached <= self.cfg.max_local_prefill_tokens:
            return _local(decode, "short_prompt" if n <= self.cfg.max_local_prefill_tokens else "cached", uncached)
        prefills = [p for p in view.prefills if p.worker_id != decode.worker_id]
        if not prefills:
            return _local(decode, NO_PREFILL_WORKER, uncached)
        senders, why = view.senders(decode, prefills)
        if why:
            return _local(decode, why, uncached)
        room = {p.worker_id: b for p, b in senders if queued_tokens(view, p) < self.cfg.max_prefill_queue_tokens}
        if not room:
            return _local(decode, "prefill_queue", uncached)
        prefill = pick_worker((p for p, _ in senders if p.worker_id in room), request.block_hashes)
        return Plan(decode.worker_id, prefill.worker_id, room[prefill.worker_id], kind=DISAGG, reason="long_prompt",
                    prefill_tokens=n - request.cached_on(prefill, view.block_size))

    def settings(self) -> dict:
        return {"max_local_prefill_tokens": self.cfg.max_local_prefill_tokens,
                "max_prefill_queue_tokens": self.cfg.max_prefill_queue_tokens}

    def estimates(self, view: ClusterView) -> dict[str, dict]:
        """Per worker its load (how the decode and prefill workers are picked);
        per prefill worker also its queue and whether it takes more."""
        out = {}
        for w in view.workers:
            out[w.worker_id] = {"load": round(load_of(w), 3)}
            if w.role == "prefill":
                queued = queued_tokens(view, w)
                out[w.worker_id].update(queued_prefill_tokens=queued,
                                        queue_full=queued >= self.cfg.max_prefill_queue_tokens)
        return out


def queued_tokens(view: ClusterView, w: WorkerInfo) -> int:
    """Prompt tokens waiting on `w`: its last heartbeat's count plus those placed there since."""
    e = view.estimates.workers.get(w.worker_id) if view.estimates is not None else None
    return e.pending_tokens if e is not None else 0


def _local(decode: WorkerInfo, reason: str, uncached: int) -> Plan:
    return Plan(decode.worker_id, kind=LOCAL_PREFILL, reason=reason, prefill_tokens=uncached)
