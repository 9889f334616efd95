"""Leases: which request may write which of the decode worker's blocks, until when.

The decode engine grants a lease when it reserves blocks for an incoming
request and revokes it before it frees or reuses those blocks. Every write by
a KV receiver happens inside `LeaseTable.writing()`, which holds the table's
lock for the whole write, so once `close()` has returned no write into the
lease's blocks is in progress and none can start: a late or duplicated page
can never land in blocks that now belong to another request.

One-sided writers (cuda_ipc: the prefill worker's kernel stores straight into
this pool) cannot be fenced by a lock. Such a writer registers first
(`begin_writer`, refused unless the lease is live) and says when its last
store has completed (`end_writer`). Closing a lease whose writer has not ended
answers "held": the owner keeps the blocks out of use until `released()`
hands the lease back (the writer ended, or its lease deadline plus
WRITER_GRACE_S passed: a writer never starts a copy after the deadline it was
given). The table keeps a held lease, blocks and all, beyond the request it
was granted for: the blocks are the writer's until then, not the request's.

A request's KV is complete when the sender's last message is accepted here:
`complete` (tcp, local: every pages message the sender sent was written under
this lease, which is still live) or `end_writer` of a commit (cuda_ipc). With
the sender's handoff it is then listed by `landed()`, which the owner (the
decode worker's engine thread) drains between steps; `on_landed` wakes it.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdd.transfer.base import Handoff, Landed

# How long after its lease's deadline a silent one-sided writer is assumed to
# have stopped: covers copies it launched just before the deadline that still
# queue behind its compute (at most about one prefill step).
WRITER_GRACE_S = 10.0


@dataclass(frozen=True)
class Lease:
    """One grant: `request_id` may write `block_ids` until `deadline` (time.monotonic())."""

    lease_id: str
    request_id: str
    block_ids: frozenset[int]
    deadline: float


class LeaseTable:
    """Thread-safe table of live leases, guarded by one lock."""

    def __init__(self, on_landed: Callable[[], None] | None = None) -> None:
        """on_landed: called (from a receiver's thread) when landed() has something new."""
        self._lock = threading.Lock()
        self._on_landed = on_landed
        self._leases: dict[str, Lease] = {}
        self._pages: dict[str, int] = {}       # pages messages written under each lease
        self._landed: list[Landed] = []
        # One-sided writers: lease id -> the time after which it surely stopped.
        self._writers: dict[str, float] = {}
        # Closed leases whose writer has not ended: the lease, and the time after
        # which the writer surely stopped.
        self._held: dict[str, tuple[Lease, float]] = {}
        self._released: list[Lease] = []      # held leases now safe to reuse, until released() hands them back

    def grant(self, request_id: str, block_ids: Iterable[int], ttl_s: float) -> str:
        """A new lease over `block_ids` for `ttl_s` seconds; returns its unguessable id."""
        lease_id = uuid.uuid4().hex
        lease = Lease(lease_id, request_id, frozenset(int(b) for b in block_ids), time.monotonic() + ttl_s)
        with self._lock:
            self._leases[lease_id] = lease
        return lease_id

    def close(self, lease_id: str) -> str:
        """Revoke a lease: "none" (no such lease), "free" (its blocks may be
        reused now) or "held" (a one-sided writer may still store into them:
        keep them out of use until released() lists this lease)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return "none"
            self._pages.pop(lease_id, None)
            until = self._writers.pop(lease_id, None)
            if until is None:
                return "free"
            self._held[lease_id] = (lease, until)
            return "held"

    def begin_writer(self, lease_id: str, request_id: str) -> tuple[str | None, float]:
        """Register a one-sided writer: (None, seconds it may write) or (why not, 0)."""
        with self._lock:
            err = self._check(lease_id, request_id, ())
            if err is not None:
                return err, 0.0
            lease = self._leases[lease_id]
            self._writers[lease_id] = lease.deadline + WRITER_GRACE_S
            return None, lease.deadline - time.monotonic()

    def end_writer(self, lease_id: str, request_id: str, handoff: Handoff | None = None) -> str | None:
        """The writer's last store has completed. None if its lease is still
        live (the KV it wrote may be used; with `handoff` it is listed as
        landed), else why not (the writer is ended either way: held blocks
        are released)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.request_id != request_id:
                return "lease belongs to another request"
            self._writers.pop(lease_id, None)
            held = self._held.pop(lease_id, None)
            if held is not None:
                self._released.append(held[0])
            err = self._check(lease_id, request_id, ())
            landed = err is None and self._land(lease_id, request_id, handoff)
        if landed:
            self._on_landed()
        return err

    def complete(self, lease_id: str, request_id: str, num_pages: int, handoff: Handoff | None) -> str | None:
        """A sender's last message: it sent `num_pages` pages messages under this
        lease. None if each was written and the lease is still live (with
        `handoff` it is listed as landed), else why not."""
        with self._lock:
            err = self._check(lease_id, request_id, ())
            written = self._pages.get(lease_id, 0)
            if err is None and written != num_pages:
                err = f"{written} of the request's {num_pages} pages messages were written"
            landed = err is None and self._land(lease_id, request_id, handoff)
        if landed:
            self._on_landed()
        return err

    def _land(self, lease_id: str, request_id: str, handoff: Handoff | None) -> bool:
        """(Under the lock.) List a completed request; True if its owner must be woken."""
        self._pages.pop(lease_id, None)
        if handoff is None:
            return False
        self._landed.append(Landed(request_id, lease_id, handoff))
        return self._on_landed is not None

    def landed(self) -> list[Landed]:
        """Requests whose KV landed since the last call. The owner checks that
        each lease is still its live lease for that request before it starts it."""
        with self._lock:
            out, self._landed = self._landed, []
        return out

    def released(self, now: float | None = None) -> list[Lease]:
        """Held leases whose blocks (Lease.block_ids) may now be reused, each
        handed back once."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for lid, (lease, until) in list(self._held.items()):
                if now >= until:
                    del self._held[lid]
                    self._released.append(lease)
            out, self._released = self._released, []
        return out

    def writer_ended(self, lease_id: str) -> bool:
        """No one-sided writer of `lease_id` may still store: none began, it
        ended, or its time ran out (its blocks are no longer held for it)."""
        with self._lock:
            return lease_id not in self._writers and lease_id not in self._held

    @property
    def num_held(self) -> int:
        """Closed leases whose blocks are still kept out of use: held, or
        released and not yet handed back."""
        with self._lock:
            return len(self._held) + len(self._released)

    def expired(self, now: float | None = None) -> list[tuple[str, str]]:
        """(lease_id, request_id) of leases past their deadline. Lists only: the
        owner decides what to free, then revokes."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [(lid, lease.request_id) for lid, lease in self._leases.items() if now >= lease.deadline]

    def why_not_live(self, lease_id: str, request_id: str) -> str | None:
        """None if `lease_id` is a live lease of `request_id`, else why not."""
        with self._lock:
            return self._check(lease_id, request_id, ())

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    @contextmanager
    def writing(self, lease_id: str, request_id: str, dst_block_ids: Iterable[int]) -> Iterator[str | None]:
        """Hold the lock for a write; yields None if it may proceed, else why not.

        The body runs under the lock whatever is yielded, so keep it to the
        write itself (no I/O that can wait on a peer).
        """
        with self._lock:
            err = self._check(lease_id, request_id, dst_block_ids)
            yield err
            if err is None:   # the body returned: its write is done (complete() counts them)
                self._pages[lease_id] = self._pages.get(lease_id, 0) + 1

    def _check(self, lease_id: str, request_id: str, dst_block_ids: Iterable[int]) -> str | None:
        lease = self._leases.get(lease_id)
        if lease is None:
            return "unknown or revoked lease"
        if time.monotonic() >= lease.deadline:
            return "lease expired"
        if lease.request_id != request_id:
            return "lease belongs to another request"
        for b in dst_block_ids:
            if b not in lease.block_ids:
                return f"block {b} is not leased to this request"
        return None
