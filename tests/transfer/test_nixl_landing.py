"""The nixl decode side's landing region, between two processes through UCX
host memory (as test_nixl.py): a request's pages land contiguously (two
descriptors per layer, however scattered its blocks are in the pool) and are
copied into its blocks at the commit; a full region falls back to writes into
the blocks; a failed, aborted or stalled request, or a dead peer, gives its
range back exactly when its blocks come back."""
from __future__ import annotations


import pytest
import torch

from pdd.transfer import make_receiver
from pdd.transfer.leases import LeaseTable
from pdd.transfer.nixl_agent import unavailable
from tests.e2e.cluster import _wait_for
from tests.transfer.conftest import LAYERS, make_layout, make_pool
from tests.transfer.peers import Peer, send, send_and_compare, target, wait_result
from tests.transfer.test_nixl import GRACE_S, make_nixl_sender, own_peer, stalled_request  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

POOL_BLOCKS = 40


def range_bytes(layout, blocks: int) -> int:
    page = layout.block_size * layout.num_kv_heads * layout.head_dim * getattr(torch, layout.kv_cache_dtype).itemsize
    return LAYERS * 2 * blocks * page


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def peer(request):
    """Room for two ranges of 8 blocks (256-byte aligned, as the arena hands them out)."""
    layout = make_layout(request.param)
    p = Peer(layout, backend="nixl", writer_grace_s=GRACE_S, blocks=POOL_BLOCKS,
             landing_bytes=2 * range_bytes(layout, 8) + 512)
    yield p
    p.stop()


def src_pool(layout, seed: int) -> torch.Tensor:
    return make_pool(layout, seed, blocks=POOL_BLOCKS)


def settled(peer: Peer) -> bool:
    st = peer("stats")
    return st["landing_ranges"] == 0 and st["landing_out"] == 0


@pytest.mark.parametrize("dst", [
    [31, 4, 17, 9, 22, 13, 2, 38],     # no two neighbours in the pool, in no order
    [8, 7, 6, 5, 30, 29],              # runs, descending
])
def test_scattered_blocks_land_in_two_descriptors_per_layer(peer, make_nixl_sender, dst):
    sender = make_nixl_sender(peer.layout)
    src = src_pool(peer.layout, seed=21)
    src_blocks = [3, 33, 12, 0, 25, 7, 19, 36][:len(dst)]
    landed = peer("stats")["landed_requests"]
    # the blocks, and nothing else, hold the pages
    r, t = send_and_compare(peer, sender, src, "l" + "-".join(map(str, dst)), dst, src_blocks)
    assert r.descriptors == LAYERS * 2                    # k and v of each layer, one range
    assert peer("stats")["landed_requests"] == landed + 1
    assert settled(peer)                                 # the commit gave the range back
    assert peer("close", t.lease_id) == "free"


def test_a_chunked_prompt_lands_each_chunk_as_one_run(peer, make_nixl_sender):
    sender = make_nixl_sender(peer.layout)
    src = src_pool(peer.layout, seed=22)
    before = peer("pool")
    dst = [27, 3, 35, 11, 19, 6]
    t = target(peer, "c1", dst)
    sender.prepare(t)
    send(sender, t, src, [1, 2, 3], indices=[0, 1, 2])     # two steps of a chunked prompt
    send(sender, t, src, [4, 5, 6], indices=[3, 4, 5])
    sender.finish("c1")
    r = wait_result(sender, "c1")
    assert r.ok, r.error
    assert r.descriptors == 2 * LAYERS * 2
    expected = before.clone()
    expected[:, :, dst] = src[:, :, [1, 2, 3, 4, 5, 6]]
    assert torch.equal(peer("pool"), expected)
    assert settled(peer)
    assert peer("close", t.lease_id) == "free"


def test_a_full_region_falls_back_to_writes_into_the_blocks(peer, make_nixl_sender):
    """Three requests at once, the region has room for two: the third is
    written straight into its blocks (one descriptor per k|v per block), and
    all three equal the source."""
    sender = make_nixl_sender(peer.layout)
    src = src_pool(peer.layout, seed=23)
    before = peer("pool")
    landed = peer("stats")["landed_requests"]
    dsts = {"f1": [30, 2, 14, 8, 26, 20, 33, 11], "f2": [5, 37, 17, 23, 39, 1, 28, 12],
            "f3": [9, 15, 21, 3, 34, 24]}
    srcs = {"f1": list(range(8)), "f2": list(range(10, 18)), "f3": list(range(20, 26))}
    targets = {rid: target(peer, rid, dst) for rid, dst in dsts.items()}
    writers = peer("stats")["writers"]
    for rid in ("f1", "f2"):
        sender.prepare(targets[rid])
    # Both hold their range before the third asks.
    _wait_for(lambda: peer("stats")["writers"] == writers + 2, what="two writers to begin")
    sender.prepare(targets["f3"])
    for rid in dsts:
        send(sender, targets[rid], src, srcs[rid])
    for rid in dsts:
        sender.finish(rid)
    results = {rid: wait_result(sender, rid) for rid in dsts}
    assert all(r.ok for r in results.values()), {rid: r.error for rid, r in results.items()}
    assert results["f1"].descriptors == results["f2"].descriptors == LAYERS * 2
    assert results["f3"].descriptors == LAYERS * 2 * len(dsts["f3"])   # no two neighbours: a run each
    assert peer("stats")["landed_requests"] == landed + 2
    expected = before.clone()
    for rid, dst in dsts.items():
        expected[:, :, dst] = src[:, :, srcs[rid]]
    assert torch.equal(peer("pool"), expected)
    assert settled(peer)
    assert [peer("close", t.lease_id) for t in targets.values()] == ["free"] * 3


def test_an_aborted_request_keeps_its_range_as_long_as_its_blocks(peer, make_nixl_sender):
    sender = make_nixl_sender(peer.layout)
    writers = peer("stats")["writers"]
    t = target(peer, "a1", [6, 31, 18])
    sender.prepare(t)
    _wait_for(lambda: peer("stats")["writers"] > writers, what="the writer to begin")
    assert peer("stats")["landing_ranges"] == 1
    send(sender, t, src_pool(peer.layout, seed=24), [2, 9, 4], layers=[0])
    assert peer("close", t.lease_id) == "held"            # aborted on the decode side while we may write
    assert peer("stats")["landing_ranges"] == 1           # the range is held with the blocks
    sender.abort("a1")
    assert _wait_for(lambda: peer("released"), what="the held lease to be released") == [t.lease_id]
    _wait_for(lambda: settled(peer), what="the range to come back")
    assert sender.poll() == []


def test_an_expiring_lease_frees_its_range_with_its_blocks(peer, make_nixl_sender):
    """The writer begins (a range is granted), then its lease would expire
    before it may write: it fails and ends; the range comes back."""
    sender = make_nixl_sender(peer.layout)
    before = peer("pool")
    t = target(peer, "e1", [10, 36], ttl_s=0.5)           # shorter than the sender's safety margin
    send(sender, t, src_pool(peer.layout, seed=25), [0, 1])
    sender.finish("e1")
    r = wait_result(sender, "e1")
    assert not r.ok and "would expire" in r.error
    assert _wait_for(lambda: peer("expired"), what="the lease to expire") == [(t.lease_id, "free")]
    _wait_for(lambda: settled(peer), what="the range to come back")
    assert torch.equal(peer("pool"), before)


def test_a_stalled_write_keeps_the_range_until_the_writer_surely_stopped(own_peer, make_nixl_sender):
    """A stalled request's writes are cancelled (they may still land): no end
    is sent, so the range, like the blocks, is held until the lease's deadline
    plus the grace; then both come back and the next request lands."""
    peer = own_peer(blocks=POOL_BLOCKS, landing_bytes=2 * range_bytes(make_layout(), 8) + 512)
    sender = make_nixl_sender(peer.layout, timeout_s=1.0)
    r, t = stalled_request(peer, sender, "s1", [3, 21], src_pool(peer.layout, seed=26), [5, 6])
    assert not r.ok
    if peer("close", t.lease_id) == "held":
        assert _wait_for(lambda: peer("released"), what="the held lease to be released") == [t.lease_id]
    _wait_for(lambda: settled(peer), what="the range to come back")
    src = src_pool(peer.layout, seed=27)
    before = peer("pool")
    t2 = target(peer, "s2", [33, 7, 25])
    send(sender, t2, src, [1, 2, 3])
    sender.finish("s2")
    r2 = wait_result(sender, "s2")
    assert r2.ok and r2.descriptors == LAYERS * 2, r2.error
    expected = before.clone()
    expected[:, :, [33, 7, 25]] = src[:, :, [1, 2, 3]]
    assert torch.equal(peer("pool"), expected)


def test_a_write_aimed_outside_its_range_fails_the_commit(peer, make_nixl_sender):
    """Every notification of a lease with a range must name that range: a
    write that says it went straight into the blocks (forced here by dropping
    the granted range on the sender after the begin) is refused, and nothing
    of it is copied into the blocks from the region."""
    sender = make_nixl_sender(peer.layout)
    writers = peer("stats")["writers"]
    before = peer("pool")
    t = target(peer, "w1", [16, 2])
    sender.prepare(t)
    _wait_for(lambda: peer("stats")["writers"] > writers, what="the writer to begin")
    req = sender._reqs["w1"]
    _wait_for(lambda: req.granted, what="the begin's answer")
    req.landing, req.landing_offset = None, -1           # the fault: write into the blocks instead
    send(sender, t, src_pool(peer.layout, seed=28), [0, 1])
    sender.finish("w1")
    r = wait_result(sender, "w1")
    assert not r.ok and r.error == "the write landed outside the request's landing range", r.error
    after = peer("pool")
    # The direct writes did land in the blocks (nothing can refuse a one-sided
    # write); the refused commit means the engine never uses them.
    others = [b for b in range(POOL_BLOCKS) if b not in (16, 2)]
    assert torch.equal(after[:, :, others], before[:, :, others])
    _wait_for(lambda: settled(peer), what="the range to come back")
    assert peer("close", t.lease_id) == "free"


def test_the_arena_hands_out_ranges_first_fit_and_merges_what_comes_back():
    from pdd.transfer.nixl_landing import LandingArena

    layout = make_layout()
    kv = make_pool(layout, seed=3)
    one = range_bytes(layout, 1)                         # 256-byte aligned already
    arena = LandingArena(5 * one, kv)
    a, b, c = arena.take(2), arena.take(1), arena.take(2)
    assert (a, b, c) == (0, 2 * one, 3 * one) and arena.take(1) is None
    arena.give_back(a, 2)
    assert arena.take(3) is None                         # two free blocks' room, not three
    arena.give_back(b, 1)                                # merged with a's: three
    assert arena.take(3) == 0 and arena.held == 2
    pages = arena.pages(3 * one, 2)
    assert list(pages.shape) == [LAYERS, 2, 2, *kv.shape[3:]]


def test_copy_out_writes_exactly_the_written_pages_of_each_layer():
    from pdd.transfer.nixl_landing import LandingArena

    layout = make_layout()
    kv = make_pool(layout, seed=3)
    before = kv.clone()
    arena = LandingArena(range_bytes(layout, 3), kv)
    offset = arena.take(3)
    rng = arena.pages(offset, 3)
    rng.copy_(make_pool(layout, seed=9, blocks=3))
    # Blocks 7, 2 at places 0, 2 in every layer; block 5 (place 1) written in layer 1 only.
    arena.copy_out(offset, 3, {7: 0, 5: 1, 2: 2}, {0: {7, 2}, 1: {7, 5, 2}, 2: {7, 2}})
    expected = before.clone()
    expected[:, :, [7, 2]] = rng[:, :, [0, 2]]
    expected[1, :, 5] = rng[1, :, 1]
    assert torch.equal(kv, expected)


def test_the_setting_is_validated_and_its_default_is_one_longest_request():
    from pdd.config import ConfigError, WorkerConfig
    from pdd.config_loader import load_cluster_config
    from pdd.transfer.nixl_landing import landing_bytes

    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="worker.nixl_landing_bytes"):
            WorkerConfig(nixl_landing_bytes=bad).validate()
    cfg = load_cluster_config(env={"PDD_WORKER__NIXL_LANDING_BYTES": "0"})
    assert cfg.worker.nixl_landing_bytes == 0
    assert landing_bytes(None, 128 << 10, 16384) == 2 << 30           # the 8B shape's 16k tokens: the cap
    assert landing_bytes(None, 128 << 10, 131072) == 2 << 30
    assert landing_bytes(None, 2048, 4096) == 8 << 20
    assert landing_bytes(0, 2048, 4096) == 0 and landing_bytes(12345, 2048, 4096) == 12345


def test_a_pool_sized_from_free_gpu_memory_leaves_the_region_room(monkeypatch):
    """gpu_kv_budget is replaced (no GPU here): the path a GPU worker takes
    when its pool is sized from free memory."""
    import pdd.kv.cache as cache
    from pdd.config import EngineConfig

    monkeypatch.setattr(cache, "gpu_kv_budget", lambda device, utilization: 1000 << 20)
    spec = cache.KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    gpu = torch.device("cuda")
    per_block = spec.bytes_per_block
    assert spec.num_blocks_for(EngineConfig(), gpu) == (1000 << 20) // per_block
    assert spec.num_blocks_for(EngineConfig(), gpu, beside_bytes=100 << 20) == (900 << 20) // per_block
    # A pool of a fixed size is that size: the region comes on top.
    assert spec.num_blocks_for(EngineConfig(kv_cache_bytes=64 << 20), gpu, beside_bytes=100 << 20) == \
        (64 << 20) // per_block


def test_the_warm_up_copies_through_the_region_and_leaves_the_pool_as_it_was():
    layout = make_layout()
    pool = make_pool(layout, seed=2)
    before = pool.clone()
    receiver = make_receiver("nixl", pool, layout, LeaseTable(), nixl_landing_bytes=range_bytes(layout, 2))
    try:
        receiver.warm_up()
        assert torch.equal(pool, before)
    finally:
        receiver.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_scattered_blocks_land_on_a_gpu(make_nixl_sender):
    """Both pools on the GPU (the decode side in its own process): UCX moves
    device memory, and the copy out of the region runs on its own stream and
    is done before the commit is accepted."""
    layout = make_layout("bfloat16")
    peer = Peer(layout, device="cuda", backend="nixl", blocks=POOL_BLOCKS, landing_bytes=range_bytes(layout, 8))
    try:
        sender = make_nixl_sender(layout)
        src = src_pool(layout, seed=29).cuda()
        before = peer("pool")
        dst = [31, 4, 17, 9, 22, 13, 2, 38]
        t = target(peer, "g1", dst)
        sender.prepare(t)
        send(sender, t, src, [3, 33, 12, 1, 25, 7, 19, 36])
        sender.finish("g1")
        r = wait_result(sender, "g1")
        assert r.ok and r.descriptors == LAYERS * 2, r.error
        expected = before.clone()
        expected[:, :, dst] = src[:, :, [3, 33, 12, 1, 25, 7, 19, 36]].cpu()
        assert torch.equal(peer("pool"), expected)
        assert peer("stats")["landed_requests"] == 1 and settled(peer)
    finally:
        peer.stop()
