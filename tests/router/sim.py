"""A simulated cluster around the real ControlPlane: no sockets, no processes.

Workers are small models of the real ones (FIFO inboxes, requests held as
(request id, epoch), blocks reserved and freed); the test decides when each
message is delivered, when each worker acts, when time passes and when a
worker dies or restarts. A decode worker's output at position i is
`token(request_id, i)`, as a seeded sampler would give on any worker, so a
migrated request must continue with exactly the tokens it would have had.
"""
from __future__ import annotations

import itertools
import uuid
import zlib
from collections import deque
from dataclasses import dataclass, field

from pdd.api import SamplingParams
from pdd.config import RouterConfig
from pdd.kv.layout import KVLayout
from pdd.router.metrics import RouterMetrics
from pdd.protocol import messages as m
from pdd.router.control import ControlPlane
from pdd.router.registry import WorkerRegistry
from pdd.router.requests import RequestError

LAYOUT = KVLayout("sim", "0", "float32", 4, 2, 1, 8)


def token(request_id: str, position: int) -> int:
    return zlib.crc32(f"{request_id}/{position}".encode()) % 1000


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Hold:
    """A request on a simulated worker."""
    epoch: int
    kind: str                # reserved | running | prefilling | first_sent | landed (PrefillDone due)
    position: int = 0        # next output position (running)
    max_tokens: int = 0
    blocks: int = 0
    target: str | None = None   # prefilling: the decode worker its KVTarget named (pages may be sent)


@dataclass
class SimWorker:
    worker_id: str
    role: str
    num_blocks: int = 64
    step: m.StepLimits = field(default_factory=m.StepLimits)   # its scheduler's limits, as registered
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    inbox: deque = field(default_factory=deque)
    holds: dict = field(default_factory=dict)     # (request id, epoch) -> Hold
    violations: list = field(default_factory=list)

    def register_message(self) -> m.Register:
        return m.Register(self.worker_id, self.role, "host", 1, "cpu", LAYOUT.to_dict(), self.num_blocks, 8,
                          10_000, data_addr=f"tcp://{self.worker_id}:1" if self.role != "prefill" else "",
                          transfer_backends=["tcp"], incarnation=self.incarnation, step=self.step)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - sum(h.blocks for h in self.holds.values())

    def holding(self, rid: str):
        return [(k, h) for k, h in self.holds.items() if k[0] == rid]

    def take(self, rid: str, epoch: int, hold: Hold) -> None:
        if self.holding(rid):
            # The router aborts a request's old placement before a new one reaches
            # the same worker: two epochs here at once is a double admission.
            self.violations.append(f"{self.worker_id} got {rid}@{epoch} while holding {self.holding(rid)}")
        self.holds[(rid, epoch)] = hold


class SimCluster:
    def __init__(self, mode: str = "auto", reserve_timeout_s: float = 5.0, lease_ttl_s: float = 30.0,
                 **router_cfg):
        self.clock = Clock()
        cfg = RouterConfig(mode=mode, reserve_timeout_s=reserve_timeout_s, kv_lease_ttl_s=lease_ttl_s,
                           heartbeat_interval_s=0.5, heartbeat_misses=3, **router_cfg)
        self.registry = WorkerRegistry(cfg.heartbeat_interval_s, cfg.heartbeat_misses, cfg.liveness_grace_s,
                                       self.clock)
        self.control = ControlPlane(cfg, self.registry, RouterMetrics(), self._deliver_to_worker, self.clock)
        self.workers: dict[str, SimWorker] = {}
        self.states = {}          # every request ever submitted
        self.client_aborted = set()
        self.choices_of: dict[str, list[str]] = {}   # an n > 1 request's choice ids, by each of them
        self._ids = itertools.count()

    # ---------------------------------------------------------------- cluster

    def _deliver_to_worker(self, peer: str, msg: m.Message) -> None:
        w = self.workers.get(peer)
        if w is not None:     # a dead process's messages are lost
            w.inbox.append(msg)

    def add_worker(self, worker_id: str, role: str, num_blocks: int = 64,
                   step: m.StepLimits | None = None) -> SimWorker:
        w = self.workers[worker_id] = SimWorker(worker_id, role, num_blocks, step or m.StepLimits())
        self.control.handle(worker_id, w.register_message())
        reply = w.inbox.popleft()
        assert isinstance(reply, m.RegisterReply) and reply.ok, reply
        return w

    def kill(self, worker_id: str) -> None:
        del self.workers[worker_id]
        self.control.membership.worker_lost(worker_id, "killed by the test")

    def restart(self, worker_id: str) -> SimWorker:
        """A new process under the same id, registering before the old one expired."""
        old = self.workers.pop(worker_id)
        return self.add_worker(worker_id, old.role, old.num_blocks, old.step)

    def submit(self, max_tokens: int = 4, n: int = 1):
        """A request (its first choice's state when n > 1)."""
        rid = f"r{next(self._ids)}"
        states = self.control.submit_choices(list(range(1, 11)), SamplingParams(max_tokens=max_tokens, seed=1), rid, n)
        for state in states:
            self.states[state.request_id] = state
            self.choices_of[state.request_id] = [s.request_id for s in states]
        return states[0]

    def abort(self, rid: str) -> None:
        """The client leaves: every choice of its request ends, in index order (as the HTTP handler does)."""
        for choice in self.choices_of.get(rid, [rid]):
            self.client_aborted.add(choice)
            self.control.abort(self.states[choice])

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        self.control.fire_timers()

    # ---------------------------------------------------------------- worker behaviour

    def step_inbox(self, w: SimWorker, reserve: str = "ok") -> bool:
        """Deliver `w`'s next message. reserve: ok | refuse | silent (a Reserve's fate)."""
        if not w.inbox:
            return False
        msg = w.inbox.popleft()
        send = lambda reply: self.control.handle(w.worker_id, reply)  # noqa: E731
        if isinstance(msg, m.Abort):
            for rid in msg.request_ids:
                for key, _ in w.holding(rid):
                    del w.holds[key]
        elif isinstance(msg, m.Admit):
            w.take(msg.request_id, msg.epoch, Hold(msg.epoch, "running", msg.num_prior_output_tokens,
                                                   msg.sampling.max_tokens, 3))
        elif isinstance(msg, m.Reserve):
            if reserve == "refuse" or w.free_blocks < 3:
                send(m.Reserved(w.worker_id, msg.request_id, msg.epoch, ok=False, error="no free KV blocks"))
                return True
            w.take(msg.request_id, msg.epoch, Hold(msg.epoch, "reserved", 0, msg.sampling.max_tokens, 3))
            if reserve == "ok":
                send(m.Reserved(w.worker_id, msg.request_id, msg.epoch, ok=True, lease_id=f"L{msg.epoch}",
                                block_ids=[0, 1, 2]))
        elif isinstance(msg, m.Prefill):
            w.take(msg.request_id, msg.epoch, Hold(msg.epoch, "prefilling", blocks=3))
        elif isinstance(msg, m.KVTarget):
            hold = w.holds.get((msg.request_id, msg.epoch))
            if hold is not None:       # else: aborted or failed meanwhile, nothing to send
                hold.target = msg.dst_worker
        elif isinstance(msg, m.PrefillLocally):
            hold = w.holds.get((msg.request_id, msg.epoch))
            if hold is not None and hold.kind == "running":
                return True            # it started when its KV landed (below, in act): it runs on
            if hold is None or hold.kind != "reserved":
                send(m.RequestFailed(w.worker_id, msg.request_id, msg.epoch, "no reservation", retriable=True))
                return True
            first = msg.first_token
            hold.kind, hold.position = "running", (0 if first is None else 1)
        return True

    def act(self, w: SimWorker, key, outcome: str = "ok") -> None:
        """Worker `w` makes progress on one request it holds.
        outcome: ok | fail (prefill fails / lease expires) | first (prefill: FirstToken only)."""
        rid, epoch = key
        hold = w.holds[key]
        send = lambda reply: self.control.handle(w.worker_id, reply)  # noqa: E731
        if hold.kind in ("prefilling", "first_sent"):
            if hold.kind == "prefilling" and (outcome == "first" or (outcome == "ok" and not hold.target)):
                hold.kind = "first_sent"
                send(m.FirstToken(w.worker_id, rid, epoch, token(rid, 0)))
                return
            if outcome == "ok" and not hold.target:
                return   # computed; its pages wait for the target
            del w.holds[key]
            if outcome == "fail":
                send(m.PrefillFailed(w.worker_id, rid, epoch, "transfer failed (simulated)"))
                return
            # The data plane tells the decode worker the KV landed: it starts on its
            # own (its first item repeats the first token), ahead of PrefillDone.
            dst = self.workers.get(hold.target)
            reserved = dst.holds.get(key) if dst is not None else None
            if reserved is not None and reserved.kind == "reserved":
                reserved.kind, reserved.position = "running", 0
            w.holds[key] = Hold(epoch, "landed")   # PrefillDone races the decode worker's tokens
        elif hold.kind == "landed":
            del w.holds[key]
            send(m.PrefillDone(w.worker_id, rid, epoch, token(rid, 0)))
        elif hold.kind == "reserved":
            if outcome == "fail":   # the lease expired before the KV came
                del w.holds[key]
                send(m.RequestFailed(w.worker_id, rid, epoch, "KV lease expired", retriable=True))
        elif hold.kind == "running":
            # A first token that already reached max_tokens ends it with no new token.
            tokens = [token(rid, hold.position)] if hold.position < hold.max_tokens else []
            hold.position += len(tokens)
            done = hold.position >= hold.max_tokens
            if done:
                del w.holds[key]
            item = m.TokenItem(rid, epoch, hold.position - len(tokens), tokens, done, "length" if done else None)
            send(m.TokenBatch(w.worker_id, [item]))

    # ---------------------------------------------------------------- checks

    def check(self) -> None:
        self.control.inflight.check_invariants()
        for w in self.workers.values():
            assert not w.violations, w.violations

    def outcome(self, rid: str) -> tuple[str, list[int]]:
        """('done', tokens) | ('error', tokens) | ('open', tokens); at most one terminal event."""
        state = self.states[rid]
        events = list(state.events)
        terminal = [e for e in events if isinstance(e, RequestError) or e.finished]
        assert len(terminal) <= 1, f"{rid} ended {len(terminal)} times"
        assert not terminal or events[-1] is terminal[0], f"{rid}: events after its end"
        tokens = [t for e in events if not isinstance(e, RequestError) for t in e.token_ids]
        if not terminal:
            return "open", tokens
        return ("error" if isinstance(terminal[0], RequestError) else "done"), tokens

    def quiescent(self) -> bool:
        return not self.control.inflight.requests and not any(w.inbox or w.holds for w in self.workers.values())
