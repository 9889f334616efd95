"""The router's view of its workers: registration, load from heartbeats, liveness, drain.

Liveness counts silence on the router's clock, less the spans the router
itself did not run (`excuse`): a worker silent past the window (heartbeat
interval x misses) is suspect, past the window + grace lost; any message
from it ends a suspicion (`heard`).

The first worker to register fixes the cluster's KV layout; a later worker
whose layout differs is refused with the name of the field (a worker of
another model or dtype must never be paired with these).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.kv.layout import KVLayout
from pdd.protocol import messages as m

log = logging.getLogger(__name__)

_MAX_TRACKED_HASHES = 200_000  # per worker, for prefix affinity
# ... of its host KV tier: the tier's own capacity, at most this many.
_MAX_TRACKED_HOST_HASHES = 1_000_000


def _note(seen: OrderedDict, hashes: list[int], limit: int) -> None:
    """Hashes a worker reported, newest last, the oldest forgotten past `limit`."""
    for h in hashes:
        seen[h] = None
        seen.move_to_end(h)
    while len(seen) > limit:
        seen.popitem(last=False)


def _tier_fill(stats: dict) -> str | None:
    """ "used/capacity" blocks of a host KV tier, None without one."""
    return f"{stats.get('used_blocks', 0)}/{stats['capacity_blocks']}" if stats else None


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    host: str
    pid: int
    device: str
    layout: KVLayout
    num_blocks: int
    max_num_seqs: int
    max_model_len: int
    data_addr: str = ""
    transfer_backends: list[str] = field(default_factory=list)
    host_id: str = ""
    incarnation: str = ""           # this process's start; another one under the same id is a new worker
    public_key: str = ""            # its data socket's CURVE key, handed to prefill workers that write to it
    prefills_for_others: bool = False   # a colocated worker that also prefills prompts and ships their KV
    step: m.StepLimits = field(default_factory=m.StepLimits)   # its scheduler's limits
    build: dict = field(default_factory=dict)   # its pdd.build_info()
    session: int = 0                # its drops of what this router placed on it (Register.session)
    last_seen: float = field(default_factory=time.monotonic)
    load: m.Heartbeat | None = None
    heartbeats: int = 0             # received since it registered: lets a caller wait for a fresh one
    draining: bool = False          # set by the admin (drain) ...
    self_draining: bool = False     # ... or by the worker itself (SIGTERM)
    hung: bool = False              # its engine step outran worker.step_timeout_s
    suspect: bool = False           # silent past the liveness window, not yet past the grace
    # Requests with a phase owned here (pdd.router.inflight keeps it exact;
    # fresher than the last heartbeat).
    inflight: int = 0
    inflight_at_report: int = 0     # `inflight` when its last heartbeat came (busy)
    cached_hashes: OrderedDict = field(default_factory=OrderedDict)
    host_hashes: OrderedDict = field(default_factory=OrderedDict)   # in its host KV tier (pdd.kv.tier)

    @property
    def serving(self) -> bool:
        """It goes on with the work it holds: not drained, draining or hung (a
        suspect one does: heard within the grace, it keeps its requests)."""
        return not (self.draining or self.self_draining or self.hung)

    @property
    def accepting(self) -> bool:
        """It takes new work."""
        return self.serving and not self.suspect

    @property
    def busy(self) -> int:
        """Requests on it: what the worker last said it runs and queues (every
        router's), moved by what this router placed or ended there since; never
        less than this router's own (exact). Without the move, every request a
        router places between two heartbeats would go to the one worker that
        last reported least."""
        if self.load is None:
            return self.inflight
        return max(self.inflight, self.load.running + self.load.waiting + self.inflight - self.inflight_at_report)

    @property
    def free_blocks(self) -> int:
        return self.load.free_blocks if self.load else self.num_blocks

    def note_hashes(self, hashes: list[int], host_hashes: list[int] = ()) -> None:
        _note(self.cached_hashes, hashes, _MAX_TRACKED_HASHES)
        if host_hashes:
            capacity = self.load.host_kv.get("capacity_blocks", 0) if self.load else 0
            _note(self.host_hashes, host_hashes, min(capacity or _MAX_TRACKED_HOST_HASHES, _MAX_TRACKED_HOST_HASHES))

    def prefix_match(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt this worker (probably) caches,
        in its pool or in its host KV tier (from where it loads them)."""
        return self.tiered_prefix_match(hashes)[0]

    def tiered_prefix_match(self, hashes: list[int]) -> tuple[int, int]:
        """(leading blocks it probably caches, of those the ones only its host
        tier holds): the cost model prices the second kind as a load."""
        n = host = 0
        for h in hashes:
            if h in self.cached_hashes:
                pass
            elif h in self.host_hashes:
                host += 1
            else:
                break
            n += 1
        return n, host

    def summary(self) -> dict:
        load = self.load
        return {
            "worker_id": self.worker_id, "role": self.role, "host": self.host, "pid": self.pid,
            "device": self.device, "accepting": self.accepting, "draining": self.draining or self.self_draining,
            "hung": self.hung, "suspect": self.suspect,
            "inflight": self.inflight, "num_blocks": self.num_blocks,
            "running": load.running if load else 0, "waiting": load.waiting if load else 0,
            "free_blocks": self.free_blocks,
            "prefix_hit_rate": load.prefix_hit_rate if load else 0.0,
            "transfer_backends": list(self.transfer_backends), "prefills_for_others": self.prefills_for_others,
            "transfer": dict(load.transfer) if load else {},
            "last_seen_s_ago": round(time.monotonic() - self.last_seen, 3), "heartbeats": self.heartbeats,
            "steps_completed": load.steps_completed if load else 0,
            "step_running_s": load.step_running_s if load else 0.0,
            "faults": dict(load.faults) if load else {},
            "kernels_compiled_in_service": load.kernels_compiled_in_service if load else 0,
            "host_kv": dict(load.host_kv) if load else {},
            "host_kv_blocks": _tier_fill(load.host_kv) if load else None,
        }


class WorkerRegistry:
    def __init__(self, heartbeat_interval_s: float, heartbeat_misses: int, grace_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.workers: dict[str, WorkerInfo] = {}
        self.drained: set[str] = set()   # worker ids drained by the admin (pdd.router.drained keeps them)
        self.layout: KVLayout | None = None
        self.window_s = heartbeat_interval_s * heartbeat_misses   # silent this long: suspect
        self.lost_after_s = self.window_s + grace_s                # silent this long: lost
        self.clock = clock

    def is_new_incarnation(self, msg: m.Register) -> bool:
        """A worker id already registered by another process (restarted before its
        old entry expired): the old one is lost, with everything it held."""
        old = self.workers.get(msg.worker_id)
        return old is not None and (old.incarnation, old.pid, old.host) != (msg.incarnation, msg.pid, msg.host)

    def register(self, msg: m.Register) -> str | None:
        """Add or refresh a worker. Returns an error message if refused. The
        caller has removed an older incarnation under the same id first."""
        try:
            layout = KVLayout.from_dict(msg.layout)
        except (TypeError, ValueError) as e:
            return f"bad KV layout descriptor: {e}"
        if self.layout is not None:
            mismatch = self.layout.mismatch(layout)
            if mismatch:
                return f"{mismatch} (cluster vs worker {msg.worker_id})"
        else:
            self.layout = layout
        old = self.workers.get(msg.worker_id)
        info = WorkerInfo(msg.worker_id, msg.role, msg.host, msg.pid, msg.device, layout, msg.num_blocks,
                          msg.max_num_seqs, msg.max_model_len, msg.data_addr, list(msg.transfer_backends), msg.host_id,
                          msg.incarnation, msg.public_key, msg.prefills_for_others, msg.step, build=msg.build,
                          session=msg.session,
                          last_seen=self.clock())
        # Drained by the admin: whatever process registers under the id, after
        # a restart of either side, stays drained until undrained.
        info.draining = msg.worker_id in self.drained
        if old is not None:
            # A repeated registration of the same process keeps its state.
            info.draining = info.draining or old.draining
            info.inflight, info.cached_hashes, info.host_hashes = old.inflight, old.cached_hashes, old.host_hashes
            info.load, info.heartbeats = old.load, old.heartbeats
        self.workers[msg.worker_id] = info
        return None

    def heartbeat(self, msg: m.Heartbeat) -> bool:
        """False if the worker is unknown (it must re-register)."""
        info = self.workers.get(msg.worker_id)
        if info is None:
            return False
        info.load = msg
        info.inflight_at_report = info.inflight
        info.heartbeats += 1
        info.self_draining = msg.draining
        info.note_hashes(msg.recent_hashes, msg.host_hashes)
        return True

    def heard(self, worker_id: str) -> float | None:
        """A message from a registered worker: it is not silent. If it was
        suspect it no longer is: returns how long it had been silent."""
        info = self.workers.get(worker_id)
        if info is None:
            return None
        now = self.clock()
        silent_s, info.last_seen = now - info.last_seen, now
        if not info.suspect:
            return None
        info.suspect = False
        return silent_s

    def remove(self, worker_id: str) -> WorkerInfo | None:
        info = self.workers.pop(worker_id, None)
        if not self.workers:
            self.layout = None  # an empty cluster may be re-formed with another model
        return info

    def excuse(self, seconds: float) -> None:
        """The router could not hear anyone for `seconds`: no worker missed a heartbeat then."""
        now = self.clock()
        for w in self.workers.values():
            w.last_seen = min(now, w.last_seen + seconds)

    def silent(self) -> tuple[list[str], list[str]]:
        """(workers silent past the window that were not suspect: suspect now,
        workers silent past the window + grace: lost)."""
        now = self.clock()
        suspects, lost = [], []
        for w in self.workers.values():
            silent_s = now - w.last_seen
            if silent_s > self.lost_after_s:
                lost.append(w.worker_id)
            elif silent_s > self.window_s and not w.suspect:
                w.suspect = True
                suspects.append(w.worker_id)
        return suspects, lost

    def candidates(self, roles: tuple[str, ...]) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role in roles and w.accepting]

    def max_model_len(self) -> int | None:
        lens = [w.max_model_len for w in self.workers.values()]
        return min(lens) if lens else None
