"""The operator's commands that change the cluster, as `pdd admin` sends them
(pdd.admin.server): a breaker forced, faults set on workers (only with
router.allow_fault_injection), a worker drained or taken back (kept on disk,
pdd.router.drained, for a restarted router), a request aborted. Each checks
its arguments and raises ValueError or KeyError naming what is wrong."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdd import faults
from pdd.config import ClusterConfig
from pdd.protocol import messages as m
from pdd.router.breaker import PATH
from pdd.router.control import ControlPlane
from pdd.router.drained import DrainedWorkers, state_dir
from pdd.router.registry import WorkerRegistry

log = logging.getLogger(__name__)


class Operations:
    def __init__(self, cfg: ClusterConfig, registry: WorkerRegistry, control: ControlPlane,
                 post: Callable[[str, m.Message], None]):
        """post: sends a message to a worker (the router's outbox)."""
        self.cfg = cfg
        self.registry = registry
        self.control = control
        self.post = post
        self.drained = DrainedWorkers(state_dir(cfg.router.state_dir))
        registry.drained = self.drained.load()

    def set_breaker(self, state: str, prefill: str | None = None, decode: str | None = None) -> list[dict]:
        """`pdd admin breaker open|close|auto PREFILL DECODE | all`: force until set back to auto."""
        forced = {"open": "open", "close": "closed", "closed": "closed", "auto": None}
        if state not in forced:
            raise ValueError(f"breaker: expected open, close or auto, got {state!r}")
        if prefill is None:
            raise ValueError(f"breaker {state}: name a pair or all: pdd admin breaker {state} PREFILL DECODE, "
                             f"or pdd admin breaker {state} all (pdd admin breaker lists the pairs)")
        if prefill == "all" and decode is not None:
            raise ValueError(f"breaker {state} all: takes no second worker")
        if prefill == "all":
            keys = [PATH, *self.control.breakers.breakers]
        elif decode is None:
            raise ValueError("breaker: name a PREFILL and a DECODE worker, or all")
        else:
            roles = {wid: w.role for wid, w in self.registry.workers.items()}
            known = (prefill, decode) in self.control.breakers.breakers
            if not known and (roles.get(prefill) not in ("prefill", "colocated")
                              or roles.get(decode) not in ("decode", "colocated")):
                pairs = ", ".join(f"{p} {d}" for p, d in self.control.breakers.breakers if (p, d) != PATH)
                raise ValueError(f"breaker: no pair {prefill} -> {decode} (PREFILL first, then DECODE; "
                                 f"registered: {', '.join(sorted(roles)) or 'none'}; pairs so far: {pairs or 'none'})")
            keys = [(prefill, decode)]
        self.control.breakers.force(forced[state], keys, self.control.clock())
        return self.control.breakers.snapshot(time.monotonic())

    def faults(self, action: str | None = None, *args: str) -> dict:
        """`pdd admin faults`: what each worker reports set (its latest heartbeat);
        `faults set NAME=VALUE[,...] [WORKER]`, `faults clear [WORKER]`: forward
        to that worker, or to all, over the control bus."""
        if action is None:
            return {"allow_fault_injection": self.cfg.router.allow_fault_injection,
                    "workers": {wid: dict(w.load.faults) if w.load else {}
                                for wid, w in sorted(self.registry.workers.items())}}
        if action not in ("set", "clear"):
            raise ValueError(f"faults: expected set or clear, got {action!r}")
        if not self.cfg.router.allow_fault_injection:
            raise ValueError("fault injection at run time is off on this router: set "
                             "router.allow_fault_injection = true (PDD_ROUTER__ALLOW_FAULT_INJECTION=1) "
                             "to allow it")
        if action == "set":
            if not args:
                raise ValueError("faults set: name NAME=VALUE[,NAME=VALUE...] and optionally a WORKER")
            spec, worker = args[0], (args[1] if len(args) > 1 else None)
            values = faults.parse(spec)
            if not values:
                raise ValueError("faults set: name NAME=VALUE[,NAME=VALUE...]")
        else:
            values, worker = {}, (args[0] if args else None)
        targets = self._fault_targets(worker, values)
        for wid in targets:
            self.post(wid, m.SetFaults(values, clear=action == "clear"))
        log.warning("fault injection: %s %s on %s", action, faults.format_values(values), ", ".join(targets))
        return {"sent_to": targets, "set" if action == "set" else "cleared": values}

    def _fault_targets(self, worker: str | None, values: dict[str, float]) -> list[str]:
        """The workers a faults command goes to; each fault must act on one of them."""
        workers = self.registry.workers
        if worker is not None and worker not in workers:
            raise KeyError(f"no worker {worker!r}; known: {sorted(workers)}")
        targets = [worker] if worker is not None else sorted(workers)
        roles = {workers[wid].role for wid in targets}
        for name in values:
            if not any(faults.acts_in(name, role) for role in roles):
                where = worker or "this cluster"
                raise ValueError(f"{name} acts in {' and '.join(faults.KNOWN[name].roles)} workers only; "
                                 f"{where} has {' and '.join(sorted(roles)) or 'no'} worker(s)")
        return targets

    def set_draining(self, worker_id: str, draining: bool) -> dict:
        """`pdd admin drain|undrain WORKER`: no new work for it (or again), kept
        in the state file (pdd.router.drained) for a restarted router. A worker
        drained and not registered now (after a restart) may be undrained."""
        worker = self.registry.workers.get(worker_id)
        if worker is None and not (not draining and worker_id in self.registry.drained):
            raise KeyError(f"no worker {worker_id!r}; known: {sorted(self.registry.workers)}")
        if draining:
            self.registry.drained.add(worker_id)
        else:
            self.registry.drained.discard(worker_id)
        if worker is not None:
            worker.draining = draining
        out = worker.summary() if worker is not None else {"worker_id": worker_id, "draining": False}
        try:
            self.drained.save(self.registry.drained)
        except OSError as e:
            log.error("router: cannot keep the drained workers in %s (%s); a restarted router forgets them",
                      self.drained.path, e)
            return {**out, "kept_in": None, "warning": f"not kept across a restart: {self.drained.path}: {e}"}
        return {**out, "kept_in": str(self.drained.path) if self.drained.path else None}

    def abort_request(self, request_id: str) -> dict:
        """`pdd admin abort ID`: end that request (ControlPlane.operator_abort)."""
        aborted = self.control.operator_abort(request_id)
        if not aborted:
            raise KeyError(f"no request {request_id!r} in flight (pdd admin requests lists them)")
        return {"aborted": aborted}
