"""KV data plane: pick a backend by name (see pdd.transfer.base for the interface)."""
from __future__ import annotations

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer.base import KVReceiver, KVSender, ReceiverStats, TransferResult, TransferTarget
from pdd.transfer.leases import LeaseTable

__all__ = ["BACKENDS", "KVReceiver", "KVSender", "LeaseTable", "ReceiverStats", "TransferResult",
           "TransferTarget", "make_receiver", "make_sender"]

BACKENDS = ("tcp", "local", "cuda_ipc")


def _unknown(backend: str) -> ValueError:
    return ValueError(f"unknown KV transfer backend {backend!r} (choices: {', '.join(BACKENDS)})")


def _cuda_ipc_missing() -> NotImplementedError:
    # >>> cuda_ipc goes here: same-host peer writes into the decode worker's
    # exported pool (docs/design.md, "Data plane"). Until it exists, pick tcp.
    return NotImplementedError("KV transfer backend 'cuda_ipc' is not implemented yet; use 'tcp'")


def make_sender(backend: str, layout: KVLayout, **kw) -> KVSender:
    """A sender for `backend`; `kw` go to its constructor (e.g. timeout_s)."""
    if backend == "tcp":
        from pdd.transfer.tcp import TcpSender
        return TcpSender(layout, **kw)
    if backend == "local":
        from pdd.transfer.local import LocalSender
        return LocalSender(layout, **kw)
    if backend == "cuda_ipc":
        raise _cuda_ipc_missing()
    raise _unknown(backend)


def make_receiver(backend: str, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                  addr: str | None = None) -> KVReceiver:
    """A receiver for `backend`, not yet started; `addr` defaults to a free
    loopback port (tcp) or a fresh name (local)."""
    if backend == "tcp":
        from pdd.transfer.tcp import TcpReceiver
        return TcpReceiver(kv_cache, layout, leases, addr or "tcp://127.0.0.1:0")
    if backend == "local":
        from pdd.transfer.local import LocalReceiver
        return LocalReceiver(kv_cache, layout, leases, addr or "local://")
    if backend == "cuda_ipc":
        raise _cuda_ipc_missing()
    raise _unknown(backend)
