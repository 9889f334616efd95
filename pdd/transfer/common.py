"""What every sender backend shares: argument checks, page staging, per-request
progress, and the result queue behind poll()."""
from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from pdd import ops
from pdd.kv.layout import KVLayout
from pdd.transfer.accept import pool_mismatch
from pdd.transfer.base import KVSender, TransferResult, TransferTarget


def dst_blocks_for(layout: KVLayout, target: TransferTarget, src_layer: torch.Tensor,
                   src_block_ids: list[int], block_indices: list[int]) -> list[int]:
    """The destination block of each source block; ValueError on a caller's mistake."""
    err = pool_mismatch(src_layer, layout, "source layer")
    if err:
        raise ValueError(err)
    if len(src_block_ids) != len(block_indices):
        raise ValueError(f"{len(src_block_ids)} source blocks but {len(block_indices)} block indices")
    n = len(target.dst_block_ids)
    bad = [i for i in block_indices if not 0 <= i < n]
    if bad:
        raise ValueError(f"block index {bad[0]} outside the target's {n} destination blocks")
    return [int(target.dst_block_ids[i]) for i in block_indices]


def index_tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids as a long tensor on `device`, without a host sync: a plain
    torch.tensor(..., device="cuda") copies from pageable memory and waits for
    the whole stream, which would stall the engine behind its own forward pass."""
    if device.type != "cuda":
        return torch.tensor(ids, dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


@dataclass
class Staged:
    """One layer's pages in memory the sender owns, plus how to know they are ready."""

    pages: torch.Tensor
    ready: "torch.cuda.Event | None" = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def stage_pages(src_layer: torch.Tensor, src_block_ids: list[int], to_host: bool) -> Staged:
    """Gather pages into a fresh contiguous tensor (on the host if `to_host`).

    On CUDA the gather and the device->host copy are queued on the current
    stream, so the engine's later writes to those blocks are ordered after
    them; the copy lands in pinned memory and an event says when it is done.
    """
    pages = ops.gather_blocks(src_layer, index_tensor(src_block_ids, src_layer.device))
    if not to_host or not pages.is_cuda:
        return Staged(pages.contiguous())
    host = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
    host.copy_(pages, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return Staged(host, event)


@dataclass
class Progress:
    """What has been delivered of one request so far."""

    request_id: str
    t_first: float = field(default_factory=time.perf_counter)
    bytes: int = 0
    blocks: set[int] = field(default_factory=set)
    t_last: float = 0.0

    def delivered(self, nbytes: int, dst: list[int]) -> None:
        self.bytes += nbytes
        self.blocks.update(dst)
        self.t_last = time.perf_counter()

    def result(self, ok: bool, error: str = "", blocks_skipped: int = 0) -> TransferResult:
        end = self.t_last if ok and self.t_last else time.perf_counter()
        return TransferResult(self.request_id, ok, error, self.bytes, max(0.0, end - self.t_first),
                              len(self.blocks), blocks_skipped)


class Tombstones:
    """Requests that already failed before finish(): their later pages are
    dropped and finish() reports nothing more. Bounded, oldest forgotten first."""

    def __init__(self, cap: int = 10_000):
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._cap = cap

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        while len(self._ids) > self._cap:
            self._ids.popitem(last=False)

    def discard(self, request_id: str) -> bool:
        if request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids


class Mailbox:
    """Commands from the engine thread to a sender's I/O thread, plus a pipe
    the I/O thread polls next to its sockets so a command wakes it up."""

    def __init__(self) -> None:
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self.closed = False
        self._idle = False  # set by the I/O thread just before it polls

    @property
    def fd(self) -> int:
        return self._wake_r

    def put(self, cmd: tuple) -> bool:
        """Queue a command; False once a ("close",) was queued. The lock keeps a
        late put() from writing to the pipe as it is closed."""
        with self._lock:
            if self.closed:
                return False
            self.closed = cmd[0] == "close"
            self._cmds.put(cmd)
            # Wake the I/O thread only if it is (about to be) asleep: a busy one
            # drains the queue before it sleeps again. Fewer syscalls in the
            # engine thread, fewer GIL hand-offs to the I/O thread.
            if self._idle:
                self._idle = False
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:  # pipe full: a wake-up is pending anyway
                    pass
            return True

    def going_idle(self) -> bool:
        """Announce sleep, then look: True if commands wait (do not sleep). A
        command queued after the look finds the flag set and writes to the pipe."""
        self._idle = True
        return not self._cmds.empty()

    def woken(self, readable: bool) -> None:
        """After the poll; `readable`: the poll reported our fd."""
        self._idle = False
        if not readable:
            return
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def take(self) -> list[tuple]:
        out = []
        while True:
            try:
                out.append(self._cmds.get_nowait())
            except queue.Empty:
                return out

    def close_fds(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)


class SenderBase(KVSender):
    """The result queue: backends call _emit(), the engine calls poll()."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.layout_dict = layout.to_dict()  # sent with every message: build it once
        self._results: list[TransferResult] = []
        self._results_lock = threading.Lock()

    def poll(self) -> list[TransferResult]:
        with self._results_lock:
            out, self._results = self._results, []
        return out

    def _emit(self, result: TransferResult) -> None:
        with self._results_lock:
            self._results.append(result)
        self._wake()
