"""NIXL, as pdd uses it: the optional import, one agent with its UCX backend,
the descriptors of a page write, and the registered staging memory a sender
writes from.

NIXL (PyPI `nixl-cu13`, the optional extra `pdd[nixl]`) moves memory between
agents through UCX, which picks the transport: RDMA verbs across hosts,
cuda_ipc/NVLink or shared memory within one, TCP where nothing else exists.
UCX reads its settings from the environment (UCX_TLS, UCX_NET_DEVICES, ...):
they pass through to every worker as set.

Cost is per descriptor (on H200 x2, 1 GiB moved at 343 GB/s as one descriptor
and at 66 GB/s as 2048), so a write names maximal contiguous runs: in a pool
[layers, 2, blocks, block_size, kv_heads, head_dim] the pages of one (layer,
k|v) are contiguous across consecutive block ids, so a run of consecutive
destination blocks is one descriptor per k and v (`runs`).
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
import uuid
from collections import deque
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# The wheel's own module, then the meta-package's name for it.
_MODULES = ("nixl_cu13", "nixl")


class NixlUnavailable(RuntimeError):
    """The nixl backend cannot run in this process (the message says why, in one line)."""


@functools.cache
def _import():
    errors = []
    for name in _MODULES:
        raise_exc = logging.raiseExceptions   # NIXL's logging setup resets this process-wide flag
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        finally:
            logging.raiseExceptions = raise_exc
        if "NIXL_LOG_LEVEL" not in os.environ:
            # NIXL logs every agent and backend it creates at INFO, on stdout.
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return mod, ""
    return None, "; ".join(errors)


def unavailable() -> str | None:
    """None if NIXL can be imported here, else why not (one line)."""
    mod, why = _import()
    return None if mod is not None else (
        f"the nixl KV transfer backend is not installed (pip install 'pdd[nixl]'): {why}")


def _load():
    why = unavailable()
    if why:
        raise NixlUnavailable(why)
    return _import()[0]


def mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


def device_id(t: torch.Tensor) -> int:
    return t.device.index if t.is_cuda else 0


Desc = tuple[int, int, int]   # (address, bytes, device id)


class Agent:
    """One NIXL agent with the UCX backend, named uniquely per process life (a
    restarted worker is a new agent: peers drop the old one by its name).

    Its calls are serialized by NIXL (strict thread sync): the engine thread
    may register memory while an I/O thread posts writes."""

    def __init__(self, role: str):
        nixl = _load()
        self.name = f"pdd-{role}-{uuid.uuid4().hex[:12]}"
        # No progress thread: NIXL's spins (half a core while idle, in every
        # worker that offers nixl). The agent progresses when asked about
        # writes and notifications: the sender polls while it writes, the
        # decode side while a writer is begun (pdd.transfer.nixl_control).
        conf = nixl.nixl_agent_config(backends=["UCX"], enable_prog_thread=False,
                                      sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self._agent = nixl.nixl_agent(self.name, conf)
        except Exception as e:  # the library's refusal, whatever its type
            raise NixlUnavailable(f"NIXL agent could not start: {type(e).__name__}: {e}") from e
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable("NIXL has no UCX plugin here (its wheel ships one: reinstall pdd[nixl])")
        self._regs: list = []
        self.peers: set[str] = set()

    def register(self, t: torch.Tensor) -> None:
        """Register a contiguous tensor's memory (once: registration pins and maps it)."""
        if not t.is_contiguous():
            raise ValueError("NIXL registers contiguous memory only")
        self._regs.append(self._agent.register_memory(t))

    def metadata(self) -> bytes:
        """What a peer loads (add_peer) to write into what we registered."""
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self.peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer (it restarted or went away): disconnects from it."""
        if name in self.peers:
            self.peers.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # already gone in NIXL: nothing left to drop
                log.debug("nixl: removing peer %s: %s", name, e)

    def write(self, local: list[Desc], local_mem: str, remote: list[Desc], remote_mem: str, peer: str,
              notif: bytes):
        """Post a one-sided WRITE of `local` into `peer`'s `remote` (pairwise
        equal lengths); NIXL notifies the peer with `notif` once it landed.
        Returns the transfer's handle; raises if it cannot be posted."""
        handle = self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(local, local_mem),
                                             self._agent.get_xfer_descs(remote, remote_mem), peer, notif)
        try:
            if self._agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL refused to post the write")
        except Exception:
            self.release(handle)
            raise
        return handle

    def state(self, handle) -> str:
        """DONE (landed at the peer, its notification sent), PROC, or ERR: <why>."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as e:  # e.g. the peer disconnected
            return f"ERR: {type(e).__name__}: {e}"

    def release(self, handle) -> bool:
        """Free a transfer's handle; one in progress is cancelled. False if NIXL
        could not (it may still be reading its source)."""
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception as e:
            log.warning("nixl: a transfer could not be released: %s", e)
            return False

    def notifs(self) -> list[bytes]:
        """Notifications that arrived since the last call, from any peer."""
        return [n for msgs in self._agent.get_new_notifs().values() for n in msgs]

    def close(self) -> None:
        for name in list(self.peers):
            self.remove_peer(name)
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.warning("nixl: deregistering memory: %s", e)
        self._regs = []
        self._agent = None


def runs(dst: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive destination block ids, as (position in
    `dst`, first block, length): each is one descriptor per k and v."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(dst):
        if out and out[-1][1] + out[-1][2] == b:
            pos, first, n = out[-1]
            out[-1] = (pos, first, n + 1)
        else:
            out.append((i, b, 1))
    return out


@dataclass(frozen=True)
class PoolRegion:
    """A registered KV pool as a peer addresses it."""

    addr: int
    nbytes: int
    device: int
    mem: str
    num_blocks: int

    def to_dict(self) -> dict:
        return {"addr": self.addr, "nbytes": self.nbytes, "device": self.device, "mem": self.mem,
                "num_blocks": self.num_blocks}

    @staticmethod
    def of(pool: torch.Tensor) -> "PoolRegion":
        return PoolRegion(pool.data_ptr(), pool.numel() * pool.element_size(), device_id(pool), mem_type(pool),
                          pool.shape[2])


def write_descs(region: PoolRegion, page_bytes: int, layer: int, staged_addr: int, n: int, dst: list[int],
                staged_device: int) -> tuple[list[Desc], list[Desc]]:
    """Descriptors (local, remote) writing staged pages [2, n, page] (page i for
    destination block dst[i]) into layer `layer` of a pool [layers, 2, blocks, page]."""
    local, remote = [], []
    for pos, first, length in runs(dst):
        for kv in (0, 1):
            local.append((staged_addr + (kv * n + pos) * page_bytes, length * page_bytes, staged_device))
            remote.append((region.addr + ((layer * 2 + kv) * region.num_blocks + first) * page_bytes,
                           length * page_bytes, region.device))
    return local, remote


class StagingArena:
    """Registered memory pages are written from: a ring of byte ranges, taken
    by the engine thread in order and given back by the I/O thread as their
    writes complete (in any order; space is reused once everything taken
    before it came back too). Staging lets the engine overwrite its blocks as
    soon as a step ends, whatever the network does."""

    def __init__(self, nbytes: int, device: torch.device):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self._cond = threading.Condition()
        self._live: deque[list] = deque()    # [start, size, returned] in the order taken
        self.closed = False

    def take(self, size: int, timeout: float) -> int | None:
        """The offset of `size` free bytes, waiting up to `timeout` s for
        space; None if none came (or the arena closed)."""
        if size > self.nbytes:
            raise ValueError(f"{size} bytes do not fit a staging arena of {self.nbytes}")
        with self._cond:
            ok = self._cond.wait_for(lambda: self.closed or self._fit(size) is not None, timeout)
            if not ok or self.closed:
                return None
            start = self._fit(size)
            self._live.append([start, size, False])
            return start

    def _fit(self, size: int) -> int | None:
        if not self._live:
            return 0
        tail = self._live[0][0]
        newest = self._live[-1]
        head = newest[0] + newest[1]
        if newest[0] >= tail:   # not wrapped: free are [head, end) and [0, tail)
            if head + size <= self.nbytes:
                return head
            return 0 if size <= tail else None
        return head if head + size <= tail else None   # wrapped: free is [head, tail)

    def give_back(self, start: int) -> None:
        with self._cond:
            for entry in self._live:
                if entry[0] == start and not entry[2]:
                    entry[2] = True
                    break
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        with self._cond:
            return len(self._live)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
