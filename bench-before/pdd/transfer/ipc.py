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
(pdd.transfer.receiver) passes it: the bookkeeping of one-sided writes
(pdd.transfer.writers), whose open hands out the pool's CUDA IPC export. The
pages never pass through there: the prefill worker's kernel stores them
straight into our pool.
"""
from __future__ import annotations

import functools
import os

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer.base import Handoff
from pdd.transfer.leases import LeaseTable
from pdd.transfer.wire import dtype_from_name, dtype_name, encode_reply
from pdd.transfer.writers import OneSidedControl


class PoolOpenError(RuntimeError):
    """The pool cannot be used from here (other host, GPU not visible, no peer access, ...)."""


@functools.cache
def host_id() -> str:
    """This boot of this machine, in this network namespace: two processes
    with one are on one host (CUDA IPC may connect them; the router keeps
    nixl for two). A container with a network of its own counts as a host:
    it reaches the others over a network, as another machine would."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        import socket
        return socket.gethostname()
    try:
        return f"{boot}/{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return boot


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


class IpcControl(OneSidedControl):
    family = "ipc"

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable, stats=None):
        super().__init__(layout, leases, stats)
        self.kv_cache = kv_cache

    def _export(self, token: int) -> bytes:
        try:
            pool = export_pool(self.kv_cache)
        except PoolOpenError as e:
            return encode_reply(token, False, str(e))
        return encode_reply(token, True, pool=pool, pool_id=self.pool_id)

    def _commit(self, token: int, msg: dict, peer) -> bytes:
        stale = self._stale(token, msg)  # (a stale sender was never let begin here)
        if stale:
            return stale
        err = self.leases.end_writer(msg["lease_id"], msg["request_id"], Handoff.from_dict(msg["handoff"]))
        return encode_reply(token, err is None, err or "")
