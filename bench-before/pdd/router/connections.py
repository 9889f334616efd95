"""Which control connection is each worker id's process.

A worker's connection to the router is its own per process (the DEALER's
identity is worker id + incarnation, pdd.worker.worker), while everything the
router decides is keyed by worker id. Were the identity the worker id, a
second process started under a live worker's id would take the connection
over (ZMQ_ROUTER_HANDOVER) and the first would be cut off in silence: its
messages lost, nothing ever telling it to stop, its GPU memory held for good.
With one identity per process the router tells the two apart here, at its
bus boundary:

- the process registered last under an id is the worker; the connection it
  registered from gets what the router sends to that id;
- any other connection that speaks under the id is not the worker: it is
  answered Replaced (it exits) and is not let back in under that id, not even
  by registering (no fight over the id), until the router forgets the id
  (pdd.router.membership.Membership.forget_departed);
- a connection whose id has no registered process may speak (it is told to
  register, or that its requests are nobody's).

Nothing here parses identities: a peer's identity is opaque, and the worker
id is what its messages say.
"""
from __future__ import annotations

from collections import deque

# Connections remembered as replaced, per worker id: each restart under the id
# adds one, and a replaced process tells itself to exit at its first answer.
MAX_REPLACED = 8


class Connections:
    def __init__(self) -> None:
        self.current: dict[str, str] = {}          # worker id -> connection of its registered process
        self.replaced: dict[str, deque[str]] = {}  # worker id -> connections told they were replaced

    def speaks_for(self, worker_id: str, conn: str, registering: bool) -> bool:
        """May a message from `conn` speak for `worker_id`? False: another
        process is that worker (`conn` is barred from the id from now on)."""
        if conn in self.replaced.get(worker_id, ()):
            return False
        current = self.current.get(worker_id)
        if registering or current is None or current == conn:
            return True
        self._bar(worker_id, conn)
        return False

    def registered(self, worker_id: str, conn: str) -> str | None:
        """`conn` registered as `worker_id`; the connection it replaced, if any."""
        old = self.current.get(worker_id)
        self.current[worker_id] = conn
        if old is None or old == conn:
            return None
        self._bar(worker_id, old)
        return old

    def of(self, worker_id: str) -> str | None:
        return self.current.get(worker_id)

    def forget(self, worker_id: str) -> None:
        self.current.pop(worker_id, None)
        self.replaced.pop(worker_id, None)

    def _bar(self, worker_id: str, conn: str) -> None:
        self.replaced.setdefault(worker_id, deque(maxlen=MAX_REPLACED)).append(conn)
