"""KV data plane: which backend a worker offers, and a sender or receiver by
backend name (the interface is pdd.transfer.base).

    base.py          the interface: TransferTarget, KVSender, KVReceiver, Handoff, Landed
    wire.py          frames on the data socket: pages, done, acks, one-sided control; nixl's notifications;
                     whether an endpoint is reachable from this host only
    leases.py        which blocks a sender may write, until when; what landed
    receiver.py      the decode worker's data socket (tcp pages, one-sided control), PageWriter
    staging.py       a layer's pages on their way out: destination blocks checked, gathered into sender memory
    progress.py      a sender's record of its requests: delivered so far, stalled when, failed before finish
    sender.py        the senders' base classes: the result queue, the I/O thread (IoSender, ControlSender)
    dest.py          one decode worker's data socket as a sender's I/O thread holds it (Dest)
    tcp.py           the tcp sender
    writers.py       the decode side of one-sided writes (cuda_ipc, nixl): open, begin, commit, end
    cuda_ipc.py      the cuda_ipc sender (one-sided page copies into a peer's pool)
    ipc.py           CUDA IPC: the pool's export/open, the decode side's writer bookkeeping
    nixl.py          the nixl sender (one-sided NIXL/UCX writes into a peer's pool; optional extra)
    nixl_control.py  the nixl decode side: the registered pool, its writers, write notifications
    nixl_agent.py    NIXL as pdd uses it: the optional import, the agent, descriptors, staging
    nixl_landing.py  the nixl decode side's landing region: contiguous ranges, copied into the blocks
    local.py         both engines in one process (tests only)
    connector.py     which pages of which request go out after each layer (prefill engine)
    plan.py          a worker's data plane at its start: backends, the receiver and what it sets aside, the sender
    injected.py      the data plane's faults (pdd.faults), put in once one is set
"""
from __future__ import annotations

import torch

from pdd import faults
from pdd.kv.layout import KVLayout
from pdd.transfer.base import KVReceiver, KVSender, TransferResult, TransferTarget
from pdd.transfer.leases import LeaseTable
from pdd.transfer.nixl_agent import NixlUnavailable, unavailable

__all__ = ["BACKENDS", "KVReceiver", "KVSender", "LeaseTable", "MultiSender", "TransferResult", "TransferTarget",
           "make_receiver", "make_sender", "offered_backends"]

BACKENDS = ("tcp", "local", "cuda_ipc", "nixl")


def _unknown(backend: str) -> ValueError:
    return ValueError(f"unknown KV transfer backend {backend!r} (choices: {', '.join(BACKENDS)})")


def offered_backends(configured: str, device: torch.device) -> list[str]:
    """The backends a worker process offers, best first. "auto": cuda_ipc on a
    GPU, nixl where the extra is installed, and tcp (which of them a pair uses
    is the router's choice: pdd.router.placement.transfer_choice). ValueError
    if the configured one cannot run on `device`; NixlUnavailable (one line)
    if it is nixl and the extra is absent. Never "local": it only joins two
    engines of one process."""
    if configured == "auto":
        return (["cuda_ipc"] if device.type == "cuda" else []) + (["nixl"] if unavailable() is None else []) + ["tcp"]
    if configured == "cuda_ipc" and device.type != "cuda":
        raise ValueError(f"worker.transfer_backend = 'cuda_ipc' needs a GPU; this worker runs on {device}")
    if configured == "nixl" and (why := unavailable()):
        raise NixlUnavailable(f"worker.transfer_backend = 'nixl': {why}")
    if configured not in ("tcp", "cuda_ipc", "nixl"):
        raise ValueError(f"worker.transfer_backend = {configured!r}: a worker offers auto, tcp, cuda_ipc or nixl")
    return [configured]


def make_sender(backend: str, layout: KVLayout, security=None, **kw) -> KVSender:
    """A sender for `backend`; `kw` go to its constructor (e.g. timeout_s).
    `security` (pdd.security.data_security) for the backends with sockets."""
    if backend == "tcp":
        from pdd.transfer.injected import hold_pages
        from pdd.transfer.tcp import TcpSender
        sender = TcpSender(layout, security=security, **kw)
        faults.when_armed(sender, hold_pages)   # transfer.send_delay_s
        return sender
    if backend == "local":
        from pdd.transfer.local import LocalSender
        return LocalSender(layout, **kw)
    if backend == "cuda_ipc":
        from pdd.transfer.cuda_ipc import CudaIpcSender
        return CudaIpcSender(layout, security=security, **kw)
    if backend == "nixl":
        from pdd.transfer.nixl import NixlSender
        return NixlSender(layout, security=security, **kw)
    raise _unknown(backend)


def make_receiver(backend: str, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                  addr: str | None = None, security=None, nixl_landing_bytes: int = 0) -> KVReceiver:
    """A receiver for `backend`, not yet started. tcp, cuda_ipc, nixl and auto
    get the data socket (it answers tcp and cuda_ipc; with nixl it also
    registers the pool with a NIXL agent: a worker that offers nixl among
    others asks for "nixl"; `addr` defaults to a free loopback port); local a
    fresh in-process name. `security` (pdd.security.data_security; None:
    plaintext) applies to the socket; the local backend has none.
    `nixl_landing_bytes`: nixl's landing region beside the pool (0: none;
    pdd.transfer.nixl_landing)."""
    from pdd.transfer.injected import refuse_pages

    if backend in ("tcp", "cuda_ipc", "nixl", "auto"):
        from pdd.transfer.receiver import DataSocket
        controls = []
        if backend == "nixl":
            from pdd.transfer.nixl_control import NixlControl
            controls.append(lambda *pool: NixlControl(*pool, landing_bytes=nixl_landing_bytes))
        receiver = DataSocket(kv_cache, layout, leases, addr or "tcp://127.0.0.1:0", security=security,
                              controls=controls)
    elif backend == "local":
        from pdd.transfer.local import LocalReceiver
        receiver = LocalReceiver(kv_cache, layout, leases, addr or "local://")
    else:
        raise _unknown(backend)
    faults.when_armed(receiver.writer, refuse_pages)   # transfer.reject
    return receiver


class MultiSender(KVSender):
    """One sender per backend a prefill worker offers, picked per request by the
    backend the router chose for the pair (TransferTarget.backend).

    With "auto" a worker offers cuda_ipc (on a GPU), nixl (with the extra)
    and tcp; if a decode worker's pool cannot be opened through CUDA IPC from
    here (no peer path between the GPUs, say), that request fails over to a
    local prefill and later requests to that decode worker go over tcp."""

    def __init__(self, senders: dict[str, KVSender]):
        assert senders, "no sender"
        self.senders = senders
        self._chosen: dict[str, KVSender] = {}   # request id -> its sender

    def _pick(self, target: TransferTarget) -> KVSender:
        s = self._chosen.get(target.request_id)
        if s is None:
            backend = target.backend
            if backend not in self.senders:
                raise ValueError(f"KV transfer backend {backend!r} is not offered by this worker "
                                 f"(it offers {', '.join(self.senders)})")
            ipc = self.senders.get("cuda_ipc")
            if backend == "cuda_ipc" and "tcp" in self.senders and ipc.cannot_reach(target.dst_addr):
                backend = "tcp"
            s = self._chosen[target.request_id] = self.senders[backend]
        return s

    def prepare(self, target: TransferTarget) -> None:
        self._pick(target).prepare(target)

    def send_layer(self, target, layer, src_layer, src_block_ids, block_indices) -> None:
        self._pick(target).send_layer(target, layer, src_layer, src_block_ids, block_indices)

    def step_done(self) -> None:
        for s in self.senders.values():
            s.step_done()

    def warm_up(self, kv_cache: torch.Tensor) -> None:
        for s in self.senders.values():
            s.warm_up(kv_cache)

    def finish(self, request_id: str, blocks_skipped: int = 0, handoff=None) -> None:
        # A request never prepared sent nothing: any sender reports that.
        s = self._chosen.pop(request_id, None) or next(iter(self.senders.values()))
        s.finish(request_id, blocks_skipped, handoff)

    def abort(self, request_id: str) -> None:
        s = self._chosen.pop(request_id, None)
        if s is not None:
            s.abort(request_id)

    def poll(self) -> list[TransferResult]:
        out = []
        for s in self.senders.values():
            out.extend(s.poll())
        return out

    def set_wakeup(self, fn) -> None:
        for s in self.senders.values():
            s.set_wakeup(fn)

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
