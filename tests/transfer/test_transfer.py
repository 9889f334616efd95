"""Behaviour of every backend (tcp, local and nixl, through the `backend`
fixture): pages land exactly in the leased blocks, and every refusal writes
nothing."""
from __future__ import annotations

import time

import pytest
import torch

from tests.transfer.conftest import BLOCKS, LAYERS, Pair, make_layout


def _page_bytes(pair: Pair) -> int:
    layer = pair.src[0]
    return layer[:, 0].numel() * layer.element_size()


def _expected(pair: Pair, before: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]) -> torch.Tensor:
    out = before.clone()
    out[:, :, dst_blocks] = pair.src[:, :, src_blocks]
    return out


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", ""), ("bfloat16", ""), ("bfloat16", "float8_e4m3fn")])
def test_pages_land_exactly_in_leased_blocks(make_pair, dtype, kv_cache_dtype):
    """FP8 pages too: one byte an element, as they are (the bytes count says so)."""
    pair = make_pair(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    before = pair.dst.clone()
    src_blocks, dst_blocks = [1, 4, 5, 10], [7, 2, 9, 0]
    pair.send_all(pair.target("r1", dst_blocks), src_blocks)
    pair.sender.finish("r1", blocks_skipped=1)
    r = pair.wait_result("r1")
    assert r.ok, r.error
    assert r.bytes == LAYERS * len(src_blocks) * _page_bytes(pair)
    assert (r.blocks_sent, r.blocks_skipped) == (4, 1)
    assert torch.equal(pair.dst, _expected(pair, before, src_blocks, dst_blocks))
    assert pair.receiver.stats.messages == LAYERS and pair.receiver.stats.rejected == 0


def test_chunks_and_interleaved_requests(pair):
    """Chunked prefill sends a request's blocks in pieces; two requests interleave."""
    before = pair.dst.clone()
    ta, tb = pair.target("a", [3, 6, 8]), pair.target("b", [11, 1])
    for layer in range(LAYERS):
        pair.sender.send_layer(ta, layer, pair.src[layer], [0, 2], [0, 1])
        pair.sender.send_layer(tb, layer, pair.src[layer], [9], [0])
    for layer in range(LAYERS):
        pair.sender.send_layer(ta, layer, pair.src[layer], [7], [2])
        pair.sender.send_layer(tb, layer, pair.src[layer], [5], [1])
    pair.sender.finish("a")
    pair.sender.finish("b")
    ra, rb = pair.wait_result("a"), pair.wait_result("b")
    assert ra.ok and rb.ok, (ra.error, rb.error)
    assert (ra.blocks_sent, rb.blocks_sent) == (3, 2)
    expected = _expected(pair, before, [0, 2, 7], [3, 6, 8])
    expected[:, :, [11, 1]] = pair.src[:, :, [9, 5]]
    assert torch.equal(pair.dst, expected)


def test_finish_without_pages_is_ok(pair):
    pair.sender.finish("empty", blocks_skipped=3)
    r = pair.wait_result("empty")
    assert r.ok and r.bytes == 0 and r.blocks_skipped == 3


def test_source_may_change_after_send_layer_returns(pair):
    """send_layer copies: the engine may overwrite its blocks right away."""
    before = pair.dst.clone()
    pair.send_all(pair.target("r", [4]), [2])
    sent = pair.src[:, :, [2]].clone()
    pair.src.fill_(-1)
    pair.sender.finish("r")
    assert pair.wait_result("r").ok
    expected = before.clone()
    expected[:, :, [4]] = sent
    assert torch.equal(pair.dst, expected)


FP8_UNIT = dict(kv_cache_dtype="float8_e4m3fn", kv_scales="unit")


@pytest.mark.parametrize("receiver_kv, sender, field", [
    ("", dict(block_size=8), "block_size"), ("", dict(dtype="bfloat16"), "dtype"),
    ("", dict(weights_hash="w1"), "weights_hash"),
    ("", FP8_UNIT, "kv_cache_dtype"),                                                   # FP8 pages, float32 pool
    ("float8_e4m3fn", {**FP8_UNIT, "kv_scales": "b2:0123456789ab"}, "kv_scales")])   # FP8 under other scales
def test_layout_mismatch_is_refused(make_pair, receiver_kv, sender, field):
    pair = make_pair(kv_cache_dtype=receiver_kv, sender_layout=make_layout(**{"dtype": "float32", **sender}))
    before = pair.dst.clone()
    pair.send_all(pair.target("r", [1, 2]), [3, 4])
    pair.sender.finish("r")
    r = pair.wait_result("r")
    assert not r.ok and f"mismatch on {field}" in r.error, r.error
    assert torch.equal(pair.dst, before)
    assert pair.receiver.stats.rejected >= 1 and pair.receiver.stats.messages == 0


def _bad_lease(pair: Pair, case: str):
    """(target, expected error) for each way a lease can be wrong."""
    if case == "unknown":
        return pair.target("r", [1, 2], lease_id="f" * 32), "unknown or revoked lease"
    if case == "expired":
        lease = pair.leases.grant("r", [1, 2], ttl_s=0.0)
        return pair.target("r", [1, 2], lease_id=lease), "lease expired"
    if case == "revoked":
        lease = pair.leases.grant("r", [1, 2], ttl_s=30)
        assert pair.leases.close(lease) == "free"
        return pair.target("r", [1, 2], lease_id=lease), "unknown or revoked lease"
    if case == "other_request":
        lease = pair.leases.grant("someone-else", [1, 2], ttl_s=30)
        return pair.target("r", [1, 2], lease_id=lease), "lease belongs to another request"
    assert case == "block_outside"
    lease = pair.leases.grant("r", [1], ttl_s=30)
    return pair.target("r", [1, 2], lease_id=lease), "block 2 is not leased to this request"


@pytest.mark.parametrize("case", ["unknown", "expired", "revoked", "other_request", "block_outside"])
def test_bad_lease_is_refused_and_writes_nothing(pair, case):
    target, expected = _bad_lease(pair, case)
    before = pair.dst.clone()
    pair.send_all(target, [3, 4])
    pair.sender.finish("r")
    r = pair.wait_result("r")
    assert not r.ok and r.error == expected
    assert torch.equal(pair.dst, before)


def test_no_write_after_revoke(pair):
    """Revoke in the middle of a stream: once revoke() returns, nothing more lands."""
    if pair.backend == "nixl":
        pytest.skip("one-sided writes are fenced by holding the blocks instead (test_nixl.py)")
    target = pair.target("r", [5, 6])
    g = torch.Generator().manual_seed(7)

    def send_some(n: int) -> None:
        for i in range(n):
            # New contents for every message, so any late write would show.
            pair.src[:, :, [0, 1]] = torch.rand(pair.src[:, :, [0, 1]].shape, generator=g) + 10 + i
            pair.sender.send_layer(target, i % LAYERS, pair.src[i % LAYERS], [0, 1], [0, 1])

    send_some(30)
    deadline = time.monotonic() + 5
    while pair.receiver.stats.messages < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pair.receiver.stats.messages >= 3
    assert pair.leases.close(target.lease_id) == "free"
    snapshot = pair.dst.clone()
    send_some(30)
    pair.sender.finish("r")
    r = pair.wait_result("r")
    assert not r.ok and r.error == "unknown or revoked lease"
    settle(pair)  # every page sent before the probe has been handled by now
    assert torch.equal(pair.dst[:, :, :BLOCKS - 1], snapshot[:, :, :BLOCKS - 1])


def settle(pair: Pair, block: int = BLOCKS - 1) -> None:
    """Send a probe request (into `block`) and wait for its result: the receiver
    handles one connection's messages in order, and the sender its commands in
    order, so everything sent before has been written, refused or dropped."""
    lease = pair.leases.grant("probe", [block], ttl_s=30)
    pair.send_all(pair.target("probe", [block], lease_id=lease), [0])
    pair.sender.finish("probe")
    assert pair.wait_result("probe").ok


def test_abort_yields_no_result(pair):
    pair.send_all(pair.target("r", [1, 2]), [3, 4])
    pair.sender.abort("r")
    pair.send_all(pair.target("other", [5]), [6])
    pair.sender.finish("other")
    assert pair.wait_result("other").ok   # the abort was applied before it: no result can follow
    settle(pair)
    assert [r for r in pair.results + pair.sender.poll() if r.request_id == "r"] == []


def test_missing_receiver_fails_within_timeout(make_pair, backend, free_tcp_addr):
    pair = make_pair(timeout_s=0.5)
    addr = "local://nobody" if backend == "local" else free_tcp_addr
    pair.send_all(pair.target("r", [1], addr=addr), [2])
    pair.sender.finish("r")
    r = pair.wait_result("r", timeout=30)
    assert not r.ok
    if backend != "local":
        assert r.error == "stalled: no progress for 0.5s waiting for the decode worker (worker.transfer_timeout_s)"
    else:
        assert r.error == "no local receiver at local://nobody"


def test_failure_is_reported_once(pair):
    """After a refusal, the rest of the request's pages and its finish() are silent."""
    target = pair.target("r", [1, 2], lease_id="0" * 32)
    pair.send_all(target, [3, 4])
    r = pair.wait_result("r")
    pair.send_all(target, [3, 4])
    pair.sender.finish("r")
    settle(pair)   # the later pages and the finish were handled before the probe
    assert not r.ok and [x for x in pair.results + pair.sender.poll() if x.request_id == "r"] == []


def test_wakeup_and_close(pair):
    pair.send_all(pair.target("r", [1]), [2])
    pair.sender.finish("r")
    assert pair.woken.wait(5)
    assert pair.wait_result("r").ok
    pair.sender.close()
    pair.sender.close()  # idempotent
    pair.sender.finish("late")  # harmless after close
    pair.sender.abort("late")
    with pytest.raises(RuntimeError, match="closed"):
        pair.send_all(pair.target("r2", [1]), [2])


def test_send_layer_rejects_caller_mistakes(pair):
    target = pair.target("r", [1, 2])
    with pytest.raises(ValueError, match="block index 5"):
        pair.sender.send_layer(target, 0, pair.src[0], [1], [5])
    with pytest.raises(ValueError, match="dtype"):
        pair.sender.send_layer(target, 0, pair.src[0].to(torch.float16), [1], [0])


def _inject(pair: Pair, header: bytes, pages: torch.Tensor) -> str | None:
    """Hand one raw message to the receiver, bypassing the sender; its refusal or None."""
    if pair.backend == "local":
        return pair.receiver.deliver(header, pages)
    import zmq

    from pdd.transfer.wire import decode_ack, tensor_bytes

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        sock.connect(pair.receiver.address)
        sock.send_multipart([header, tensor_bytes(pages.contiguous())])
        ack = decode_ack(sock.recv())
        return None if ack["ok"] else ack["error"]
    finally:
        sock.close(linger=0)
        ctx.term()


def test_garbage_does_not_kill_the_receiver(pair):
    import msgpack

    pages = pair.src[0][:, [1]]
    before = pair.dst.clone()
    for header, expected in [(b"\x00garbage", "malformed header"), (msgpack.packb({"v": 1}), "malformed header"),
                             (msgpack.packb(None), "malformed header")]:
        err = _inject(pair, header, pages)
        assert err is not None and err.startswith(expected), err
    assert torch.equal(pair.dst, before)
    pair.send_all(pair.target("good", [2]), [3])
    pair.sender.finish("good")
    assert pair.wait_result("good").ok
    assert torch.equal(pair.dst[:, :, 2], pair.src[:, :, 3])


def test_warm_up_leaves_both_pools_as_they_were(pair):
    """A worker's warm-up runs its data plane's page kernels once on its own
    pool's null block (read, or written with its own pages) before it serves:
    no page of either pool changes, and transfers go on as before."""
    src, dst = pair.src.clone(), pair.dst.clone()
    pair.sender.warm_up(pair.src)
    pair.receiver.warm_up()
    assert torch.equal(pair.src, src) and torch.equal(pair.dst, dst)
    pair.send_all(pair.target("r", [3]), [5])
    pair.sender.finish("r")
    assert pair.wait_result("r").ok
    assert torch.equal(pair.dst, _expected(pair, dst, [5], [3]))
