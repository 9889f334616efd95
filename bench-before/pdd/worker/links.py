"""A worker's connections to the routers of its cluster, one link each.

Every router places requests of its own (pdd.config RouterConfig.routers:
active-active), so a worker holds requests of several routers at once. Their
ids are each router's own — a client's X-Request-Id may reach two routers —
so with more than one router every id is put in its router's namespace at this
boundary, `router-1|<id>`, before the engine sees it, and taken out on the way
back, which is also what says which router a reply goes to. The workers of a
cluster list its routers in one order, so a prefill and a decode worker name
one request alike (the KV data plane between them carries the id). With one
router, ids pass unchanged.

What a router's requests hold here (blocks, KV leases, reservations) is dropped
when that router says it does not know this worker (ReRegister) and when its
connection closes — the process is gone, and nothing it placed will be asked
for. Each such drop opens a new `session`, which the next Register carries: a
router that did not see the connection close learns from it that what it placed
here is gone, and moves it.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdd.protocol import messages as m
from pdd.protocol.bus import DealerChannel

SEPARATOR = "|"

# Commands whose request id is the router's; Abort names a list of them.
_ONE_ID = (m.Admit, m.Reserve, m.PrefillLocally, m.Prefill, m.KVTarget)
# Replies that name one request.
_REPLIES = (m.RequestFailed, m.Reserved, m.FirstToken, m.PrefillDone, m.PrefillFailed)


@dataclass(eq=False)
class RouterLink:
    """One router: its connection and what this worker knows of it."""
    index: int
    addr: str
    prefix: str                  # "router-I|" with several routers, "" with one
    chan: DealerChannel | None = None
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    liveness_s: float = 0.0      # the router's, from its RegisterReply (0: it does not answer heartbeats)
    last_heard: float = field(default_factory=time.monotonic)
    unanswered: bool = False     # said so: no answer for its liveness window
    session: int = 0             # drops of everything it placed here, so far
    # Drops the engine thread has not done yet: until it has, what it hands over
    # for this router is about requests that are dropped.
    forgets_pending: int = 0

    @property
    def name(self) -> str:
        """As log lines name it: "router", or "router-I" of several."""
        return self.prefix.removesuffix(SEPARATOR) or "router"


def make_links(addrs: list[str]) -> list[RouterLink]:
    several = len(addrs) > 1
    return [RouterLink(i, addr, f"router-{i}{SEPARATOR}" if several else "") for i, addr in enumerate(addrs)]


def into_namespace(link: RouterLink, msg: m.Message) -> m.Message:
    """A router's command with its request ids in that router's namespace."""
    if not link.prefix:
        return msg
    if isinstance(msg, _ONE_ID):
        msg.request_id = link.prefix + msg.request_id
    elif isinstance(msg, m.Abort):
        msg.request_ids = [link.prefix + rid for rid in msg.request_ids]
    elif isinstance(msg, m.ResetPrefixCache):
        msg.reset_id = link.prefix + msg.reset_id
    return msg


class Outgoing:
    """Which router each message the engine thread hands over goes to."""

    def __init__(self, links: list[RouterLink]):
        self.links = links
        self.by_prefix = {link.prefix.removesuffix(SEPARATOR): link for link in links}

    def route(self, msg: m.Message) -> list[tuple[RouterLink, m.Message]]:
        """(link, message) pairs, ids back in each router's own terms; a message
        about no request (none today) goes to every router."""
        if len(self.links) == 1:
            return [(self.links[0], msg)]
        if isinstance(msg, m.TokenBatch):
            batches: dict[RouterLink, list[m.TokenItem]] = {}
            for item in msg.items:
                link, item.request_id = self._split(item.request_id)
                if link is not None:
                    batches.setdefault(link, []).append(item)
            return [(link, m.TokenBatch(msg.worker_id, items)) for link, items in batches.items()]
        if isinstance(msg, _REPLIES):
            link, msg.request_id = self._split(msg.request_id)
            return [(link, msg)] if link is not None else []
        if isinstance(msg, m.PrefixCacheReset):
            link, msg.reset_id = self._split(msg.reset_id)
            return [(link, msg)] if link is not None else []
        return [(link, msg) for link in self.links]

    def _split(self, rid: str) -> tuple[RouterLink | None, str]:
        namespace, _, own = rid.partition(SEPARATOR)
        return self.by_prefix.get(namespace), own


def held_by(link: RouterLink, request_id: str) -> bool:
    """Whether a request id (as the engine holds it) is one of this router's."""
    return request_id.startswith(link.prefix)
