"""The decode side of the `nixl` backend: the pool registered with this
worker's NIXL agent, the control messages of its writers, and the write
notifications that say what landed. The sender is pdd.transfer.nixl.

The pool is registered once, when the data socket is made; an open
(pdd.transfer.writers) hands a writer the agent's metadata and where the pool
is. The agent is new in every process (its name is the pool incarnation,
`pool_id`), so a writer that still holds our previous life's metadata is
refused at its begin; we never load a writer's metadata, so a writer that
restarts leaves nothing stale here.

A write lands without us taking part; NIXL then delivers the notification it
carried (pdd.transfer.wire, "nixl_write"), which the data socket's thread
drains. A notification is checked like a tcp pages message: our pool
incarnation, our KV layout, a live lease of that request, blocks of that
lease. A commit names how many writes the request made: it is accepted only
once each of them was notified and passed, and the lease is still live. A
notification may arrive after the commit (it travels beside the data socket,
not on it), so the commit's answer waits for it, up to _NOTIF_WAIT_S.

With a landing arena (pdd.transfer.nixl_landing; `landing_bytes` > 0, also
registered), a begin that asks for it is granted a range of the arena where
there is room: the writer then writes the request's pages there, two
descriptors per layer. Every notification of that lease must name that range
(and every one of a lease without one, none): a write aimed elsewhere fails
the commit. An accepted commit copies the range's written pages into the
lease's blocks, and only once that copy is done is the KV reported landed.
The range comes back when the lease's blocks would: its writer ended (commit
answered, end), or the lease's deadline plus WRITER_GRACE_S passed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer.base import Handoff, ReceiverStats
from pdd.transfer import leases as lease_rules
from pdd.transfer.leases import LeaseTable
from pdd.transfer.nixl_agent import Agent, PoolRegion
from pdd.transfer.nixl_landing import LandingArena
from pdd.transfer.wire import WireError, decode_write_notif, encode_reply, layout_digest
from pdd.transfer.writers import OneSidedControl, Peer

log = logging.getLogger(__name__)

# How long a commit waits for the notifications of writes its sender saw
# complete (they are on their way: NIXL sends one once its write landed).
_NOTIF_WAIT_S = 5.0
# How often notifications are drained (which is also when UCX progresses
# here: the agent runs no progress thread) while a writer is begun or a commit
# waits for them.
_POLL_MS = 1


@dataclass
class _Tally:
    """The writes notified under one lease."""

    request_id: str
    seqs: set[int] = field(default_factory=set)
    error: str = ""
    # With a landing range: each block's place there (the writer's choice,
    # fixed at its first write), and the blocks written in each layer.
    places: dict[int, int] = field(default_factory=dict)
    owners: dict[int, int] = field(default_factory=dict)    # place -> block
    written: dict[int, set[int]] = field(default_factory=dict)


@dataclass
class _Range:
    """A lease's range of the landing arena."""

    offset: int
    num_blocks: int     # the lease's: a place for each
    until: float        # time.monotonic() after which its writer surely stopped


@dataclass
class _Commit:
    peer: Peer
    token: int
    msg: dict
    until: float   # time.monotonic()


class NixlControl(OneSidedControl):
    family = "nixl"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable, stats: ReceiverStats,
                 landing_bytes: int = 0):
        """landing_bytes: of the landing arena (0: none, every write goes into the blocks)."""
        super().__init__(layout, leases, stats)
        if not kv_cache.is_contiguous():
            raise ValueError("the nixl backend registers the KV pool as one region: it must be contiguous")
        self.landing = LandingArena(landing_bytes, kv_cache) if landing_bytes else None
        if self.landing is not None and self.landing.range_bytes(1) > landing_bytes:
            raise ValueError(f"worker.nixl_landing_bytes = {landing_bytes}: the landing region holds no block "
                             f"({self.landing.range_bytes(1)} bytes a block)")
        self.agent = Agent("decode")
        self.agent.register(kv_cache)
        if self.landing is not None:
            self.agent.register(self.landing.buf)
        self.region = PoolRegion.of(kv_cache)
        self.pool_id = self.agent.name
        self._metadata = self.agent.metadata()
        self._layout_id = layout_digest(layout.to_dict())
        self._num_layers = kv_cache.shape[0]
        self._tallies: dict[str, _Tally] = {}   # lease id ->
        self._commits: list[_Commit] = []       # waiting for notifications
        self._writing: set[str] = set()         # lease ids of writers begun and not yet settled or ended
        self._ranges: dict[str, _Range] = {}    # lease id -> its landing range
        self.landed_requests = 0                # commits accepted through a landing range

    def _export(self, token: int) -> bytes:
        return encode_reply(token, True, metadata=self._metadata, pool=self.region.to_dict(), pool_id=self.pool_id,
                            landing=self.landing.region() if self.landing is not None else None)

    # -- notifications -------------------------------------------------------

    def _drain(self) -> None:
        for raw in self.agent.notifs():
            try:
                note = decode_write_notif(raw)
            except WireError as e:
                self._refuse(f"malformed write notification: {e}")
                continue
            if note["pool_id"] != self.pool_id:
                self._refuse("a write notification for another pool incarnation")
                continue
            lease_id = note["lease_id"]
            err = self.leases.why_not_live(lease_id, note["request_id"])
            if err is not None:
                self._refuse(err)   # its commit is refused on the same grounds
                continue
            tally = self._tallies.setdefault(lease_id, _Tally(note["request_id"]))
            err = self._check(note, lease_id)
            if err is not None:
                tally.error = tally.error or self._refuse(err)
                continue
            tally.seqs.add(note["seq"])
            if note["landing"] >= 0:
                for b, place in zip(note["dst_block_ids"], note["places"]):
                    tally.places[b], tally.owners[place] = place, b
                tally.written.setdefault(note["layer"], set()).update(note["dst_block_ids"])
            self.stats.messages += 1
            self.stats.bytes += note["nbytes"]

    def _check(self, note: dict, lease_id: str) -> str | None:
        if note["layout_id"] != self._layout_id:
            return "the write was made under another KV layout than this pool's"
        if note["layer"] >= self._num_layers:
            return f"layer {note['layer']} out of range (pool has {self._num_layers})"
        lease = self.leases.get(lease_id)
        for b in note["dst_block_ids"]:
            if lease is None or b not in lease.block_ids:
                return f"block {b} is not leased to this request"
        rng = self._ranges.get(lease_id)
        if note["landing"] != (rng.offset if rng is not None else -1):
            return ("the write landed outside the request's landing range" if rng is not None else
                    "a write into the landing region for a request granted no range")
        tally = self._tallies[lease_id]
        for b, place in zip(note["dst_block_ids"], note["places"] if rng is not None else ()):
            if place >= rng.num_blocks:
                return f"place {place} outside the landing range of {rng.num_blocks} blocks"
            if tally.places.get(b, place) != place or tally.owners.get(place, b) != b:
                return f"block {b} landed at place {place}, which another write gave another block"
        return None

    def _begin(self, token: int, msg: dict, peer: Peer) -> bytes:
        begun = self.num_writers
        reply = super()._begin(token, msg, peer)
        if self.num_writers > begun:
            self._writing.add(msg["lease_id"])
        return reply

    def _granted(self, msg: dict, lease, seconds: float) -> dict:
        """A landing range, if the writer asked for one and the arena has room
        (a repeated begin keeps the lease's range)."""
        if msg.get("landing") is not True or self.landing is None:
            return {}
        rng = self._ranges.get(lease.lease_id)
        if rng is None:
            n = len(lease.block_ids)
            offset = self.landing.take(n) if n else None
            if offset is None:
                return {}
            rng = self._ranges[lease.lease_id] = _Range(offset, n, 0.0)
        # Held as long as the lease table holds the blocks for this writer.
        rng.until = time.monotonic() + seconds + lease_rules.WRITER_GRACE_S
        return {"landing": {"offset": rng.offset, "nbytes": self.landing.range_bytes(rng.num_blocks)}}

    def _free_ranges(self, now: float | None = None) -> None:
        """Ranges whose writer surely stopped go back to the arena."""
        now = time.monotonic() if now is None else now
        for lease_id, rng in list(self._ranges.items()):
            if now >= rng.until or self.leases.writer_ended(lease_id):
                del self._ranges[lease_id]
                self.landing.give_back(rng.offset, rng.num_blocks)

    # -- commits -------------------------------------------------------------

    def _commit(self, token: int, msg: dict, peer: Peer) -> bytes | None:
        stale = self._stale(token, msg)
        if stale:
            return stale
        self._drain()
        if self._complete(msg) or self.leases.why_not_live(msg["lease_id"], msg["request_id"]):
            return self._settle(token, msg)
        self._commits.append(_Commit(peer, token, msg, time.monotonic() + _NOTIF_WAIT_S))
        return None

    def _complete(self, msg: dict) -> bool:
        tally = self._tallies.get(msg["lease_id"])
        seen = tally.seqs if tally is not None else set()
        return bool(tally and tally.error) or len(seen) >= msg["writes"]

    def _settle(self, token: int, msg: dict) -> bytes:
        """Answer a commit: the writer is done either way (held blocks are released)."""
        lease_id, rid, writes = msg["lease_id"], msg["request_id"], msg["writes"]
        tally = self._tallies.pop(lease_id, None) or _Tally(rid)
        self._writing.discard(lease_id)
        err = self.leases.why_not_live(lease_id, rid) or tally.error or None
        if err is None and tally.seqs != set(range(writes)):
            err = f"{len(tally.seqs & set(range(writes)))} of the request's {writes} writes were notified"
        rng = self._ranges.get(lease_id)
        if err is None and rng is not None:
            # Before the writer ends: until then the blocks stay out of use even
            # if the lease is revoked meanwhile (they are held for the writer).
            err = self._copy_out(rng, tally)
        if err is None:
            err = self.leases.end_writer(lease_id, rid, Handoff.from_dict(msg["handoff"]))
            if err is None and rng is not None:
                self.landed_requests += 1
        else:
            self.leases.end_writer(lease_id, rid)
            self._refuse(err)
        self._free_ranges()
        return encode_reply(token, err is None, err or "")

    def _copy_out(self, rng: _Range, tally: _Tally) -> str | None:
        try:
            self.landing.copy_out(rng.offset, rng.num_blocks, tally.places, tally.written)
        except Exception as e:  # a failed copy fails the commit; the receiver keeps serving
            log.exception("kv receiver: copying a landing range into the pool")
            return f"copying the landing range into the blocks failed: {type(e).__name__}: {e}"
        return None

    def _end(self, token: int, msg: dict, peer: Peer) -> bytes:
        self._tallies.pop(msg["lease_id"], None)
        self._writing.discard(msg["lease_id"])
        reply = super()._end(token, msg, peer)
        self._free_ranges()
        return reply

    def due(self) -> list[tuple[Peer, bytes]]:
        self._drain()
        out, waiting, now = [], [], time.monotonic()
        for c in self._commits:
            if self._complete(c.msg) or now >= c.until:
                out.append((c.peer, self._settle(c.token, c.msg)))
            else:
                waiting.append(c)
        self._commits = waiting
        self._forget_dead_leases()
        if self._ranges:
            self._free_ranges(now)
        return out

    def _forget_dead_leases(self) -> None:
        """Tallies of leases that ended without a commit (aborted, expired, the
        writer died): nothing will ask for them."""
        asked = {c.msg["lease_id"] for c in self._commits}
        for lease_id in [lid for lid in self._tallies if lid not in asked and self.leases.get(lid) is None]:
            del self._tallies[lease_id]
        self._writing = {lid for lid in self._writing if lid in asked or self.leases.get(lid) is not None}

    def wait_ms(self) -> int | None:
        return _POLL_MS if self._commits or self._writing else None

    def warm_up(self) -> None:
        """The landing copy's kernel compiled now (KVReceiver.warm_up)."""
        if self.landing is not None:
            self.landing.warm_up()

    @property
    def ranges_held(self) -> int:
        return len(self._ranges)

    def close(self) -> None:
        self.agent.close()
