"""The GPU staging path (gather on the device, pinned host copy, event): runs
only where CUDA is available."""
from __future__ import annotations

import time

import pytest
import torch

from pdd.transfer import make_receiver, make_sender
from pdd.transfer.leases import LeaseTable
from tests.transfer.conftest import Pair, make_layout, make_pool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def gpu_pair(backend, request):
    """Two pools on the GPU, a started receiver and a sender, closed afterwards."""
    layout = make_layout(getattr(request, "param", "bfloat16"))
    leases = LeaseTable()
    src, dst = make_pool(layout, 1).cuda(), make_pool(layout, 2).cuda()
    receiver = make_receiver(backend, dst, layout, leases)
    receiver.start()
    sender = make_sender(backend, layout, timeout_s=5)
    try:
        yield Pair(backend, src, dst, sender, receiver, leases)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("gpu_pair", ["float32", "bfloat16"], indirect=True)
def test_gpu_pools(gpu_pair):
    pair, src, dst, sender = gpu_pair, gpu_pair.src, gpu_pair.dst, gpu_pair.sender
    before = dst.clone()
    expected_pages = src[:, :, [1, 6]].clone()
    pair.send_all(pair.target("r", [9, 3]), [1, 6])
    src.fill_(-1)  # queued after the gather on the same stream: must not leak into the pages
    sender.finish("r")
    r = pair.wait_result("r")
    assert r.ok, r.error
    before[:, :, [9, 3]] = expected_pages
    torch.cuda.synchronize()
    assert torch.equal(dst, before)


def test_send_layer_does_not_wait_for_the_gpu(backend, gpu_pair):
    """The engine queues its forward pass and calls send_layer: the call must
    not block until the GPU has caught up (tcp: the I/O thread waits instead)."""
    if backend == "local":
        pytest.skip("local copies synchronously by design")
    pair, src, dst, sender = gpu_pair, gpu_pair.src, gpu_pair.dst, gpu_pair.sender
    pair.send_all(pair.target("warm", [0]), [0])
    sender.finish("warm")
    assert pair.wait_result("warm").ok
    torch.cuda.synchronize()
    expected = src[:, :, [2]].clone() + 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time queued ahead of the pages
    src.add_(1)                     # the "forward pass" that writes the pages
    end.record()
    t0 = time.perf_counter()
    pair.send_all(pair.target("r", [5]), [2])
    host_s = time.perf_counter() - t0
    sender.finish("r")
    r = pair.wait_result("r")
    end.synchronize()
    gpu_s = start.elapsed_time(end) / 1e3
    assert r.ok, r.error
    assert host_s < gpu_s / 2, (host_s, gpu_s)
    torch.cuda.synchronize()
    assert torch.equal(dst[:, :, 5], expected[:, :, 0])
