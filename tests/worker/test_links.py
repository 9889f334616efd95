"""A worker's links to several routers (pdd.worker.links): each router's
request ids in a namespace of its own on the way in, back in its own terms on
the way out, and every reply to the router whose request it is."""
from __future__ import annotations

from pdd import SamplingParams
from pdd.protocol import messages as m
from pdd.worker.links import Outgoing, held_by, into_namespace, make_links


def admit(rid: str) -> m.Admit:
    return m.Admit(rid, 1, [1, 2, 3], SamplingParams(max_tokens=2))


def test_one_router_sees_its_ids_unchanged():
    (link,) = links = make_links(["tcp://a:1"])
    assert into_namespace(link, admit("x")).request_id == "x"
    batch = m.TokenBatch("w", [m.TokenItem("x", 1, 0, [5])])
    assert Outgoing(links).route(batch) == [(link, batch)]


def test_the_same_client_id_from_two_routers_is_two_requests_and_each_reply_goes_home():
    r0, r1 = links = make_links(["tcp://a:1", "tcp://b:1"])
    a, b = into_namespace(r0, admit("x")), into_namespace(r1, admit("x"))   # one X-Request-Id, two routers
    assert a.request_id != b.request_id and held_by(r0, a.request_id) and not held_by(r0, b.request_id)
    abort = into_namespace(r1, m.Abort(["x", "y|z"]))
    assert abort.request_ids == [f"{r1.prefix}x", f"{r1.prefix}y|z"]
    out = Outgoing(links)
    batch = m.TokenBatch("w", [m.TokenItem(a.request_id, 1, 0, [5]), m.TokenItem(b.request_id, 1, 0, [6]),
                               m.TokenItem(f"{r1.prefix}y|z", 1, 3, [7])])
    routed = {link.index: msg for link, msg in out.route(batch)}
    assert [(i.request_id, i.token_ids) for i in routed[0].items] == [("x", [5])]
    assert [(i.request_id, i.token_ids) for i in routed[1].items] == [("x", [6]), ("y|z", [7])]
    (home, failed), = out.route(m.RequestFailed("w", b.request_id, 1, "boom"))
    assert home is r1 and failed.request_id == "x"
    reset = into_namespace(r0, m.ResetPrefixCache("flush-1"))
    (home, answer), = out.route(m.PrefixCacheReset("w", reset.reset_id, 3))
    assert home is r0 and answer.reset_id == "flush-1"


def test_a_reply_for_no_known_router_is_dropped():
    out = Outgoing(make_links(["tcp://a:1", "tcp://b:1"]))
    assert out.route(m.PrefillFailed("w", "router-7|x", 1, "gone")) == []
