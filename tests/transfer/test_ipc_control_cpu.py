"""The cuda_ipc sender's control plane without a GPU: against a CPU decode pool
the data socket refuses to export it, and the sender must turn that into one
failed result (no hang, nothing written, later calls for the request silent)
and remember the decode worker as unreachable (so `auto` uses tcp for it).

Also: a decode worker whose connection drops (it exited) fails what is being
written to it at once and has its pool let go of (a dead process's GPU memory
stays allocated while anyone maps it).

Faked, and only to get past the sender's constructor on a machine without
CUDA: torch.cuda.is_available and torch.cuda.Stream; for the dropped-connection
test also the CUDA IPC export/open of the pool (the CPU tensor stands for the
mapping). Nothing here launches a kernel; the GPU paths are covered by
test_cuda_ipc.py on the lent H200s."""
from __future__ import annotations

import time

import pytest
import torch

from pdd.transfer import make_receiver
from pdd.transfer.base import TransferTarget
from pdd.transfer.cuda_ipc import WriteState
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


def test_a_dropped_connection_fails_the_write_and_unmaps_the_pool(cpu_ipc_sender, monkeypatch):
    import pdd.transfer.cuda_ipc as cuda_ipc
    import pdd.transfer.ipc as ipc_receiver

    layout = make_layout()
    leases = LeaseTable()
    pool = make_pool(layout, seed=3)
    monkeypatch.setattr(ipc_receiver, "export_pool", lambda kv: {"fake": "export"})
    monkeypatch.setattr(cuda_ipc, "open_pool", lambda desc, device: pool)
    receiver = make_receiver("tcp", pool, layout, leases)
    receiver.start()
    lease = leases.grant("r", [1, 2], 60)
    target = TransferTarget("r", lease, "d", receiver.address, (1, 2), backend="cuda_ipc")
    cpu_ipc_sender.prepare(target)
    write = cpu_ipc_sender._writes["r"]
    assert cpu_ipc_sender._wait_answered(write, 5) and not write.error   # opened, registered as a writer
    assert write.state is WriteState.WRITING
    dest = cpu_ipc_sender._dests[(receiver.address, "")]   # (address, server key: none without keys)
    assert dest.pool is pool
    t0 = time.monotonic()
    receiver.close()                                          # the decode worker goes away
    results = []
    while not results and time.monotonic() - t0 < 5:
        results = cpu_ipc_sender.poll()
        time.sleep(0.01)
    assert len(results) == 1 and not results[0].ok and "disconnected" in results[0].error
    assert time.monotonic() - t0 < 2                          # seen at once, not by a timeout
    assert dest.pool is None and dest.pool_id == "" and write.pool is None


def test_the_pool_is_opened_only_under_a_live_lease(cpu_ipc_sender, monkeypatch):
    """ipc_open names the request's lease: a sender without a live one gets no
    export (the pool would map the decode worker's whole KV cache)."""
    import pdd.transfer.cuda_ipc as cuda_ipc
    import pdd.transfer.ipc as ipc_receiver

    layout = make_layout()
    leases = LeaseTable()
    pool = make_pool(layout, seed=4)
    exported = []
    monkeypatch.setattr(ipc_receiver, "export_pool", lambda kv: exported.append(kv) or {"fake": "export"})
    monkeypatch.setattr(cuda_ipc, "open_pool", lambda desc, device: pool)
    receiver = make_receiver("tcp", pool, layout, leases)
    receiver.start()
    try:
        target = TransferTarget("r", "not-a-lease", "d", receiver.address, (1, 2), backend="cuda_ipc")
        cpu_ipc_sender.prepare(target)
        deadline, results = time.monotonic() + 5, []
        while not results and time.monotonic() < deadline:
            results = cpu_ipc_sender.poll()
            time.sleep(0.01)
        assert len(results) == 1 and not results[0].ok and "unknown or revoked lease" in results[0].error
        assert exported == []
        # One request's dead lease is not the decode worker's fault: the next request opens the pool.
        assert not cpu_ipc_sender.cannot_reach(receiver.address)
        lease = leases.grant("r2", [3], 30)
        cpu_ipc_sender.prepare(TransferTarget("r2", lease, "d", receiver.address, (3,), backend="cuda_ipc"))
        write = cpu_ipc_sender._writes["r2"]
        assert cpu_ipc_sender._wait_answered(write, 5) and write.state is WriteState.WRITING
        assert write.pool is pool and len(exported) == 1
    finally:
        receiver.close()
