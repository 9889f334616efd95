"""cuda_ipc with keys, on a GPU: the decode worker's data socket runs CURVE, the
cluster's sender opens its pool (under a live lease) and writes; a sender with
keys of its own gets no pool and writes nothing. Runs only where CUDA is."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from pdd.transfer import make_sender
from pdd.transfer.base import TransferTarget
from tests.security.conftest import secure_config
from tests.transfer.conftest import make_layout, make_pool
from tests.transfer.peers import serve_pool, wait_result

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PEER = "cuda:1" if torch.cuda.is_available() and torch.cuda.device_count() > 1 else "cuda:0"


@pytest.fixture(scope="module")
def peer(keys):
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=serve_pool, args=(child, make_layout().to_dict(), PEER, 2, str(keys)), daemon=True)
    proc.start()
    assert conn.poll(120), "peer did not start"
    address, key = conn.recv()

    def ask(*cmd):
        conn.send(cmd)
        assert conn.poll(30), f"peer did not answer {cmd[0]}"
        return conn.recv()

    ask.address, ask.key = address, key
    yield ask
    ask("stop")
    proc.join(10)


def transfer(sender, peer, rid: str, dst: list[int], src: torch.Tensor):
    target = TransferTarget(rid, peer("grant", rid, dst, 30), "d", peer.address, tuple(dst), backend="cuda_ipc",
                            dst_public_key=peer.key)
    sender.prepare(target)
    for layer in range(src.shape[0]):
        sender.send_layer(target, layer, src[layer], [1, 6], [0, 1])
    sender.step_done()
    sender.finish(rid)
    return wait_result(sender, rid)


@pytest.mark.parametrize("whose", ["cluster", "stranger"])
def test_the_pool_opens_only_to_the_cluster(peer, keys, stranger_keys, whose):
    from pdd.security import data_security

    layout = make_layout()
    sec = data_security(secure_config(keys if whose == "cluster" else stranger_keys))
    sender = make_sender("cuda_ipc", layout, timeout_s=5, device="cuda:0", security=sec)
    src = make_pool(layout, seed=1).cuda()
    before = peer("pool")
    try:
        result = transfer(sender, peer, f"r-{whose}", [9, 3], src)
    finally:
        sender.close()
    after = peer("pool")
    if whose == "cluster":
        assert result.ok, result.error
        expected = before.clone()
        expected[:, :, [9, 3]] = src[:, :, [1, 6]].cpu()
        assert torch.equal(after, expected)
    else:   # no handshake: the open is never answered (whichever wait gives up first), nothing is written
        assert not result.ok and "no answer to ipc_" in result.error
        assert torch.equal(after, before)
