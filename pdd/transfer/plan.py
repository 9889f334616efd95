"""What a worker's data plane takes, decided at its start, so that the worker
names no backend: which backends it offers, which receiver serves them, the
memory that receiver sets aside beside the KV pool and why, the sender of a
prefill worker, and the receiver's counts for the heartbeat.

Two moments, because the engine sizes its KV pool before the data plane
exists: `set_aside` while the pool is sized (what to leave out of the pool's
memory budget), `receiver_plan` once the engine runs (the backends, checked
against its device).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from pdd import faults
from pdd.config import WorkerConfig
from pdd.kv.layout import KVLayout
from pdd.transfer import MultiSender, make_receiver, make_sender, offered_backends
from pdd.transfer.base import KVReceiver
from pdd.transfer.injected import inject_transfer_faults
from pdd.transfer.leases import LeaseTable
from pdd.transfer.nixl_agent import unavailable as nixl_unavailable
from pdd.transfer.nixl_landing import landing_size


class SetAside(NamedTuple):
    nbytes: int   # memory beside the KV pool on its device (0: none)
    note: str     # for the worker's start log line ("": nothing to say)


class ReceiverPlan(NamedTuple):
    backends: list[str]       # offered, best first (pdd.transfer.offered_backends)
    receiver: str             # the backend the receiver is made for (make_receiver)
    beside_pool_bytes: int    # what set_aside reserved, which the receiver takes


def set_aside(wc: WorkerConfig, bytes_per_token: int, max_tokens: int) -> SetAside:
    """The memory a worker of `wc` keeps beside its KV pool for its receiver:
    nixl's landing region (pdd.transfer.nixl_landing.landing_size) where a
    worker that may be sent KV offers nixl."""
    landing = landing_size(wc, nixl_unavailable() is None, bytes_per_token, max_tokens)
    if not landing.why:
        return SetAside(landing.nbytes, "")
    size = f"of {landing.nbytes / 2**20:.1f} MiB" if landing.nbytes else "none"
    return SetAside(landing.nbytes, f"nixl landing region {size} ({landing.why})")


def receiver_plan(wc: WorkerConfig, device: torch.device, beside_pool_bytes: int = 0) -> ReceiverPlan:
    """ValueError, or NixlUnavailable, as offered_backends: the configured
    backend cannot run here. One socket takes tcp pages and the one-sided
    writers' control messages (cuda_ipc; nixl, its pool registered, where offered)."""
    backends = offered_backends(wc.transfer_backend, device)
    return ReceiverPlan(backends, "nixl" if "nixl" in backends else wc.transfer_backend, beside_pool_bytes)


def open_receiver(plan: ReceiverPlan, kv_cache: torch.Tensor, layout: KVLayout, leases: LeaseTable,
                  addr: str, security=None) -> KVReceiver:
    """The plan's receiver, started."""
    receiver = make_receiver(plan.receiver, kv_cache, layout, leases, addr, security=security,
                             nixl_landing_bytes=plan.beside_pool_bytes)
    receiver.start()
    return receiver


def open_sender(backends: list[str], wc: WorkerConfig, layout: KVLayout, device: torch.device,
                security=None) -> MultiSender:
    """A prefill worker's sender: one per backend it offers, each as wc sets
    it, with the transfer faults in it once one is set (pdd.transfer.injected)."""
    ipc = {"device": device, "layer_group": wc.ipc_layers_per_copy}
    sender = MultiSender({b: make_sender(b, layout, security=security, timeout_s=wc.transfer_timeout_s,
                                         **(ipc if b == "cuda_ipc" else {}))
                          for b in backends})
    faults.when_armed(sender, inject_transfer_faults)
    return sender


def receiver_counts(receiver: KVReceiver, leases: LeaseTable) -> dict:
    """A data socket's counts and its leases', as a worker's heartbeat reports them."""
    st, nixl = receiver.stats, receiver.nixl
    return {"received_messages": st.messages, "received_bytes": st.bytes, "rejected": st.rejected,
            "last_rejection": st.last_error, "leases": len(leases), "held_leases": leases.num_held,
            "ipc_writers": receiver.ipc.num_writers,
            "nixl_writers": nixl.num_writers if nixl is not None else 0,
            # nixl's landing region (bytes; 0: none), requests copied in from it, and its ranges out now.
            "nixl_landing_bytes": nixl.landing.nbytes if nixl is not None and nixl.landing is not None else 0,
            "nixl_landed": nixl.landed_requests if nixl is not None else 0,
            "nixl_landing_ranges": nixl.ranges_held if nixl is not None else 0}
