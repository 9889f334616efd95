"""Fixtures for the KV data plane: two small pools in one process, a receiver
and a sender of the backend under test, all stopped at the end of the test."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from pdd.kv.layout import KVLayout
from pdd.transfer import make_receiver, make_sender
from pdd.transfer.base import KVReceiver, KVSender, TransferResult, TransferTarget
from pdd.transfer.leases import LeaseTable

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 12, 4, 2, 8


def make_layout(dtype: str = "float32", **over) -> KVLayout:
    base = dict(model_id="m", weights_hash="w0", dtype=dtype, block_size=BLOCK_SIZE, num_layers=LAYERS,
                num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    return KVLayout(**{**base, **over})


def make_pool(layout: KVLayout, seed: int, blocks: int = BLOCKS) -> torch.Tensor:
    """Random, never zero: a block left untouched is told apart from one written."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    x = torch.rand(shape, generator=g) + 1.0
    return (x * (1 + seed)).to(getattr(torch, layout.kv_cache_dtype))


@dataclass
class Pair:
    """A prefill pool + sender and a decode pool + receiver."""

    backend: str
    src: torch.Tensor
    dst: torch.Tensor
    sender: KVSender
    receiver: KVReceiver
    leases: LeaseTable
    results: list[TransferResult] = field(default_factory=list)
    woken: threading.Event = field(default_factory=threading.Event)

    def target(self, request_id: str, dst_blocks: list[int], lease_id: str | None = None,
               addr: str | None = None) -> TransferTarget:
        if lease_id is None:
            lease_id = self.leases.grant(request_id, dst_blocks, ttl_s=30)
        return TransferTarget(request_id, lease_id, "decode-0", addr or self.receiver.address, tuple(dst_blocks))

    def send_all(self, target: TransferTarget, src_blocks: list[int], layers=None) -> None:
        """Every layer, as the engine does: one send_layer per layer."""
        for layer in (range(self.src.shape[0]) if layers is None else layers):
            self.sender.send_layer(target, layer, self.src[layer], src_blocks, list(range(len(src_blocks))))

    def wait_result(self, request_id: str, timeout: float = 5.0) -> TransferResult:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.results += self.sender.poll()
            for r in self.results:
                if r.request_id == request_id:
                    self.results.remove(r)
                    return r
            self.woken.wait(0.02)
            self.woken.clear()
        raise AssertionError(f"no result for {request_id} within {timeout}s")


def _nixl_unavailable() -> str | None:
    from pdd.transfer.nixl_agent import unavailable
    return unavailable()


@pytest.fixture(params=["tcp", "local", pytest.param("nixl", marks=pytest.mark.skipif(
    _nixl_unavailable() is not None, reason=str(_nixl_unavailable())))])
def backend(request) -> str:
    return request.param


@pytest.fixture
def make_pair(backend):
    """Factory: make_pair(dtype=..., kv_cache_dtype=..., sender_layout=..., timeout_s=...) -> Pair."""
    made: list[Pair] = []

    def make(dtype: str = "float32", sender_layout: KVLayout | None = None, timeout_s: float = 5.0,
             kv_cache_dtype: str = "") -> Pair:
        layout = make_layout(dtype, kv_cache_dtype=kv_cache_dtype, kv_scales="unit" if kv_cache_dtype else "")
        slayout = sender_layout or layout
        leases = LeaseTable()
        dst = make_pool(layout, seed=2)
        receiver = make_receiver(backend, dst, layout, leases)
        receiver.start()
        sender = make_sender(backend, slayout, timeout_s=timeout_s)
        pair = Pair(backend, make_pool(slayout, seed=1), dst, sender, receiver, leases)
        sender.set_wakeup(pair.woken.set)
        made.append(pair)
        return pair

    yield make
    for p in made:
        p.sender.close()
        p.receiver.close()


@pytest.fixture
def pair(make_pair) -> Pair:
    return make_pair()


@pytest.fixture
def free_tcp_addr() -> str:
    """A loopback address nobody listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(autouse=True)
def no_leftover_threads():
    """Every test stops the sender and receiver threads it started."""
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("kv-")]
    assert not left, f"threads still running: {left}"
