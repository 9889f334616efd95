"""The decode side of one-sided writes (cuda_ipc, nixl): the control messages
a writer sends on the data socket before, and after, it stores into our pool.

A one-sided write cannot be refused once it is made, so what keeps it safe is
the bookkeeping around it (pdd.transfer.leases):

    <b>_open    -> what the writer needs to reach our pool, if its KV layout equals
                   ours and it names a live lease of ours (request_id, lease_id)
    <b>_begin   -> the lease is live: the writer may write for the seconds
                   returned, into the lease's blocks (listed)
    <b>_commit  -> the writer is done and the lease still live: the KV may be
                   used (reported landed, with the commit's handoff)
    <b>_end     -> the writer is done (aborted or failed): held blocks may be reused

(<b> the backend's prefix: ipc, nixl). Every message after the open names the
pool incarnation (`pool_id`) it was opened from: a writer that opened the pool
of a decode worker since restarted on the same address is refused before it
writes anything. What an open hands out lets the peer write our whole pool, so
it goes only to a peer that got through the data socket's CURVE handshake (an
authorized worker, pdd.security) and holds a live lease here: a lease id comes
only from the router, to the prefill worker it chose.

A backend says what its open hands out (`_export`) and what its commit
checks; a commit may be answered later (`due`), when what it waits for came.
"""
from __future__ import annotations

import abc
import logging
import uuid

from pdd.kv.layout import KVLayout
from pdd.transfer.base import ReceiverStats
from pdd.transfer.leases import LeaseTable
from pdd.transfer.wire import WireError, control_family, decode_control, encode_reply, peek_token

log = logging.getLogger(__name__)

Peer = bytes   # the data socket's routing id of the writer's connection


class OneSidedControl(abc.ABC):
    family: str   # the control messages' prefix ("ipc", "nixl")

    def __init__(self, layout: KVLayout, leases: LeaseTable, stats: ReceiverStats | None = None):
        """stats: the data socket's, where refusals are counted."""
        self.layout = layout
        self.leases = leases
        self.stats = stats if stats is not None else ReceiverStats()
        self.pool_id = uuid.uuid4().hex
        self.num_writers = 0   # writers begun, for stats

    def handle(self, msg: dict, peer: Peer) -> bytes | None:
        """One decoded control message of our family: its reply, or None if it
        will come from due(). Never raises."""
        token = msg["token"]
        try:
            return getattr(self, "_" + msg["kind"].removeprefix(self.family + "_"))(token, msg, peer)
        except Exception as e:  # a bug here must answer, not kill the receiver thread
            log.exception("kv receiver: error handling %s", msg["kind"])
            return encode_reply(token, False, f"receiver error: {type(e).__name__}: {e}")

    def due(self) -> list[tuple[Peer, bytes]]:
        """Replies that could not be given at once, now ready."""
        return []

    def wait_ms(self) -> int | None:
        """How soon due() may have something (None: only after a message)."""
        return None

    def close(self) -> None:
        """Let go of what the backend holds (after the data socket stopped)."""

    def _open(self, token: int, msg: dict, peer: Peer) -> bytes:
        refusal = self._no_live_lease(msg)
        if refusal:
            # A refusal of this request, not of the sender: it may open under another lease.
            log.info("kv receiver: refused a %s_open: %s", self.family, refusal)
            return encode_reply(token, False, refusal, lease_refused=True)
        try:
            theirs = KVLayout.from_dict(msg["layout"])
        except (TypeError, ValueError) as e:
            return encode_reply(token, False, f"bad layout: {e}")
        err = theirs.mismatch(self.layout)
        if err:
            return encode_reply(token, False, self._refuse(err))
        return self._export(token)

    @abc.abstractmethod
    def _export(self, token: int) -> bytes:
        """The reply to an accepted open: what reaches our pool, with our pool_id."""

    def _refuse(self, err: str) -> str:
        """Count a refusal of what a writer sent (its reply says why)."""
        log.debug("kv receive refused: %s", err)
        return self.stats.refused(err)

    def _no_live_lease(self, msg: dict) -> str | None:
        """Why `msg` does not name a live lease of ours, or None (the lease table's words)."""
        rid, lease_id = msg.get("request_id"), msg.get("lease_id")
        if not isinstance(rid, str) or not isinstance(lease_id, str):
            return f"{self.family}_open must name a live lease (request_id, lease_id)"
        return self.leases.why_not_live(lease_id, rid)

    def _stale(self, token: int, msg: dict) -> bytes | None:
        if msg["pool_id"] != self.pool_id:
            return encode_reply(token, False, "stale pool: the decode worker restarted since it was opened")
        return None

    def _begin(self, token: int, msg: dict, peer: Peer) -> bytes:
        stale = self._stale(token, msg)
        if stale:
            return stale
        lease = self.leases.get(msg["lease_id"])
        err, seconds = self.leases.begin_writer(msg["lease_id"], msg["request_id"])
        if err:
            return encode_reply(token, False, err)
        self.num_writers += 1
        return encode_reply(token, True, seconds=seconds, blocks=sorted(lease.block_ids),
                            **self._granted(msg, lease, seconds))

    def _granted(self, msg: dict, lease, seconds: float) -> dict:
        """What else an accepted begin's reply carries (the writer is registered)."""
        return {}

    def _end(self, token: int, msg: dict, peer: Peer) -> bytes:
        self.leases.end_writer(msg["lease_id"], msg["request_id"])
        return encode_reply(token, True)


def answer_control(raw: bytes | memoryview, controls: dict[str, OneSidedControl], peer: Peer) -> bytes | None:
    """The reply to one control frame (None: its backend answers later); never raises."""
    try:
        msg = decode_control(raw)
    except WireError as e:
        log.warning("kv receiver: malformed control message: %s", e)
        return encode_reply(peek_token(raw), False, f"malformed control message: {e}")
    control = controls.get(control_family(msg))
    if control is None:
        return encode_reply(msg["token"], False, f"this decode worker does not serve {control_family(msg)} "
                                                 "writes (see worker.transfer_backend)")
    return control.handle(msg, peer)
