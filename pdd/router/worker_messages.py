"""What a worker sends: checked, handed to the one handler of its type, and read.

pdd.router.router has matched the connection a message came on to the worker
id it speaks for; here the message itself is checked before anything acts on
it:

    of a type no handler takes                             logged, dropped
    a message that names another worker than its sender   logged, dropped
    from a worker not registered (lost, or from before a router restart):
        dropped, and the request it names aborted there — whatever that
        worker holds is nobody's; it re-registers on its next heartbeat
        (Register and Heartbeat pass: they are how it does)
    otherwise   the sender counts as heard (its liveness; not by a Register,
                which may be another process's under its id), and the
                message goes to its handler, its request id in the log context

Registration, heartbeats and goodbyes are pdd.router.membership's; what a
worker says about a request (TokenBatch, Reserved, FirstToken, PrefillDone,
PrefillFailed, RequestFailed) is the request state machine's
(pdd.router.control), which first asks `current` whether the message speaks
of the request's current placement: same epoch, from the worker that owns
the phase. A message about any other is stale, and a worker that holds a
copy it does not own is told to drop it. Of a current TokenBatch item, `unseen`
reads the part its client has not had: each item says where its tokens stand
in the output.

What the state machine does with each message is pdd.router.control's; what
is here decides nothing about a request.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from pdd.logs import request_context
from pdd.protocol import messages as m
from pdd.router.membership import Membership
from pdd.router.registry import WorkerRegistry
from pdd.router.requests import RequestState, TokenEvent

log = logging.getLogger(__name__)

Handler = Callable[[str, m.Message], None]


class WorkerMessages:
    def __init__(self, registry: WorkerRegistry, membership: Membership, requests: dict[str, RequestState],
                 send: Callable[[str, m.Message], None], request_handlers: dict[type, Handler]):
        """requests: the requests in flight by id (pdd.router.inflight's table);
        request_handlers: the state machine's handler of each message about a request."""
        self.registry = registry
        self.membership = membership
        self.requests = requests
        self.send = send
        self._handlers: dict[type, Handler] = {
            m.Register: membership.on_register, m.Heartbeat: membership.on_heartbeat,
            m.Goodbye: membership.on_goodbye, **request_handlers,
        }

    def handle(self, peer: str, msg: m.Message) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("router: ignoring %s from %s", msg.TYPE, peer)
            return
        if getattr(msg, "worker_id", peer) != peer:
            log.warning("router: %s from %s claims to be %s; dropped", msg.TYPE, peer, msg.worker_id)
            return
        rid = getattr(msg, "request_id", None)
        if type(msg) not in (m.Register, m.Heartbeat) and peer not in self.registry.workers:
            # Not registered (lost, or from before a router restart): whatever it
            # holds is nobody's; it re-registers on its next heartbeat.
            if rid is not None:
                self.send(peer, m.Abort([rid]))
            return
        if type(msg) is not m.Register:   # (a Register may be another process's, under its id)
            self.membership.heard(peer)
        with request_context(rid):   # what it logs carries the request's id
            handler(peer, msg)

    def current(self, peer: str, request_id: str, epoch: int, phase: str | None, owner: str
                ) -> RequestState | None:
        """The request a worker's message speaks of, if that message is current:
        same epoch, the sender owns the phase. A worker that holds a request it
        does not own (any more) is told to drop it."""
        state = self.requests.get(request_id)
        owns = state is not None and (
            (owner in ("decode", "any") and state.decode_worker == peer)
            or (owner in ("prefill", "any") and state.prefill_worker == peer))
        if state is not None and owns and state.epoch == epoch and (phase is None or state.phase == phase):
            return state
        if state is None or peer not in state.owners:
            # Unknown (finished, aborted, from before a restart) or placed elsewhere:
            # its copy there is nobody's. (An owner of the current epoch with a
            # stale message was sent an Abort before this epoch began.)
            self.send(peer, m.Abort([request_id]))
        return None


class TokenGap(Exception):
    """A decode worker's tokens start past what the client has: it lost some."""


def unseen(state: RequestState, item: m.TokenItem) -> TokenEvent | m.TokenItem | None:
    """The part of `item` the client has not had (None: nothing), or TokenGap.
    The first token can come twice (from the prefill worker, and from the
    decode worker that started on the KV)."""
    seen = len(state.output_token_ids) - item.position
    if seen < 0:
        raise TokenGap
    if seen == 0:   # the common case: all of it is new (an item is an event's shape)
        return item
    tokens = item.token_ids[seen:]
    if not tokens and not item.finished:
        return None
    return TokenEvent(tokens, item.finished, item.finish_reason,
                      item.logprobs[seen:] if item.logprobs else item.logprobs, item.num_cached_tokens)


def transfer_note(peer: str, stats: dict) -> str:
    """A transfer's figures as its prefill worker measured them (PrefillDone.transfer)."""
    return (f"from {peer}: {float(stats.get('seconds', 0.0)):.4f}s, {int(stats.get('bytes', 0))} bytes, "
            f"{int(stats.get('blocks_sent', 0))} blocks sent, {int(stats.get('blocks_skipped', 0))} skipped")
