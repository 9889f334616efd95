"""A request's last data-plane message: the receiver accepts it only once every
page before it was written under a still live lease, and only then reports
the request landed, with the prefill side's first token (what the decode
worker starts on). tcp, local and nixl, through the `backend` fixture."""
from __future__ import annotations

import threading

import pytest

from pdd.transfer.base import Handoff, Landed
from pdd.transfer.leases import LeaseTable

FIRST = Handoff(17, [[-0.25, [[17, -0.25]]]], 32)


@pytest.fixture
def landing(pair):
    """The pair's lease table, reporting landed requests as the decode worker's does."""
    woken = threading.Event()
    pair.leases._on_landed = woken.set   # (a LeaseTable built with on_landed=woken.set)
    return pair, woken


def test_the_last_message_reports_the_first_token_after_every_page(landing):
    pair, woken = landing
    target = pair.target("r", [3, 7])
    pair.sender.prepare(target)
    pair.send_all(target, [1, 2])
    pair.sender.finish("r", handoff=FIRST)
    assert pair.wait_result("r").ok
    assert woken.is_set()
    assert pair.leases.landed() == [Landed("r", target.lease_id, FIRST)]
    assert pair.leases.landed() == []                       # each one once
    assert (pair.dst[:, :, [3, 7]] == pair.src[:, :, [1, 2]]).all()


def test_a_request_without_pages_still_lands(landing):
    """Every block skipped (the decode worker caches them): the last message alone starts it."""
    pair, _ = landing
    target = pair.target("r", [])
    pair.sender.prepare(target)
    pair.sender.finish("r", blocks_skipped=2, handoff=FIRST)
    r = pair.wait_result("r")
    assert r.ok and r.bytes == 0 and r.blocks_skipped == 2
    assert pair.leases.landed() == [Landed("r", target.lease_id, FIRST)]


def test_nothing_lands_under_a_revoked_lease(landing):
    pair, woken = landing
    target = pair.target("r", [3])
    pair.send_all(target, [1])
    pair.sender.step_done()
    closed = pair.leases.close(target.lease_id)               # aborted meanwhile
    # A one-sided writer (nixl) that has begun keeps the blocks held until it ends.
    assert closed == "free" or (pair.backend == "nixl" and closed == "held")
    pair.sender.finish("r", handoff=FIRST)
    r = pair.wait_result("r")
    assert not r.ok and r.error == "unknown or revoked lease"
    assert pair.leases.landed() == [] and not woken.is_set()
    if closed == "held":
        assert [held.lease_id for held in pair.leases.released()] == [target.lease_id]     # the refused commit ended the writer


def test_a_refused_page_keeps_the_request_from_landing(landing, monkeypatch):
    """A page refused for a reason other than the lease (a forced fault on layer
    0) must not let the last message through, though the lease is still live."""
    pair, _ = landing
    if pair.backend == "nixl":   # the check of a write's notification
        from pdd.transfer.nixl_control import NixlControl
        real_nixl = NixlControl._check
        monkeypatch.setattr(NixlControl, "_check", lambda self, note, lease_id: "forced fault" if note["layer"] == 0
                            else real_nixl(self, note, lease_id))
    else:
        from pdd.transfer.receiver import PageWriter
        real = PageWriter._check
        monkeypatch.setattr(PageWriter, "_check",
                            lambda self, h, payload: "forced fault" if h["layer"] == 0 else real(self, h, payload))
    pair.send_all(pair.target("r", [3, 4]), [1, 2])
    pair.sender.finish("r", handoff=FIRST)
    r = pair.wait_result("r")
    assert not r.ok and r.error == "forced fault"
    assert pair.leases.landed() == []


def test_a_transfer_alone_lands_nothing(landing):
    """finish() without a handoff (tests, benchmarks): checked, reported, nobody started."""
    pair, woken = landing
    pair.send_all(pair.target("r", [5]), [6])
    pair.sender.finish("r")
    assert pair.wait_result("r").ok
    assert pair.leases.landed() == [] and not woken.is_set()


def test_the_page_count_is_checked():
    """The last message says how many pages messages came before it."""
    leases = LeaseTable()
    lease = leases.grant("r", [1], ttl_s=30)
    with leases.writing(lease, "r", [1]) as err:
        assert err is None
    assert leases.complete(lease, "r", 2, FIRST) == "1 of the request's 2 pages messages were written"
    assert leases.landed() == []
    assert leases.complete(lease, "r", 1, FIRST) is None
    assert leases.landed() == [Landed("r", lease, FIRST)]


def test_a_writer_commit_lands_with_its_handoff():
    """cuda_ipc: the commit after the copies completed is the last message."""
    woken = threading.Event()
    leases = LeaseTable(on_landed=woken.set)
    lease = leases.grant("r", [1], ttl_s=30)
    assert leases.begin_writer(lease, "r")[0] is None
    assert leases.end_writer(lease, "r", FIRST) is None and woken.is_set()
    assert leases.landed() == [Landed("r", lease, FIRST)]
    assert leases.close(lease) == "free"
