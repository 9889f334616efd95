"""What the cuda_ipc sender (pdd.transfer.cuda_ipc) keeps: per request, its
transfer's state; per decode worker, its socket (queued frames, replies, a
monitor that sees the connection drop) and opened pool; per step, the
blocks it copies; and the view of several layers of a pool one launch copies."""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from pdd.transfer.base import TransferTarget
from pdd.transfer.common import Progress
from pdd.transfer.wire import WireError, decode_reply

log = logging.getLogger("pdd.transfer.cuda_ipc")


@dataclass
class IpcWrite:
    """One request's transfer. Fields the engine thread reads are set under the sender's lock."""

    target: TransferTarget
    progress: Progress
    granted: threading.Event = field(default_factory=threading.Event)  # begin answered (or failed)
    pool: torch.Tensor | None = None    # the decode worker's pool, opened here
    pool_id: str = ""
    deadline: float = 0.0               # perf_counter(): no copy launched after it
    error: str = ""                     # why it failed; no more copies
    closed: bool = False                # no more copies (finishing or failed)
    begun: bool = False                 # the decode worker counts us as a writer
    copies: int = 0                     # kernels launched
    finished: bool = False              # finish() was called
    aborted: bool = False               # abort() was called: report nothing
    blocks_skipped: int = 0
    ids: "StepIds | None" = None


def run_of_layers(layer_view: torch.Tensor, index: int, first: int) -> torch.Tensor:
    """Layers first..index of the pool whose layer `index` is `layer_view`: the
    pool is one contiguous [layers, 2, blocks, ...] allocation, so neighbouring
    layers sit one layer's size apart in the same storage."""
    n = layer_view.numel()
    return layer_view.as_strided((index - first + 1, *layer_view.shape), (n, *layer_view.stride()),
                                 layer_view.storage_offset() - (index - first) * n)


@dataclass
class StepIds:
    """The blocks one engine step sends for a request, as the engine passed
    them (compared by identity) and as device index tensors."""

    src: list[int]
    indices: list[int]
    dst: list[int]
    src_t: torch.Tensor
    dst_t: torch.Tensor
    nbytes: int          # per layer
    counted: bool = False  # its blocks are in the request's progress


@dataclass
class IpcDest:
    """One decode worker's data socket and its pool, as far as we know it."""

    sock: zmq.Socket
    # Tells us when the connection drops: a decode worker that died must not
    # keep its GPU memory allocated through our mapping of its pool.
    monitor: zmq.Socket | None = None
    pending: deque = field(default_factory=deque)   # frames zmq could not take yet
    pool: torch.Tensor | None = None
    pool_id: str = ""
    opening: bool = False
    opening_for: str = ""          # the request whose lease the pending ipc_open names
    waiting: list[str] = field(default_factory=list)  # requests to begin once the pool is open
    error: str = ""
    failed_at: float = 0.0

    def saw_disconnect(self) -> bool:
        """Drain the monitor's events; True if the connection dropped."""
        from zmq.utils.monitor import recv_monitor_message

        dropped = False
        while True:
            try:
                event = recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return dropped
            dropped |= event["event"] == zmq.EVENT_DISCONNECTED

    def flush(self, poller: zmq.Poller) -> None:
        """Hand zmq what it takes now; poll for writability while frames wait."""
        while self.pending:
            try:
                self.sock.send(self.pending[0], flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self.pending.popleft()
        poller.register(self.sock, zmq.POLLIN | (zmq.POLLOUT if self.pending else 0))

    def replies(self):
        """The decoded replies waiting on the socket (malformed ones logged, dropped)."""
        while True:
            try:
                frame = self.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                yield decode_reply(frame)
            except WireError as e:
                log.warning("kv ipc sender: dropped a malformed reply: %s", e)

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)
