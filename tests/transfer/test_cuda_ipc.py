"""The cuda_ipc backend between two processes: the decode pool and its data
socket in a child process (on the second GPU when there is one), the sender
here. Pages must land exactly in the leased blocks; every refusal must be
reported and write nothing. Runs only where CUDA is available."""
from __future__ import annotations

import time

import pytest
import torch

from pdd.transfer import make_sender
from tests.transfer.conftest import make_layout, make_pool
from tests.transfer.peers import Peer, send, send_and_compare, target, wait_result

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PEER = "cuda:1" if torch.cuda.is_available() and torch.cuda.device_count() > 1 else "cuda:0"


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def peer(request):
    p = Peer(make_layout(request.param), PEER, backend="cuda_ipc")
    yield p
    p.stop()


@pytest.fixture
def sender(peer):
    s = make_sender("cuda_ipc", peer.layout, timeout_s=10, device="cuda:0")
    yield s
    s.close()


def test_pages_land_in_the_leased_blocks(peer, sender):
    src = make_pool(peer.layout, seed=1).cuda()
    r, t = send_and_compare(peer, sender, src, "r1", [9, 3], [1, 6])
    assert r.blocks_sent == 2 and r.bytes == src[:, :, :2].numel() * src.element_size()
    assert peer("close", t.lease_id) == "free"      # committed: nothing held


def test_revoked_lease_is_refused_before_any_write(peer, sender):
    src = make_pool(peer.layout, seed=3).cuda()
    before = peer("pool")
    t = target(peer, "r2", [4])
    assert peer("close", t.lease_id) == "free"
    send(sender, t, src, [0])
    sender.finish("r2")
    r = wait_result(sender, "r2")
    assert not r.ok and "unknown or revoked lease" in r.error
    assert torch.equal(peer("pool"), before)


def test_abort_holds_the_blocks_until_the_writer_ends(peer, sender):
    src = make_pool(peer.layout, seed=4).cuda()
    t = target(peer, "r3", [5, 7])
    send(sender, t, src, [2, 8], layers=[0])
    assert peer("close", t.lease_id) == "held"       # the decode side aborted while we may still write
    assert peer("released") == []
    sender.abort("r3")
    deadline = time.monotonic() + 10
    released = []
    while not released and time.monotonic() < deadline:
        released = peer("released")
        time.sleep(0.01)
    assert released == [t.lease_id]
    assert sender.poll() == []                  # an abort reports nothing


def test_lease_about_to_expire_is_not_written(peer, sender):
    before = peer("pool")
    src = make_pool(peer.layout, seed=5).cuda()
    t = target(peer, "r4", [10], ttl_s=0.5)     # shorter than the sender's safety margin
    send(sender, t, src, [0])
    sender.finish("r4")
    r = wait_result(sender, "r4")
    assert not r.ok and "would expire" in r.error
    assert torch.equal(peer("pool"), before)


def test_layout_mismatch_refuses_to_open_the_pool(peer):
    other = make_layout(peer.layout.dtype, weights_hash="w1")
    s = make_sender("cuda_ipc", other, timeout_s=10, device="cuda:0")
    try:
        send(s, target(peer, "r5", [1]), make_pool(other, seed=6).cuda(), [0])
        s.finish("r5")
        r = wait_result(s, "r5")
        assert not r.ok and "KV layout mismatch on weights_hash" in r.error, r.error
        assert s.cannot_reach(peer.address)
    finally:
        s.close()


def test_a_commit_waits_for_its_own_copies_not_a_later_steps(peer, sender):
    """The prefill worker reads a step's first tokens after launching the next
    step, whose copies (another request's) queue on the side stream behind that
    step's compute. The finished request's commit must not wait for them: it
    completes while the later step still runs."""
    src = make_pool(peer.layout, seed=7).cuda()
    first, later = target(peer, "r6", [8]), target(peer, "r7", [11])
    sender.prepare(first)
    sender.prepare(later)
    send(sender, first, src, [0])                  # step N: r6's last pages
    torch.cuda._sleep(10_000_000_000)             # step N+1's compute: ~5 s of GPU time
    step_done = torch.cuda.Event()
    step_done.record()
    send(sender, later, src, [1])                  # step N+1's pages of r7, queued behind it
    sender.finish("r6")
    r = wait_result(sender, "r6")
    assert r.ok, r.error
    assert not step_done.query()                  # committed while step N+1 still ran
    sender.finish("r7")
    assert wait_result(sender, "r7").ok
    assert peer("close", first.lease_id) == peer("close", later.lease_id) == "free"


@pytest.fixture(scope="module")
def deep_peer():
    """A pool of 7 layers: copies of 3 layers each leave a last group of one."""
    p = Peer(make_layout("bfloat16", num_layers=7), PEER, backend="cuda_ipc")
    yield p
    p.stop()


@pytest.mark.parametrize("layers_per_copy", [1, 3])
def test_layer_wise_copies_land_every_layer(deep_peer, layers_per_copy):
    """worker.ipc_layers_per_copy >= 1: a copy is launched every N layers as the
    forward writes them (the last group may be shorter), over two steps of one
    prompt; every page of every layer lands in its leased block."""
    s = make_sender("cuda_ipc", deep_peer.layout, timeout_s=10, device="cuda:0", layer_group=layers_per_copy)
    try:
        src = make_pool(deep_peer.layout, seed=10 + layers_per_copy).cuda()
        before = deep_peer("pool")
        rid = f"g{layers_per_copy}"
        t = target(deep_peer, rid, [2, 9, 4])
        s.prepare(t)
        send(s, t, src, [5, 1], indices=[0, 1])     # the prompt's blocks 0-1, then block 2
        send(s, t, src, [7], indices=[2])
        s.finish(rid)
        r = wait_result(s, rid)
        assert r.ok, r.error
        assert r.blocks_sent == 3 and r.bytes == src[:, :, :3].numel() * src.element_size()
        expected = before.clone()
        expected[:, :, [2, 9, 4]] = src[:, :, [5, 1, 7]].cpu()
        assert torch.equal(deep_peer("pool"), expected)
        assert deep_peer("close", t.lease_id) == "free"      # committed: nothing held
    finally:
        s.close()


def test_the_warm_up_compiles_the_copy_a_transfer_makes():
    """The warm-up copies the null block onto itself in the sender's own pool;
    after it, a transfer into a peer's pool of another size compiles nothing
    (a compile in service stalls every request on the worker)."""
    import triton
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    layout = make_layout("bfloat16", head_dim=24)   # a page no other test here copies: nothing compiled yet
    peer = Peer(layout, PEER, backend="cuda_ipc")
    s = make_sender("cuda_ipc", layout, timeout_s=10, device="cuda:0")
    hook, compiled = runtime.jit_post_compile_hook, []
    try:
        src = make_pool(layout, seed=3, blocks=40).cuda()
        before = src.clone()
        s.warm_up(src)
        assert torch.equal(src, before)
        runtime.jit_post_compile_hook = lambda **kw: compiled.append(f"{kw.get('repr')} key={kw.get('key')}")
        t = target(peer, "w", [5, 2])
        s.prepare(t)
        send(s, t, src, [33, 1])
        s.finish("w")
        r = wait_result(s, "w")
        assert r.ok, r.error
        assert compiled == []
    finally:
        runtime.jit_post_compile_hook = hook
        s.close()
        peer.stop()
