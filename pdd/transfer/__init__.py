"""KV data plane: pick a backend by name (see pdd.transfer.base for the interface)."""
from __future__ import annotations

import torch

from pdd.kv.layout import KVLayout
from pdd.transfer.base import KVReceiver, KVSender, ReceiverStats, TransferResult, TransferTarget
from pdd.transfer.leases import LeaseTable

__all__ = ["BACKENDS", "KVReceiver", "KVSender", "LeaseTable", "ReceiverStats", "TransferResult",
           "TransferTarget", "make_receiver", "make_sender", "offered_backends"]

BACKENDS = ("tcp", "local", "cuda_ipc")


def _unknown(backend: str) -> ValueError:
    return ValueError(f"unknown KV transfer backend {backend!r} (choices: {', '.join(BACKENDS)})")


def offered_backends(configured: str, device: torch.device) -> list[str]:
    """The backends a worker offers, best first ("auto": cuda_ipc on a GPU, and tcp).
    ValueError if the configured one cannot run on `device`."""
    if configured == "auto":
        return ["cuda_ipc", "tcp"] if device.type == "cuda" else ["tcp"]
    if configured == "cuda_ipc" and device.type != "cuda":
        raise ValueError(f"worker.transfer_backend = 'cuda_ipc' needs a GPU; this worker runs on {device}")
    if configured not in BACKENDS:
        raise _unknown(configured)
    return [configured]


def make_sender(backend: str, layout: KVLayout, security=None, **kw) -> KVSender:
    """A sender for `backend`; `kw` go to its constructor (e.g. timeout_s).
    `security` (pdd.security.data_security) for the backends with sockets."""
    if backend == "tcp":
        from pdd.transfer.tcp import TcpSender
        return TcpSender(layout, security=security, **kw)
    if backend == "local":
        from pdd.transfer.local import LocalSender
        return LocalSender(layout, **kw)
    if backend == "cuda_ipc":
        from pdd.transfer.cuda_ipc import CudaIpcSender
        return CudaIpcSender(layout, security=security, **kw)
    raise _unknown(backend)


def make_receiver(backend: str, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                  addr: str | None = None, security=None) -> KVReceiver:
    """A receiver for `backend`, not yet started; `addr` defaults to a free
    loopback port (tcp) or a fresh name (local). The tcp receiver's socket also
    answers cuda_ipc senders (the pages of those never pass through it).
    `security` (pdd.security.data_security; None: plaintext) applies to its
    socket; the local backend has none to protect."""
    if backend in ("tcp", "cuda_ipc"):
        from pdd.transfer.tcp import TcpReceiver
        return TcpReceiver(kv_cache, layout, leases, addr or "tcp://127.0.0.1:0", security=security)
    if backend == "local":
        from pdd.transfer.local import LocalReceiver
        return LocalReceiver(kv_cache, layout, leases, addr or "local://")
    raise _unknown(backend)
