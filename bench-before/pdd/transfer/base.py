"""The KV data plane: one interface, several backends.

A prefill worker's engine hands each layer's freshly written pages to a
`KVSender` while the forward pass continues; the sender moves them into the
decode worker's reserved blocks, where a `KVReceiver` accepts them only for
blocks held under a live lease (pdd.transfer.leases) and only from a sender
with the same KV layout. Backends:

    tcp       pages gathered to host memory, ZeroMQ data socket (any hosts, CPU too)
    cuda_ipc  same host, peer GPU memory written by a copy kernel (GPU path)
    nixl      one-sided writes through NIXL/UCX (RDMA across hosts; optional extra)
    local     both engines in one process (tests only: a worker never offers it)

A request's transfer ends with one last message after its pages (tcp: a done
frame on the same ordered stream; cuda_ipc, nixl: the commit, sent once its
copies or writes completed). The receiver accepts it only if every page landed under a still
live lease; it then reports `Landed` with the prefill side's `Handoff` (the
first token), and the decode worker starts the request from that report,
with no relay through the router. The sender's result is that acceptance.

A transfer never hangs: it completes, fails with a reason, or times out
(the sender's timeout_s after its last progress: pdd.transfer.progress.Progress).

With keys (pdd.security.data_security) every data socket runs CURVE: a
receiver lets in only authorized worker keys, and a sender talks only to the
holder of the key the decode worker registered (TransferTarget.dst_public_key).
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TransferTarget:
    request_id: str
    lease_id: str
    dst_worker: str
    dst_addr: str                  # the receiver's data address (tcp://host:port, local://name)
    dst_block_ids: tuple[int, ...] # the decode worker's blocks; index i <-> the request's i-th block
    skip_blocks: int = 0           # leading blocks the decode worker already caches: never sent
    backend: str = "tcp"           # the data plane the router chose for this pair
    # The decode worker's data-socket CURVE key (z85), as it registered; the
    # sender dials with it, so only that worker can answer. "" when insecure.
    dst_public_key: str = ""


@dataclass(frozen=True)
class Handoff:
    """What the decode side needs to start a request whose KV landed: the
    first token the prefill side sampled."""

    first_token: int
    logprobs: list | None = None   # the first token's logprobs entry, when asked for
    num_cached_tokens: int = 0     # prompt tokens the prefill side found in its own cache

    def to_dict(self) -> dict:
        return {"first_token": self.first_token, "logprobs": self.logprobs,
                "num_cached_tokens": self.num_cached_tokens}

    @staticmethod
    def from_dict(d: dict | None) -> "Handoff | None":
        """Inverse of to_dict (a validated wire field: pdd.transfer.wire)."""
        return Handoff(d["first_token"], d["logprobs"], d["num_cached_tokens"]) if d is not None else None


@dataclass(frozen=True)
class Landed:
    """Receiver -> decode worker: every page of `request_id` landed under `lease_id`."""

    request_id: str
    lease_id: str
    handoff: Handoff


@dataclass
class TransferResult:
    request_id: str
    ok: bool
    error: str = ""
    bytes: int = 0
    seconds: float = 0.0           # first page handed over -> last page acknowledged
    blocks_sent: int = 0           # distinct destination blocks written
    blocks_skipped: int = 0
    descriptors: int = 0           # nixl: memory regions the writes named (after coalescing runs)


class KVSender(abc.ABC):
    """Prefill side. Called from the engine thread; I/O happens elsewhere."""

    def prepare(self, target: TransferTarget) -> None:
        """A request will send to `target`: a backend may set up ahead of its first page."""

    def step_done(self) -> None:
        """The engine step is over: the next one may overwrite any source block.
        A backend still reading source blocks asynchronously orders that here."""

    @abc.abstractmethod
    def send_layer(self, target: TransferTarget, layer: int, src_layer: torch.Tensor,
                   src_block_ids: list[int], block_indices: list[int]) -> None:
        """Ship `src_layer[:, src_block_ids]` (one layer of the local pool,
        [2, blocks, block_size, kv_heads, head_dim]) into
        `target.dst_block_ids[i] for i in block_indices`. When this returns the
        sender no longer needs the source blocks (it copied them, or the
        backend orders the copy before the next step's writes)."""

    @abc.abstractmethod
    def finish(self, request_id: str, blocks_skipped: int = 0, handoff: Handoff | None = None) -> None:
        """No more pages for this request: send the last message (with
        `handoff`, the decode side starts the request on it; None: a transfer
        alone, as tests and benchmarks use) and report the result once the
        receiver accepted it."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Forget the request: unsent pages are dropped and no result is reported."""

    @abc.abstractmethod
    def poll(self) -> list[TransferResult]:
        """Results completed since the last call (never blocks)."""

    def warm_up(self, kv_cache: torch.Tensor) -> None:
        """Launch once each kernel this backend runs on the pages (a gather, a
        copy into a peer's pool), on the worker's own pool `kv_cache` and its
        null block 0 (read, or copied onto itself), so that Triton compiles
        them before the first request waits on it. For an idle worker."""

    def set_wakeup(self, fn: Callable[[], None]) -> None:
        """`fn` is called, from any thread, whenever poll() has something new."""
        self._wakeup = fn

    def _wake(self) -> None:
        fn = getattr(self, "_wakeup", None)
        if fn is not None:
            fn()

    @abc.abstractmethod
    def close(self) -> None: ...


class KVReceiver(abc.ABC):
    """Decode side: writes arriving pages into leased blocks of the local pool;
    what landed is reported through the lease table (LeaseTable.landed)."""

    address: str = ""

    @abc.abstractmethod
    def start(self) -> None: ...

    def warm_up(self) -> None:
        """As KVSender.warm_up, for the kernels that write arriving pages."""

    @abc.abstractmethod
    def close(self) -> None: ...


@dataclass
class ReceiverStats:
    messages: int = 0              # pages messages written (nixl: writes notified)
    bytes: int = 0
    rejected: int = 0              # messages refused (pages, a last message, a writer's open or write)
    last_error: str = ""
    rejections: list[str] = field(default_factory=list)   # the latest reasons

    MAX_REJECTIONS_KEPT = 100

    def refused(self, err: str) -> str:
        """Count a refusal; returns its reason."""
        self.rejected += 1
        self.last_error = err
        self.rejections.append(err)
        del self.rejections[:-self.MAX_REJECTIONS_KEPT]
        return err
