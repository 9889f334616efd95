"""Which workers belong to the cluster: registration, heartbeats, hang
detection, loss, and what the router keeps of a worker that left until it is
forgotten.

A worker is lost when it says goodbye, cannot be reached, another process
registers under its id, or it stays silent past the liveness grace. Silent
past the heartbeat window only, it is suspect: no new requests go to it, and
those it holds stay where they are; a message from it within the grace makes
it healthy again with nothing moved (a compile or a call holding its
interpreter, a starved host, delays heartbeats without ending a process). The
window counts only time the router itself ran (`router_stalled`). A suspect
is probed at once: a process that is gone has closed its connection, the
probe cannot be delivered, and it is lost then, without the grace.

What a loss means for the requests the worker held is the request state
machine's (pdd.router.control): this module tells it through `orphaned` (the
worker is gone) and `hung` (its engine step never ends; it stays registered).
Like ControlPlane, every method is one event that runs to completion without
awaiting.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.config import RouterConfig
from pdd.metrics import RouterMetrics
from pdd.protocol import messages as m
from pdd.router.breaker import Breakers
from pdd.router.estimator import Estimator
from pdd.router.placement import Policy
from pdd.router.registry import WorkerRegistry

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Membership:
    cfg: RouterConfig
    registry: WorkerRegistry
    metrics: RouterMetrics
    estimator: Estimator
    breakers: Breakers
    policy: Policy                               # its balances_roles: whether rebalance() does anything
    send: Callable[[str, m.Message], None]
    clock: Callable[[], float]
    step_timeout_s: float
    orphaned: Callable[[str, str], None]         # (worker id, why): the process registered under it is gone
    hung: Callable[[str, float], None]           # (worker id, seconds): its engine step has run past step_timeout_s
    departed: dict[str, float] = field(default_factory=dict)   # unregistered worker id -> when it left

    def on_register(self, peer: str, msg: m.Register) -> None:
        known = self.registry.workers.get(peer)
        # Another process under the id, or this one after it dropped what it held
        # of ours (its connection to us closed): the old entry goes, with its requests.
        why = None
        if self.registry.is_new_incarnation(msg):
            why = "it restarted (a new process registered under its id)"
        elif known is not None and known.session != msg.session:
            why = "it dropped what it held (its connection to this router closed)"
        if why is not None:
            self.registry.remove(peer)
        again = peer in self.registry.workers   # the same process again (its Registers queued up while we were busy)
        error = self.registry.register(msg)
        if error:
            log.error("refused worker %s: %s", peer, error)
            if why is not None:
                self._depart(peer)
        else:
            self.departed.pop(peer, None)
            (log.debug if again else log.info)("worker %s registered (%s on %s, %d blocks)", peer, msg.role,
                                               msg.device, msg.num_blocks)
        self.send(peer, m.RegisterReply(ok=error is None, error=error or "",
                                        heartbeat_interval_s=self.cfg.heartbeat_interval_s,
                                        liveness_s=self.registry.lost_after_s))
        self.rebalance()
        if why is not None:
            # Its requests may move to the (new) process itself: it registered first.
            self.orphaned(peer, why)

    def on_heartbeat(self, peer: str, msg: m.Heartbeat) -> None:
        worker = self.registry.workers.get(peer)
        steps_before = worker.load.steps_completed if worker is not None and worker.load else None
        if not self.registry.heartbeat(msg):
            self.send(peer, m.ReRegister())
            return
        self.send(peer, m.HeartbeatAck())
        self.metrics.observe_heartbeat(msg)
        self.estimator.observe(msg)
        self.rebalance()
        if msg.step_running_s > self.step_timeout_s:
            # Its loop still answers: it keeps its registration (and gets its
            # requests back as Aborts once it wakes) but no new work.
            if not worker.hung:
                worker.hung = True
                self.hung(peer, msg.step_running_s)
        elif worker.hung and steps_before is not None and msg.steps_completed > steps_before:
            worker.hung = False
            log.warning("worker %s steps again (%d steps done); it takes new requests", peer,
                        msg.steps_completed)

    def on_goodbye(self, peer: str, msg: m.Goodbye) -> None:
        self.worker_lost(peer, "said goodbye")

    def rebalance(self) -> None:
        """Adaptive: which workers lean to prefill follows every change of the
        workers and their load (readers such as `pdd admin status` only look)."""
        if self.policy.balances_roles:
            self.estimator.rebalance(self.registry.workers.values(), self.clock())

    def heard(self, worker_id: str) -> None:
        """Any message from a registered worker: it is alive."""
        silent_s = self.registry.heard(worker_id)
        if silent_s is not None:
            self.metrics.liveness.labels("back").inc()
            log.warning("worker %s heard again after %.1fs of silence; it takes new requests, and kept its own",
                        worker_id, silent_s)

    def check_liveness(self) -> None:
        """Silent workers turn suspect (and are probed), or are lost."""
        suspects, lost = self.registry.silent()
        for wid in suspects:
            self.metrics.liveness.labels("suspect").inc()
            log.warning("worker %s silent for over %gs (router.heartbeat_misses heartbeats): suspect, no new "
                        "requests; those it holds stay unless it is silent %gs more (router.liveness_grace_s)",
                        wid, self.registry.window_s, self.cfg.liveness_grace_s)
            # The probe: sent to a process that is gone, it cannot be delivered,
            # and the router's send loop reports the worker unreachable (lost).
            self.send(wid, m.HeartbeatAck())
        for wid in lost:
            self.worker_lost(wid, f"silent for over {self.registry.lost_after_s:g}s: missed heartbeats")

    def router_stalled(self, seconds: float) -> None:
        """The router did not run for `seconds`: what the workers sent meanwhile
        waits unread, so that time is not their silence, and a departed
        worker's time to be forgotten moves on by it too."""
        self.registry.excuse(seconds)
        self.departed = {wid: at + seconds for wid, at in self.departed.items()}

    def worker_lost(self, worker_id: str, why: str) -> None:
        if self.registry.remove(worker_id) is not None:
            self.metrics.liveness.labels("lost").inc()
            self._depart(worker_id)
            self.orphaned(worker_id, why)

    def _depart(self, worker_id: str) -> None:
        """Unregistered: what the router keeps of it (breakers, estimates, metric
        series) waits router.forget_after_s for it to come back under its id."""
        self.departed[worker_id] = self.clock()
        self.estimator.left(worker_id)

    def forget_departed(self) -> list[str]:
        """Workers gone for router.forget_after_s without registering again lose
        what the router kept of them, so that the dead ones of a long life (each
        restart under a default id, role-host-pid, is a new worker) do not pile
        up. Returns their ids."""
        cutoff = self.clock() - self.cfg.forget_after_s
        gone = [wid for wid, at in self.departed.items() if at <= cutoff]
        for wid in gone:
            del self.departed[wid]
            pairs = self.breakers.forget(wid)
            self.metrics.forget_worker(wid, pairs)
            self.estimator.forget(wid)
            log.info("worker %s forgotten: gone for %gs (router.forget_after_s); %d breaker(s), its estimates "
                     "and metric series dropped", wid, self.cfg.forget_after_s, len(pairs))
        return gone
