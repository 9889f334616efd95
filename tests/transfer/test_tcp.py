"""tcp-only behaviour: hostile or broken frames on the receiver's socket, a
sender whose receiver is absent, and address resolution."""
from __future__ import annotations

import socket
import time

import msgpack
import pytest
import torch
import zmq

from pdd.transfer.receiver import DataSocket, _public_endpoint
from pdd.transfer.tcp import TcpSender
from pdd.transfer.wire import decode_ack, decode_reply, encode_control, encode_pages_header, tensor_bytes
from tests.transfer.conftest import Pair, make_layout


@pytest.fixture
def backend() -> str:  # overrides the parametrized one: these tests are tcp only
    return "tcp"


@pytest.fixture
def dealer(pair):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(pair.receiver.address)
    yield sock
    sock.close()
    ctx.term()


def _header(pair: Pair, lease: str, **over) -> bytes:
    fields = dict(request_id="r", lease_id=lease, layer=0, dst_block_ids=[1], dtype="float32",
                  shape=[2, 1, *pair.dst.shape[3:]], layout=make_layout().to_dict(), seq=4)
    return encode_pages_header(**{**fields, **over})


def _tamper(header: bytes, **over) -> bytes:
    """A header the encoder would not produce."""
    return msgpack.packb({**msgpack.unpackb(header), **over})


def _garbage(pair: Pair, lease: str) -> list[tuple[list[bytes], str]]:
    page = tensor_bytes(pair.src[0, :, :1].contiguous()).tobytes()
    return [
        ([b"a", b"b", b"c"], "malformed message: 3 frames, expected 2 (pages) or 1 (done, control)"),
        ([b"\xc1\xc1\xc1", page], "malformed header: not msgpack"),
        ([msgpack.packb([1, 2]), page], "malformed header: expected a map, got list"),
        ([msgpack.packb({"v": 99, "request_id": "r", "seq": 4}), page], "unsupported wire version 99"),
        ([_tamper(_header(pair, lease), layer="x"), page], "field 'layer' must be non-negative int"),
        ([_header(pair, lease, layout={"dtype": "float32"}), page], "malformed header: bad layout"),
        ([_header(pair, lease, layer=7), page], "layer 7 out of range"),
        ([_header(pair, lease, dtype="float16"), page], "dtype mismatch: pages are float16, pool is float32"),
        ([_header(pair, lease, shape=[2, 1, 4, 2, 9]), page], "shape mismatch"),
        ([_header(pair, lease), page[:-4]], "payload is"),
        ([_header(pair, lease, dst_block_ids=[99], shape=[2, 1, 4, 2, 8]), page], "block 99 out of range"),
        ([_header(pair, lease, dst_block_ids=[1, 1], shape=[2, 2, 4, 2, 8]), page + page],
         "duplicate destination block ids"),
    ]


def test_garbage_frames_are_refused_and_the_receiver_keeps_serving(pair, dealer):
    lease = pair.leases.grant("r", [1], ttl_s=30)
    before = pair.dst.clone()
    cases = _garbage(pair, lease)
    for frames, expected in cases:
        dealer.send_multipart(frames)
        ack = decode_ack(dealer.recv())
        assert not ack["ok"] and expected in ack["error"], (expected, ack)
    # Raw bytes that are not even ZMTP: zmq drops the connection, nothing else.
    with socket.create_connection(("127.0.0.1", int(pair.receiver.address.rsplit(":", 1)[1]))) as s:
        s.sendall(b"\xff" * 64 + b"GET / HTTP/1.0\r\n\r\n")
    assert torch.equal(pair.dst, before)
    assert pair.receiver.stats.rejected == len(cases)
    # The receiver still works.
    pair.send_all(pair.target("good", [2]), [3])
    pair.sender.finish("good")
    assert pair.wait_result("good").ok
    assert torch.equal(pair.dst[:, :, 2], pair.src[:, :, 3])


def test_control_messages_on_the_data_socket(pair, dealer):
    """cuda_ipc bookkeeping over the data socket, checked on CPU: bad
    frames are answered with the reason, a CPU pool is not exported, and
    begin/commit follow the lease table."""
    ipc = pair.receiver.ipc

    def ask(frame: bytes) -> dict:
        dealer.send_multipart([frame])
        return decode_reply(dealer.recv())

    bad = ask(b"junk")
    assert not bad["ok"] and "malformed control message" in bad["error"] and bad["token"] == -1
    assert "unknown control message kind 'nope'" in ask(msgpack.packb({"v": 1, "kind": "nope", "token": 3}))["error"]
    r = ask(encode_control("ipc_begin", 4, request_id="r", lease_id="l"))
    assert r["token"] == 4 and "missing field 'pool_id'" in r["error"]
    # The pool is exported only to the holder of a live lease of this receiver.
    r = ask(encode_control("ipc_open", 5, layout=make_layout().to_dict()))
    assert not r["ok"] and "must name a live lease" in r["error"]
    r = ask(encode_control("ipc_open", 5, layout=make_layout().to_dict(), request_id="r", lease_id="guess"))
    assert not r["ok"] and r["error"] == "unknown or revoked lease" and r["data"] == {"lease_refused": True}
    lease = pair.leases.grant("r", [1], ttl_s=30)
    r = ask(encode_control("ipc_open", 5, layout=make_layout().to_dict(), request_id="other", lease_id=lease))
    assert not r["ok"] and r["error"] == "lease belongs to another request"
    held = dict(request_id="r", lease_id=lease)
    r = ask(encode_control("ipc_open", 5, layout={**make_layout().to_dict(), "block_size": 32}, **held))
    assert not r["ok"] and "KV layout mismatch on block_size" in r["error"]
    r = ask(encode_control("ipc_open", 6, layout=make_layout().to_dict(), **held))
    assert not r["ok"] and "not a GPU" in r["error"]
    r = ask(encode_control("ipc_begin", 7, request_id="r", lease_id=lease, pool_id="old"))
    assert not r["ok"] and "stale pool" in r["error"]
    r = ask(encode_control("ipc_begin", 8, request_id="r", lease_id=lease, pool_id=ipc.pool_id, handoff=None))
    assert r["ok"] and 29 < r["data"]["seconds"] <= 30
    assert pair.leases.close(lease) == "held"           # aborted while the writer may still store
    r = ask(encode_control("ipc_commit", 9, request_id="r", lease_id=lease, pool_id=ipc.pool_id, handoff=None))
    assert not r["ok"] and r["error"] == "unknown or revoked lease"
    assert [held.lease_id for held in pair.leases.released()] == [lease]
    lease2 = pair.leases.grant("r2", [2], ttl_s=30)
    assert ask(encode_control("ipc_begin", 10, request_id="r2", lease_id=lease2, pool_id=ipc.pool_id, handoff=None))["ok"]
    assert ask(encode_control("ipc_commit", 11, request_id="r2", lease_id=lease2, pool_id=ipc.pool_id,
                              handoff=None))["ok"]
    assert pair.leases.close(lease2) == "free"


def test_versioned_nack_reaches_the_right_request(pair, dealer):
    dealer.send_multipart([msgpack.packb({"v": 99, "request_id": "abc", "seq": 9}), b""])
    ack = decode_ack(dealer.recv())
    assert (ack["request_id"], ack["seq"], ack["ok"]) == ("abc", 9, False)


def test_abort_while_receiver_absent_reports_nothing(free_tcp_addr):
    layout = make_layout()
    sender = TcpSender(layout, timeout_s=0.3)
    try:
        src = torch.rand(3, 2, 4, 4, 2, 8) + 1
        from pdd.transfer.base import TransferTarget
        t = TransferTarget("r", "l", "d", free_tcp_addr, (0, 1))
        for layer in range(3):
            sender.send_layer(t, layer, src[layer], [0, 1], [0, 1])
        sender.abort("r")
        time.sleep(0.6)
        assert sender.poll() == []
    finally:
        sender.close()


def test_receiver_that_comes_late_still_gets_the_pages(pair, free_tcp_addr):
    """Pages queued while the receiver is not yet listening go out once it is."""
    late = DataSocket(pair.dst, make_layout(), pair.leases, free_tcp_addr)
    target = pair.target("r", [8], addr=free_tcp_addr)
    pair.send_all(target, [9])
    pair.sender.finish("r")
    time.sleep(0.1)
    late.start()
    try:
        assert pair.wait_result("r").ok
        assert torch.equal(pair.dst[:, :, 8], pair.src[:, :, 9])
    finally:
        late.close()


def test_a_failing_control_does_not_stop_the_data_socket(pair, monkeypatch, caplog):
    """A one-sided control (cuda_ipc, nixl) raising in its periodic work is
    logged; the socket keeps serving every other sender (here tcp pages)."""
    import threading
    failed = threading.Event()

    def due():
        if not failed.is_set():
            failed.set()
            raise RuntimeError("a control's bug")
        return []
    monkeypatch.setattr(pair.receiver.ipc, "due", due)
    assert failed.wait(10)
    target = pair.target("r", [8])
    pair.send_all(target, [9])
    pair.sender.finish("r")
    assert pair.wait_result("r").ok
    assert torch.equal(pair.dst[:, :, 8], pair.src[:, :, 9])
    assert any("ipc control failed" in r.getMessage() for r in caplog.records), caplog.text


def test_addresses(pair):
    assert pair.receiver.address.startswith("tcp://127.0.0.1:")
    assert not pair.receiver.address.endswith(":0")
    public = _public_endpoint("tcp://0.0.0.0:5555")
    assert public.startswith("tcp://") and public.endswith(":5555") and "0.0.0.0" not in public


def test_bind_failure_is_a_clear_error(pair):
    other = DataSocket(pair.dst, make_layout(), pair.leases, pair.receiver.address)
    with pytest.raises(ValueError, match="cannot bind"):
        other.start()
    other.close()
