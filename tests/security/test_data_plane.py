"""The KV data socket with keys: a peer without an authorized worker key can
neither write pages nor ask for the pool (cuda_ipc's export, nixl's agent
metadata), even holding a live lease id; the cluster's own senders (tcp,
nixl) write as before, and a sender with the wrong keys fails its transfer
with the reason instead of waiting for a timeout."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from pdd.transfer import make_receiver, make_sender
from pdd.transfer.base import TransferTarget
from pdd.transfer.leases import LeaseTable
from pdd.transfer.nixl_agent import unavailable as nixl_unavailable
from pdd.transfer.tcp import TcpSender
from pdd.transfer.wire import encode_control, encode_pages_header, tensor_bytes
from pdd.security import data_security
from tests.security.conftest import secure_config, wait_handshake_failure
from tests.transfer.conftest import make_layout, make_pool


@pytest.fixture
def decode(secure_cfg):
    """A decode worker's data socket, with the cluster's keys."""
    layout = make_layout()
    leases = LeaseTable()
    pool = make_pool(layout, seed=2)
    receiver = make_receiver("nixl" if nixl_unavailable() is None else "tcp", pool, layout, leases,
                             security=data_security(secure_cfg))
    receiver.start()
    yield receiver, pool, leases
    receiver.close()


def wait_result(sender: TcpSender, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = sender.poll()
        if results:
            return results[0]
        time.sleep(0.01)
    raise AssertionError("no transfer result")


def send_request(sender: TcpSender, target: TransferTarget, src: torch.Tensor, src_blocks: list[int]) -> None:
    for layer in range(src.shape[0]):
        sender.send_layer(target, layer, src[layer], src_blocks, list(range(len(src_blocks))))
    sender.finish(target.request_id)


@pytest.mark.parametrize("kind", ["plaintext", "own keys"])
def test_a_stranger_with_a_live_lease_writes_nothing_and_opens_nothing(kind, decode, secure_cfg, stranger_keys):
    receiver, pool, leases = decode
    layout = make_layout()
    lease = leases.grant("victim", [1], ttl_s=60)          # suppose the stranger learnt the lease id
    before = pool.clone()
    ctx = zmq.Context()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    if kind == "own keys":
        theirs = data_security(secure_config(stranger_keys))
        theirs.dial(evil, data_security(secure_cfg).public_key)   # the decode worker's key is public
    monitor = evil.get_monitor_socket()
    evil.connect(receiver.address)
    page = tensor_bytes(torch.zeros(2, 1, *pool.shape[3:]))
    header = encode_pages_header(request_id="victim", lease_id=lease, layer=0, dst_block_ids=[1], dtype="float32",
                                 shape=[2, 1, *pool.shape[3:]], layout=layout.to_dict(), seq=0)
    for frames in ([header, page],
                   [encode_control("ipc_open", 1, layout=layout.to_dict(), request_id="victim", lease_id=lease)],
                   [encode_control("nixl_open", 2, layout=layout.to_dict(), request_id="victim", lease_id=lease)]):
        try:   # offered, never waited for: a refused handshake leaves nowhere to queue
            evil.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
    assert wait_handshake_failure(monitor)
    # The cluster's own sender still writes, and is the only one that did.
    sender = TcpSender(layout, security=data_security(secure_cfg))
    try:
        src = make_pool(layout, seed=1)
        lease2 = leases.grant("r", [2], ttl_s=60)
        send_request(sender, TransferTarget("r", lease2, "decode-0", receiver.address, (2,),
                                            dst_public_key=data_security(secure_cfg).public_key), src, [3])
        assert wait_result(sender).ok
    finally:
        sender.close()
    assert torch.equal(pool[:, :, 2], src[:, :, 3])
    assert torch.equal(pool[:, :, 1], before[:, :, 1])
    assert receiver.stats.messages == layout.num_layers and receiver.stats.rejected == 0
    assert receiver.ipc.num_writers == 0 and (receiver.nixl is None or receiver.nixl.num_writers == 0)
    evil.disable_monitor()
    monitor.close(0)
    evil.close(0)
    ctx.term()


BACKENDS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(nixl_unavailable() is not None,
                                                                reason=str(nixl_unavailable())))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, reason", [
    ("no key registered", "registered no data-socket key"),
    ("our key not authorized", "CURVE handshake with the decode worker"),
    ("wrong decode key", "CURVE handshake with the decode worker"),
])
def test_a_sender_with_the_wrong_keys_fails_with_the_reason(case, reason, backend, decode, secure_cfg, stranger_keys):
    receiver, pool, leases = decode
    layout = make_layout()
    ours, theirs = data_security(secure_cfg), data_security(secure_config(stranger_keys))
    sender_security = theirs if case == "our key not authorized" else ours
    dst_key = {"no key registered": "", "wrong decode key": theirs.public_key}.get(case, ours.public_key)
    sender = make_sender(backend, layout, timeout_s=600, security=sender_security)   # a timeout would not say why
    before = pool.clone()
    try:
        lease = leases.grant("r", [2], ttl_s=600)
        send_request(sender, TransferTarget("r", lease, "decode-0", receiver.address, (2,), dst_public_key=dst_key),
                     make_pool(layout, seed=1), [3])
        result = wait_result(sender)
    finally:
        sender.close()
    assert not result.ok and reason in result.error
    assert torch.equal(pool, before)


@pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))
def test_the_clusters_nixl_sender_opens_and_writes_over_curve(decode, secure_cfg):
    receiver, pool, leases = decode
    layout = make_layout()
    sender = make_sender("nixl", layout, security=data_security(secure_cfg))
    src = make_pool(layout, seed=1)
    try:
        lease = leases.grant("r", [4, 5], ttl_s=60)
        send_request(sender, TransferTarget("r", lease, "decode-0", receiver.address, (4, 5), backend="nixl",
                                            dst_public_key=data_security(secure_cfg).public_key), src, [6, 7])
        result = wait_result(sender)
    finally:
        sender.close()
    assert result.ok, result.error
    assert torch.equal(pool[:, :, [4, 5]], src[:, :, [6, 7]])
    assert leases.close(lease) == "free"
