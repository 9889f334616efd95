"""What a worker does with the router's commands, by role.

Every role can run a request whole (Admit: prefill and decode here): the
router sends one to a prefill worker only when no decode-capable worker is
left, so that no request is lost.

DecodeSide (decode and colocated workers): reserve blocks under a lease, run
the KV receiver, start decoding when the data plane reports the last page
landed (with the first token: no relay through the router), fall back to a
local prefill on PrefillLocally, and expire leases whose KV never came. A
lease closed while a one-sided (cuda_ipc) writer may still store into its
blocks keeps them held until the writer ends (pdd.transfer.leases).

PrefillSide (prefill workers, and colocated workers with
worker.prefill_for_others beside their DecodeSide): run prompts as
prefill-only requests, ship their KV layer by layer through the connector,
send the first token to the router as soon as it is sampled (FirstToken) and
in the transfer's last message to the decode worker, and report PrefillDone
once the decode worker accepted that message.

Both live on the worker's engine thread and are driven between steps, so
they touch the engine only while no step runs. The engine knows each request
by its placement's engine id (pdd.worker.placements); every reply carries the
request id and epoch of that placement. Invariant on the decode side: a lease
is revoked before its blocks are freed or start being used, so a late page can
never land in blocks that belong to another request.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from pdd import faults
from pdd.api import InvalidRequest
from pdd.config import WorkerConfig
from pdd.engine.engine import EngineOutput, LLMEngine
from pdd.kv.layout import KVLayout
from pdd.protocol import messages as m
from pdd.security import Curve
from pdd.transfer import MultiSender, make_receiver, make_sender, offered_backends
from pdd.transfer.base import Handoff, Landed, TransferTarget
from pdd.transfer.connector import PrefillConnector
from pdd.transfer.leases import LeaseTable
from pdd.worker.placements import PlacementTable

log = logging.getLogger(__name__)


def admit(engine: LLMEngine, worker_id: str, placements: PlacementTable, msg: m.Admit) -> list[m.Message]:
    """Run a request whole here: prompt (+ tokens streamed elsewhere before) and decode."""
    try:
        with placements.placing(msg.request_id, msg.epoch) as eid:
            engine.add_request(eid, msg.prompt_token_ids, msg.sampling,
                               num_prior_output_tokens=msg.num_prior_output_tokens, block_hashes=msg.block_hashes,
                               prefill_chunk=msg.prefill_chunk)
    except InvalidRequest as e:
        return [m.RequestFailed(worker_id, msg.request_id, msg.epoch, str(e), retriable=False)]
    return []


def token_batch(worker_id: str, placements: PlacementTable, outputs: list[EngineOutput]) -> list[m.Message]:
    """A step's tokens (or requests the first token ended): one TokenBatch.
    A finished request's placement ends here."""
    items = []
    for o in outputs:
        p = placements.remove(o.request_id) if o.finished else placements.get(o.request_id)
        items.append(m.TokenItem(p.request_id, p.epoch, o.position, o.new_token_ids, o.finished,
                                 o.finish_reason, o.logprobs or None, o.num_cached_tokens))
    return [m.TokenBatch(worker_id, items)] if items else []


class DecodeSide:
    def __init__(self, engine: LLMEngine, worker_id: str, wc: WorkerConfig, layout: KVLayout,
                 placements: PlacementTable, wakeup: Callable[[], None], security: Curve | None = None):
        """wakeup: called from the receiver's thread when a request's KV landed.
        security: the data socket's (pdd.security.data_security; None: plaintext)."""
        self.engine = engine
        self.worker_id = worker_id
        self.placements = placements
        self.leases = LeaseTable(on_landed=wakeup)
        # One socket at data_addr takes tcp pages and cuda_ipc control messages.
        self.receiver = make_receiver(wc.transfer_backend, engine.runner.kv_cache, layout, self.leases,
                                      wc.data_addr, security=security)
        self.receiver.start()
        self.lease_of: dict[str, str] = {}     # engine id -> its live lease
        # Engine id -> the lease it ran under, for requests started by the data
        # plane: a PrefillLocally that crossed the start names that lease.
        self.started: dict[str, str] = {}
        self.held: dict[str, list[int]] = {}   # closed leases whose writer may still store

    @property
    def data_addr(self) -> str:
        return self.receiver.address

    def handle(self, msg: m.Message) -> list[m.Message]:
        if isinstance(msg, m.Reserve):
            return [self._reserve(msg)]
        if isinstance(msg, m.PrefillLocally):
            return self._prefill_locally(msg)
        raise TypeError(f"DecodeSide does not take {msg.TYPE} messages")

    def on_outputs(self, outputs: list[EngineOutput]) -> list[m.Message]:
        for o in outputs:
            if o.finished:
                self.started.pop(o.request_id, None)
        return token_batch(self.worker_id, self.placements, outputs)

    def _reserve(self, msg: m.Reserve) -> m.Reserved:
        wid = self.worker_id
        try:
            with self.placements.placing(msg.request_id, msg.epoch) as eid:
                reserved = self.engine.reserve(eid, msg.prompt_token_ids, msg.sampling, msg.block_hashes)
        except InvalidRequest as e:
            return m.Reserved(wid, msg.request_id, msg.epoch, ok=False, error=str(e))
        if reserved is None:
            self.placements.remove(eid)
            return m.Reserved(wid, msg.request_id, msg.epoch, ok=False, error="no free KV blocks on this decode worker")
        blocks, num_cached = reserved
        skip = num_cached // self.engine.cfg.block_size
        # Only the blocks the transfer may write are leased; cached prefix blocks
        # may be shared with other requests and must never be written.
        self.lease_of[eid] = self.leases.grant(eid, blocks[skip:], msg.lease_ttl_s)
        return m.Reserved(wid, msg.request_id, msg.epoch, ok=True, lease_id=self.lease_of[eid], block_ids=blocks,
                          num_cached_tokens=num_cached)

    def _prefill_locally(self, msg: m.PrefillLocally) -> list[m.Message]:
        """The KV will not come (as the router sees it): the reservation under
        msg.lease_id computes its prompt here. The router may have re-placed it
        under a new epoch: replies carry the message's epoch from now on."""
        eid = self._reservation(msg.request_id, msg.lease_id)
        if eid is None:
            eid = next((e for e in self.placements.of_request(msg.request_id)
                        if self.started.get(e) == msg.lease_id), None)
            if eid is None:
                return [m.RequestFailed(self.worker_id, msg.request_id, msg.epoch,
                                        "no reservation for this request (lease expired?)", retriable=True)]
            # It started on its KV meanwhile (the data plane was faster than the
            # router heard): it runs, nothing to redo.
            return self._run_as(eid, msg.epoch, lambda: None)
        # Revoked before the blocks are used (or freed): no page may land after this.
        self._close(self.lease_of.pop(eid))
        return self._run_as(eid, msg.epoch, lambda: self.engine.prefill_locally(eid, msg.first_token))

    def _run_as(self, eid: str, epoch: int, start: Callable[[], EngineOutput | None]) -> list[m.Message]:
        """Hold the placement under `epoch` from now on and `start` it; its
        output if the first token ends it."""
        try:
            self.placements.renew(eid, epoch)
            out = start()
        except InvalidRequest as e:
            return self._failed(eid, epoch, str(e))
        return self.on_outputs([out]) if out is not None else []

    def _failed(self, eid: str, epoch: int, error: str) -> list[m.Message]:
        self.engine.abort_request(eid)
        self.started.pop(eid, None)
        p = self.placements.remove(eid)
        return [m.RequestFailed(self.worker_id, p.request_id, epoch, error, retriable=False)]

    def _landed(self, landed: Landed) -> list[m.Message]:
        """The data plane says every page of a reservation landed: it starts now,
        and the first token goes to the router from here too (position 0; the
        router keeps one copy). A lease no longer live here is dropped: the
        request was aborted, or its lease expired (the router hears of that)."""
        eid = landed.request_id
        if self.lease_of.get(eid) != landed.lease_id or eid not in self.engine.scheduler.waiting_for_kv:
            log.debug("KV landed for %s under lease %s, which is not live here: dropped", eid, landed.lease_id)
            return []
        self._close(self.lease_of.pop(eid))
        h = landed.handoff
        try:
            out = self.engine.kv_ready(eid, h.first_token)
        except InvalidRequest as e:   # e.g. a first token outside the vocabulary
            return self._failed(eid, self.placements.get(eid).epoch, str(e))
        if out is None:
            self.started[eid] = landed.lease_id
        p = self.placements.remove(eid) if out is not None else self.placements.get(eid)
        item = m.TokenItem(p.request_id, p.epoch, 0, [h.first_token], out is not None,
                           out.finish_reason if out is not None else None, h.logprobs, h.num_cached_tokens)
        return [m.TokenBatch(self.worker_id, [item])]

    def _reservation(self, request_id: str, lease_id: str) -> str | None:
        """The engine id of the request's live reservation under `lease_id`."""
        return next((eid for eid in self.placements.of_request(request_id)
                     if self.lease_of.get(eid) == lease_id and eid in self.engine.scheduler.waiting_for_kv), None)

    def _close(self, lease_id: str) -> None:
        """Revoke a lease; if a one-sided writer may still store into its blocks,
        hold them (beyond their request's life) until the writer ends."""
        lease = self.leases.get(lease_id)
        if self.leases.close(lease_id) == "held" and lease is not None:
            blocks = sorted(lease.block_ids)
            self.engine.kv.hold(blocks)
            self.held[lease_id] = blocks

    def abort(self, eid: str) -> None:
        self.started.pop(eid, None)
        lease = self.lease_of.pop(eid, None)
        if lease is not None:
            self._close(lease)

    def poll(self) -> list[m.Message]:
        """Between steps: start the reservations whose KV landed, then expire
        those whose KV did not come in time (in that order: a request that
        landed in time is not expired for having waited for this pass)."""
        replies = []
        for landed in self.leases.landed():
            replies += self._landed(landed)
        return replies + self.expire()

    def expire(self) -> list[m.Message]:
        """Reservations whose KV did not come in time: free them, tell the router.
        Blocks held for writers that have since ended go back to the pool."""
        for lease in self.leases.released():
            blocks = self.held.pop(lease, None)
            if blocks:
                self.engine.kv.release(blocks)
        replies = []
        for lease, eid in self.leases.expired():
            self._close(lease)
            if self.lease_of.get(eid) == lease:
                del self.lease_of[eid]
                self.engine.abort_request(eid)
                p = self.placements.remove(eid)
                log.warning("KV lease of %s (epoch %d) expired; its blocks are freed", p.request_id, p.epoch,
                            extra={"request_id": p.request_id})
                replies.append(m.RequestFailed(self.worker_id, p.request_id, p.epoch,
                                               "KV lease expired before the KV arrived", retriable=True))
        return replies

    @property
    def waiting_for_kv(self) -> bool:
        return bool(self.lease_of)

    def stats(self) -> dict:
        st = self.receiver.stats
        return {"received_messages": st.messages, "received_bytes": st.bytes, "rejected": st.rejected,
                "last_rejection": st.last_error, "leases": len(self.leases), "held_leases": len(self.held),
                "ipc_writers": self.receiver.ipc.num_writers}

    def close(self) -> None:
        self.receiver.close()


class PrefillSide:
    def __init__(self, engine: LLMEngine, worker_id: str, wc: WorkerConfig, layout: KVLayout,
                 placements: PlacementTable, wakeup: Callable[[], None], security: Curve | None = None):
        """wakeup: called from the sender's threads when a transfer ends.
        security: for dialing data sockets (pdd.security.data_security; None: plaintext)."""
        self.engine = engine
        self.worker_id = worker_id
        self.placements = placements
        device = engine.device
        ipc = {"device": device, "layer_group": wc.ipc_layers_per_copy}
        self.sender = MultiSender({
            b: make_sender(b, layout, security=security, timeout_s=wc.transfer_timeout_s,
                           **(ipc if b == "cuda_ipc" else {}))
            for b in offered_backends(wc.transfer_backend, device)})
        self.sender.set_wakeup(wakeup)
        self.connector = PrefillConnector(self.sender, engine.runner.kv_cache, engine.cfg.block_size, engine.kv)
        engine.attach_connector(self.connector)
        # Prompts whose target has not come yet: the backend their Prefill named, their length.
        self.backends: dict[str, str] = {}
        self.prompt_lens: dict[str, int] = {}
        # Prompts computed, pages in flight: (first token, logprobs, own cache hits) by engine id.
        self.first_tokens: dict[str, tuple[int, list | None, int]] = {}
        # Prompts computing here for a decode worker (engine ids); the engine's
        # other requests run whole here (Admit), or are a colocated worker's own.
        self.computing: set[str] = set()

    def handle(self, msg: m.Message) -> list[m.Message]:
        if isinstance(msg, m.KVTarget):
            return self._target(msg)
        if not isinstance(msg, m.Prefill):
            raise TypeError(f"PrefillSide does not take {msg.TYPE} messages")
        try:
            if msg.transfer_backend not in self.sender.senders:
                raise InvalidRequest(f"transfer_backend: {msg.transfer_backend!r} is not offered by this worker "
                                     f"({', '.join(self.sender.senders)})")
            with self.placements.placing(msg.request_id, msg.epoch) as eid:
                self.engine.add_request(eid, msg.prompt_token_ids, msg.sampling, prefill_only=True,
                                        block_hashes=msg.block_hashes)
        except InvalidRequest as e:
            return [m.PrefillFailed(self.worker_id, msg.request_id, msg.epoch, str(e))]
        self.backends[eid] = msg.transfer_backend
        self.prompt_lens[eid] = len(msg.prompt_token_ids)
        self.computing.add(eid)
        self.connector.expect(eid)
        return []

    def _target(self, msg: m.KVTarget) -> list[m.Message]:
        """Where an expected prompt's KV goes (the decode worker's reservation)."""
        eid = self.placements.find(msg.request_id, msg.epoch)
        if eid is None or eid not in self.backends:
            return []   # aborted meanwhile, or failed already: nothing to send
        try:
            self._check_target(msg, self.prompt_lens[eid])
        except InvalidRequest as e:
            self._forget(eid)
            return [m.PrefillFailed(self.worker_id, msg.request_id, msg.epoch, str(e))]
        self.connector.set_target(TransferTarget(
            eid, msg.lease_id, msg.dst_worker, msg.dst_addr, tuple(msg.dst_block_ids), msg.skip_blocks,
            backend=self.backends.pop(eid), dst_public_key=msg.dst_public_key))
        self.prompt_lens.pop(eid, None)
        return []

    def _forget(self, eid: str) -> None:
        self.engine.abort_request(eid)
        self.abort(eid)
        self.placements.remove(eid)

    def _check_target(self, msg: m.KVTarget, prompt_len: int) -> None:
        """Where the KV goes must hold the whole prompt: a short block list found
        mid-forward would fail every request of the batch."""
        num_blocks = -(-prompt_len // self.engine.cfg.block_size)
        if len(msg.dst_block_ids) < num_blocks:
            raise InvalidRequest(f"dst_block_ids: {len(msg.dst_block_ids)} blocks for a prompt of "
                                 f"{prompt_len} tokens, which needs {num_blocks}")
        if not 0 <= msg.skip_blocks <= num_blocks:
            raise InvalidRequest(f"skip_blocks: must be in [0, {num_blocks}], got {msg.skip_blocks}")

    def on_outputs(self, outputs: list[EngineOutput]) -> list[m.Message]:
        """The step sampled first tokens: those prompts are done, their pages all
        handed over. The tokens go to the router now, ahead of the pages, and
        to the decode worker with the transfer's last message."""
        replies = []
        for o in outputs:
            self.computing.discard(o.request_id)
            first = self.first_tokens[o.request_id] = (o.new_token_ids[0], o.logprobs or None, o.num_cached_tokens)
            # An injected failure (pdd.faults) withholds the start, as a lost last message would.
            self.connector.finish(o.request_id, None if faults.fail_transfer(o.request_id) else Handoff(*first))
            p = self.placements.get(o.request_id)
            replies.append(m.FirstToken(self.worker_id, p.request_id, p.epoch, *first))
        return replies

    def poll(self) -> list[m.Message]:
        """Transfers that ended: PrefillDone (the decode worker accepted the last
        message: it started the request), or PrefillFailed (the router then has
        the decode worker prefill the request itself)."""
        replies = []
        wid = self.worker_id
        for r in faults.transfer_results(self.sender.poll()):   # injected failures/delays, if set
            eid = r.request_id
            first = self.first_tokens.pop(eid, None)
            if first is None:
                if not r.ok and self.engine.abort_request(eid):
                    # Failed while the prompt still computes: stop computing it.
                    self.abort(eid)
                    p = self.placements.remove(eid)
                    log.warning("KV transfer of %s failed mid-prefill: %s", p.request_id, r.error,
                                extra={"request_id": p.request_id})
                    replies.append(m.PrefillFailed(wid, p.request_id, p.epoch, f"KV transfer failed: {r.error}"))
                continue  # else: aborted meanwhile
            p = self.placements.remove(eid)
            if r.ok:
                stats = {"bytes": r.bytes, "seconds": r.seconds, "blocks_sent": r.blocks_sent,
                         "blocks_skipped": r.blocks_skipped}
                replies.append(m.PrefillDone(wid, p.request_id, p.epoch, first[0], first[1], first[2], stats))
            else:
                log.warning("KV transfer of %s failed: %s", p.request_id, r.error, extra={"request_id": p.request_id})
                replies.append(m.PrefillFailed(wid, p.request_id, p.epoch, f"KV transfer failed: {r.error}"))
        return replies

    def abort(self, eid: str) -> None:
        self.connector.abort(eid)
        self.computing.discard(eid)
        self.first_tokens.pop(eid, None)
        self.backends.pop(eid, None)
        self.prompt_lens.pop(eid, None)

    @property
    def transfers_pending(self) -> bool:
        return bool(self.first_tokens)

    def close(self) -> None:
        self.sender.close()
