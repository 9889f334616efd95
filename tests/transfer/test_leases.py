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
    assert t.revoke(c) and not t.revoke(c) and t.get(c) is None
    assert sorted(t.revoke_request("r1")) == sorted([a, b])
    assert len(t) == 0 and t.revoke_request("r1") == []


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
    inside.wait(2)
    assert t.revoke(lid)
    events.append("revoked")
    th.join()
    assert events == ["write done", "revoked"]
    with t.writing(lid, "r", [1]) as err:
        assert err == "unknown or revoked lease"
