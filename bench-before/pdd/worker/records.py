"""The worker's record of each placement it holds, and the one path that ends one.

The router may place one request on this worker more than once (moved away
and back, or a fallback), each time under a higher epoch, while an older
placement still runs here. So the engine knows each placement by its own id,
`engine_id(request_id, epoch)`, and the worker maps it back to (request id,
epoch) for everything it reports. That id also keys the placement's KV
transfer: the prefill worker sends under it and the decode worker leases its
blocks under it, both from the (request id, epoch) of the same placement.

Everything the worker keeps about a placement is on its `WorkerPlacement`,
owned by the `PlacementTable`; state that later travels with a request
belongs on that record too, never in a map beside it. Its state says what it
holds besides the engine's request:

    decode side    reserved ──▶ landed     the KV came under its lease: it decodes
                       └──────▶ running    PrefillLocally: its prompt computes here
    prefill side   computing ──▶ shipping ──▶ done
    whole here     running                 Admit

The engine's own view (a reserved request waits in WAITING_FOR_KV) stays the
engine's; the worker reads its records, never the scheduler's queues.

`PlacementTable.release` is the one way a placement ends here, whatever its
state: each holder (the decode and prefill sides) frees what it keeps for
the placement — a live lease is revoked first, so no page can land in blocks
that are being freed; a transfer not over is dropped — then the engine drops
the request (its blocks), and the record goes.
"""
from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdd.api import InvalidRequest
from pdd.tracing import placements as spans
from pdd.tracing.placements import PlacementTrace
from pdd.transfer.base import Handoff, TransferTarget

if TYPE_CHECKING:
    from pdd.engine.engine import LLMEngine


def engine_id(request_id: str, epoch: int) -> str:
    return f"{request_id}#{epoch}"


class PlacementState(enum.Enum):
    RUNNING = "running"       # the engine runs it: whole (Admit), or a reservation prefilled here
    RESERVED = "reserved"     # decode: blocks reserved under a live lease, the KV on its way
    LANDED = "landed"         # decode: started on the KV that landed under its (now closed) lease
    COMPUTING = "computing"   # prefill: its prompt computes here for a decode worker
    SHIPPING = "shipping"     # prefill: prompt computed, first token sampled; its transfer is not over
    DONE = "done"             # prefill: its transfer is over (the result is in): nothing left to free


@dataclass
class WorkerPlacement:
    request_id: str
    epoch: int              # what replies carry: the epoch of the router's latest command about it
    engine_id: str          # the engine's (and the transfer's) id for it, from the epoch it came with
    state: PlacementState
    # Decode side: the lease its reserved blocks were granted under; live only
    # while reserved, kept after so a PrefillLocally that crossed the start is known.
    lease_id: str = ""
    # Prefill side: what its Prefill said, where its KV goes (once the KVTarget
    # came), and what its first token's sampling gave (once computed).
    backend: str = ""
    num_prompt_tokens: int = 0
    target: TransferTarget | None = None
    handoff: Handoff | None = None
    trace: PlacementTrace | None = None   # its open spans, when traced (pdd.tracing.placements)


class Holder(Protocol):
    def release(self, p: WorkerPlacement) -> None:
        """Free what is kept here for `p`, as its state says (called before the
        engine drops the placement's request)."""


class PlacementTable:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._records: dict[str, WorkerPlacement] = {}    # engine id -> record
        self._engine_ids: dict[str, set[str]] = {}        # request id -> its engine ids
        self._holders: list[Holder] = []

    def add_holder(self, holder: Holder) -> None:
        """`holder` keeps state for some placements: release() asks it to free that."""
        self._holders.append(holder)

    def add(self, request_id: str, epoch: int, state: PlacementState) -> WorkerPlacement:
        """A new placement's record; InvalidRequest if this worker holds it already."""
        eid = engine_id(request_id, epoch)
        if eid in self._records or self.find(request_id, epoch) is not None:
            raise InvalidRequest(f"epoch: request {request_id!r} epoch {epoch} is already placed on this worker")
        p = self._records[eid] = WorkerPlacement(request_id, epoch, eid, state)
        self._engine_ids.setdefault(request_id, set()).add(eid)
        return p

    @contextmanager
    def placing(self, request_id: str, epoch: int, state: PlacementState) -> Iterator[WorkerPlacement]:
        """add() for a block that hands the placement to the engine: if the
        engine refuses it (InvalidRequest), the placement is released again."""
        p = self.add(request_id, epoch, state)
        try:
            yield p
        except InvalidRequest:
            self.release(p.engine_id)
            raise

    def get(self, eid: str) -> WorkerPlacement | None:
        return self._records.get(eid)

    def state_of(self, eid: str) -> PlacementState | None:
        p = self._records.get(eid)
        return p.state if p is not None else None

    def find(self, request_id: str, epoch: int) -> WorkerPlacement | None:
        return next((self._records[eid] for eid in self._engine_ids.get(request_id, ())
                     if self._records[eid].epoch == epoch), None)

    def of_request(self, request_id: str) -> list[WorkerPlacement]:
        """Every placement of the request held here, whatever its epoch."""
        return [self._records[eid] for eid in sorted(self._engine_ids.get(request_id, ()))]

    def renew(self, p: WorkerPlacement, epoch: int) -> None:
        """The router now holds this placement under `epoch` (it re-placed a
        reservation's prefill, e.g. a local fallback): replies carry it from
        now on. InvalidRequest if another placement here has that epoch."""
        other = self.find(p.request_id, epoch)
        if other is not None and other is not p:
            raise InvalidRequest(f"epoch: request {p.request_id!r} epoch {epoch} is already placed on this worker")
        p.epoch = epoch

    def release(self, eid: str) -> WorkerPlacement | None:
        """End the placement `eid` here, whatever its state: every holder frees
        what it keeps for it, then the engine drops its request (and frees its
        blocks). Returns its record, None if none was held (the engine still
        drops any request of that id)."""
        p = self._records.pop(eid, None)
        if p is not None:
            ids = self._engine_ids[p.request_id]
            ids.discard(eid)
            if not ids:
                del self._engine_ids[p.request_id]
            for holder in self._holders:
                holder.release(p)
            spans.ended(p)
        self.engine.abort_request(eid)
        return p

    def any_in(self, state: PlacementState) -> bool:
        return any(p.state is state for p in self._records.values())

    def all(self) -> list[WorkerPlacement]:
        return [self._records[eid] for eid in sorted(self._records)]

    def __len__(self) -> int:
        return len(self._records)
