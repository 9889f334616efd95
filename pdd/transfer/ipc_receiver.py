"""The decode side of `cuda_ipc`: control messages on the data socket.

The pages themselves never pass through here: the prefill worker's kernel
stores them straight into our pool. What passes is the bookkeeping that keeps
those one-sided writes safe (pdd.transfer.leases):

    ipc_open    -> the pool's CUDA IPC export, if the sender's KV layout equals ours
                   and it names a live lease of ours (request_id, lease_id)
    ipc_begin   -> the lease is live: the sender may write for the seconds returned
    ipc_commit  -> the writer is done and the lease still live: the KV may be used
    ipc_end     -> the writer is done (aborted or failed): held blocks may be reused

Every message names the pool incarnation (`pool_id`) it was opened from: a
sender that opened the pool of a decode worker since restarted on the same
address is refused before it writes anything.

The export maps our whole KV pool into the opener's address space, so it goes
only to a peer that got through the data socket's CURVE handshake (an
authorized worker, pdd.security) and holds a live lease here: a lease id comes
only from the router, to the prefill worker it chose.
"""
from __future__ import annotations

import logging
import time
import uuid

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer.ipc_pool import PoolOpenError, export_pool
from pdd.transfer.leases import LeaseTable
from pdd.transfer.wire import WireError, decode_control, encode_reply, peek_token

log = logging.getLogger(__name__)


class IpcControl:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable):
        self.kv_cache = kv_cache
        self.layout = layout
        self.leases = leases
        self.pool_id = uuid.uuid4().hex
        self.num_writers = 0   # writers begun, for stats

    def handle(self, raw: bytes | memoryview) -> bytes:
        """One control message in, one reply out; never raises."""
        try:
            msg = decode_control(raw)
        except WireError as e:
            log.warning("kv receiver: malformed control message: %s", e)
            return encode_reply(peek_token(raw), False, f"malformed control message: {e}")
        token = msg["token"]
        try:
            return getattr(self, "_" + msg["kind"])(token, msg)
        except Exception as e:  # a bug here must answer, not kill the receiver thread
            log.exception("kv receiver: error handling %s", msg["kind"])
            return encode_reply(token, False, f"receiver error: {type(e).__name__}: {e}")

    def _ipc_open(self, token: int, msg: dict) -> bytes:
        refusal = self._no_live_lease(msg)
        if refusal:
            # A refusal of this request, not of the sender: it may open under another lease.
            log.info("kv receiver: refused an ipc_open: %s", refusal)
            return encode_reply(token, False, refusal, lease_refused=True)
        try:
            theirs = KVLayout.from_dict(msg["layout"])
        except (TypeError, ValueError) as e:
            return encode_reply(token, False, f"bad layout: {e}")
        err = theirs.mismatch(self.layout)
        if err:
            return encode_reply(token, False, err)
        try:
            pool = export_pool(self.kv_cache)
        except PoolOpenError as e:
            return encode_reply(token, False, str(e))
        return encode_reply(token, True, pool=pool, pool_id=self.pool_id)

    def _no_live_lease(self, msg: dict) -> str | None:
        """Why `msg` does not name a live lease of ours, or None (the lease table's words)."""
        rid, lease_id = msg.get("request_id"), msg.get("lease_id")
        if not isinstance(rid, str) or not isinstance(lease_id, str):
            return "ipc_open must name a live lease (request_id, lease_id)"
        lease = self.leases.get(lease_id)
        if lease is None:
            return "unknown or revoked lease"
        if time.monotonic() >= lease.deadline:
            return "lease expired"
        if lease.request_id != rid:
            return "lease belongs to another request"
        return None

    def _stale(self, token: int, msg: dict) -> bytes | None:
        if msg["pool_id"] != self.pool_id:
            return encode_reply(token, False, "stale pool: the decode worker restarted since it was opened")
        return None

    def _ipc_begin(self, token: int, msg: dict) -> bytes:
        stale = self._stale(token, msg)
        if stale:
            return stale
        err, seconds = self.leases.begin_writer(msg["lease_id"], msg["request_id"])
        if err:
            return encode_reply(token, False, err)
        self.num_writers += 1
        return encode_reply(token, True, seconds=seconds)

    def _ipc_commit(self, token: int, msg: dict) -> bytes:
        stale = self._stale(token, msg)  # (a stale sender was never let begin here)
        if stale:
            return stale
        err = self.leases.end_writer(msg["lease_id"], msg["request_id"])
        return encode_reply(token, err is None, err or "")

    def _ipc_end(self, token: int, msg: dict) -> bytes:
        self.leases.end_writer(msg["lease_id"], msg["request_id"])
        return encode_reply(token, True)
