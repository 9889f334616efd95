"""The cuda_ipc sender's control plane without a GPU: against a CPU decode pool
the data socket refuses to export it, and the sender must turn that into one
failed result (no hang, nothing written, later calls for the request silent)
and remember the decode worker as unreachable (so `auto` uses tcp for it).

Faked, and only to get past the sender's constructor on a machine without
CUDA: torch.cuda.is_available and torch.cuda.Stream. Nothing here launches a
kernel; the GPU paths are covered by test_cuda_ipc.py on the lent H200s."""
from __future__ import annotations

import time

import pytest
import torch

from pdd.transfer import make_receiver
from pdd.transfer.base import TransferTarget
from pdd.transfer.leases import LeaseTable
from tests.transfer.conftest import make_layout, make_pool


@pytest.fixture
def cpu_ipc_sender(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a real GPU is here: test_cuda_ipc.py covers it")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    from pdd.transfer.cuda_ipc import CudaIpcSender
    sender = CudaIpcSender(make_layout(), timeout_s=5, device="cuda:0")
    yield sender
    sender.close()


def test_unopenable_pool_fails_the_request_once(cpu_ipc_sender):
    layout = make_layout()
    leases = LeaseTable()
    pool = make_pool(layout, seed=2)
    before = pool.clone()
    receiver = make_receiver("tcp", pool, layout, leases)
    receiver.start()
    try:
        lease = leases.grant("r", [1, 2], 30)
        target = TransferTarget("r", lease, "d", receiver.address, (1, 2), backend="cuda_ipc")
        cpu_ipc_sender.prepare(target)
        deadline, results = time.monotonic() + 5, []
        while not results and time.monotonic() < deadline:
            results = cpu_ipc_sender.poll()
            time.sleep(0.01)
        assert len(results) == 1 and not results[0].ok
        assert "cannot open the decode worker's KV pool" in results[0].error and "not a GPU" in results[0].error
        assert cpu_ipc_sender.cannot_reach(receiver.address)
        cpu_ipc_sender.finish("r")          # already reported: silent
        time.sleep(0.05)
        assert cpu_ipc_sender.poll() == []
        assert torch.equal(pool, before) and leases.close(lease) == "free"   # never registered as a writer
    finally:
        receiver.close()
