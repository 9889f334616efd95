from __future__ import annotations

import threading
import time

from pdd.transfer.leases import LeaseTable


def test_grant_get_revoke():
    t = LeaseTable()
    a = t.grant("r1", [1, 2], ttl_s=10)
    b = t.grant("r1", [3], ttl_s=10)
    c = t.grant("r2", [4], ttl_s=10)
    assert len({a, b, c}) == 3 and len(a) == 32 and len(t) == 3
    assert t.get(a).block_ids == frozenset({1, 2}) and t.get(a).request_id == "r1"
    assert t.close(c) == "free" and t.close(c) == "none" and t.get(c) is None
    assert t.close(a) == "free" and t.close(a) == "none" and len(t) == 1


def test_expired_lists_without_revoking():
    t = LeaseTable()
    old = t.grant("r1", [1], ttl_s=0.0)
    t.grant("r2", [2], ttl_s=60)
    assert t.expired() == [(old, "r1")]
    assert t.expired(now=time.monotonic() + 120) and len(t.expired(now=time.monotonic() + 120)) == 2
    assert len(t) == 2


def test_writing_checks():
    t = LeaseTable()
    lid = t.grant("r", [1, 2], ttl_s=10)
    cases = [
        ((lid, "r", [2, 1]), None),
        (("nope", "r", [1]), "unknown or revoked lease"),
        ((lid, "other", [1]), "lease belongs to another request"),
        ((lid, "r", [1, 17]), "block 17 is not leased to this request"),
    ]
    for args, expected in cases:
        with t.writing(*args) as err:
            assert err == expected
    gone = t.grant("r", [1], ttl_s=0.0)
    with t.writing(gone, "r", [1]) as err:
        assert err == "lease expired"


def test_revoke_waits_for_a_write_in_progress():
    """The safety property: revoke() returns only after a running write ended."""
    t = LeaseTable()
    lid = t.grant("r", [1], ttl_s=10)
    inside, events = threading.Event(), []

    def writer():
        with t.writing(lid, "r", [1]) as err:
            assert err is None
            inside.set()
            time.sleep(0.2)
            events.append("write done")

    th = threading.Thread(target=writer)
    th.start()
    assert inside.wait(30)
    assert t.close(lid) == "free"
    events.append("revoked")
    th.join()
    assert events == ["write done", "revoked"]
    with t.writing(lid, "r", [1]) as err:
        assert err == "unknown or revoked lease"


def test_one_sided_writer_holds_revoked_blocks_until_it_ends():
    """cuda_ipc: a lease closed while its writer may still store answers "held";
    the blocks are released once the writer ends, never before."""
    t = LeaseTable()
    lid = t.grant("r", [1, 2], ttl_s=10)
    assert t.begin_writer(lid, "other") == ("lease belongs to another request", 0.0)
    err, seconds = t.begin_writer(lid, "r")
    assert err is None and 9 < seconds <= 10
    assert t.close(lid) == "held" and t.num_held == 1
    assert t.released() == []
    assert t.end_writer(lid, "r") == "unknown or revoked lease"   # ended, but its KV is not wanted
    assert t.num_held == 1                                        # until the owner takes the blocks back
    (back,) = t.released()
    assert (back.lease_id, back.block_ids) == (lid, {1, 2})       # the blocks to give back
    assert t.released() == [] and t.num_held == 0


def test_committed_writer_frees_normally_and_refusals():
    t = LeaseTable()
    lid = t.grant("r", [1], ttl_s=10)
    assert t.begin_writer("nope", "r")[0] == "unknown or revoked lease"
    assert t.begin_writer(lid, "r")[0] is None
    assert t.end_writer(lid, "r") is None                  # commit: lease live, KV usable
    assert t.close(lid) == "free" and t.released() == []
    late = t.grant("r", [1], ttl_s=0.0)
    assert t.begin_writer(late, "r") == ("lease expired", 0.0)


def test_silent_writer_is_released_after_deadline_plus_grace():
    from pdd.transfer.leases import WRITER_GRACE_S
    t = LeaseTable()
    lid = t.grant("r", [1], ttl_s=5)
    t.begin_writer(lid, "r")
    assert t.close(lid) == "held"
    now = time.monotonic()
    assert t.released(now + 5 + WRITER_GRACE_S - 1) == []
    assert [lease.lease_id for lease in t.released(now + 5 + WRITER_GRACE_S + 1)] == [lid]
