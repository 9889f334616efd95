"""Leases: which request may write which of the decode worker's blocks, until when.

The decode engine grants a lease when it reserves blocks for an incoming
request and revokes it before it frees or reuses those blocks. Every write by
a KV receiver happens inside `LeaseTable.writing()`, which holds the table's
lock for the whole write, so once `revoke()` has returned no write into the
lease's blocks is in progress and none can start: a late or duplicated page
can never land in blocks that now belong to another request.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    """One grant: `request_id` may write `block_ids` until `deadline` (time.monotonic())."""

    lease_id: str
    request_id: str
    block_ids: frozenset[int]
    deadline: float


class LeaseTable:
    """Thread-safe table of live leases, guarded by one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}

    def grant(self, request_id: str, block_ids: Iterable[int], ttl_s: float) -> str:
        """A new lease over `block_ids` for `ttl_s` seconds; returns its unguessable id."""
        lease_id = uuid.uuid4().hex
        lease = Lease(lease_id, request_id, frozenset(int(b) for b in block_ids), time.monotonic() + ttl_s)
        with self._lock:
            self._leases[lease_id] = lease
        return lease_id

    def revoke(self, lease_id: str) -> bool:
        """Remove a lease. When this returns, no write under it runs or will run."""
        with self._lock:
            return self._leases.pop(lease_id, None) is not None

    def revoke_request(self, request_id: str) -> list[str]:
        """Revoke every lease of a request; returns the revoked lease ids."""
        with self._lock:
            ids = [lid for lid, lease in self._leases.items() if lease.request_id == request_id]
            for lid in ids:
                del self._leases[lid]
        return ids

    def expired(self, now: float | None = None) -> list[tuple[str, str]]:
        """(lease_id, request_id) of leases past their deadline. Lists only: the
        owner decides what to free, then revokes."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [(lid, lease.request_id) for lid, lease in self._leases.items() if now >= lease.deadline]

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
            yield self._check(lease_id, request_id, dst_block_ids)

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
