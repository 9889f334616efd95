"""CUDA IPC between a decode worker and the prefill workers of its host: the
KV pool's export and opening, and the decode side's bookkeeping of one-sided
writes (IpcControl). The sender is pdd.transfer.cuda_ipc.

The export is torch's own CUDA IPC description of the pool tensor
(torch.multiprocessing.reductions.reduce_tensor) turned into plain msgpack
fields, plus what the opener needs to decide whether it can use it: the host
(boot id) and the GPU's UUID, which names the same device in every process
whatever CUDA_VISIBLE_DEVICES says.

The opener maps the memory in its *own* device's context (CUDA's lazy peer
access): a peer pool opened the default way lives in the peer device's
context, where a Triton kernel on the local GPU is refused or faults
(docs/design.md, "Data plane"). The opened tensor therefore says it is on the
local device while its memory is on the peer GPU: touch it only through the
page-copy kernel's stores.

IpcControl answers the control messages the data socket
(pdd.transfer.receiver) passes it. The pages never pass through there: the
prefill worker's kernel stores them straight into our pool. What passes is
the bookkeeping that keeps those one-sided writes safe (pdd.transfer.leases):

    ipc_open    -> the pool's CUDA IPC export, if the sender's KV layout equals ours
                   and it names a live lease of ours (request_id, lease_id)
    ipc_begin   -> the lease is live: the sender may write for the seconds returned
    ipc_commit  -> the writer is done and the lease still live: the KV may be used
                   (the request is reported landed, with the commit's handoff)
    ipc_end     -> the writer is done (aborted or failed): held blocks may be reused

Every message names the pool incarnation (`pool_id`) it was opened from: a
sender that opened the pool of a decode worker since restarted on the same
address is refused before it writes anything. The export maps our whole KV
pool into the opener's address space, so it goes only to a peer that got
through the data socket's CURVE handshake (an authorized worker,
pdd.security) and holds a live lease here: a lease id comes only from the
router, to the prefill worker it chose.
"""
from __future__ import annotations

import functools
import logging
import uuid

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer.base import Handoff
from pdd.transfer.leases import LeaseTable
from pdd.transfer.wire import WireError, decode_control, dtype_from_name, dtype_name, encode_reply, peek_token

log = logging.getLogger(__name__)


class PoolOpenError(RuntimeError):
    """The pool cannot be used from here (other host, GPU not visible, no peer access, ...)."""


@functools.cache
def host_id() -> str:
    """This boot of this machine: equal for two processes iff CUDA IPC can connect them."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket
        return socket.gethostname()


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_pool(kv_cache: torch.Tensor) -> dict:
    """msgpack-able fields from which open_pool() rebuilds `kv_cache` in another process."""
    from torch.multiprocessing.reductions import reduce_tensor
    if not kv_cache.is_cuda:
        raise PoolOpenError(f"the KV pool is on {kv_cache.device}, not a GPU: it cannot be shared through CUDA IPC")
    with torch.cuda.device(kv_cache.device):
        _, args = reduce_tensor(kv_cache)
    (_, size, stride, offset, _, dtype, _, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    return {
        "host_id": host_id(), "device_uuid": device_uuid(kv_cache.device),
        "shape": list(size), "stride": list(stride), "offset": int(offset), "dtype": dtype_name(dtype),
        "handle": bytes(handle), "size_bytes": int(size_bytes), "offset_bytes": int(offset_bytes),
        "ref_handle": bytes(ref_handle) if ref_handle is not None else None, "ref_offset": int(ref_offset),
        "event_handle": bytes(event_handle) if event_handle is not None else None,
        "event_sync": bool(event_sync),
    }


def local_index_of(uuid: str) -> int | None:
    """The index of the GPU with this UUID among the devices this process sees."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return i
    return None


def open_pool(desc: dict, device: torch.device) -> torch.Tensor:
    """Map an exported pool into `device`'s context; PoolOpenError says why it cannot be."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    if desc.get("host_id") != host_id():
        raise PoolOpenError("the decode worker runs on another host (or another boot of it)")
    peer = local_index_of(desc["device_uuid"])
    if peer is None:
        raise PoolOpenError(f"the decode worker's GPU {desc['device_uuid']} is not visible to this process "
                            "(CUDA_VISIBLE_DEVICES must list it)")
    local = device.index if device.index is not None else torch.cuda.current_device()
    if peer != local and not torch.cuda.can_device_access_peer(local, peer):
        raise PoolOpenError(f"cuda:{local} cannot access cuda:{peer} (no peer path between the two GPUs)")
    try:
        with torch.cuda.device(local):
            return rebuild_cuda_tensor(
                torch.Tensor, torch.Size(desc["shape"]), tuple(desc["stride"]), desc["offset"],
                torch.UntypedStorage, dtype_from_name(desc["dtype"]), local, desc["handle"],
                desc["size_bytes"], desc["offset_bytes"], False, desc["ref_handle"], desc["ref_offset"],
                desc["event_handle"], desc["event_sync"])
    except Exception as e:  # the driver's refusal, whatever its type
        raise PoolOpenError(f"opening the CUDA IPC handle failed: {type(e).__name__}: {e}") from e


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
        return self.leases.why_not_live(lease_id, rid)

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
        err = self.leases.end_writer(msg["lease_id"], msg["request_id"], Handoff.from_dict(msg["handoff"]))
        return encode_reply(token, err is None, err or "")

    def _ipc_end(self, token: int, msg: dict) -> bytes:
        self.leases.end_writer(msg["lease_id"], msg["request_id"])
        return encode_reply(token, True)
