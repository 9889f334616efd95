"""Where a request runs: the one function that decides.

`place(request, view, policy)` returns a Plan — a prefill worker, a decode
worker and the KV transfer backend between them (disaggregated), or one
worker that prefills and decodes — or None when nobody can take the request.
It is pure: it reads the view (the workers that may take work, the circuit
breakers' `pair_allowed`, the cost model's estimates) and changes nothing, so
it is tested on constructed states. router.mode names the policy:

    auto, colocated, disagg   the static layouts (static.py)
    adaptive                  every option priced by a cost model measured online (adaptive.py)
    threshold                 the peers' rule: uncached prompt tokens and the prefill queue (threshold.py)

Every policy gets the same view (base.py: exclusions and the breaker are
applied there, not per policy), and a re-placement after a failure prefills
where it decodes whatever the policy.

Roles differ by capability:
    prefill    computes prompts and ships their KV; runs requests whole only
               when no decode-capable worker is left (a request moved off a
               dead decode worker continues there rather than fail)
    decode     decodes KV that prefill workers send; prefills locally as a
               fallback, or when the policy chooses it
    colocated  prefills and decodes its own requests; with
               worker.prefill_for_others it also computes prompts for other
               workers and, in adaptive mode, receives KV from them
Every plan says its kind (disagg | local_prefill | colocated) and why
(`reason`): the router counts them (pdd_placement_total).
"""
from __future__ import annotations

from pdd.config import RouterConfig
from pdd.router.placement.adaptive import AdaptivePolicy
from pdd.router.placement.base import (COLOCATED, DISAGG, LOCAL_PREFILL, SERVING_ROLES, ClusterView, PairAllowed,
                                       Plan, PlaceRequest, Policy, load_of, on_serving_worker, pick_worker,
                                       prefills_for_others, transfer_backend, transfer_choice, transfer_pairs)
from pdd.router.placement.static import AutoPolicy, ColocatedPolicy, DisaggPolicy
from pdd.router.placement.threshold import ThresholdPolicy

__all__ = ["COLOCATED", "DISAGG", "LOCAL_PREFILL", "SERVING_ROLES", "AdaptivePolicy", "AutoPolicy", "ClusterView",
           "ColocatedPolicy", "DisaggPolicy", "PairAllowed", "PlaceRequest", "Plan", "Policy", "ThresholdPolicy",
           "load_of", "pick_worker", "place", "policy_for", "prefills_for_others", "transfer_backend",
           "transfer_choice", "transfer_pairs"]


def policy_for(cfg: RouterConfig) -> Policy:
    """The policy router.mode names, with its settings."""
    policies = {"auto": AutoPolicy, "colocated": ColocatedPolicy, "disagg": DisaggPolicy,
                "adaptive": lambda: AdaptivePolicy(cfg.adaptive), "threshold": lambda: ThresholdPolicy(cfg.threshold)}
    return policies[cfg.mode]()


def place(request: PlaceRequest, view: ClusterView, policy: Policy) -> Plan | None:
    """Where `request` runs, as `policy` decides on `view`. A re-placement after
    a failure (`colocated_only`), and a request asking for its prompt's
    logprobs (`prompt_logits`), prefill where they decode, on the least loaded
    decode-capable worker, whatever the policy. A later choice of an n > 1
    request goes `beside` the first while that worker takes work: its prefix
    cache holds their prompt."""
    shared = next((w for w in view.serving if w.worker_id == request.beside), None) if request.beside else None
    if shared is not None:
        return Plan(shared.worker_id, kind=LOCAL_PREFILL if shared.role == "decode" else COLOCATED,
                    reason="shared_prompt")
    if request.colocated_only or request.prompt_logits:
        reason = "placed_again" if request.colocated_only else "prompt_logprobs"
        return on_serving_worker(view, request, lambda worker: Plan(worker.worker_id, reason=reason))
    return policy.place(request, view)
