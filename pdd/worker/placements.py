"""Which engine request is which placement of a router request.

The router may place one request on this worker more than once (moved away
and back, or a fallback), each time under a higher epoch, while an older
placement still runs here. So the engine knows each placement by its own id,
`engine_id(request_id, epoch)`, and the worker maps it back to (request id,
epoch) for everything it reports. That id also keys the placement's KV
transfer: the prefill worker sends under it and the decode worker leases its
blocks under it, both from the (request id, epoch) of the same placement.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdd.api import InvalidRequest


def engine_id(request_id: str, epoch: int) -> str:
    return f"{request_id}#{epoch}"


@dataclass
class Placement:
    request_id: str
    epoch: int   # what replies carry: the epoch of the router's latest command about it


class PlacementTable:
    def __init__(self):
        self._placements: dict[str, Placement] = {}     # engine id -> placement
        self._engine_ids: dict[str, set[str]] = {}      # request id -> its engine ids

    def add(self, request_id: str, epoch: int) -> str:
        """A new placement's engine id; InvalidRequest if this worker holds it already."""
        eid = engine_id(request_id, epoch)
        if eid in self._placements or self.find(request_id, epoch) is not None:
            raise InvalidRequest(f"epoch: request {request_id!r} epoch {epoch} is already placed on this worker")
        self._placements[eid] = Placement(request_id, epoch)
        self._engine_ids.setdefault(request_id, set()).add(eid)
        return eid

    @contextmanager
    def placing(self, request_id: str, epoch: int) -> Iterator[str]:
        """add() for a block that hands the placement to the engine: if the
        engine refuses it (InvalidRequest), the placement is removed again."""
        eid = self.add(request_id, epoch)
        try:
            yield eid
        except InvalidRequest:
            self.remove(eid)
            raise

    def get(self, eid: str) -> Placement | None:
        return self._placements.get(eid)

    def find(self, request_id: str, epoch: int) -> str | None:
        return next((eid for eid in self._engine_ids.get(request_id, ())
                     if self._placements[eid].epoch == epoch), None)

    def of_request(self, request_id: str) -> list[str]:
        """Every placement of the request held here, whatever its epoch."""
        return sorted(self._engine_ids.get(request_id, ()))

    def renew(self, eid: str, epoch: int) -> None:
        """The router now holds this placement under `epoch` (it re-placed a
        reservation's prefill, e.g. a local fallback): replies carry it from
        now on. InvalidRequest if another placement here has that epoch."""
        p = self._placements[eid]
        if self.find(p.request_id, epoch) not in (None, eid):
            raise InvalidRequest(f"epoch: request {p.request_id!r} epoch {epoch} is already placed on this worker")
        p.epoch = epoch

    def remove(self, eid: str) -> Placement | None:
        p = self._placements.pop(eid, None)
        if p is not None:
            ids = self._engine_ids[p.request_id]
            ids.discard(eid)
            if not ids:
                del self._engine_ids[p.request_id]
        return p

    def all(self) -> list[str]:
        return sorted(self._placements)

    def __len__(self) -> int:
        return len(self._placements)
